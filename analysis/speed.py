"""The machine's speed as a covariate: every run's samples/s brought to one speed of the machine.

Every rank times the same fixed work after every step (bench.run.machine.SpeedProbe); a record's
metrics.probe_cpu_s holds the median CPU seconds of each kind of it. On this project's virtual
machine the CPU time of that fixed work drifted by a quarter within 12 minutes, and the runs'
samples/s followed it: within a configuration, log samples/s against log probe seconds, R^2 0.94
over 16 runs of 4 configurations (docs/validation-log.md, 7 Dec 07:21). So most of the spread of
the repeats is the machine's speed at the time, and it can be measured out.

The adjustment is the textbook one (analysis of covariance, configurations as fixed effects): one
slope b of log samples/s on log probe seconds, fitted within the configurations of one comparison,
and every run brought to the comparison's median probe time p0: adjusted = samples/s * (p0 / p)^b.
The adjusted repeats are compared with the same rank interval as the raw ones
(analysis.stats.ratio_of_medians), widened by the slope's own 95% error times the two sides'
difference in median log probe time (widened). What this assumes, and the report says, is one
slope for every configuration (a step that leans more on per-op overhead than on arithmetic could
follow the machine differently) and a probe that measures the machine, not the system under test.
The probe runs after every rank has passed the step's closing barrier, but helper threads and
disaggregated preprocessing workers may still run beside it and share its caches; so a comparison
is adjusted only where the two sides' probe times do not differ beyond their own noise
(analysis.at_speed.ratio_at_speed), and only where the slope is told from zero (its 95% t interval
excludes 0): on a steady machine the probe's spread is its own noise and a slope fitted to it
mostly error. Where either fails, the report says it did not adjust, and why.

Fitting the slope on the runs it adjusts, and adjusting only where it is told from zero, lets no
more noise through (simulated in tests/test_stats.py, a drifting machine set to the 7 Dec
measurements, 8 + 8 repeats of 4 configurations): with no difference the adjusted verdict claims
one 3.8% of the time and its interval covers the truth 96%, also where the two sides' slopes are
-1.0 and -0.6; on a steady machine 5-10% of comparisons are adjusted at all. Where the raw
repeats' spread is mostly the drift, it tells far more: a true 1.05x at 12 + 12 repeats reads
faster 70% of the time at one speed, 8% raw (600 trials).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from bench.run.machine import SpeedProbe

PROBE_COLUMN = "probe_s"          # runs frame: the record's probe CPU seconds, summed over kinds
# Residual degrees of freedom (runs - configurations - 1) the slope needs before it is fitted at
# all: with fewer, its error is too wide to tell anything from zero.
MIN_DOF = 3
# The kinds of fixed work a probe time sums: a record that timed other kinds is not comparable.
KINDS = frozenset(SpeedProbe.KINDS)

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
    def half_width(self) -> float:
        """Half the slope's 95% t interval."""
        return t_975(self.dof) * self.slope_se

    @property
    def told_from_zero(self) -> bool:
        """Whether the slope's 95% t interval excludes 0: the runs are adjusted only then."""
        return abs(self.slope) > self.half_width

    def describe(self) -> str:
        return (f"slope {self.slope:.2f} ± {self.half_width:.2f}, R² {self.r2:.2f} within configurations, "
                f"{self.runs} runs of {self.configurations} configurations")


def probe_seconds(records: list[dict]) -> list[float]:
    """Each record's probe CPU seconds (every kind of KINDS, summed), NaN where it has none."""
    out = []
    for r in records:
        probe = (r.get("metrics") or {}).get("probe_cpu_s")
        usable = (isinstance(probe, dict) and set(probe) == KINDS
                  and all(type(v) in (int, float) and v > 0 for v in probe.values()))
        out.append(float(sum(probe.values())) if usable else float("nan"))
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
    dof = len(y) - configs - 1
    # a probe constant within every configuration leaves rounding residue, not a signal (logs: ~1e-16)
    if dof < MIN_DOF or float(xc @ xc) <= 1e-20 * len(xc) or float(yc @ yc) <= 0:
        return None
    slope = float(xc @ yc) / float(xc @ xc)
    residual = yc - slope * xc
    rss = float(residual @ residual)
    return SpeedFit(slope, float(np.sqrt(rss / dof / float(xc @ xc))), dof, 1.0 - rss / float(yc @ yc),
                    float(np.median(probe[usable])), len(y), configs)


def adjusted(runs: pd.DataFrame, speed: SpeedFit) -> pd.Series:
    """Each run's samples/s at the fit's reference probe time; NaN where the run has no probe."""
    probe = runs[PROBE_COLUMN].astype(float)
    return runs["samples_per_s"].astype(float) * (speed.reference_s / probe) ** speed.slope


def widened(low: float, high: float, speed: SpeedFit, probe_a: list[float], probe_b: list[float]) -> tuple:
    """A ratio's interval widened by the slope's own error: the adjustment moves a over b by
    (median probe a / median probe b)^-slope, so the slope's 95% half-width moves it by up to
    that factor to the power of the half-width, either way."""
    shift = abs(float(np.median(np.log(probe_a)) - np.median(np.log(probe_b)))) * speed.half_width
    return low * np.exp(-shift), high * np.exp(shift)
