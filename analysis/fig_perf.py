"""Headline figures: throughput, MFU, speedup over the chosen baseline, scaling with device count."""
from __future__ import annotations

import pandas as pd
import seaborn as sns
from matplotlib.lines import Line2D

from analysis.load import WORKLOAD_ORDER
from analysis.repeats import best_layouts
from analysis.style import (FIGSIZE, PROFILE_SHORT, NoData, bars, figure, legend_handles, mode_title, modes_in,
                            new_figure, panel_legend, system_palette, with_groups)

GROUP_XLABEL = "workload · data profile · devices (count)"
GROUP_KEYS = ["workload", "data_profile", "num_devices"]


def headline_groups(best: pd.DataFrame) -> pd.DataFrame:
    """One device count per workload, profile and mode: the one most systems ran (then the
    largest); the other counts are in the scaling figure and the summary table."""
    keys = ["workload", "data_profile", "mode", "cluster"]
    n = best.groupby(keys + ["num_devices"])["system"].nunique().rename("n").reset_index()
    pick = n.sort_values(["n", "num_devices"]).groupby(keys).tail(1)
    return best.merge(pick[keys + ["num_devices"]], on=keys + ["num_devices"])


def _system_bars(value: pd.DataFrame, ylabel: str, title: str, annotate=None, log_ok=True,
                 skip_annotate=()):
    """One panel per mode and cluster (measured above simulated), bars per system grouped by
    model size; `value` rows with `low` / `high` get an interval bar (from repeats: analysis.stats).
    bench validate's simulations of measured runs are model checks, in the report's validation
    table, not here."""
    value = headline_groups(value[value["experiment"] != "validation"])
    panels = [(mode, cluster) for mode in modes_in(value)
              for cluster in sorted(value.loc[value["mode"] == mode, "cluster"].unique())]
    palette = system_palette(value["system"])
    groups = max(value[(value["mode"] == m) & (value["cluster"] == c)][GROUP_KEYS].drop_duplicates().shape[0]
                 for m, c in panels)
    width = max(FIGSIZE[0], 1.5 + 0.5 * groups)          # two-line labels need room side by side
    fig, axes = new_figure(nrows=len(panels), size=(width, 1.2 + 2.9 * len(panels)))
    for ax, (mode, cluster) in zip(axes, panels):
        df, order = with_groups(value[(value["mode"] == mode) & (value["cluster"] == cluster)])
        hue_order = [s for s in palette if s in set(df["system"])]
        bars(ax, df, "group", "value", "system", order, hue_order, palette,
             annotate=annotate, skip_annotate=skip_annotate, interval=("low", "high"))
        positive = df["value"][df["value"] > 0]
        log = log_ok and len(positive) and positive.max() / positive.min() > 5
        if log:
            ax.set_yscale("log")
        ax.set_title(f"{mode_title(mode)}, {cluster}")
        ax.set_ylabel(ylabel + (", log scale" if log else ""))
        ax.set_xlabel("")
        if len(order) > 6:
            ax.tick_params(axis="x", labelrotation=90)
    axes[-1].set_xlabel(GROUP_XLABEL)
    fig.suptitle(title)
    panel_legend(fig, legend_handles(palette, any(m == "simulated" for m, _ in panels)), "system")
    return fig


@figure("throughput", "Training throughput (samples/s, median of the repeats; error bars: the "
        "order-statistic interval of the median, >= 95% from 6 repeats, the repeats' range below) "
        "of the fastest layout of each system, grouped by model size (at the device count most "
        "systems ran); simulated results (hatched) in their own panel.")
def throughput(data):
    best = best_layouts(data.runs)
    if best.empty:
        raise NoData("no ok record with samples_per_s")
    return _system_bars(best.assign(value=best["samples_per_s"], low=best["samples_per_s_low"],
                                    high=best["samples_per_s_high"]),
                        "samples/s (median)", "Training throughput, best layout per system")


@figure("mfu", "Model FLOPs utilization (% of the peak FLOP/s of all devices) of the fastest "
        "layout of each system, grouped by model size; simulated results (hatched) in their "
        "own panel.")
def mfu(data):
    best = best_layouts(data.runs)
    best = best[best["mfu"].notna()] if not best.empty else best
    if best.empty:
        raise NoData("no ok record with mfu")
    return _system_bars(best.assign(value=best["mfu"] * 100), "MFU (%)",
                        "Model FLOPs utilization, best layout per system", log_ok=False)


def speedup_table(runs: pd.DataFrame, baseline: str) -> pd.DataFrame:
    """Best layout of each system with its speedup over the best layout of `baseline` (ratio of
    medians, exact 95% rank-based interval) as value / low / high, where its group has that baseline."""
    best = best_layouts(runs, baseline=baseline)
    return best.assign(value=best["speedup"], low=best["speedup_low"], high=best["speedup_high"]
                       ).dropna(subset=["value"])


@figure("speedup", "Median throughput of the fastest layout of each system divided by that "
        "of the fastest layout of the speedup baseline (error bars: exact 95% interval of the "
        "ratio from the Mann-Whitney test; none where 3 + 3 repeats are too few for one) "
        "(`--baseline`; by default the first registered baseline with a run) on the same "
        "workload, data profile, mode and device count.")
def speedup(data):
    base = data.baseline
    if base is None:
        raise NoData("no speedup baseline: no registered baseline system has a successful run "
                     "(name one with --baseline)")
    table = speedup_table(data.runs, base)
    if (table["system"] != base).sum() == 0:
        raise NoData(f"no workload has both a {base} run and another system's run "
                     "(ok, same data profile, mode and device count)")
    fig = _system_bars(table, f"speedup over {base} (×)", f"Speedup over the {base} baseline",
                       annotate="%.2f×", log_ok=False, skip_annotate=(base,))
    for ax in fig.axes:
        ax.axhline(1.0, color="black", linestyle=":", linewidth=1)
        ax.margins(y=0.15)
    return fig


def scaling_panels(best: pd.DataFrame) -> dict[tuple, pd.DataFrame]:
    """(workload, data profile, cluster) -> its rows: a panel per simulated cluster, each with the
    measured runs of its workload beside where they come from one device kind (two clusters'
    curves never merge); measured runs of several device kinds, or of a workload nobody
    simulated, get a panel per device kind ("measured on cpu")."""
    panels = {}
    for (workload, profile), df in best.groupby(["workload", "data_profile"], sort=False):
        measured = df[df["mode"] == "measured"]
        simulated = df[df["mode"] != "measured"]
        beside = measured if measured["cluster"].nunique() == 1 else measured.iloc[:0]
        for cluster, sim in simulated.groupby("cluster", sort=True):
            panels[(workload, profile, cluster)] = pd.concat([beside, sim])
        if simulated.empty or beside.empty:
            for device, own in measured.groupby("cluster", sort=True):
                panels[(workload, profile, f"measured on {device}")] = own
    return panels


@figure("scaling", "Throughput against device count for the fastest layout at each count, one panel "
        "per workload, data profile and simulated cluster (the workload's measured runs beside); "
        "measured runs are solid lines with circles, simulated runs dashed lines with squares.")
def scaling(data):
    best = best_layouts(data.runs)
    if best.empty:
        raise NoData("no ok record with samples_per_s")
    panels = scaling_panels(best)
    counts = {k: df["num_devices"].nunique() for k, df in panels.items()}
    counts = {k: n for k, n in counts.items() if n >= 2}
    if not counts:
        raise NoData("no workload has ok runs at two or more device counts")
    size = {w: i for i, w in enumerate(WORKLOAD_ORDER)}
    picked = sorted(counts, key=lambda k: (-counts[k], size.get(k[0], 99)))[:3]
    picked = sorted(picked, key=lambda k: (size.get(k[0], 99), k))
    palette = system_palette(best["system"])
    fig, axes = new_figure(ncols=len(picked))
    for ax, (workload, profile, cluster) in zip(axes, picked):
        df = panels[(workload, profile, cluster)]
        sns.lineplot(data=df, x="num_devices", y="samples_per_s", hue="system", style="mode",
                     palette={s: palette[s] for s in set(df["system"])},
                     style_order=["measured", "simulated"],
                     dashes={"measured": "", "simulated": (4, 2)},
                     markers={"measured": "o", "simulated": "s"}, errorbar=None,
                     markersize=6, ax=ax, legend=False)
        ticks = sorted(df["num_devices"].unique())
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, labels=[str(int(t)) for t in ticks])
        if len(ticks) > 3:        # close counts (256, 288) would overlap on a log axis
            ax.tick_params(axis="x", labelrotation=60, labelsize=8)
        ax.minorticks_off()
        ax.set_ylim(bottom=0)
        ax.set_title(f"{workload} · {PROFILE_SHORT.get(profile, profile)}\n{cluster}")
        ax.set_xlabel("devices (count, log₂ axis)")
        ax.set_ylabel("")
    axes[0].set_ylabel("throughput (samples/s)")
    handles = [Line2D([], [], color=c, linewidth=2, label=s) for s, c in palette.items()]
    modes = modes_in(best)
    handles += [Line2D([], [], color="black", marker="o", label="measured (solid)")] * ("measured" in modes)
    handles += [Line2D([], [], color="black", marker="s", linestyle=(0, (4, 2)),
                       label="simulated (dashed)")] * ("simulated" in modes)
    panel_legend(fig, handles, "system / mode", ncol=len(handles))
    fig.suptitle("Scaling with device count")
    return fig
