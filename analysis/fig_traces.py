"""Per-step figures: loss curves of all systems on the same data, and one iteration's timeline."""
from __future__ import annotations

import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from analysis.load import WORKLOAD_ORDER, system_order
from analysis.style import (BUBBLE_COLOR, FIGSIZE, MODULE_COLORS, NoData, figure, new_figure,
                            panel_legend, system_palette)

PREFERENCE = {"validation": 0, "main": 1}


def _pick_runs(heads: pd.DataFrame) -> tuple[tuple, pd.DataFrame]:
    """The (workload, profile) with the most systems, and its preferred run per line."""
    size = {w: i for i, w in enumerate(WORKLOAD_ORDER)}
    score = heads.groupby(["workload", "data_profile"]).agg(
        systems=("system", "nunique"), lines=("layout_label", "nunique"),
        validation=("experiment", lambda e: (e == "validation").any()))
    best = max(score.index, key=lambda k: (score.loc[k, "systems"], score.loc[k, "validation"],
                                           score.loc[k, "lines"], -size.get(k[0], 99)))
    runs = heads[(heads["workload"] == best[0]) & (heads["data_profile"] == best[1])]
    runs = runs.assign(_failed=runs["status"] != "ok", _pref=runs["experiment"].map(
        lambda e: PREFERENCE.get(e, 2)), _ts=runs["timestamp"])
    runs = runs.sort_values(["_failed", "_pref", "_ts"], ascending=[True, True, False])
    return best, runs


@figure("loss", "Training loss per step of every system and layout on the same workload and "
        "data (measured); identical curves overlap, drawn widest-first so each stays visible.")
def loss(data):
    st = data.steps[(data.steps["mode"] == "measured") & data.steps["loss"].notna()]
    if st.empty:
        raise NoData("no measured step with a loss")
    (workload, profile), runs = _pick_runs(st.drop_duplicates("run_id"))
    runs = runs.drop_duplicates(["system", "layout_label"])
    palette = system_palette(runs["system"])
    fig, (ax,) = new_figure()
    k = 0  # lines are drawn widest first, so identical curves nest instead of hiding
    for system in palette:  # in system order
        mine = runs[runs["system"] == system].sort_values("layout_label")
        for j, (_, run) in enumerate(mine.iterrows()):
            curve = st[st["run_id"] == run["run_id"]].sort_values("step")
            color = tuple(c * (1 - 0.22 * (j % 4)) for c in palette[system])
            sns.lineplot(data=curve, x="step", y="loss", ax=ax, color=color,
                         linewidth=max(5.0 - 1.2 * k, 1.0), alpha=0.9,
                         linestyle=("-", "--", ":", "-.")[j % 4], errorbar=None,
                         label=f"{system} · {run['layout_label']}")
            k += 1
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("training step (iteration #)")
    ax.set_ylabel("training loss (total, dimensionless)")
    ax.set_title(f"Loss curves on the same data: {workload} · {profile} (measured)")
    handles, labels = ax.get_legend_handles_labels()
    ax.get_legend().remove()
    fig.legend(handles, labels, title="system · layout", loc="outside lower center",
               ncol=min(len(labels), 2), frameon=False)
    return fig


def _last_steps(steps: pd.DataFrame, column: str) -> pd.DataFrame:
    st = steps[steps["mode"] == "measured"]
    last = st.sort_values("step").groupby("run_id").tail(1)
    has = last[column].map(lambda v: isinstance(v, (list, tuple)) and len(v) > 0)
    return last.loc[has.astype(bool)]


def _busy_union(segments: list[tuple[float, float]]) -> float:
    total, end = 0.0, -np.inf
    for s, e in sorted(segments):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def _draw_timeline(ax, entries: pd.DataFrame, span: float, kinds: set) -> float:
    ranks = sorted(entries["rank"].unique())
    for y, rank in enumerate(ranks):
        ax.broken_barh([(0, span)], (y - 0.4, 0.8), facecolor=BUBBLE_COLOR, edgecolor="none")
        mine = entries[entries["rank"] == rank]
        for _, e in mine.iterrows():
            if e["kind"] == "idle":
                continue
            base = MODULE_COLORS.get(e["module"], (0.5, 0.5, 0.5))
            color = {"fwd": base, "bwd": tuple(0.6 * c for c in base)}.get(e["kind"], "#7f7f7f")
            kinds.add(("comm", None) if e["kind"] not in ("fwd", "bwd") else (e["kind"], e["module"]))
            ax.broken_barh([(e["t0"], e["t1"] - e["t0"])], (y - 0.4, 0.8), facecolor=color,
                           edgecolor="white", linewidth=0.3)
    ax.set_yticks(range(len(ranks)), labels=[str(r) for r in ranks])
    ax.invert_yaxis()
    busy = sum(_busy_union(list(zip(g["t0"], g["t1"])))
               for _, g in entries[entries["kind"] != "idle"].groupby("rank"))
    return 1 - busy / (span * len(ranks))


def _draw_stacked(ax, run, color) -> float:
    busy, idle = np.asarray(run["rank_busy_s"], float), np.asarray(run["rank_idle_s"], float)
    ranks = np.arange(len(busy))
    ax.barh(ranks, busy, color=color, edgecolor="black", linewidth=0.5)
    ax.barh(ranks, idle, left=busy, color=BUBBLE_COLOR, edgecolor="black", linewidth=0.5)
    ax.set_yticks(ranks, labels=[str(r) for r in ranks])
    ax.invert_yaxis()
    return float(idle.sum() / (busy.sum() + idle.sum()))


def _segment_order(kind_module) -> tuple:
    kind, module = kind_module
    modules = list(MODULE_COLORS)
    return (modules.index(module) if module in modules else 9, str(module), kind != "fwd")


@figure("timeline", "Per-rank timeline of the last measured iteration: busy segments by module "
        "(forward light, backward dark, communication grey) over the bubble (idle) background; "
        "without a recorded timeline, per-rank busy and idle seconds are stacked.")
def timeline(data):
    last = _last_steps(data.steps, "timeline")
    detailed = not last.empty
    if not detailed:
        last = _last_steps(data.steps, "rank_busy_s")
        last = last.loc[last["rank_idle_s"].map(lambda v: isinstance(v, (list, tuple))).astype(bool)]
    if last.empty:
        raise NoData("no measured step with a per-rank timeline or rank_busy_s/rank_idle_s")
    (workload, profile), runs = _pick_runs(last)
    # The module pipeline's bubbles are the interesting ones: prefer non-colocated layouts.
    colocated = runs["layout_label"].astype(str).str.startswith("colocated")
    runs = runs.assign(_colocated=colocated).sort_values("_colocated", kind="stable").drop_duplicates("system")
    systems = system_order(runs["system"])[:3]
    by_system = runs.set_index("system")
    heights = [len({e["rank"] for e in by_system.loc[s, "timeline"]}) if detailed
               else len(by_system.loc[s, "rank_busy_s"]) for s in systems]
    size = (FIGSIZE[0], max(FIGSIZE[1], 1.0 + sum(0.6 + 0.3 * h for h in heights)))
    fig, axes = new_figure(nrows=len(systems), size=size, sharex=True,
                           gridspec_kw={"height_ratios": [0.6 + 0.3 * h for h in heights]})
    kinds: set = set()
    palette = system_palette(systems)
    for ax, system in zip(axes, systems):
        run = by_system.loc[system]
        if detailed:
            entries = pd.DataFrame(run["timeline"])
            t0 = entries["start_s"].min()
            entries = entries.assign(t0=entries["start_s"] - t0, t1=entries["end_s"] - t0)
            bubble = _draw_timeline(ax, entries, entries["t1"].max(), kinds)
        else:
            bubble = _draw_stacked(ax, run, palette[system])
        ax.set_title(f"{system} · {run['layout_label']}: bubble {bubble:.0%} of rank-time")
        ax.set_ylabel("rank (#)")
    axes[-1].set_xlabel("time since iteration start (s)" if detailed
                        else "busy + idle time in the last step (s)")
    if detailed:
        handles = [Patch(facecolor=MODULE_COLORS.get(m, (0.5, 0.5, 0.5)) if k == "fwd" else
                         tuple(0.6 * c for c in MODULE_COLORS.get(m, (0.5, 0.5, 0.5))),
                         label=f"{m} {k}") for k, m in sorted(kinds, key=_segment_order) if k != "comm"]
        handles += [Patch(facecolor="#7f7f7f", label="communication")] * (("comm", None) in kinds)
    else:
        handles = [Patch(facecolor=c, edgecolor="black", label=f"{s} busy") for s, c in palette.items()]
    handles.append(Patch(facecolor=BUBBLE_COLOR, edgecolor="black", label="bubble (idle)"))
    panel_legend(fig, handles, "segment (kind of work)")
    fig.suptitle(f"One iteration per rank: {workload} · {profile} (measured, last step)")
    return fig
