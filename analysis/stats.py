"""Statistics of repeated measurements, in one place: medians, 95% intervals, ratios, verdicts.

Both intervals are exact and distribution-free (they hold for any continuous distribution of a
configuration's repeats), because this project has 3-8 repeats per configuration, where a
percentile bootstrap falls well short of its nominal level: measured on lognormal repeats, its
95% interval of a median covered 75% / 87% / 93% of the time at 3 / 4 / 5 repeats, and its
ratio interval at 3 + 3 repeats 90% (a "faster" from pure noise one time in ten).

- A configuration measured N times (N records sharing a `config_key`) is summarized by the
  median of its repeats and the order-statistic interval of that median: the narrowest
  [x(j), x(N+1-j)] that covers the true median with probability >= 95% (a binomial count). Up to
  5 repeats none does; the interval is then the repeats' whole range and `level` says what it
  covers (1 - 2^(1-N): 75%, 88%, 94% at 3, 4, 5 repeats).
- A comparison of two configurations is the ratio of their medians, with the interval for a
  multiplicative difference a / b that the two-sided Mann-Whitney (Wilcoxon rank-sum) test
  does not reject at 5% (Moses' interval on the logarithms: order statistics of the pairwise
  ratios, counted from the test's exact null distribution; what R's `wilcox.test(conf.int=TRUE)`
  gives). It is worded faster or slower only when that interval excludes 1, so a difference is
  claimed from pure noise at most 5% of the time, whatever the noise looks like. At 3 + 3 or
  3 + 4 repeats no interval reaches 95% (the most extreme ordering is 1 of 20 or 35): no verdict.
- A comparison of each side's *best* configuration, chosen among k_a and k_b on the same
  repeats, could have won its place by noise: its critical count is the one that keeps a
  verdict from noise at 5% with that choice made (`chosen_critical_count`). At 4-5 repeats the
  plain test's discreteness already holds it (measured: best of 2 against 1, 2.6% / 3.0% at
  4 + 4 / 5 + 5), and the count is the plain one; from ~6 repeats and 3 candidates it is not
  (best of 4 against 1 at 8 + 8: 6.8% with the plain count).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

CONFIDENCE = 0.95


@dataclass(frozen=True)
class Summary:
    n: int
    median: float
    low: float           # interval of the median (NaN with fewer than 2 repeats)
    high: float
    cv: float            # standard deviation / mean of the repeats (NaN with fewer than 2)
    level: float = math.nan      # probability that [low, high] covers the true median


@dataclass(frozen=True)
class Ratio:
    value: float         # median(a) / median(b)
    low: float           # NaN: too few repeats for an interval at the confidence asked
    high: float
    n_a: int
    n_b: int

    def direction(self) -> int | None:
        """1 where the interval lies above 1, -1 below, 0 where it holds 1, None without one."""
        if self.n_a < 2 or self.n_b < 2 or math.isnan(self.low):
            return None
        return 1 if self.low > 1.0 else -1 if self.high < 1.0 else 0

    def verdict(self, faster: str = "faster", slower: str = "slower") -> str:
        """Words for the comparison: a direction only when the interval excludes 1."""
        if self.n_a < 2 or self.n_b < 2:
            return f"{self.value:.2f}× (one run each: no interval, no verdict)"
        if math.isnan(self.low):
            return f"{self.value:.2f}× ({self.n_a} + {self.n_b} repeats: too few for a 95% interval, no verdict)"
        shown = f"{self.value:.2f}× [{self.low:.2f}, {self.high:.2f}]"
        if self.low > 1.0:
            return f"{shown}, {faster}"
        if self.high < 1.0:
            return f"{shown}, {slower}"
        noise = 100.0 * max(self.high - 1.0, 1.0 - self.low)
        return f"{shown}, no difference beyond the noise (±{noise:.0f}%)"


def summarize(values, confidence: float = CONFIDENCE) -> Summary:
    """Median, order-statistic interval of the median and coefficient of variation of repeats."""
    x = np.sort(np.asarray([v for v in values if v is not None and np.isfinite(v)], dtype=np.float64))
    n = len(x)
    if n == 0:
        return Summary(0, math.nan, math.nan, math.nan, math.nan)
    med = float(np.median(x))
    if n < 2:
        return Summary(1, med, math.nan, math.nan, math.nan)
    # P(x(j) > true median) = P(fewer than j of n repeats fall below it) = P(Binomial(n, 1/2) < j)
    below = np.cumsum([math.comb(n, i) for i in range(n + 1)]) / 2.0 ** n
    j = max(1, int(np.sum(below <= (1.0 - confidence) / 2.0)))
    cv = float(np.std(x, ddof=1) / np.mean(x)) if np.mean(x) else math.nan
    return Summary(n, med, float(x[j - 1]), float(x[n - j]), cv, level=float(1.0 - 2.0 * below[j - 1]))


@lru_cache(maxsize=None)
def rank_sum_null(m: int, n: int) -> tuple[float, ...]:
    """P(U = u), u = 0..mn: the Mann-Whitney statistic U (pairs where a beats b) of m values of a
    and n of b when all orderings are equally likely. The largest of the m + n values is one of
    a's with probability m / (m + n), and then beats all n of b's."""
    table = {(0, j): np.ones(1) for j in range(n + 1)}
    table.update({(i, 0): np.ones(1) for i in range(m + 1)})
    for i in range(1, m + 1):
        for j in range(1, n + 1):
            top_a = np.concatenate([np.zeros(j), table[i - 1, j], np.zeros(i * j - len(table[i - 1, j]) - j + 1)])
            top_b = np.concatenate([table[i, j - 1], np.zeros(i * j + 1 - len(table[i, j - 1]))])
            table[i, j] = (i * top_a + j * top_b) / (i + j)
    return tuple(table[m, n])


SELECTION_DRAWS = 100_000      # seeded draws per (m, n, k_a, k_b): ~0.1 s each, cached


@lru_cache(maxsize=None)
def chosen_critical_count(m: int, n: int, k_a: int, k_b: int, confidence: float = CONFIDENCE) -> int:
    """The critical count c of `ratio_of_medians` when a is the best (highest median) of k_a
    configurations of m repeats and b the best of k_b of n, chosen on the same repeats: a verdict
    is said when fewer than c pairs favour one side (min(U, mn - U) < c), and c is the largest
    count at which that happens from noise at most 1 - confidence of the time. The choice and U
    are both decided by ranks, so under "all configurations alike" the rate is the same for any
    continuous distribution: estimated on seeded uniform draws (SELECTION_DRAWS; its standard
    error at 5% is 0.07 points). Some of the candidates may differ from the rest, leaving fewer
    real contenders, so c is the smallest over j_a <= k_a and j_b <= k_b contenders."""
    if (k_a, k_b) == (1, 1):
        null = np.asarray(rank_sum_null(m, n))      # exact: the two-sided count of the plain test
        return int(np.sum(np.cumsum(null) <= (1.0 - confidence) / 2.0))
    rng = np.random.default_rng(0)
    counts = [chosen_critical_count(m, n, j_a, j_b, confidence)
              for j_a in range(1, k_a + 1) for j_b in range(1, k_b + 1) if (j_a, j_b) != (k_a, k_b)]
    rows = np.arange(SELECTION_DRAWS)
    draws_a, draws_b = rng.random((SELECTION_DRAWS, k_a, m)), rng.random((SELECTION_DRAWS, k_b, n))
    a = draws_a[rows, np.argmax(np.median(draws_a, axis=2), axis=1)]
    b = draws_b[rows, np.argmax(np.median(draws_b, axis=2), axis=1)]
    u = (a[:, :, None] > b[:, None, :]).sum(axis=(1, 2))
    claimed = np.cumsum(np.bincount(np.minimum(u, m * n - u), minlength=m * n + 1)) / SELECTION_DRAWS
    return min([int(np.sum(claimed <= 1.0 - confidence)), *counts])


def ratio_of_medians(a, b, confidence: float = CONFIDENCE, chosen_from: tuple[int, int] = (1, 1)) -> Ratio:
    """median(a) / median(b), with the exact rank-based interval of the ratio (module docstring);
    `chosen_from` (k_a, k_b): a and b are each the best of that many configurations, chosen on
    these repeats (chosen_critical_count)."""
    xa = np.asarray([v for v in a if np.isfinite(v) and v > 0], dtype=np.float64)
    xb = np.asarray([v for v in b if np.isfinite(v) and v > 0], dtype=np.float64)
    m, n = len(xa), len(xb)
    if m == 0 or n == 0:
        return Ratio(math.nan, math.nan, math.nan, m, n)
    value = float(np.median(xa) / np.median(xb))
    if m < 2 or n < 2:
        return Ratio(value, math.nan, math.nan, m, n)
    # Reject "a / b = r" when fewer than k of the m n pairwise ratios lie above r, or fewer than k
    # below: k is the largest count with P(U < k) <= (1 - confidence) / 2 under the null.
    k = chosen_critical_count(m, n, *chosen_from, confidence)
    if k == 0:
        return Ratio(value, math.nan, math.nan, m, n)
    pairwise = np.sort((xa[:, None] / xb[None, :]).ravel())
    return Ratio(value, float(pairwise[k - 1]), float(pairwise[m * n - k]), m, n)
