"""Where a validation error lies: the measured steps' phases against the simulated ones.

Systems that time their step's phases (systems.base.STEP_PHASES, each step's `rank_phase_s`)
let `bench validate` split a configuration's error in two: compute = the forward/backward
schedule up to the gradient reduction, the slowest rank's (the step waits for it), against the
simulated schedule to the pipeline flush; after = the rest of the step, from the last rank's end
of its schedule (its data wait + compute) to the step's end: gradient reduction, optimizer step,
parameter all-gather, the harness's barriers; against the simulated gradient sync, optimizer
and host time. Where the ranks also timed their schedule's CPU seconds (`rank_phase_cpu_s`),
their sum over the ranks against the simulated schedule's work (device-seconds, each operation
priced alone) says how much more CPU the same work took with the ranks side by side: the co-run
slowdown the step actually met, to set beside the profile's (bench.profile.tp). With TP > 1 the
simulated work includes the TP collectives' waits, which use no CPU: the ratio then reads low.
Their optimizer steps' CPU seconds against its wall seconds say whether a slow optimizer step
worked longer or was off the CPU; where the kernel also gave the seconds the training thread
waited for a core (`rank_phase_runqueue_s`, systems.clock), the rest it slept: on a collective's
peers or on gloo's I/O thread doing the collective's copies (work the training thread's CPU
does not count: a DP-1 parameter all-gather is such a copy), which the ranks' CPU seconds over all
their threads (`rank_phase_process_cpu_s`) show beside the training thread's.
"""
from __future__ import annotations

import statistics

from bench.records import record_variant


def measured_phases(record: dict) -> dict | None:
    """{"compute_s", "after_compute_s"[, "compute_cpu_s", "optimizer_cpu_s", "optimizer_s"]
    [, "optimizer_runqueue_s"][, "optimizer_process_cpu_s"]}: medians over the measured steps (the
    others: of the ranks' summed schedule CPU seconds, optimizer CPU, wall, runqueue and all-thread
    CPU seconds, where every step has them); None if the system did not time its phases."""
    steps = [s for s in record.get("steps") or [] if not s.get("warmup") and s.get("rank_phase_s")]
    if not steps:
        return None
    compute = [max(s["rank_phase_s"]["compute"]) for s in steps]
    after = [s["latency_s"] - _schedules_end(s) for s in steps]
    out = {"compute_s": statistics.median(compute), "after_compute_s": statistics.median(after)}

    def summed(kind: str, phase: str) -> float:      # median over the steps of the ranks' sum
        return statistics.median(sum(s[f"rank_{kind}_s"][phase]) for s in steps)

    if all(s.get("rank_phase_cpu_s") for s in steps):
        out.update(compute_cpu_s=summed("phase_cpu", "compute"), optimizer_cpu_s=summed("phase_cpu", "optimizer"),
                   optimizer_s=summed("phase", "optimizer"))
    for kind in ("runqueue", "process_cpu"):
        if all(s.get(f"rank_phase_{kind}_s") for s in steps):
            out[f"optimizer_{kind}_s"] = summed(f"phase_{kind}", "optimizer")
    return out


def _schedules_end(step: dict) -> float:
    """When the last rank ended its schedule: each rank loads its data, then runs it, so the
    latest of data wait + compute per rank. Ranks' data waits differ (a DeepSpeed rank waited
    2.1 s while the slowest schedule's rank waited ~0.1 s: the slowest wait plus the slowest
    schedule put the schedules' end past the step's: 'after' read below zero). Records without
    per-rank data waits: those two."""
    compute, waits = step["rank_phase_s"]["compute"], step.get("rank_data_wait_s")
    if waits and len(waits) == len(compute):
        return max(w + c for w, c in zip(waits, compute))
    return step.get("data_wait_s", 0.0) + max(compute)


def phase_rows(groups: list[list[tuple[dict, dict]]]) -> list[dict]:
    """(measured, simulated) record pairs grouped by configuration (bench.sim.validate.by_configuration)
    -> per configuration whose repeats all timed their phases: the median over the repeats of each
    phase, measured and simulated, and the errors."""
    rows = []
    for group in groups:
        measured = [measured_phases(m) for m, _ in group]
        if None in measured or any("compute_s" not in s["metrics"] for _, s in group):
            continue
        meas = group[0][0]
        row = {"system": meas["system"], "workload": meas["workload"],
               "layout": str(meas["layout"].get("label")) + record_variant(meas),
               "nproc": int(meas["num_devices"]), "repeats": len(group)}
        for key in ("compute_s", "after_compute_s"):
            m = statistics.median(x[key] for x in measured)
            s = statistics.median(float(sim["metrics"][key]) for _, sim in group)
            row[key] = {"measured": m, "simulated": s, "error_pct": 100.0 * (s - m) / m if m > 0 else 0.0}
        if all("compute_cpu_s" in x for x in measured) and all("compute_work_s" in s["metrics"] for _, s in group):
            cpu = statistics.median(x["compute_cpu_s"] for x in measured)
            work = statistics.median(float(sim["metrics"]["compute_work_s"]) for _, sim in group)
            row["compute_cpu"] = {"measured": cpu, "work": work, "ratio": cpu / work if work > 0 else None}
        if all("optimizer_cpu_s" in x for x in measured):
            cpu, wall = (statistics.median(x[k] for x in measured) for k in ("optimizer_cpu_s", "optimizer_s"))
            row["optimizer_cpu"] = {"cpu": cpu, "wall": wall, "ratio": cpu / wall if wall > 0 else None,
                                    "runqueue": None, "slept": None, "other_threads": None}
            if all("optimizer_runqueue_s" in x for x in measured):
                queued = statistics.median(x["optimizer_runqueue_s"] for x in measured)
                row["optimizer_cpu"].update(runqueue=queued, slept=max(0.0, wall - cpu - queued))
            if all("optimizer_process_cpu_s" in x for x in measured):
                process = statistics.median(x["optimizer_process_cpu_s"] for x in measured)
                row["optimizer_cpu"]["other_threads"] = max(0.0, process - cpu)
        rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    """The validation table's second section: each phase measured and simulated."""
    if not rows:
        return ""
    lines = ["", "## Where the error lies", "",
             "Configurations of systems that time their steps' phases: compute = the forward/backward schedule "
             "up to the gradient reduction, the slowest rank's; after = the rest of the step (gradient reduction, "
             "optimizer step, parameter all-gather, barriers; not the data wait); medians over the steps, then "
             "over the repeats (bench/sim/phases.py). Schedule CPU = the ranks' CPU seconds in their "
             "schedules (training threads, summed over the ranks) over the simulated schedule's work "
             "(device-seconds, each operation priced alone): how much more CPU the work took side by side "
             "(with TP > 1 the work includes the TP collectives' waits, so it reads low). Optimizer CPU = the "
             "ranks' CPU seconds in their optimizer steps over those steps' wall seconds (summed over the ranks): "
             "well under 1, the step was mostly off the CPU rather than working; of the rest, the training "
             "threads waited for a core (runqueue, where the kernel says) or slept: on a collective's peers or on "
             "gloo's I/O thread doing the collective's copies (a parameter all-gather, even over a DP group of "
             "one, is work on that thread); in brackets, the CPU seconds the ranks' other threads spent "
             "meanwhile.", "",
             "| system | workload | layout | nproc | repeats | compute measured s | simulated s | error % "
             "| after measured s | simulated s | error % | schedule CPU s / work s | optimizer CPU s / wall s "
             "| optimizer runqueue s, slept s (other threads' CPU s) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["workload"], r["system"], r["nproc"], r["layout"])):
        c, a, u, o = r["compute_s"], r["after_compute_s"], r.get("compute_cpu"), r.get("optimizer_cpu")
        cpu = (f"{u['measured']:.4g} / {u['work']:.4g} = {u['ratio']:.2f}" if u and u["ratio"] is not None
               else "")
        opt = f"{o['cpu']:.4g} / {o['wall']:.4g} = {o['ratio']:.2f}" if o and o["ratio"] is not None else ""
        off = f"{o['runqueue']:.4g}, {o['slept']:.4g}" if o and o["runqueue"] is not None else ""
        if off and o["other_threads"] is not None:
            off += f" ({o['other_threads']:.4g})"
        lines.append(f"| {r['system']} | {r['workload']} | {r['layout']} | {r['nproc']} | {r['repeats']} | "
                     f"{c['measured']:.4g} | {c['simulated']:.4g} | {c['error_pct']:+.1f} | "
                     f"{a['measured']:.4g} | {a['simulated']:.4g} | {a['error_pct']:+.1f} | {cpu} | {opt} | {off} |")
    return "\n".join(lines) + "\n"
