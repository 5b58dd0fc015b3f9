"""Heterogeneous parallelism at long context (arXiv 2605.27678), simulated: the paper's three
configurations side by side — optimized homogeneous (one layout for all modules), colocated
heterogeneous (per-module layouts time-sharing the same GPUs) and non-colocated heterogeneous
(disjoint rank sets) — each at the best layout its search finds, in TFLOPS/GPU and tokens/s.

Records name their configuration in `tags.configuration` (the sweep file sets it), so nothing
here needs to know which system implements which configuration.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from analysis.load import WORKLOAD_ORDER
from analysis.style import SIM_HATCH, NoData, figure, new_figure

EXPERIMENT = "heterogeneous-sim"
CONFIGURATIONS = ("homogeneous", "colocated", "non-colocated")
COLORS = {"homogeneous": "#7f7f7f", "colocated": "#2ca02c", "non-colocated": "#1f77b4"}
# The paper's gains over its optimized homogeneous layout (arXiv 2605.27678, abstract): colocated
# heterogeneous "up to 49.3%" TFLOPS/GPU; non-colocated "up to 13.0%" token throughput and "up to
# 9.6%" TFLOPS/GPU.
PAPER_GAINS = {("colocated", "tflops_per_gpu"): 0.493, ("non-colocated", "tokens_per_s"): 0.130,
               ("non-colocated", "tflops_per_gpu"): 0.096}
METRICS = {"tflops_per_gpu": "per GPU (TFLOP/s)", "tokens_per_s": "throughput (tokens/s)"}


def configurations_frame(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per (workload, GPUs, configuration): the best simulated record by tokens/s, with its
    gain over the homogeneous configuration of the same workload and GPU count."""
    needed = {"tags.configuration", "metrics.tflops_per_gpu"}
    if runs.empty or not needed <= set(runs):
        return pd.DataFrame()
    df = runs[(runs["experiment"] == EXPERIMENT) & (runs["mode"] == "simulated") & (runs["status"] == "ok")
              & runs["tags.configuration"].isin(CONFIGURATIONS)]
    if df.empty:
        return pd.DataFrame()
    df = df.assign(configuration=df["tags.configuration"], tflops_per_gpu=df["metrics.tflops_per_gpu"])
    group = ["workload", "cluster", "num_devices"]          # gains only within one simulated cluster
    best = df.loc[df.groupby(group + ["configuration"])["tokens_per_s"].idxmax()].reset_index(drop=True)
    homogeneous = best[best["configuration"] == "homogeneous"].set_index(group)
    for metric in METRICS:
        reference = best.set_index(group).index.map(homogeneous[metric].to_dict())
        best[f"gain_{metric}"] = best[metric].to_numpy() / np.asarray(reference, dtype=float) - 1
    order = {w: i for i, w in enumerate(WORKLOAD_ORDER)}
    best["_w"] = best["workload"].map(lambda w: order.get(w, len(order)))
    best["_c"] = best["configuration"].map(CONFIGURATIONS.index)
    return best.sort_values(["cluster", "num_devices", "_w", "_c"]).drop(columns=["_w", "_c"]).reset_index(drop=True)


@figure("heterogeneous", "Heterogeneous parallelism at long context (simulated, hatched): TFLOPS/GPU and "
        "token throughput of the optimized homogeneous layout (one TP/CP/PP/DP for every module), colocated "
        "heterogeneous (per-module layouts on the same GPUs) and non-colocated heterogeneous (disjoint GPUs), "
        "each at its search's best layout, across context length and encoder size (x) and GPU count "
        "(columns). Labels over the bars: gain over homogeneous.")
def heterogeneous_sweep(data):
    df = configurations_frame(data.runs)
    if df.empty:
        raise NoData(f"no simulated record tagged experiment={EXPERIMENT} with a configuration tag")
    gpus = sorted(set(zip(df["cluster"], df["num_devices"])))      # a column per cluster and GPU count
    fig, axes = new_figure(nrows=len(METRICS), ncols=len(gpus), size=(3.6 * len(gpus) + 1, 6.4))
    width = 0.8 / len(CONFIGURATIONS)
    for col, (cluster, n) in enumerate(gpus):
        part = df[(df["cluster"] == cluster) & (df["num_devices"] == n)]
        workloads = list(dict.fromkeys(part["workload"]))
        for row, (metric, title) in enumerate(METRICS.items()):
            ax = axes[row * len(gpus) + col]
            for i, conf in enumerate(CONFIGURATIONS):
                sub = part[part["configuration"] == conf].set_index("workload")
                xs = [k + (i - 1) * width for k, w in enumerate(workloads) if w in sub.index]
                ys = [sub.loc[w, metric] for w in workloads if w in sub.index]
                for k, w in enumerate(workloads):
                    if w not in sub.index:      # no layout of this configuration fits (a skipped record)
                        ax.text(k + (i - 1) * width, 0, "none fits", rotation=90, ha="center", va="bottom", fontsize=7)
                bars = ax.bar(xs, ys, width, color=COLORS[conf], hatch=SIM_HATCH, edgecolor="white",
                              label=conf if (row, col) == (0, 0) else None)
                if conf != "homogeneous":
                    gains = [sub.loc[w, f"gain_{metric}"] for w in workloads if w in sub.index]
                    ax.bar_label(bars, [f"{100 * g:+.0f}%" if np.isfinite(g) else "" for g in gains], fontsize=7)
            ax.set_xticks(range(len(workloads)), workloads, rotation=20, ha="right")
            ax.set_xlabel("workload (preset)" if row == len(METRICS) - 1 else "")
            ax.set_ylabel(title if col == 0 else "")
            if row == 0:
                ax.set_title(f"{n} GPUs of {cluster} (simulated)")
    fig.legend(loc="outside upper center", ncol=len(CONFIGURATIONS), frameon=False)
    return fig
