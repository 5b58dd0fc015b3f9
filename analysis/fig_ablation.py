"""Ablation figures: orchestration plan, data reordering, data preprocessing placement,
interleaving DistTrain's backbone.

Each reads only records tagged `tags.experiment == <ablation>`; the variant comes from the
record (tags.plan_kind, config.data.reorder, config.data.preprocess, tags.pipeline). Repeats of a
configuration are summarized by their medians (analysis.repeats); throughput bars carry the
interval of the median when there are repeats (analysis.stats).
"""
from __future__ import annotations

import seaborn as sns

from analysis.load import ABLATIONS, COMPARE_KEYS, ok, ordered
from analysis.repeats import configurations
from analysis.style import FIGSIZE, NoData, bars, figure, legend_handles, new_figure, panel_legend, with_groups

GROUP_XLABEL = "workload · data profile · devices (count)"


def _ablation(data, experiment: str, variant: str, variants: tuple, panels: list, title: str,
              legend_title: str, colors: str):
    runs = data.runs
    df = ok(runs[runs["experiment"] == experiment])
    df = df[df[variant].notna()]
    if df.empty:
        raise NoData(f'no ok record tagged experiment="{experiment}" that names its {variant}')
    configs = configurations(df)
    best = configs.loc[configs.groupby(COMPARE_KEYS + ["system", variant])["samples_per_s"].idxmax()]
    panels = [p for p in panels if best[p[0]].notna().any()]
    present = ordered(best[variant], variants)
    palette = dict(zip(present, sns.color_palette(colors, len(present) + 1)[1:]))
    best, order = with_groups(best, with_system=best["system"].nunique() > 1, with_mode=True)
    if len(order) <= 2 and len(panels) <= 2:  # side by side while the tick labels fit
        fig, axes = new_figure(ncols=len(panels))
    else:
        fig, axes = new_figure(nrows=len(panels), size=(FIGSIZE[0], 1.2 + 2.9 * len(panels)))
    for ax, (col, ylabel, scale) in zip(axes, panels):
        value = best.assign(value=best[col] * scale).dropna(subset=["value"])
        if col == "samples_per_s":
            value = value.assign(low=value["samples_per_s_low"] * scale, high=value["samples_per_s_high"] * scale)
        bars(ax, value, "group", "value", variant, order, present, palette,
             interval=("low", "high") if col == "samples_per_s" else None)
        ax.set_xlabel(GROUP_XLABEL if ax is axes[-1] or len(order) <= 2 else "")
        ax.set_ylabel(ylabel)
        ax.set_title(ylabel.split(" (")[0])
    simulated = (best["mode"] == "simulated").any()
    panel_legend(fig, legend_handles(palette, simulated), legend_title)
    fig.suptitle(title + (" (includes simulated)" if simulated else ""))
    return fig


THROUGHPUT = ("samples_per_s", "throughput (samples/s)", 1.0)


@figure("orchestration", "Ablation: the searched orchestration plan ('auto') against "
        "a naive plan, same workload and devices (experiment=orchestration).")
def orchestration(data):
    return _ablation(data, "orchestration", *ABLATIONS["orchestration"],
                     [THROUGHPUT, ("mfu", "MFU (%)", 100.0)],
                     "Ablation: orchestration plan", "plan", "Greens")


@figure("reorder", "Ablation: data reordering (none / intra-microbatch / inter-microbatch / "
        "both): throughput, encoder load imbalance across data-parallel ranks (max/mean "
        "per-rank encoder FLOPs) and, where the system records it, the measured bubble share "
        "of rank-time (experiment=reorder).")
def reorder(data):
    return _ablation(data, "reorder", *ABLATIONS["reorder"],
                     [THROUGHPUT, ("encoder_load_imbalance", "encoder imbalance (max/mean ratio)", 1.0),
                      ("bubble_fraction", "bubble (% of rank-time)", 100.0)],
                     "Ablation: data reordering", "reorder", "Blues")


@figure("preprocess", "Ablation: data preprocessing colocated with training against "
        "disaggregated preprocessing: share of step time spent waiting for data, and "
        "throughput (experiment=preprocess).")
def preprocess(data):
    return _ablation(data, "preprocess", *ABLATIONS["preprocess"],
                     [("data_wait_fraction", "data wait (% of step time)", 100.0), THROUGHPUT],
                     "Ablation: data preprocessing placement", "preprocessing", "Oranges")


@figure("interleaving", "Ablation: DistTrain's backbone in plain 1F1B against interleaved 1F1B "
        "(vpp chunks per pipeline rank), same plan, workload and devices: throughput and the measured "
        "bubble share of rank-time (experiment=interleaving).")
def interleaving(data):
    return _ablation(data, "interleaving", *ABLATIONS["interleaving"],
                     [THROUGHPUT, ("bubble_fraction", "bubble (% of rank-time)", 100.0)],
                     "Ablation: interleaved backbone pipeline", "pipeline", "Purples")
