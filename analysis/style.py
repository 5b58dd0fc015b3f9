"""Shared look of every figure, the figure registry and the bar-chart helper.

A new figure is one function decorated with `@figure("name", "caption")` that takes a
`Results` and returns a matplotlib Figure, or raises NoData("why") when its data is absent.
"""
from __future__ import annotations

import functools
from typing import Callable

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from analysis.load import WORKLOAD_ORDER, system_order  # noqa: E402
from systems.base import baseline_names, system_names  # noqa: E402

FIGSIZE = (7, 4)
DPI = 140
RC = {"font.size": 10, "axes.titlesize": 11, "axes.labelsize": 10, "xtick.labelsize": 9,
      "ytick.labelsize": 9, "legend.fontsize": 9, "legend.title_fontsize": 9,
      "figure.titlesize": 12, "hatch.linewidth": 0.8, "savefig.dpi": DPI, "figure.dpi": DPI}
SIM_HATCH = "///"
_BASE = sns.color_palette("colorblind")
# Baselines and systems under study each walk their own part of the palette, so the two
# never share a color.
BASELINE_COLORS = [_BASE[i] for i in (1, 7, 5, 8)]
STUDY_COLORS = [_BASE[i] for i in (2, 0, 3, 4, 6, 9)]
MODULE_COLORS = {"encoder": _BASE[0], "backbone": _BASE[1], "generator": _BASE[2]}
BUBBLE_COLOR = "#f2c4c4"
PROFILE_SHORT = {"uniform": "uniform", "heterogeneous": "hetero"}


class NoData(Exception):
    """Raised by a figure function whose data is absent; the message says what is missing."""


FIGURES: dict[str, Callable] = {}
CAPTIONS: dict[str, str] = {}


def figure(name: str, caption: str):
    """Register a figure function under `name`; it draws with the shared theme."""
    def wrap(fn):
        @functools.wraps(fn)
        def themed(data):
            with sns.axes_style("whitegrid"), plt.rc_context(RC):
                return fn(data)
        FIGURES[name] = themed
        CAPTIONS[name] = caption
        return themed
    return wrap


def system_palette(systems) -> dict:
    """System -> color for the distinct `systems`, in system_order. Colors are dealt over every
    registered system too, so a registered system keeps its color in every figure; an
    unregistered one (a system under study) follows them in name order."""
    baselines = set(baseline_names())
    everyone = system_order([*system_names(), *systems])
    colors = {}
    for walk, part in ((BASELINE_COLORS, [s for s in everyone if s in baselines]),
                       (STUDY_COLORS, [s for s in everyone if s not in baselines])):
        colors.update({s: walk[i % len(walk)] for i, s in enumerate(part)})
    return {s: colors[s] for s in system_order(systems)}


def group_label(row, with_system: bool = False, with_mode: bool = False, with_cluster: bool = False) -> str:
    """'mllm-9b\\nhetero · 8 dev' — the x tick of one comparison group."""
    n = int(row["num_devices"])
    lines = [str(row["workload"]),
             f"{PROFILE_SHORT.get(row['data_profile'], row['data_profile'])} · {n} dev"]
    if with_cluster:
        lines.append(str(row["cluster"]))
    if with_system:
        lines.append(str(row["system"]))
    if with_mode and row["mode"] == "simulated":
        lines.append("(simulated)")
    return "\n".join(lines)


def with_groups(df: pd.DataFrame, with_system: bool = False,
                with_mode: bool = False) -> tuple[pd.DataFrame, list[str]]:
    """df plus a 'group' column, and the groups in model-size order; the cluster is in the
    label where the rows come from more than one."""
    df = df.copy()
    several = df["cluster"].nunique() > 1
    df["group"] = [group_label(r, with_system, with_mode, several) for _, r in df.iterrows()]
    rank = {w: i for i, w in enumerate(WORKLOAD_ORDER)}
    keyed = df.assign(_w=df["workload"].map(lambda w: rank.get(w, 99)))
    keys = ["_w", "workload", "data_profile", "cluster", "num_devices", "system", "mode"]
    order = list(dict.fromkeys(keyed.sort_values(keys)["group"]))
    return df, order


def bars(ax, df: pd.DataFrame, x: str, y: str, hue: str, order, hue_order, palette,
         annotate: str | None = None, skip_annotate=(), interval: tuple[str, str] | None = None) -> None:
    """Seaborn bars; a bar whose row is simulated (df['mode']) is hatched; with `interval`
    (low, high columns) a bar whose row has both gets an error bar from low to high."""
    sns.barplot(data=df, x=x, y=y, hue=hue, order=order, hue_order=hue_order, palette=palette,
                errorbar=None, ax=ax, edgecolor="black", linewidth=0.6, legend=False,
                width=min(0.8, 0.3 * len(hue_order)))  # a lone bar is not a wall
    sim = {(r[x], r[hue]) for _, r in df.iterrows() if r["mode"] == "simulated"}
    for level, container in zip(hue_order, ax.containers):
        for bar in container:
            if not bar.get_height() == bar.get_height() or bar.get_height() == 0:
                continue
            tick = order[int(round(bar.get_x() + bar.get_width() / 2))]
            if (tick, level) in sim:
                bar.set_hatch(SIM_HATCH)
            if interval:
                _error_bar(ax, bar, df[(df[x] == tick) & (df[hue] == level)], interval)
        if annotate and level not in skip_annotate:
            ax.bar_label(container, fmt=annotate, fontsize=9, padding=2)
    if len(order) > 5:
        ax.tick_params(axis="x", labelrotation=30)
        for tick in ax.get_xticklabels():
            tick.set_horizontalalignment("right")


def _error_bar(ax, bar, rows: pd.DataFrame, interval: tuple[str, str]) -> None:
    low, high = interval
    if rows.empty or low not in rows or pd.isna(rows[low].iloc[0]) or pd.isna(rows[high].iloc[0]):
        return
    x, y = bar.get_x() + bar.get_width() / 2, bar.get_height()
    lo, hi = float(rows[low].iloc[0]), float(rows[high].iloc[0])
    ax.errorbar([x], [y], yerr=[[max(y - lo, 0.0)], [max(hi - y, 0.0)]], fmt="none", ecolor="black",
                elinewidth=1, capsize=3, zorder=3)


def legend_handles(palette: dict, simulated: bool, labels: dict | None = None) -> list:
    handles = [Patch(facecolor=c, edgecolor="black", linewidth=0.6, label=(labels or {}).get(k, k))
               for k, c in palette.items()]
    if simulated:
        handles.append(Patch(facecolor="white", edgecolor="black", hatch=SIM_HATCH,
                             label="simulated (hatched)"))
    return handles


def panel_legend(fig, handles, title: str | None = None, ncol: int | None = None) -> None:
    """One legend for the whole figure, below the panels."""
    ncol = ncol or min(len(handles), 4)
    fig.legend(handles=handles, title=title, loc="outside lower center", ncol=ncol,
               frameon=False, columnspacing=1.2, handlelength=1.8)


def new_figure(ncols: int = 1, nrows: int = 1, size=FIGSIZE, **kw):
    fig, axes = plt.subplots(nrows, ncols, figsize=size, layout="constrained", squeeze=False, **kw)
    return fig, axes.ravel()


def modes_in(df: pd.DataFrame) -> list[str]:
    return [m for m in ("measured", "simulated") if (df["mode"] == m).any()]


def mode_title(mode: str) -> str:
    return "measured" if mode == "measured" else "simulated (cost model, not measured)"
