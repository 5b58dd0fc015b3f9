"""Statistics of repeated measurements, in one place: medians, 95% intervals, ratios, verdicts.

A configuration measured N times (N records sharing a `config_key`) is summarized by the
median of its repeats, a percentile-bootstrap 95% confidence interval of that median, and the
coefficient of variation. A comparison of two configurations is the ratio of their medians
with a bootstrap interval (each side resampled independently); it is worded faster or slower
only when the interval excludes 1, otherwise "no difference beyond the noise (±x%)".

The bootstrap is seeded: the same records give the same intervals (reports are reproducible).
With one repeat there is no interval (NaN bounds), and no verdict beyond "one run each".
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from bench.bootstrap import RESAMPLES, bootstrap_medians, rng as _rng

CONFIDENCE = 0.95


@dataclass(frozen=True)
class Summary:
    n: int
    median: float
    low: float           # 95% interval of the median (NaN with fewer than 2 repeats)
    high: float
    cv: float            # standard deviation / mean of the repeats (NaN with fewer than 2)


@dataclass(frozen=True)
class Ratio:
    value: float         # median(a) / median(b)
    low: float
    high: float
    n_a: int
    n_b: int

    def verdict(self, faster: str = "faster", slower: str = "slower") -> str:
        """Words for the comparison: a direction only when the interval excludes 1."""
        if self.n_a < 2 or self.n_b < 2 or math.isnan(self.low):
            return f"{self.value:.2f}× (one run each: no interval, no verdict)"
        if self.low > 1.0:
            return f"{self.value:.2f}× [{self.low:.2f}, {self.high:.2f}], {faster}"
        if self.high < 1.0:
            return f"{self.value:.2f}× [{self.low:.2f}, {self.high:.2f}], {slower}"
        noise = 100.0 * max(self.high - 1.0, 1.0 - self.low)
        return (f"{self.value:.2f}× [{self.low:.2f}, {self.high:.2f}], "
                f"no difference beyond the noise (±{noise:.0f}%)")


def summarize(values, confidence: float = CONFIDENCE, resamples: int = RESAMPLES, seed: int | None = None) -> Summary:
    """Median, bootstrap interval of the median and coefficient of variation of repeats."""
    x = np.asarray([v for v in values if v is not None and np.isfinite(v)], dtype=np.float64)
    if len(x) == 0:
        return Summary(0, math.nan, math.nan, math.nan, math.nan)
    med = float(np.median(x))
    if len(x) < 2:
        return Summary(1, med, math.nan, math.nan, math.nan)
    boot = bootstrap_medians(x, _rng(seed), resamples)
    tail = (1.0 - confidence) / 2.0
    low, high = np.quantile(boot, [tail, 1.0 - tail])
    cv = float(np.std(x, ddof=1) / np.mean(x)) if np.mean(x) else math.nan
    return Summary(len(x), med, float(low), float(high), cv)


def ratio_of_medians(a, b, confidence: float = CONFIDENCE, resamples: int = RESAMPLES,
                     seed: int | None = None) -> Ratio:
    """median(a) / median(b) with a bootstrap interval (a and b resampled independently)."""
    xa = np.asarray([v for v in a if np.isfinite(v)], dtype=np.float64)
    xb = np.asarray([v for v in b if np.isfinite(v)], dtype=np.float64)
    if len(xa) == 0 or len(xb) == 0:
        return Ratio(math.nan, math.nan, math.nan, len(xa), len(xb))
    value = float(np.median(xa) / np.median(xb))
    if len(xa) < 2 or len(xb) < 2:
        return Ratio(value, math.nan, math.nan, len(xa), len(xb))
    rng = _rng(seed)
    ratios = bootstrap_medians(xa, rng, resamples) / bootstrap_medians(xb, rng, resamples)
    tail = (1.0 - confidence) / 2.0
    low, high = np.quantile(ratios, [tail, 1.0 - tail])
    return Ratio(value, float(low), float(high), len(xa), len(xb))
