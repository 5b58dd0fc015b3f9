"""The machine's speed beside the runs: each measured run's samples/s against the CPU time of the
fixed work its ranks timed after every step (bench.speed.SpeedProbe; analysis.speed)."""
from __future__ import annotations

import numpy as np
import seaborn as sns
from matplotlib.ticker import FormatStrFormatter

from analysis import at_speed, speed
from analysis.repeats import repeat_key
from analysis.style import FIGSIZE, NoData, figure, new_figure

MAX_PANELS = 10


@figure("machine_speed", "The machine's speed beside the runs: each measured run's samples/s against the "
        "CPU time its ranks took for the same fixed work after every step (log-log), one colour per "
        "configuration, one panel per comparison of the report; where it has repeats enough and the slope is "
        "told from zero, the lines are the one slope analysis.speed fits within its configurations, which the "
        "report's ratios 'at one speed of the machine' use. Spread along a line is the machine; the gap "
        "between lines, the configurations.")
def machine_speed(data):
    runs = at_speed.probed(data.runs)
    if runs.empty:
        raise NoData("no measured run carries a probe time (metrics.probe_cpu_s, recorded since 7 Dec 2026)")
    # one panel per comparison, the runs the report fits one slope over (analysis.at_speed)
    panels = [(_title(experiment, group), group)
              for experiment, runs_of in runs.groupby(runs["experiment"].fillna("untagged"), sort=False)
              for _, group in runs_of.groupby(at_speed.group_keys(experiment), sort=False)][:MAX_PANELS]
    ncols = min(len(panels), 2)
    nrows = -(-len(panels) // ncols)
    fig, axes = new_figure(ncols=ncols, nrows=nrows, size=(max(FIGSIZE[0], 5 * ncols), 0.8 + 3.2 * nrows))
    for ax, (title, group) in zip(axes, panels):
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
        if fitted is not None:
            title += (f"\nslope {fitted.slope:.2f} ± {fitted.half_width:.2f}, R² {fitted.r2:.2f}"
                      + ("" if fitted.told_from_zero else " (not adjusted)"))
        ax.set_title(title, fontsize=8)
        ax.set_xlabel("fixed-work probe (CPU ms a step)")
        ax.set_ylabel("throughput (samples/s)")
        ax.legend(fontsize=6, loc="best")
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    fig.suptitle("Throughput against the machine's speed (measured)")
    return fig


def _title(experiment: str, group) -> str:
    first = group.iloc[0]
    system = f" · {first['system']}" if "system" in at_speed.group_keys(experiment) else ""
    return f"{experiment}{system} · {first['workload']} · {first['num_devices']} devices"
