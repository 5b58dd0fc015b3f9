"""python -m bench validate: the simulator against this machine's measured runs.

For every measured, ok record that ran on the CPU, of a system that has a cost model
(SystemAdapter.simulate_step), the same configuration is simulated (workload, data profile, global and
micro batch, layout or
plan, process count, the measured steps' very samples and the trainers' own data
assignment) on a CPU cluster built from the measured profile of this machine
(results/profiles/cpu-<workload>.json; measured first if missing), or from each of several
profiles of it (`--profiles DIR` repeated: the machine's speed drifts by 10-25% between
profiles taken an hour apart, so the simulated time is the median over the profiles and the
table shows their range): per-module compute from
the profile's fit, gloo latency and bandwidth, the host costs (preprocessing in the trainer,
optimizer step), and the processes sharing `cores` CPU cores: with P processes on C cores each
gets min(1, C / P) of a core, so compute runs max(1, P / C) times slower (disaggregated
preprocessing workers count as busy only for their share of the step: processes_of). Nothing is
fitted per record: every constant comes from the profiles.

A profile's machine and a run's are the same machine at different speeds (it drifts by a quarter
within minutes): both time the same fixed work (bench.speed.SpeedProbe), the profile alone
between its timed passes and by copies at once in its co-run, the run on every rank after every
step. So each simulation is also given at the run's speed (at_run_speed): each profile's time
times (run's probe / profile's probe under as many ranks)^-slope, with the slope of log
1 / step time on log probe time within the workload's configurations (the one analysis.speed
adjusts comparisons with), where that slope is told from zero. A diagnostic beside the raw
error, not a replacement: it narrowed the disagreement between profile passes (15.2 -> 11.0
points per configuration) but not the error, and the lone probe of a profile missed a slow state
the runs' four busy ranks met minutes later (docs/validation-log.md, 7 Dec 13:02 and 14:14).

Each simulation is appended as a record (mode "simulated", tags {"experiment": "validation",
"measured_run_id": ...}) and `validation.md` beside the results file gets the table system,
layout, nproc, measured iteration s, simulated s, error %.
"""
from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

from bench.bootstrap import noise_pct
from bench.records import record_variant
from bench.speed import SpeedFit, fit_slope, probe_seconds, probe_total

GOAL_PCT = 10.0
def simulatable(system: str) -> bool:
    """Whether `system` is registered and prices its iterations (SystemAdapter.simulate_step)."""
    from systems.base import ConfigError, get_system
    try:
        return get_system(system).has_cost_model()
    except ConfigError:
        return False


def measured_runs(records: list[dict]) -> list[dict]:
    """Measured, ok, CPU records of systems that have a cost model."""
    out = []
    for r in records:
        device = (r.get("env") or {}).get("device") or (r.get("config") or {}).get("device")
        if r["mode"] == "measured" and r["status"] == "ok" and device == "cpu" and r["steps"] \
                and simulatable(r["system"]):
            out.append(r)
    return out


def processes_of(record: dict, busy_workers: float | None = None) -> float:
    """Processes competing for the cores: the trainers, plus the disaggregated preprocessing
    workers, as many as are busy on average over a step (`busy_workers`; all of them if not
    given). A worker prefetches and then blocks: on `small` at dp2 the batch's preprocessing is
    ~0.05 CPU-s of a 3 s step, and the runs' step phases matched the preprocessing-in-trainer
    runs' (3-4 Dec: counting both workers as busy priced the optimizer and the gradient sync 2x)."""
    data = record["config"].get("data", {})
    workers = int(data.get("num_workers", 0)) if data.get("preprocess") == "disaggregated" else 0
    busy = workers if busy_workers is None else min(float(busy_workers), workers)
    return int(record["num_devices"]) + busy


def cluster_for(record: dict, profile: dict, cores: int | None = None, busy_workers: float | None = None,
                inline_data: bool = False):
    """The CPU cluster `record` ran on, from `profile`: its processes on `cores` cores, with the
    preprocessing in the trainers unless the run had it in workers (or `inline_data`)."""
    from dataclasses import replace
    from bench.sim.cluster import cluster_from_profile
    cores = cores or ((record.get("env") or {}).get("hardware") or {}).get("cpu_count") or os.cpu_count()
    cl = cluster_from_profile(profile, processes=processes_of(record, busy_workers), cores=cores)
    cl = replace(cl, gpus_per_node=max(int(record["num_devices"]), 1))
    if record["config"].get("data", {}).get("preprocess") == "disaggregated" and not inline_data:
        # preprocessing happens in separate workers, ahead of the trainers (prefetch)
        cl = replace(cl, host={**cl.host, "data": None})
    return cl, cores


def simulate_measured(record: dict, profile: dict, cores: int | None = None) -> dict:
    """Simulate one measured record's configuration; returns the simulator's output dict plus
    "median_iteration_s" (the measured metric is the median step latency too). With
    disaggregated preprocessing, first without the workers, whose busy share is then their
    CPU-seconds per step (the batch's preprocessing, priced as in a trainer) over that step."""
    from bench.sim.simulate import simulate
    from workloads.presets import get_workload
    cfg = record["config"]
    w = get_workload(record["workload"], record["data_profile"])
    steps = [int(s["step"]) for s in record["steps"] if not s.get("warmup")]
    num_samples = int(cfg.get("data", {}).get("num_samples", 0)) or None

    def run(cluster):
        return simulate(w, record["system"], dict(cfg.get("options", {})), int(record["num_devices"]), cluster,
                        seed=int(cfg.get("seed", 0)), global_batch_size=int(cfg["global_batch_size"]),
                        micro_batch_size=int(cfg["micro_batch_size"]), steps=steps, num_samples=num_samples,
                        data_order=cfg.get("data", {}).get("reorder", "none"), reorder=False,
                        clip_grad=float(cfg.get("optim", {}).get("clip_grad", 0.0)))
    busy = None
    if cfg.get("data", {}).get("preprocess") == "disaggregated":
        alone = run(cluster_for(record, profile, cores, busy_workers=0)[0])
        inline = cluster_for(record, profile, cores, busy_workers=0, inline_data=True)[0]
        work = statistics.mean(_preprocess_cpu_s(w, cfg, inline, step, num_samples) for step in steps)
        busy = work / float(statistics.median(alone["iteration_times_s"]))
    cluster, cores = cluster_for(record, profile, cores, busy)
    r = run(cluster)
    r["median_iteration_s"] = float(statistics.median(r["iteration_times_s"]))
    r["cluster"], r["cores"] = cluster, cores
    return r


def _preprocess_cpu_s(w, cfg: dict, cluster, step: int, num_samples: int | None) -> float:
    """CPU-seconds to preprocess one step's batch once, in microbatches (bench.sim.costs)."""
    from bench.sim import costs as C
    from bench.sim.batch import draw_batch
    B, mbs = int(cfg["global_batch_size"]), int(cfg["micro_batch_size"])
    metas = draw_batch(w, B, int(cfg.get("seed", 0)), step, num_samples)
    return C.data_time(C.load_seconds(w, metas, cluster), range(B), B // mbs, cluster)


def measured_step_s(record: dict) -> float:
    m = record["metrics"].get("step_time_s")
    return float(m) if m is not None else float(statistics.median(s["latency_s"] for s in record["steps"]))


def corun_probe_ratios(profiles) -> dict[int, float]:
    """The probe's CPU seconds with n copies probing at once over its seconds alone (the co-runs'
    probe_cpu_s: adjacent phases, so the machine's drift cancels), the median over `profiles`.
    The probe is the same fixed work in every profile, so this is the machine's, not a workload's:
    one profile's own ratio (3 probes in each of 7 rounds) scattered 1.03-1.16 for two copies in
    twelve profiles of 7 Dec, where their median, 1.12, held the passes' disagreement lower
    (docs/validation-log.md, 7 Dec 13:02)."""
    ratios: dict[int, list[float]] = {}
    for p in profiles:
        corun = {int(n): probe_total(k) for n, k in ((p.get("corun") or {}).get("probe_cpu_s") or {}).items()}
        if corun.get(1):
            for n, t in corun.items():
                if t is not None:
                    ratios.setdefault(n, []).append(t / corun[1])
    return {n: float(statistics.median(r)) for n, r in sorted(ratios.items())}


def profile_probe_s(profile: dict, processes: int, ratios: dict[int, float]) -> float | None:
    """The probe CPU seconds `processes` processes probing at once would have read while the
    profile timed its modules: the probe timed alone between the timed passes (probe_cpu_s), times
    the co-run ratio (corun_probe_ratios) of the nearest measured number of copies; None for a
    profile without it (older ones)."""
    alone = probe_total(profile.get("probe_cpu_s"))
    if alone is None or not ratios:
        return None
    return alone * ratios[min(ratios, key=lambda n: (abs(n - processes), -n))]


def speed_fits(runs: list[dict]) -> dict[str, SpeedFit | None]:
    """Per workload, the slope of log (1 / step time) on log probe seconds within the
    configurations of its measured `runs` (bench.speed.fit_slope: the slope analysis.speed
    adjusts comparisons with)."""
    out = {}
    for workload in sorted({r["workload"] for r in runs}):
        own = [r for r in runs if r["workload"] == workload]
        out[workload] = fit_slope([1.0 / measured_step_s(r) for r in own], probe_seconds(own),
                                  [r.get("config_key") or r["run_id"] for r in own])
    return out


def at_run_speed(record: dict, by_profile: list[float], profile_probes: list, fit: SpeedFit | None) -> float | None:
    """The simulated step time brought from each profile's machine speed to the run's: times
    (run's probe / profile's probe)^-slope, the median over the profiles; None where the run or a
    profile has no probe time, or the slope is not told from zero."""
    run_probe = probe_total((record.get("metrics") or {}).get("probe_cpu_s"))
    if (fit is None or not fit.told_from_zero or run_probe is None or not profile_probes
            or any(p is None for p in profile_probes)):
        return None
    return float(statistics.median(s * (run_probe / p) ** -fit.slope for s, p in zip(by_profile, profile_probes)))


def validation_record(record: dict, profiles: list[tuple[dict, str | None]], cores: int | None = None,
                      fit: SpeedFit | None = None, ratios: dict[int, float] | None = None) -> dict:
    """The measured `record` simulated on each of `profiles` ((profile, path) pairs of its workload):
    a simulated record whose iteration time is the median over the profiles, and the same brought
    to the run's machine speed with `fit` and the probe's co-run `ratios` (at_run_speed)."""
    from bench.metrics import throughput
    from bench.records import build_record, new_run_id
    from bench.sim import costs as C
    from workloads.flops import ModuleFlops
    runs = [simulate_measured(record, prof, cores) for prof, _ in profiles]
    by_profile = [x["median_iteration_s"] for x in runs]
    r, (profile, _) = runs[0], profiles[0]
    cluster = r["cluster"]
    sim_s, meas_s = float(statistics.median(by_profile)), measured_step_s(record)
    cfg = record["config"]
    B = int(cfg["global_batch_size"])
    flops = ModuleFlops(**r["flops_per_iteration"])
    tp = throughput([sim_s], B, B * _seq(record), flops,
                    int(record["num_devices"]), float(record["metrics"].get("peak_flops_per_device")
                                                       or cluster.peak_flops))
    error = 100.0 * (sim_s - meas_s) / meas_s
    probes = [profile_probe_s(p, int(record["num_devices"]), ratios or {}) for p, _ in profiles]
    at_speed = at_run_speed(record, by_profile, probes, fit)
    metrics = {**tp.as_dict(), "iteration_time_s": sim_s, "iteration_times_s": r["iteration_times_s"],
               "profile_probe_s_by_profile": probes, "iteration_time_s_at_run_speed": at_speed,
               "error_at_run_speed_pct": None if at_speed is None else 100.0 * (at_speed - meas_s) / meas_s,
               "bubble_fraction": r["bubble_fraction"], "per_gpu_memory_gib": r["per_gpu_memory_gib"],
               "measured_iteration_time_s": meas_s, "error_pct": error, "gpus_used": r["gpus_used"],
               "iteration_time_s_by_profile": by_profile,
               # the step's two parts (bench.sim.phases): medians over the steps, then over the profiles
               "compute_s": float(statistics.median(statistics.median(x["pipeline_times_s"]) for x in runs)),
               "after_compute_s": float(statistics.median(statistics.median(x["after_pipeline_times_s"])
                                                          for x in runs)),
               "compute_work_s": float(statistics.median(statistics.median(x["schedule_work_s"]) for x in runs))}
    config = {"measured_config": cfg, "cluster": cluster.name, "profile": [path for _, path in profiles],
              "processes": cluster.host["processes"], "cores": r["cores"],
              "steps": [s["step"] for s in record["steps"]],
              "data_order": cfg.get("data", {}).get("reorder", "none")}
    assumptions = {**cluster.assumptions(), "cost_model": C.__doc__.strip(),
                   "validation": ("same configuration as the measured run (its steps' samples, the trainers' "
                                  "data assignment, its layout and process count); every constant from the "
                                  "profiles; simulated metric: median over the measured steps, then over the "
                                  "profiles (the cluster assumptions below: the first profile's)"),
                   "profile_date": profile.get("date"), "profile_load_average": profile.get("load_average"),
                   "profile_dates": [p.get("date") for p, _ in profiles]}
    return build_record(run_id=new_run_id(), mode="simulated", system=record["system"], workload=record["workload"],
                        data_profile=record["data_profile"], status="ok", num_devices=record["num_devices"],
                        layout={"label": record["layout"].get("label"), "sim_label": r["label"],
                                **{k: v for k, v in record["layout"].items() if k != "label"}},
                        config=config, env={"simulator": "bench.sim", "validated_against": "measured"},
                        tags={"experiment": "validation", "measured_run_id": record["run_id"],
                              "profile_date": profiles_key(p for p, _ in profiles),
                              "speed_fit": describe(fit, ratios or {})},
                        metrics=metrics, assumptions=assumptions)


def describe(fit: SpeedFit | None, ratios: dict[int, float] | None = None) -> str:
    """What brings a validation to its run's machine speed: the slope and, given `ratios`, the
    probe's co-run ratios (a rerun with others redoes the validation)."""
    text = ("none: too few probed repeats, or the probe never moved" if fit is None
            else fit.describe() + ("" if fit.told_from_zero else "; not told from zero: not adjusted"))
    if ratios is None:
        return text
    return text + ("; the probe by copies at once / alone " + ", ".join(f"{n}: {r:.3f}" for n, r in ratios.items())
                   if ratios else "; no profile timed the probe")


def profiles_key(profiles) -> str:
    """What a validation was simulated with: its profiles' dates (a rerun with the same ones is skipped)."""
    return ",".join(str(p.get("date")) for p in profiles)


def _seq(record: dict) -> int:
    from workloads.presets import get_workload
    return get_workload(record["workload"]).backbone.seq_length


def by_configuration(pairs: list[tuple[dict, dict]]) -> list[list[tuple[dict, dict]]]:
    """(measured, simulated) record pairs grouped by measured configuration (its repeats)."""
    groups: dict[str, list[tuple[dict, dict]]] = {}
    for meas, sim in pairs:
        groups.setdefault(meas.get("config_key") or meas["run_id"], []).append((meas, sim))
    return list(groups.values())


def table_rows(pairs: list[tuple[dict, dict]]) -> list[dict]:
    """(measured, simulated) record pairs -> one row per measured configuration: the median of
    its repeats' step times, their spread (min..max), the simulated time (the same for every
    repeat: same steps, same samples) and the error against the median."""
    rows = []
    for group in by_configuration(pairs):
        measured = [measured_step_s(m) for m, _ in group]
        simulated = statistics.median(float(s["metrics"]["iteration_time_s"]) for _, s in group)
        by_profile = [s["metrics"].get("iteration_time_s_by_profile") or [s["metrics"]["iteration_time_s"]]
                      for _, s in group]
        sim_low, sim_high = (statistics.median(min(b) for b in by_profile),
                             statistics.median(max(b) for b in by_profile))
        median, low, high = statistics.median(measured), min(measured), max(measured)
        at_speed = [s["metrics"].get("iteration_time_s_at_run_speed") for _, s in group]
        at_speed = statistics.median(at_speed) if None not in at_speed else None
        shares = [m["metrics"].get("outside_cpu_share") for m, _ in group]
        shares = [x for x in shares if x is not None]
        meas = group[0][0]
        ranks = {k: [m["metrics"][k] for m, _ in group if m["metrics"].get(k) is not None]
                 for k in ("rank_cpu_share", "rank_runqueue_share", "rank_helper_runqueue_share", "rank_gc_share",
                          "rank_sys_share")}
        rows.append({"system": meas["system"], "workload": meas["workload"],
                     "layout": str(meas["layout"].get("label")) + record_variant(meas),
                     "nproc": int(meas["num_devices"]),
                     "repeats": len(group), "measured_s": median, "measured_low_s": low, "measured_high_s": high,
                     "spread_pct": 50.0 * (high - low) / median, "simulated_s": simulated,
                     "simulated_low_s": sim_low, "simulated_high_s": sim_high, "profiles": len(by_profile[0]),
                     "error_pct": 100.0 * (simulated - median) / median, "within_spread": low <= simulated <= high,
                     "at_speed_s": at_speed,
                     "at_speed_error_pct": None if at_speed is None else 100.0 * (at_speed - median) / median,
                     "at_speed_within_spread": at_speed is not None and low <= at_speed <= high,
                     "noise_pct": noise_pct(measured),
                     "outside_cpu_share": statistics.median(shares) if shares else None,
                     **{k: statistics.median(v) if v else None for k, v in ranks.items()}})
    return rows


def markdown(rows: list[dict], profiles: dict[str, str] | None = None, goal: float = GOAL_PCT,
             speed_fits: dict[str, str] | None = None, probe_ratios: dict[int, float] | None = None) -> str:
    """The validation table: per measured configuration, the simulator against the median of its
    repeats and their spread; the summary counts configurations whose error lies within the spread."""
    lines = ["# Simulator validation", "",
             "Measured CPU configurations against the simulator on a CPU cluster built from this machine's "
             "profile (`python -m bench validate`). Error = (simulated - median of the repeats) / median; "
             "spread = the repeats' range (min..max, ± half of it relative to the median); other load = the "
             "median share of the machine's CPU that processes outside the run used while it measured; ranks' CPU / "
             "runqueue = the median over repeats of the shares of the ranks' step time on a CPU (all threads) and "
             "with the training thread, then gloo's and other helper threads, runnable but waiting for a core (the "
             "kernel's schedstat; the helpers' summed over them, so it can exceed 100%); GC = the share in "
             "Python's garbage collector; kernel = the share in the kernel (getrusage system time, page faults "
             "included); "
             "with several profiles, simulated = the median over them (their range in brackets); at the runs' "
             "speed = the same brought from each profile's machine speed to each repeat's (the fixed-work probe "
             "timed in both, bench.speed; the slope of the workload's runs), the median over the repeats: a "
             "diagnostic of how much of an error is the profile's machine state, not a better estimate (a lone "
             "probe in a profile misses states only busy ranks meet: docs/validation-log.md, 7 Dec 14:14). "
             "The repeats' "
             "own noise (summary lines) = the mean |error| expected of a model exact on average, from each "
             "configuration's repeats (the mean |bootstrap median - median| / median): the floor of what these "
             "repeats can tell.", ""]
    if profiles:
        lines += ["Profiles: " + ", ".join(f"`{w}`: {p}" for w, p in sorted(profiles.items())), ""]
    lines += ["| system | workload | layout | nproc | repeats | measured median s | spread | simulated s | error % "
              "| within spread | at the runs' speed s (error %) | other load % "
              "| ranks' CPU / runqueue % (training, helpers); GC %; kernel % |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["workload"], r["system"], r["nproc"], r["layout"])):
        share = "?" if r.get("outside_cpu_share") is None else f"{100 * r['outside_cpu_share']:.0f}"
        lines.append(f"| {r['system']} | {r['workload']} | {r['layout']} | {r['nproc']} | {r['repeats']} | "
                     f"{r['measured_s']:.4g} | {r['measured_low_s']:.4g}..{r['measured_high_s']:.4g} "
                     f"(±{r['spread_pct']:.0f}%) | {r['simulated_s']:.4g}{_range(r)} | {r['error_pct']:+.1f} | "
                     f"{'yes' if r['within_spread'] else 'no'} | {_at_speed(r)} | {share} | {_rank_shares(r)} |")

    def stats(rs, what, error="error_pct", within="within_spread"):
        errs = [abs(r[error]) for r in rs]
        return (f"{what}: {len(rs)} configurations, mean |error| {statistics.fmean(errs):.1f}%, median "
                f"{statistics.median(errs):.1f}%, max {max(errs):.1f}%; {sum(r[within] for r in rs)}/"
                f"{len(rs)} within the measured spread, {sum(e <= goal for e in errs)}/{len(rs)} within "
                f"{goal:g}%; the repeats' own noise {statistics.fmean(r.get('noise_pct', 0.0) for r in rs):.1f}%."
                ) if rs else f"{what}: none."
    if rows:
        lines += ["", stats(rows, "All")]
        for wl in sorted({r["workload"] for r in rows}):
            lines.append(stats([r for r in rows if r["workload"] == wl], f"`{wl}`"))
        repeated = [r for r in rows if r["repeats"] > 1]
        lines.append(stats(repeated, "Configurations measured more than once"))
        adjusted = [r for r in rows if r["at_speed_error_pct"] is not None]
        if adjusted:
            lines += ["", stats(adjusted, "At the runs' speed", "at_speed_error_pct", "at_speed_within_spread"),
                      stats(adjusted, "The same configurations as profiled")]
            for wl in sorted({r["workload"] for r in adjusted}):
                lines.append(stats([r for r in adjusted if r["workload"] == wl], f"`{wl}` at the runs' speed",
                                   "at_speed_error_pct", "at_speed_within_spread"))
        if speed_fits:
            lines += ["", "Slopes (log 1/step s on log probe s, within configurations): " + "; ".join(
                f"`{wl}` {text}" for wl, text in sorted(speed_fits.items())) + "."]
        if probe_ratios:
            lines.append("The probe by copies at once over alone in the profiles' co-runs (median over the "
                         "profiles): " + ", ".join(f"{n}: {r:.3f}" for n, r in probe_ratios.items()) + ".")
    else:
        lines += ["", "No measured CPU run to validate against."]
    return "\n".join(lines) + "\n"


def _rank_shares(row: dict) -> str:
    shares = [row.get(k) for k in ("rank_cpu_share", "rank_runqueue_share", "rank_helper_runqueue_share")]
    if None in shares:
        return "?"
    gc, kernel = row.get("rank_gc_share"), row.get("rank_sys_share")
    out = "{:.0f} / {:.0f}, {:.0f}".format(*(100 * x for x in shares))
    if gc is not None or kernel is not None:
        out += "; ?" if gc is None else f"; {100 * gc:.1f}"
    return out + ("" if kernel is None else f"; {100 * kernel:.0f}")


def _at_speed(row: dict) -> str:
    if row.get("at_speed_s") is None:
        return "-"
    return f"{row['at_speed_s']:.4g} ({row['at_speed_error_pct']:+.1f})"


def _range(row: dict) -> str:
    if row.get("profiles", 1) < 2:
        return ""
    return f" ({row['simulated_low_s']:.4g}..{row['simulated_high_s']:.4g})"


def get_profiles(workload: str, measure_missing: bool = True, log=print,
                 profile_dirs=None) -> list[tuple[dict, str]]:
    """(profile, path) of `workload` in each of `profile_dirs` that has one (default: results/profiles);
    if none has one, one is measured into the first folder (unless not `measure_missing`)."""
    from bench.profile.profiler import default_path, find_profile, load_profile, profile_workload, write_profile
    dirs = list(profile_dirs) if isinstance(profile_dirs, (list, tuple)) else [profile_dirs]
    paths = [p for p in (find_profile(workload, "cpu", d) for d in dirs) if p is not None]
    if not paths:
        if not measure_missing:
            return []
        log(f"[validate] no profile of {workload} on this CPU: measuring one (python -m bench profile)")
        paths = [write_profile(profile_workload(workload, log=log), default_path("cpu", workload, dirs[0]))]
    return [(load_profile(p), str(p)) for p in paths]


def validate(results: Path, out_md: Path | None = None, measure_missing: bool = True, force: bool = False,
             log=print, profile_dir: Path | list[Path] | None = None) -> tuple[list[dict], Path]:
    """Append validation records for the measured runs in `results`; write the Markdown table."""
    from bench.records import append_record, read_records
    records = read_records(results) if results.exists() else []
    done = {(r["tags"].get("measured_run_id"), r["tags"].get("profile_date"), r["tags"].get("speed_fit"))
            for r in records if r["mode"] == "simulated" and r["tags"].get("experiment") == "validation"}
    by_id = {r["run_id"]: r for r in records}
    runs = measured_runs(records)
    fits = speed_fits(runs)
    profiles = {wl: get_profiles(wl, measure_missing, log, profile_dir) for wl in sorted({r["workload"] for r in runs})}
    ratios = corun_probe_ratios(p for ps in profiles.values() for p, _ in ps)
    for wl, ps in profiles.items():
        ran = sorted({r["config"].get("host_heap", "release") for r in runs if r["workload"] == wl})
        timed = sorted({p["hardware"].get("host_heap", "release") for p, _ in ps})   # before 8 Dec: glibc's
        if ran != timed:
            log(f"[validate] {wl}: the runs' host_heap {'/'.join(ran)}, its profiles' {'/'.join(timed)}: the heap "
                f"moves a step's page faults (bench/heap.py); profile with --host-heap as the runs ran")
    latest: dict[str, dict] = {}
    for r in records:                         # the newest validation of each measured run, kept
        if r["mode"] == "simulated" and r["tags"].get("experiment") == "validation":
            latest[r["tags"].get("measured_run_id")] = r
    for rec in runs:
        profs = profiles.get(rec["workload"])
        if not profs:
            log(f"[validate] {rec['system']} {rec['layout'].get('label')}: no profile of {rec['workload']}, skipped")
            continue
        speed = describe(fits[rec["workload"]], ratios)
        if not force and (rec["run_id"], profiles_key(p for p, _ in profs), speed) in done:
            continue
        try:
            sim = validation_record(rec, profs, fit=fits[rec["workload"]], ratios=ratios)
        except (ValueError, KeyError) as e:
            log(f"[validate] {rec['system']} {rec['layout'].get('label')} ({rec['run_id']}): cannot simulate: {e}")
            continue
        append_record(sim, results)
        latest[rec["run_id"]] = sim
    pairs = [(by_id[mid], s) for mid, s in latest.items() if mid in by_id]
    rows = table_rows(pairs)
    out_md = out_md or results.parent / "validation.md"
    from bench.sim import phases
    out_md.write_text(markdown(rows, {wl: ", ".join(path for _, path in ps) for wl, ps in profiles.items() if ps},
                               speed_fits={wl: describe(f) for wl, f in fits.items()}, probe_ratios=ratios)
                      + phases.markdown(phases.phase_rows(by_configuration(pairs))))
    for row in sorted(rows, key=lambda r: (r["workload"], r["system"], r["nproc"], r["layout"])):
        log(f"[validate] {row['system']:9s} {row['workload']:5s} {row['layout']:38s} nproc {row['nproc']}: measured "
            f"{row['measured_s']:.4g} s (median of {row['repeats']}, ±{row['spread_pct']:.0f}%), simulated "
            f"{row['simulated_s']:.4g} s ({row['error_pct']:+.1f}%)")
    return rows, out_md


def add_parser(sub) -> None:
    p = sub.add_parser("validate", help="simulate every measured CPU run on this machine's profile; "
                                        "append tagged simulated records and write validation.md")
    p.add_argument("--results", type=Path, default=None, help="JSONL file of measured records (default "
                   "results/runs.jsonl); validation records are appended to it")
    p.add_argument("--out", type=Path, default=None, help="Markdown table (default: validation.md beside --results)")
    p.add_argument("--no-profile", action="store_true", help="do not measure a missing profile; skip its runs")
    p.add_argument("--force", action="store_true", help="re-simulate runs already validated with this profile")
    p.add_argument("--profiles", type=Path, action="append", default=None, help="folder of this machine's "
                   "profiles (default results/profiles); repeat it to simulate with each folder's profile of a "
                   "workload (the median counts); a workload in none of them is measured into the first")
    p.set_defaults(handler=handle)


def handle(args, results_path) -> int:
    results = Path(results_path)
    if not results.exists():
        print(f"error: no results file {results}", file=sys.stderr)
        return 2
    rows, md = validate(results, args.out, measure_missing=not args.no_profile, force=args.force,
                        profile_dir=args.profiles)
    errs = [abs(r["error_pct"]) for r in rows]
    summary = (f"mean |error| {statistics.fmean(errs):.1f}%, max {max(errs):.1f}%, "
               f"{sum(r['within_spread'] for r in rows)}/{len(rows)} within the measured spread, "
               f"{sum(e <= GOAL_PCT for e in errs)}/{len(errs)} "
               f"within {GOAL_PCT:g}%") if errs else "nothing to validate"
    print(f"[validate] {len(rows)} measured configurations vs simulated: {summary}; table {md}")
    return 0
