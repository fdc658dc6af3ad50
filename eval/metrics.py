"""Statistics of the evaluation: Wilson intervals, bootstrap intervals of a ratio of sums, and
percentiles (the KL bound lives in ``kvcomm.core.divergence``, shared with the quality guard)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


WILSON_Z = 1.959963984540054  # two-sided 95%


def wilson_interval(successes: float, n: int, z: float = WILSON_Z) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (95% by default).

    ``successes`` may be fractional (a sum of scores in [0, 1]); it is then an approximation.
    Returns (nan, nan) for n == 0.
    """
    if n <= 0:
        return (math.nan, math.nan)
    if not 0 <= successes <= n:
        raise ValueError(f"successes must be in [0, n], got {successes} of {n}")
    p = successes / n
    z2 = z * z
    denom = 1 + z2 / n
    center = (p + z2 / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / denom
    low = 0.0 if successes == 0 else max(0.0, center - half)
    high = 1.0 if successes == n else min(1.0, center + half)
    return (low, high)


def bootstrap_ratio_interval(
    numerators: Sequence[float], denominators: Sequence[float], draws: int = 2000, seed: int = 0, level: float = 0.95,
) -> tuple[float, float]:
    """Percentile bootstrap interval of ``sum(numerators) / sum(denominators)`` over units
    resampled with replacement (unit i contributes ``numerators[i]`` and ``denominators[i]``).

    For a mean KL over prompt positions the unit is one input (every call of it, all seeds):
    the calls of one input share their earlier agents' replies, so they are not independent.
    Deterministic for a given ``seed``; the same seed and unit count draw the same resamples,
    so two points over the same inputs are resampled alike. Draws whose denominators sum to 0
    are left out. Returns (nan, nan) when there are no units or no draw has a positive
    denominator."""
    num = np.asarray(numerators, dtype=np.float64)
    den = np.asarray(denominators, dtype=np.float64)
    if num.shape != den.shape or num.ndim != 1:
        raise ValueError(f"numerators and denominators must be equal-length sequences (got {num.shape} and {den.shape})")
    if not 0 < level < 1 or draws < 1:
        raise ValueError(f"level must be in (0, 1) and draws >= 1 (got {level}, {draws})")
    if num.size == 0:
        return (math.nan, math.nan)
    picks = np.random.default_rng(seed).integers(0, num.size, size=(draws, num.size))
    top, bottom = num[picks].sum(axis=1), den[picks].sum(axis=1)
    ratios = top[bottom > 0] / bottom[bottom > 0]
    if ratios.size == 0:
        return (math.nan, math.nan)
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(ratios, [tail, 100 - tail])
    return (float(low), float(high))


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolation percentile (``q`` in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(pos), math.ceil(pos)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)
