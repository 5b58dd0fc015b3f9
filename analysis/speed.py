"""The machine's speed as a covariate: every run's samples/s brought to one speed of the machine.

Every rank times the same fixed work after every step (bench.run.machine.SpeedProbe); a record's
metrics.probe_cpu_s holds the median CPU seconds of each kind of it. On this project's virtual
machine the CPU time of that fixed work drifted by a quarter within 12 minutes, and the runs' step
times followed it: within a configuration, log step time against log probe seconds, R^2 0.94 over
16 runs of 4 configurations (docs/validation-log.md, 7 Dec 07:21). So most of the spread of the
repeats is the machine's speed at the time, and it can be measured out.

The adjustment is the textbook one (analysis of covariance, configurations as fixed effects):
one slope b of log samples/s on log probe seconds, fitted within the configurations of one
comparison, and every run brought to the comparison's median probe time p0:
adjusted = samples/s * (p0 / p)^b. The adjusted repeats are compared with the same rank interval
as the raw ones (analysis.stats.ratio_of_medians). What this assumes, and the report says: one
slope for every configuration (a step that leans more on per-op overhead than on arithmetic could
follow the machine differently); a probe the system under test does not slow (it runs when every
rank has passed the step's closing barrier; its CPU seconds exclude waiting for a core); and the
slope's own error is left out of the interval. That last is why runs are adjusted only where the
slope is told from zero (its 95% t interval excludes 0): on a steady machine the probe's spread
is its own noise, a slope fitted to it is mostly error, and the report says it did not adjust.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

PROBE_COLUMN = "probe_s"          # runs frame: the record's probe CPU seconds, summed over kinds
# Runs beyond one per configuration the slope needs before it is trusted: with fewer, a slope
# fitted to noise would move the verdicts it is meant to sharpen.
MIN_WITHIN_DOF = 4


# Two-sided 95% quantiles of Student's t by degrees of freedom (any statistics table); 1.96 beyond.
T_975 = {3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228, 12: 2.179,
         15: 2.131, 20: 2.086, 25: 2.060, 30: 2.042, 40: 2.021, 60: 2.000, 120: 1.980}


def t_975(dof: int) -> float:
    """The table's quantile at the largest tabulated dof <= `dof` (a little wide between rows)."""
    return T_975[max(d for d in T_975 if d <= dof)] if dof < 1000 else 1.96


@dataclass(frozen=True)
class SpeedFit:
    slope: float          # d log(samples/s) / d log(probe seconds): -1 = the step follows the probe exactly
    slope_se: float       # its standard error
    dof: int              # runs - configurations - 1
    r2: float             # share of the within-configuration variance of log samples/s the probe explains
    reference_s: float    # the probe seconds every run is brought to: the median over the fitted runs
    runs: int
    configurations: int

    @property
    def told_from_zero(self) -> bool:
        """Whether the slope's 95% t interval excludes 0: the runs are adjusted only then."""
        return abs(self.slope) > t_975(self.dof) * self.slope_se

    def describe(self) -> str:
        return (f"slope {self.slope:.2f} ± {t_975(self.dof) * self.slope_se:.2f}, R² {self.r2:.2f} within "
                f"configurations, {self.runs} runs of {self.configurations} configurations")


def probe_seconds(records: list[dict]) -> list[float]:
    """Each record's probe CPU seconds (the kinds summed), NaN where it has none."""
    out = []
    for r in records:
        probe = (r.get("metrics") or {}).get("probe_cpu_s")
        ok = isinstance(probe, dict) and probe and all(isinstance(v, (int, float)) and v > 0 for v in probe.values())
        out.append(float(sum(probe.values())) if ok else float("nan"))
    return out


def fit(runs: pd.DataFrame, configuration: pd.Series) -> SpeedFit | None:
    """The common within-configuration slope over `runs` (ok, measured) that carry a probe time;
    None where there are too few runs beyond one per configuration or the probe never moved."""
    rate, probe = runs["samples_per_s"].astype(float), runs[PROBE_COLUMN].astype(float)
    usable = (rate > 0) & (probe > 0)
    if not usable.any():
        return None
    y, x, g = np.log(rate[usable]), np.log(probe[usable]), configuration[usable]
    yc, xc = y - y.groupby(g).transform("mean"), x - x.groupby(g).transform("mean")
    configs = int(g.nunique())
    if len(y) - configs < MIN_WITHIN_DOF or float(xc @ xc) <= 0 or float(yc @ yc) <= 0:
        return None
    slope = float(xc @ yc) / float(xc @ xc)
    residual = yc - slope * xc
    rss, dof = float(residual @ residual), len(y) - configs - 1
    return SpeedFit(slope, float(np.sqrt(rss / dof / float(xc @ xc))), dof, 1.0 - rss / float(yc @ yc),
                    float(np.median(probe[usable])), len(y), configs)


def adjusted(runs: pd.DataFrame, speed: SpeedFit) -> pd.Series:
    """Each run's samples/s at the fit's reference probe time; NaN where the run has no probe."""
    probe = runs[PROBE_COLUMN].astype(float)
    return runs["samples_per_s"].astype(float) * (speed.reference_s / probe) ** speed.slope
