"""The machine's speed as a covariate: every run's samples/s brought to one speed of the machine.

Every rank times the same fixed work after every step (bench.speed.SpeedProbe); a record's
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

import numpy as np
import pandas as pd

from bench.speed import SpeedFit, fit_slope

PROBE_COLUMN = "probe_s"          # runs frame: the record's probe CPU seconds, summed over kinds


def fit(runs: pd.DataFrame, configuration: pd.Series) -> SpeedFit | None:
    """The common within-configuration slope over `runs` (ok, measured) that carry a probe time
    (bench.speed.fit_slope); None where there are too few runs or the probe never moved."""
    return fit_slope(runs["samples_per_s"].astype(float).tolist(), runs[PROBE_COLUMN].astype(float).tolist(),
                     configuration.tolist())


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
