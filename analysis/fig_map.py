"""Where disaggregation pays: simulated speedup over the baseline against the share of the
training FLOPs done by the encoder and generator.

The share comes from the records themselves: MFU per module over total MFU is each module's
fraction of the iteration's FLOPs (bench.metrics.throughput divides both by the same time and
capacity). One point per system under study and comparison group (workload, data profile,
device count) of simulated records, at the best layout of each system.
"""
from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.lines import Line2D

from analysis.load import is_baseline
from analysis.repeats import best_layouts
from analysis.style import NoData, figure, new_figure, system_palette

# The DistTrain paper's headline (arXiv 2408.04275, abstract): "up to 2.2x" Megatron-LM's throughput.
PAPER_MAX_SPEEDUP = 2.2
# Its largest run: a 72B MLLM on 1172 GPUs; our closest preset and device count.
PAPER_POINT = ("mllm-72b", 1172)
MARKERS = ("o", "s", "D", "^", "v", "P", "X", "*")


def speedup_map(runs: pd.DataFrame, baseline: str | None) -> pd.DataFrame:
    """Simulated best layouts of the systems under study with their speedup over `baseline` and
    `side_share`, the encoder + generator fraction of the FLOPs; empty if nothing compares."""
    if baseline is None:
        return pd.DataFrame()
    # bench validate's simulations of CPU runs are checks of the model, not points of the map
    best = best_layouts(runs[(runs["mode"] == "simulated") & (runs["experiment"] != "validation")], baseline=baseline)
    if best.empty:
        return best
    best = best[~best["system"].map(is_baseline) & best["speedup"].notna()].copy()
    best["side_share"] = (best["mfu_encoder"] + best["mfu_generator"]) / best["mfu"]
    return best[best["side_share"].notna()].reset_index(drop=True)


@figure("map", "Where disaggregation pays (simulated): speedup of each system under study over the "
        "baseline's best layout, against the share of the training FLOPs done by the encoder and "
        "generator (from the records' per-module MFU), one point per workload, data profile and GPU "
        "count. The dotted line is the DistTrain paper's 'up to 2.2x'; the ringed points are our "
        "closest match to its largest run (72B, 1172 GPUs).")
def speedup_vs_share(data):
    df = speedup_map(data.runs, data.baseline)
    if df.empty:
        raise NoData("no simulated record of a system under study with a simulated baseline in the same group")
    palette = system_palette(df["system"])
    workloads = list(dict.fromkeys(df["workload"]))
    marker = {w: MARKERS[i % len(MARKERS)] for i, w in enumerate(workloads)}
    fig, (ax,) = new_figure(size=(7, 4.6))
    for _, r in df.iterrows():
        ax.scatter(100 * r["side_share"], r["speedup"], color=palette[r["system"]], marker=marker[r["workload"]],
                   s=18 + 10 * np.log2(max(r["num_devices"], 1)), edgecolor="black", linewidth=0.5, zorder=3)
        if (r["workload"], int(r["num_devices"])) == PAPER_POINT:
            ax.scatter(100 * r["side_share"], r["speedup"], s=260, facecolor="none", edgecolor="black",
                       linewidth=1.2, zorder=4)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.axhline(PAPER_MAX_SPEEDUP, color="grey", linestyle=":", linewidth=1.2)
    ax.text(0.01, PAPER_MAX_SPEEDUP, "DistTrain paper: up to 2.2x", va="bottom", fontsize=8, color="dimgrey",
            transform=ax.get_yaxis_transform())        # x in axes fraction, y in data
    ax.set_xscale("log")
    ax.set_yscale("log", base=2)
    ax.set_xlabel("encoder + generator share of training FLOPs (%), log scale")
    ax.set_ylabel(f"speedup over {data.baseline} (simulated), log2 scale")
    ax.set_title("Where disaggregation pays (simulated)")
    handles = [Line2D([], [], linestyle="", marker="o", color=c, label=s) for s, c in palette.items()]
    handles += [Line2D([], [], linestyle="", marker=marker[w], color="grey", label=w) for w in workloads]
    handles.append(Line2D([], [], linestyle="", marker="o", markerfacecolor="none", markeredgecolor="black",
                          markersize=12, label=f"closest to the paper's {PAPER_POINT[0]}, {PAPER_POINT[1]} GPUs"))
    fig.legend(handles=handles, loc="outside right center", frameon=False, fontsize=8,
               title="marker size: GPUs")
    return fig
