"""The bootstrap of a median, the one place it is drawn: validation's noise floor, how far a
model exact on average would read from a configuration's median (bench validate and the
report's validation table). Not for intervals: at this project's 3-8 repeats a percentile
bootstrap covers far less than it says (analysis.stats, which is exact instead). Seeded: the
same repeats give the same numbers."""
from __future__ import annotations

import numpy as np

RESAMPLES = 4000
SEED = 20261201


def rng(seed: int | None = None) -> np.random.Generator:
    return np.random.default_rng(SEED if seed is None else seed)


def bootstrap_medians(x: np.ndarray, generator: np.random.Generator, resamples: int = RESAMPLES) -> np.ndarray:
    """The medians of `resamples` resamples (with replacement, each as long as `x`) of `x`."""
    idx = generator.integers(0, len(x), size=(resamples, len(x)))
    return np.median(x[idx], axis=1)


def noise_pct(measured, resamples: int = RESAMPLES, seed: int | None = None) -> float:
    """How far, in % of the median, a model exact on average would read from the median of these
    repeats: the mean |bootstrap median - median| / median (the median's own scatter over
    resamples of the repeats). 0 for a single run (nothing to tell the noise from)."""
    x = np.asarray(measured, dtype=np.float64)
    if x.size < 2:
        return 0.0
    median = float(np.median(x))
    return 100.0 * float(np.mean(np.abs(bootstrap_medians(x, rng(seed), resamples) - median))) / median
