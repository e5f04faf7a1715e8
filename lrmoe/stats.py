"""The statistics of an ablation: a mean over seeds with its 95 % confidence interval, and
whether an ordering is resolved.

With few seeds (n < :data:`BOOTSTRAP_MIN`) the interval is Student's t interval of the mean,
``mean ± t(0.975, n−1) · s / √n``: the bootstrap cannot be trusted there (with 3 seeds it has
only 10 distinct resamples and its percentile intervals cover far less than 95 %), while the t
interval is exact when the paired differences are normal and is what a reviewer expects for
3-5 seeds. From :data:`BOOTSTRAP_MIN` seeds on it is the BCa bootstrap of the mean
(:func:`scipy.stats.bootstrap`, 9,999 resamples, fixed seed so tables regenerate identically),
which needs no normality. One value: no interval. An ordering is *resolved* when the interval of
the paired difference excludes 0 (docs/ablations.md)."""
from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass

CONFIDENCE = 0.95
BOOTSTRAP_MIN = 10
BOOTSTRAP_RESAMPLES = 9999


@dataclass(frozen=True)
class Estimate:
    """Mean of ``n`` values with its interval [lo, hi] (None for n < 2) and how it was made."""

    mean: float | None
    lo: float | None
    hi: float | None
    n: int
    method: str
    values: tuple = ()

    @property
    def resolved(self) -> bool:
        """The interval excludes 0."""
        return self.lo is not None and (self.lo > 0 or self.hi < 0)

    @property
    def sign(self) -> int:
        """+1 / -1 when resolved above / below 0, else 0."""
        return 0 if not self.resolved else (1 if self.lo > 0 else -1)

    def to_dict(self) -> dict:
        return dict(asdict(self), values=list(self.values), resolved=self.resolved)


def estimate(values, confidence: float = CONFIDENCE) -> Estimate:
    """The mean of ``values`` (floats, one per seed) and its confidence interval (module doc)."""
    xs = [float(v) for v in values]
    n = len(xs)
    if n == 0:
        return Estimate(None, None, None, 0, "no value")
    m = statistics.fmean(xs)
    if n == 1:
        return Estimate(m, None, None, 1, "one value: no interval", tuple(xs))
    if max(xs) == min(xs):  # no spread: every resample is the mean
        return Estimate(m, m, m, n, "no spread", tuple(xs))
    if n < BOOTSTRAP_MIN:
        from scipy import stats

        half = stats.t.ppf(0.5 + confidence / 2, n - 1) * statistics.stdev(xs) / math.sqrt(n)
        return Estimate(m, m - half, m + half, n, f"t interval (n−1 = {n - 1} degrees of freedom)", tuple(xs))
    import numpy as np
    from scipy import stats

    res = stats.bootstrap((np.asarray(xs),), np.mean, confidence_level=confidence, method="BCa",
                          n_resamples=BOOTSTRAP_RESAMPLES, rng=np.random.default_rng(0))
    lo, hi = float(res.confidence_interval.low), float(res.confidence_interval.high)
    return Estimate(m, lo, hi, n, f"BCa bootstrap ({BOOTSTRAP_RESAMPLES} resamples)", tuple(xs))
