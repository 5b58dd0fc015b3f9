"""`results/report/report.md`: the figures, a summary table and the runs that did not finish."""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from analysis.figures import Outcome, draw_all
from analysis.load import VARIANTS, Results, is_baseline, load, ok, sort_key, system_order

TITLES = {"throughput": "Throughput", "mfu": "Model FLOPs utilization", "speedup":
          "Speedup over the baseline", "scaling": "Scaling with device count", "orchestration":
          "Ablation: orchestration plan", "reorder": "Ablation: data reordering", "preprocess":
          "Ablation: data preprocessing", "loss": "Loss curves", "timeline": "Iteration timeline"}
ORDER = ["workload", "data_profile", "mode", "num_devices", "system", "layout_label"]


def _cell(value) -> str:
    text = "" if value is None or (isinstance(value, float) and pd.isna(value)) else str(value)
    text = " ".join(text.split())
    return (text[:200] + "…" if len(text) > 200 else text).replace("|", "\\|")


def _table(df: pd.DataFrame) -> list[str]:
    lines = ["| " + " | ".join(df.columns) + " |", "|" + "---|" * len(df.columns)]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return lines


def _num(fmt: str):
    return lambda v: "—" if pd.isna(v) else format(v, fmt)


def _experiment(run) -> str:
    """'reorder: intra' for an ablation run, else the experiment tag."""
    name = run["experiment"]
    if pd.isna(name):
        return "—"
    variant = VARIANTS.get(name)
    return f"{name}: {run[variant]}" if variant and pd.notna(run[variant]) else str(name)


def summary_table(runs: pd.DataFrame, baseline: str | None = None) -> pd.DataFrame:
    """One row per ok run; a "speedup vs <baseline>" column when there is a baseline."""
    okr = runs[runs["status"] == "ok"].sort_values(ORDER, key=sort_key)
    table = pd.DataFrame({
        "system": okr["system"], "workload": okr["workload"], "profile": okr["data_profile"],
        "layout": okr["layout_label"], "devices": okr["num_devices"], "mode": okr["mode"],
        "experiment": [_experiment(r) for _, r in okr.iterrows()],
        "samples/s": okr["samples_per_s"].map(_num(".4g")),
        "MFU %": (okr["mfu"] * 100).map(_num(".3g")),
    })
    if baseline is not None:
        table[f"speedup vs {baseline}"] = okr["speedup"].map(lambda v: "—" if pd.isna(v) else f"{v:.2f}×")
    return table


def validation_table(runs: pd.DataFrame) -> pd.DataFrame:
    """Simulated records tagged experiment=validation (bench/validate.py) beside their measured
    partners (tags.measured_run_id): the newest simulation of each measured run."""
    cols = ["system", "workload", "layout", "nproc", "measured iteration s", "simulated s", "error %", "measured in"]
    need = {"tags.measured_run_id", "metrics.iteration_time_s"}
    if runs.empty or not need <= set(runs.columns):
        return pd.DataFrame(columns=cols)
    sim = runs[(runs["mode"] == "simulated") & (runs["experiment"] == "validation")
               & runs["tags.measured_run_id"].notna() & (runs["status"] == "ok")]
    sim = sim.sort_values("timestamp").drop_duplicates("tags.measured_run_id", keep="last")
    meas = runs[(runs["mode"] == "measured") & (runs["status"] == "ok")].drop_duplicates("run_id").set_index("run_id")
    rows = []
    for _, s in sim.iterrows():
        mid = s["tags.measured_run_id"]
        if mid not in meas.index:
            continue
        m = meas.loc[mid]
        measured, simulated = float(m["step_time_s"]), float(s["metrics.iteration_time_s"])
        rows.append({"system": m["system"], "workload": m["workload"], "layout": m["layout_label"],
                     "nproc": int(m["num_devices"]), "measured iteration s": measured, "simulated s": simulated,
                     "error %": 100.0 * (simulated - measured) / measured,
                     "measured in": str(m["source"]).split(":")[0]})
    df = pd.DataFrame(rows, columns=cols)
    return df.sort_values(["workload", "system", "nproc", "layout"], key=sort_key).reset_index(drop=True)


def validation_section(runs: pd.DataFrame) -> list[str]:
    md = ["## Simulator validation", ""]
    table = validation_table(runs)
    if table.empty:
        return md + ["No validation yet: run `python -m bench validate` after measured CPU runs.", ""]
    err = table["error %"].abs()
    shown = table.assign(**{"measured iteration s": table["measured iteration s"].map(_num(".4g")),
                            "simulated s": table["simulated s"].map(_num(".4g")),
                            "error %": table["error %"].map(_num("+.1f"))})
    md += ["Each measured CPU run simulated in the same configuration on a CPU cluster built from this "
           "machine's profile (`python -m bench profile`, `python -m bench validate`); error = (simulated - "
           "measured) / measured.", ""]
    md += _table(shown)
    md += ["", f"{len(table)} runs: mean |error| {err.mean():.1f}%, median {err.median():.1f}%, max "
               f"{err.max():.1f}%; {int((err <= 10).sum())}/{len(table)} within 10%.", ""]
    return md


def _ratio_lines(best: pd.DataFrame) -> list[str]:
    """'<system> throughput ratio: 1.02× b1, 1.30× b2.' for each system under study in one
    comparison group (best: fastest run per system, indexed by system) against each baseline."""
    order = system_order(best.index)
    baselines = [s for s in order if is_baseline(s)]
    if not baselines:
        return []
    lines = []
    for system in (s for s in order if s not in baselines):
        ours = best.loc[system, "samples_per_s"]
        ratios = [f"{ours / best.loc[b, 'samples_per_s']:.2f}× {b}" for b in baselines]
        lines += [f"{system} throughput ratio: " + ", ".join(ratios) + ".", ""]
    return lines


def headline_section(runs: pd.DataFrame) -> list[str]:
    """The main comparison (tag experiment=main): each system's fastest layout, and each
    system under study's throughput ratio to each baseline, measured side by side in one sweep."""
    main = ok(runs[runs["experiment"] == "main"])
    if main.empty:
        return []
    md = ["## Headline: the main comparison", ""]
    for (workload, profile, mode, devices), group in main.groupby(
            ["workload", "data_profile", "mode", "num_devices"], sort=False):
        best = group.loc[group.groupby("system")["samples_per_s"].idxmax()].set_index("system")
        best = best.loc[system_order(best.index)]
        md += [f"{workload} · {profile} · {devices} devices ({mode}):", ""]
        rows = [{"system": s, "best layout": r["layout_label"], "samples/s": f"{r['samples_per_s']:.4g}",
                 "MFU %": f"{100 * r['mfu']:.3g}"} for s, r in best.iterrows()]
        md += _table(pd.DataFrame(rows)) + [""] + _ratio_lines(best)
    return md


def _speedup_note(baseline: str | None) -> str:
    if baseline is None:
        return ("No speedup is given: no registered baseline system has a successful run "
                "(`--baseline NAME` picks any system that has one).")
    return (f"Speedup divides a run's samples/s by the best {baseline} layout with the same "
            "workload, data profile, mode and device count (`--baseline NAME` picks another).")


def render(data: Results, outcomes: list[Outcome], results_dir: Path) -> str:
    runs = data.runs
    counts = runs["status"].value_counts().to_dict() if len(runs) else {}
    modes = runs["mode"].value_counts().to_dict() if len(runs) else {}
    md = ["# DistTrain benchmark report", "",
          f"Generated by `python -m analysis report` from {len(runs)} records in "
          f"{len(data.files)} file(s) under `{results_dir}`"
          + (": " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) + "; "
             + ", ".join(f"{n} {m}" for m, n in sorted(modes.items())) if len(runs) else "")
          + ".", "",
          "Simulated results come from a cost model, not from training; they are labelled "
          "*simulated* (hatched bars, dashed lines, separate panels). "
          + _speedup_note(data.baseline), "", "## Summary of successful runs", ""]
    table = summary_table(runs, data.baseline)
    md = md[:-2] + headline_section(runs) + md[-2:]
    md += _table(table) if len(table) else ["No successful run."]
    md += ["", "## Figures", ""]
    titles = {**TITLES, **({"speedup": f"Speedup over {data.baseline}"} if data.baseline else {})}
    for o in outcomes:
        md += [f"### {titles.get(o.name, o.name)}", ""]
        if o.path is not None:
            md += [f"![{titles.get(o.name, o.name)}]({o.path.name})", "", o.caption, ""]
        else:
            md += [f"*Skipped: {o.skipped}.* ({o.caption})", ""]
    md += validation_section(runs)
    md += ["## Failed and skipped runs", ""]
    bad = runs[runs["status"] != "ok"].sort_values(ORDER, key=sort_key)
    if bad.empty:
        md.append("None.")
    for _, r in bad.iterrows():
        md.append(f"- **{r['status']}** `{r['system']}` {r['workload']} · {r['data_profile']} · "
                  f"{_cell(r['layout_label'])} · {r['num_devices']} dev · {r['mode']} "
                  f"(`{r['source']}`): {_cell(r['reason'])}")
    return "\n".join(md) + "\n"


def write_report(results_dir: Path | str = "results", out_dir: Path | str | None = None,
                 baseline: str | None = None) -> Path:
    """Load, draw and write `out_dir/report.md` (default `<results_dir>/report`); returns its path.

    `baseline`: the system speedups divide by (default: see analysis.load.pick_baseline)."""
    results_dir = Path(results_dir)
    out_dir = Path(out_dir) if out_dir is not None else results_dir / "report"
    data = load(results_dir, baseline)
    outcomes = draw_all(data, out_dir)
    path = out_dir / "report.md"
    path.write_text(render(data, outcomes, results_dir))
    return path
