"""Statistics of repeats: interval coverage on a known distribution, ratios, and the verdict wording."""
from __future__ import annotations

import math

import numpy as np
import pytest

from analysis.stats import ratio_of_medians, summarize


def test_median_interval_covers_the_true_median_about_95_percent():
    rng = np.random.default_rng(7)
    true_median = 10.0                              # lognormal(mu=log 10, sigma): median exactly 10
    trials, hits = 400, 0
    for t in range(trials):
        x = rng.lognormal(math.log(true_median), 0.3, size=9)
        s = summarize(x, resamples=1000, seed=t)
        hits += s.low <= true_median <= s.high
    # The percentile bootstrap of a median from 9 repeats is close to nominal, not exact.
    assert 0.88 <= hits / trials <= 0.99


def test_ratio_interval_covers_the_true_ratio():
    rng = np.random.default_rng(8)
    trials, hits = 300, 0
    for t in range(trials):
        a, b = rng.normal(12.0, 1.0, size=7), rng.normal(10.0, 1.0, size=7)
        r = ratio_of_medians(a, b, resamples=1000, seed=t)
        hits += r.low <= 1.2 <= r.high
    assert 0.88 <= hits / trials <= 0.995


def test_summary_of_repeats():
    s = summarize([4.0, 5.0, 6.0, 5.0, 5.0])
    assert s.n == 5 and s.median == 5.0 and s.low <= 5.0 <= s.high
    assert s.cv == pytest.approx(np.std([4, 5, 6, 5, 5], ddof=1) / 5.0)
    one = summarize([3.0])
    assert one.n == 1 and one.median == 3.0 and math.isnan(one.low) and math.isnan(one.cv)
    assert summarize([]).n == 0


def test_small_difference_in_large_noise_is_no_difference():
    rng = np.random.default_rng(1)
    b = 100.0 * (1 + 0.10 * rng.standard_normal(5))
    a = 102.0 * (1 + 0.10 * rng.standard_normal(5))      # 2% faster, 10% noise
    words = ratio_of_medians(a, b).verdict()
    assert "no difference beyond the noise" in words and "faster" not in words


def test_large_difference_in_small_noise_is_faster():
    rng = np.random.default_rng(2)
    b = 100.0 * (1 + 0.02 * rng.standard_normal(5))
    a = 150.0 * (1 + 0.02 * rng.standard_normal(5))      # 50% faster, 2% noise
    r = ratio_of_medians(a, b)
    assert r.low > 1.0 and r.verdict().endswith("faster")
    assert ratio_of_medians(b, a).verdict().endswith("slower")


def test_single_runs_get_no_verdict():
    words = ratio_of_medians([2.0], [1.0]).verdict()
    assert "no verdict" in words and "faster" not in words
