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
slope's own error is left out of the interval.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

PROBE_COLUMN = "probe_s"          # runs frame: the record's probe CPU seconds, summed over kinds
# Runs beyond one per configuration the slope needs before it is trusted: with fewer, a slope
# fitted to noise would move the verdicts it is meant to sharpen.
MIN_WITHIN_DOF = 4


@dataclass(frozen=True)
class SpeedFit:
    slope: float          # d log(samples/s) / d log(probe seconds): -1 = the step follows the probe exactly
    r2: float             # share of the within-configuration variance of log samples/s the probe explains
    reference_s: float    # the probe seconds every run is brought to: the median over the fitted runs
    runs: int
    configurations: int

    def describe(self) -> str:
        return (f"slope {self.slope:.2f}, R² {self.r2:.2f} within configurations, {self.runs} runs of "
                f"{self.configurations} configurations")


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
    return SpeedFit(slope, 1.0 - float(residual @ residual) / float(yc @ yc), float(np.median(probe[usable])),
                    len(y), configs)


def adjusted(runs: pd.DataFrame, speed: SpeedFit) -> pd.Series:
    """Each run's samples/s at the fit's reference probe time; NaN where the run has no probe."""
    probe = runs[PROBE_COLUMN].astype(float)
    return runs["samples_per_s"].astype(float) * (speed.reference_s / probe) ** speed.slope
