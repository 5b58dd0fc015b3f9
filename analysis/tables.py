"""The report's tables: the headline comparison, one row per configuration, and the simulator
against the measured repeats. Every number that summarizes repeats comes from analysis.repeats
and analysis.stats (median and its interval, ratios with their exact 95% interval, a verdict
only beyond the noise); the validation's noise floor from bench.bootstrap.noise_pct, which
bench validate's own table uses too."""
from __future__ import annotations

import numpy as np
import pandas as pd

from analysis import at_speed
from analysis.load import ABLATIONS, COMPARE_KEYS, VARIANTS, is_baseline, ok, sort_key, system_order
from analysis.repeats import best_layouts, configurations, repeat_key, with_speedups
from analysis.stats import Ratio, ratio_of_medians, summarize
from bench.bootstrap import noise_pct
from bench.records import run_variant

ORDER = ["workload", "data_profile", "mode", "cluster", "num_devices", "system", "layout_label"]


def cell(value, limit: int | None = 200) -> str:
    text = "" if value is None or (isinstance(value, float) and pd.isna(value)) else str(value)
    text = " ".join(text.split())
    return (text[:limit] + "…" if limit is not None and len(text) > limit else text).replace("|", "\\|")


def markdown_table(df: pd.DataFrame, limit: int | None = 200) -> list[str]:
    """`df` as a markdown table, each cell cut to `limit` characters (None: whole)."""
    lines = ["| " + " | ".join(df.columns) + " |", "|" + "---|" * len(df.columns)]
    lines += ["| " + " | ".join(cell(v, limit) for v in row) + " |" for row in df.itertuples(index=False)]
    return lines


def num(fmt: str):
    return lambda v: "—" if pd.isna(v) else format(v, fmt)


def interval(low, high, fmt: str = ".4g") -> str:
    return "—" if pd.isna(low) or pd.isna(high) else f"[{low:{fmt}}, {high:{fmt}}]"


def median_interval(config) -> str:
    """A configuration's interval of the median, with what it covers where that is below 95%
    (fewer than 6 repeats: the repeats' range, analysis.stats.summarize)."""
    text = interval(config["samples_per_s_low"], config["samples_per_s_high"])
    level = config["samples_per_s_level"]
    return text if text == "—" or pd.isna(level) or level >= 0.95 else f"{text} ({100 * level:.0f}%)"


def _experiment(run) -> str:
    """'reorder: intra' for an ablation run, else the experiment tag."""
    name = run["experiment"]
    if pd.isna(name):
        return "—"
    variant = VARIANTS.get(name)
    return f"{name}: {run[variant]}" if variant and pd.notna(run[variant]) else str(name)


def _experiments(config, runs: pd.DataFrame, keys: pd.Series) -> str:
    """Every experiment the configuration's repeats (`keys`: repeat_key of `runs`) were run for
    ('main, orchestration: auto')."""
    if not config["experiments"]:
        return "—"
    same = runs[(keys == repeat_key(config.to_frame().T).iloc[0]) & (runs["status"] == "ok")]
    labels = dict.fromkeys(_experiment(r) for _, r in same.iterrows())
    return ", ".join(labels)


def summary_table(runs: pd.DataFrame, baseline: str | None = None) -> pd.DataFrame:
    """One row per configuration (its repeats summarized); a "speedup vs <baseline>" column
    (ratio of medians with its 95% interval) when there is a baseline. Validation simulations
    are in their own section."""
    configs = configurations(runs[runs["experiment"] != "validation"])
    if configs.empty:
        return pd.DataFrame()
    configs, keys = configs.sort_values(ORDER, key=sort_key), repeat_key(runs)
    table = pd.DataFrame({
        "system": configs["system"], "workload": configs["workload"], "profile": configs["data_profile"],
        "layout": configs["layout_label"], "devices": configs["num_devices"], "mode": configs["mode"],
        "cluster": configs["cluster"],
        "experiment": [_experiments(r, runs, keys) for _, r in configs.iterrows()], "repeats": configs["n_repeats"],
        "samples/s (median)": configs["samples_per_s"].map(num(".4g")),
        "interval of the median": [median_interval(r) for _, r in configs.iterrows()],
        "MFU %": (configs["mfu"] * 100).map(num(".3g")),
    })
    if baseline is not None:
        sped = with_speedups(configs, best_layouts(runs), baseline, COMPARE_KEYS)
        table[f"speedup vs {baseline}"] = [
            "—" if pd.isna(v) else f"{v:.2f}× {interval(lo, hi, '.2f')}"
            for v, lo, hi in zip(sped["speedup"], sped["speedup_low"], sped["speedup_high"])]
    return table


def _ratio_lines(best: pd.DataFrame, predicted: dict, candidates: pd.Series, speeds: dict) -> list[str]:
    """'<system> vs <baseline>: 1.02× [0.95, 1.10], no difference beyond the noise (±10%).' for
    each system under study against each baseline (best: best configuration per system, chosen
    among `candidates` of its configurations), with the simulator's predicted ratio where both
    configurations were validated, and the same at one speed of the machine (`speeds`:
    analysis.at_speed.at_one_speed of the comparison's runs)."""
    order = system_order(best.index)
    baselines = [s for s in order if is_baseline(s)]
    lines = []
    for system in (s for s in order if s not in baselines):
        for b in baselines:
            ratio, words = best_ratio(best, system, b, candidates)
            t_sys, t_base = predicted.get(best.loc[system, "repeat_key"]), predicted.get(best.loc[b, "repeat_key"])
            if t_sys and t_base:   # same batch: samples/s ratio = inverse ratio of iteration times
                words += f"; the simulator (bench validate) predicts {t_base / t_sys:.2f}×"
                if not np.isnan(ratio.low):
                    inside = ratio.low <= t_base / t_sys <= ratio.high
                    words += f", {'inside' if inside else 'outside'} the measured interval"
            lines += ([f"- {system} vs {b}: {words}."] + _halves_line(best, system, b, candidates, ratio)
                      + at_speed.speed_line(best, system, b, candidates, ratio, speeds))
    return lines + [""] if lines else []


def _halves_line(best: pd.DataFrame, a: str, b: str, candidates: pd.Series, whole: Ratio) -> list[str]:
    """The same ratio over the first and the second half of the runs' measured steps
    (analysis.load.half_rates), and whether the verdict holds over both: every repeat measures
    the same steps, so the repeats' interval cannot show a pattern within the runs."""
    halves_a, halves_b = best.loc[a, "repeat_halves"], best.loc[b, "repeat_halves"]
    if not isinstance(halves_a, tuple) or not isinstance(halves_b, tuple):
        return []
    k = (int(candidates[a]), int(candidates[b]))
    ratios = [ratio_of_medians(x, y, chosen_from=k) for x, y in zip(halves_a, halves_b)]
    # only where the whole run has a verdict and every repeat has both halves
    if whole.direction() is None or any(np.isnan(r.value) or (r.n_a, r.n_b) != (whole.n_a, whole.n_b)
                                        for r in ratios):
        return []
    first, second = (r.direction() for r in ratios)
    held = ("**the verdict differs between the halves**: which steps are measured decides it" if first != second
            else "the verdict holds over both halves" if first == whole.direction()
            else "both halves read alike, though not as the whole run does")
    return [f"  - over the first / second half of each run's measured steps: {ratios[0].verdict()} / "
            f"{ratios[1].verdict()}; {held}."]


def best_ratio(best: pd.DataFrame, a: str, b: str, candidates: pd.Series) -> tuple[Ratio, str]:
    """The ratio of `best` rows a and b, each its best of `candidates` configurations chosen on
    these repeats, and its verdict, which that choice does not make likelier from noise
    (analysis.stats.chosen_critical_count)."""
    k_a, k_b = int(candidates[a]), int(candidates[b])
    ratio = ratio_of_medians(best.loc[a, "repeat_values"], best.loc[b, "repeat_values"], chosen_from=(k_a, k_b))
    chosen = [f"{name}'s best of {k} configurations" for name, k in ((a, k_a), (b, k_b)) if k > 1]
    return ratio, ratio.verdict() + (f"; {' and '.join(chosen)}" if chosen else "")


def predicted_times(runs: pd.DataFrame) -> dict:
    """repeat_key -> median simulated iteration time of its validated repeats (bench validate)."""
    if runs.empty or "tags.measured_run_id" not in runs:
        return {}
    sim = runs[(runs["mode"] == "simulated") & (runs["experiment"] == "validation") & (runs["status"] == "ok")
               & runs["tags.measured_run_id"].notna()]
    measured = runs[runs["mode"] == "measured"].drop_duplicates("run_id")
    keys = pd.Series(repeat_key(measured).to_numpy(), index=measured["run_id"])
    sim = sim.assign(key=sim["tags.measured_run_id"].map(keys)).dropna(subset=["key"])
    return sim.groupby("key")["metrics.iteration_time_s"].median().to_dict()


# Experiments (tags.experiment) that compare systems head to head, in report order.
COMPARISONS = {"main": "the main comparison", "encoder-heavy": "the encoder-heavy regime",
               "generator-heavy": "the generator-heavy regime",
               "heterogeneous": "homogeneous vs colocated heterogeneous layouts (arXiv 2605.27678)"}

HOW_TO_READ = ("Median samples/s over each configuration's repeats (each a fresh launch, repeats of the "
               "configurations interleaved) with the order-statistic interval of the median (>= 95% "
               "from 6 repeats; below that the repeats' range, whose coverage follows it: 75% / 88% / 94% "
               "at 3 / 4 / 5), and ratios of medians with their exact 95% interval "
               "(Mann-Whitney, analysis.stats); a system is called faster or slower only when that "
               "interval excludes 1. Where each side is its best of several configurations, chosen on the "
               "same repeats, the interval keeps that choice from raising the chance of a verdict from noise "
               "above 5% (analysis.stats.chosen_critical_count). Under each ratio, the same over the first and "
               "the second half of each run's measured steps: every repeat measures the same steps, so a pattern "
               "within the runs is a bias no interval over repeats can show. Then the same ratio at one speed of "
               "the machine: every rank times a fixed piece of work after every step, and each run's samples/s "
               "is brought to the comparison's median probe time by one slope fitted within its configurations, "
               "the interval widened by the slope's own error (analysis.speed). It assumes one slope for every "
               "configuration and a probe that times the machine, not the system; it adjusts only where the slope "
               "is told from zero and the probe does not differ between the two sides, and otherwise says why not.")


def headline_section(runs: pd.DataFrame) -> list[str]:
    """The head-to-head comparisons (COMPARISONS): each system's best configuration by median
    samples/s with its interval, and each system under study against each baseline."""
    md, predicted = [], predicted_times(runs)
    for experiment, title in COMPARISONS.items():
        md += _comparison(runs, experiment, title, predicted)
    return ["## Headlines", "", HOW_TO_READ, ""] + md + busy_lines(runs) if md else []


def _comparison(runs: pd.DataFrame, experiment: str, title: str, predicted: dict) -> list[str]:
    main = ok(runs[runs["experiment"] == experiment])
    if main.empty:
        return []
    md = [f"### {title[0].upper()}{title[1:]}", ""]
    for (workload, profile, mode, cluster, devices), group in main.groupby(COMPARE_KEYS, sort=False):
        best = best_layouts(group)
        best = best.assign(repeat_key=repeat_key(best)).set_index("system")
        candidates = configurations(group).groupby("system").size()
        best = best.loc[system_order(best.index)]
        md += [f"{workload} · {profile} · {devices} devices ({mode}, {cluster}):", ""]
        rows = [{"system": s, "best layout": r["layout_label"], "repeats": r["n_repeats"],
                 "samples/s (median)": f"{r['samples_per_s']:.4g}",
                 "interval of the median": median_interval(r),
                 "CV %": num(".1f")(100 * r["cv"]), "MFU %": f"{100 * r['mfu']:.3g}"} for s, r in best.iterrows()]
        md += markdown_table(pd.DataFrame(rows)) + [""] + _ratio_lines(best, predicted, candidates,
                                                                      at_speed.at_one_speed(group))
    return md


def busy_lines(runs: pd.DataFrame) -> list[str]:
    """How many measured runs had the machine busy with other processes while they measured."""
    measured = runs[(runs["mode"] == "measured") & (runs["status"] == "ok")]
    known = measured[measured["busy_machine"].notna()]
    if known.empty:
        return []
    busy = int(known["busy_machine"].astype(bool).sum())
    share = known["outside_cpu_share"].median()
    return [f"Machine state: {busy} of {len(known)} measured runs were measured on a busy machine (processes "
            f"outside the run used at least 10% of its CPU during the measured steps); median outside share "
            f"{100 * share:.1f}%.", ""]


def validation_table(runs: pd.DataFrame) -> pd.DataFrame:
    """Per measured configuration: the median of its repeats' step times and their spread
    (min..max), the simulator's time for the same configuration (bench validate), the error,
    and whether the simulation lies within the measured spread."""
    cols = ["system", "workload", "layout", "nproc", "repeats", "measured median s", "spread", "simulated s",
            "profiles' range", "error %", "within spread", "at the runs' speed s", "error at speed %", "noise %"]
    need = {"tags.measured_run_id", "metrics.iteration_time_s"}
    if runs.empty or not need <= set(runs.columns):
        return pd.DataFrame(columns=cols)
    sim = runs[(runs["mode"] == "simulated") & (runs["experiment"] == "validation")
               & runs["tags.measured_run_id"].notna() & (runs["status"] == "ok")]
    sim = sim.sort_values("timestamp").drop_duplicates("tags.measured_run_id", keep="last")
    meas = runs[(runs["mode"] == "measured") & (runs["status"] == "ok")].drop_duplicates("run_id").set_index("run_id")
    meas = meas[meas.index.isin(sim["tags.measured_run_id"])]
    if meas.empty:
        return pd.DataFrame(columns=cols)
    simulated = sim.set_index("tags.measured_run_id")["metrics.iteration_time_s"]
    by_profile = (sim.set_index("tags.measured_run_id")["metrics.iteration_time_s_by_profile"]
                  if "metrics.iteration_time_s_by_profile" in sim.columns else None)
    # brought to each run's machine speed (bench.sim.validate.at_run_speed); NaN where it was not
    at_speed = sim.set_index("tags.measured_run_id").get("metrics.iteration_time_s_at_run_speed",
                                                         pd.Series(np.nan, index=simulated.index)).astype(float)
    rows = []
    for _, g in meas.groupby(repeat_key(meas.reset_index()).to_numpy(), sort=False):
        times = g["step_time_s"].astype(float)
        s = summarize(times)
        sim_s = float(simulated.loc[g.index].median())
        ranges = ([] if by_profile is None
                  else [b for b in by_profile.loc[g.index] if isinstance(b, list) and len(b) > 1])
        span = (f"{np.median([min(b) for b in ranges]):.4g}..{np.median([max(b) for b in ranges]):.4g}"
                if ranges else "")
        lo, hi = float(times.min()), float(times.max())
        speed_s = at_speed.loc[g.index]
        speed_s = float(speed_s.median()) if speed_s.notna().all() else np.nan
        first = g.iloc[0]
        layout = first["layout_label"] + run_variant(first["preprocess"], first["reorder"], first["clip_grad"])
        rows.append({"system": first["system"], "workload": first["workload"], "layout": layout,
                     "nproc": int(first["num_devices"]), "repeats": s.n, "measured median s": s.median,
                     "spread": f"{lo:.4g}..{hi:.4g} (±{50 * (hi - lo) / s.median:.0f}%)", "simulated s": sim_s,
                     "profiles' range": span, "error %": 100.0 * (sim_s - s.median) / s.median,
                     "within spread": lo <= sim_s <= hi, "at the runs' speed s": speed_s,
                     "error at speed %": 100.0 * (speed_s - s.median) / s.median, "noise %": noise_pct(times.tolist())})
    df = pd.DataFrame(rows, columns=cols)
    return df.sort_values(["workload", "system", "nproc", "layout"], key=sort_key).reset_index(drop=True)


def validation_section(runs: pd.DataFrame) -> list[str]:
    md = ["## Simulator validation", ""]
    table = validation_table(runs)
    if table.empty:
        return md + ["No validation yet: run `python -m bench validate` after measured CPU runs.", ""]
    err = table["error %"].abs()
    shown = table.assign(**{"measured median s": table["measured median s"].map(num(".4g")),
                            "simulated s": table["simulated s"].map(num(".4g")),
                            "error %": table["error %"].map(num("+.1f")),
                            "within spread": table["within spread"].map({True: "yes", False: "no"}),
                            "at the runs' speed s": table["at the runs' speed s"].map(num(".4g")),
                            "error at speed %": table["error at speed %"].map(num("+.1f")),
                            "noise %": table["noise %"].map(num(".1f"))})
    md += ["Each measured CPU configuration simulated on a CPU cluster built from this machine's profile "
           "(`python -m bench profile`, `python -m bench validate`); error = (simulated - median of the "
           "repeats) / median; spread = the repeats' range. With several profiles of the machine (run_all "
           "profiles before and after the sweep: its speed drifts between them), simulated = the median over "
           "them and their range is shown. Goal (#12): mean |error| <= 5%, every configuration within 10% or "
           "within its spread.", ""]
    md += markdown_table(shown)
    md += ["", f"{len(table)} configurations: mean |error| {err.mean():.1f}%, median {err.median():.1f}%, max "
               f"{err.max():.1f}%; {int(table['within spread'].sum())}/{len(table)} within the measured spread, "
               f"{int((err <= 10).sum())}/{len(table)} within 10%. The repeats' own noise: a model exact on "
               f"average would read {table['noise %'].mean():.1f}% off these medians (bench.bootstrap.noise_pct).",
           ""]
    adjusted = table[table["error at speed %"].notna()]
    if not adjusted.empty:
        at_speed, as_profiled = adjusted["error at speed %"].abs(), adjusted["error %"].abs()
        md += [f"At the runs' speed (each profile brought to each repeat's probe time, bench.sim.validate."
               f"at_run_speed): {len(adjusted)} configurations, mean |error| {at_speed.mean():.1f}% (as profiled: "
               f"{as_profiled.mean():.1f}%), max {at_speed.max():.1f}%, {int((at_speed <= 10).sum())}/{len(adjusted)} "
               f"within 10%: a diagnostic of how much of an error is the profile's machine state, not a better "
               f"estimate.", ""]
    return md



def ablation_section(runs: pd.DataFrame) -> list[str]:
    """Each ablation's variants against its reference variant: ratio of median samples/s with
    its 95% interval and a verdict only beyond the noise (the best configuration per variant)."""
    lines = []
    for experiment, (variant, variants) in ABLATIONS.items():
        configs = configurations(runs[runs["experiment"] == experiment])
        if configs.empty or configs[variant].isna().all():
            continue
        keys = at_speed.group_keys(experiment)
        probed = at_speed.probed(runs[runs["experiment"] == experiment])
        for group, g in configs.groupby(keys, sort=False):
            workload, system, cluster, devices = group
            best = g.loc[g.groupby(variant)["samples_per_s"].idxmax()]
            best = best.assign(repeat_key=repeat_key(best)).set_index(variant)
            candidates = g.groupby(variant).size()
            present = [v for v in variants if v in best.index]
            if len(present) < 2:
                continue
            ref = present[0]
            speeds = at_speed.at_one_speed(probed[(probed[keys] == pd.Series(group, index=keys)).all(axis=1)])
            lines += [f"- {experiment} · {system} · {workload} · {devices} devices ({cluster}): "
                      + "; ".join(f"{v} vs {ref}: " + best_ratio(best, v, ref, candidates)[1]
                                  + at_speed.speed_words(best, v, ref, candidates, speeds) for v in present[1:])]
    if not lines:
        return []
    return ["## Ablations: throughput against the reference variant", "",
            "Ratio of median samples/s (best configuration of each variant) with its 95% interval; in "
            "brackets, the same at one speed of the machine (analysis.speed), or \"not adjusted\" where the probe's "
            "slope over the experiment's runs is not told from zero or the probe itself differs between the two "
            "variants (the machine_speed figure shows each slope).", "",
            *lines, ""]
