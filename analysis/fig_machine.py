"""The machine's speed beside the runs: each measured run's samples/s against the CPU time of the
fixed work its ranks timed after every step (bench.run.machine.SpeedProbe; analysis.speed)."""
from __future__ import annotations

import numpy as np
import seaborn as sns
from matplotlib.ticker import FormatStrFormatter

from analysis import speed
from analysis.load import ok
from analysis.repeats import repeat_key
from analysis.style import FIGSIZE, NoData, figure, new_figure

MAX_PANELS = 6


@figure("machine_speed", "The machine's speed beside the runs: each measured run's samples/s against the "
        "CPU time its ranks took for the same fixed work after every step (log-log), one colour per "
        "configuration, one panel per experiment; where the experiment has repeats enough and the slope is "
        "told from zero, the lines are the one slope analysis.speed fits within its configurations, which the "
        "report's ratios 'at one speed of the machine' use. Spread along a line is the machine; the gap "
        "between lines, the configurations.")
def machine_speed(data):
    runs = ok(data.runs)
    runs = runs[(runs["mode"] == "measured") & (runs[speed.PROBE_COLUMN] > 0)]
    if runs.empty:
        raise NoData("no measured run carries a probe time (metrics.probe_cpu_s, recorded since 7 Dec 2026)")
    experiments = list(runs["experiment"].fillna("untagged").drop_duplicates())[:MAX_PANELS]
    ncols = min(len(experiments), 2)
    nrows = -(-len(experiments) // ncols)
    fig, axes = new_figure(ncols=ncols, nrows=nrows, size=(FIGSIZE[0] * ncols / 1.4, 0.8 + 3.2 * nrows))
    for ax, experiment in zip(axes, experiments):
        group = runs[runs["experiment"].fillna("untagged") == experiment]
        keys = repeat_key(group)
        fitted = speed.fit(group, keys)
        colors = dict(zip(keys.unique(), sns.color_palette("colorblind", keys.nunique())))
        for key, color in colors.items():
            mine = group[keys == key]
            probe_ms, rate = 1e3 * mine[speed.PROBE_COLUMN], mine["samples_per_s"]
            label = f"{mine['system'].iloc[0]} {mine['layout_label'].iloc[0]} ({mine['workload'].iloc[0]})"
            ax.scatter(probe_ms, rate, color=color, s=18, label=label)
            if fitted is not None and fitted.told_from_zero and len(mine) > 1:
                # the fitted line through the configuration's mean in log-log
                x = np.linspace(probe_ms.min(), probe_ms.max(), 20)
                centre = np.exp(np.log(rate).mean()) * (x / np.exp(np.log(probe_ms).mean())) ** fitted.slope
                ax.plot(x, centre, color=color, lw=1)
        ax.set_xscale("log")
        ax.set_yscale("log")
        for axis in (ax.xaxis, ax.yaxis):          # log scales less than a decade wide: plain numbers
            axis.set_major_formatter(FormatStrFormatter("%g"))
            axis.set_minor_formatter(FormatStrFormatter("%g"))
        ax.set_title(experiment + ("" if fitted is None else f": slope {fitted.slope:.2f} ± "
                                   f"{speed.t_975(fitted.dof) * fitted.slope_se:.2f}, R² {fitted.r2:.2f}"
                                   + ("" if fitted.told_from_zero else " (not adjusted)")))
        ax.set_xlabel("fixed-work probe, CPU ms a step")
        ax.set_ylabel("samples/s")
        ax.legend(fontsize=6, loc="best")
    for ax in axes[len(experiments):]:
        ax.set_visible(False)
    fig.suptitle("Throughput against the machine's speed (measured)")
    return fig
