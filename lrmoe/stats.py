"""The kit's one statistics convention, used by every table that compares runs (T1, T2, T3 and
the ablation grids; docs/statistics.md states it once):

1. **Paired differences.** A variant is compared with its baseline run of the *same seed* (C0 of
   the same seed and model family; two variants with each other seed by seed), never mean against
   mean.
2. **Mean and 95 % Student t interval** of the paired differences over the seeds,
   ``mean ± t(0.975, n−1) · s / √n`` (:func:`estimate`), with the two-sided one-sample t test's
   p-value against 0 (the interval excludes 0 exactly when p < 0.05). One value: no interval and no
   p-value. All values equal: the interval is that value (p = 0 when it is not 0, else 1).
3. **Holm's correction** across the comparisons of one table (:func:`holm`, :func:`with_holm`):
   a comparison is *resolved* when its Holm-adjusted p-value is below 0.05; the interval printed
   is the uncorrected 95 % interval. :attr:`Estimate.resolved` is the uncorrected reading,
   :attr:`Estimate.resolved_holm` the corrected one.
4. **Censored times.** A seed that never reaches a target is censored, never dropped: a table
   counts it ("reached k/n") and reports the median over *all* seeds with the unreached ones
   ranked last (:func:`censored_median`), or "not reached" when the median falls on one.

scipy supplies only the t distribution; Holm's procedure is implemented here."""
from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, replace

CONFIDENCE = 0.95
ALPHA = 1.0 - CONFIDENCE
METHOD = "t interval"
CONVENTION = ("paired differences vs the baseline run of the same seed; mean and 95 % Student t interval over "
              "seeds (uncorrected); p: two-sided one-sample t test against 0; Holm's correction across the "
              "table's comparisons, resolved = Holm-adjusted p < 0.05")


@dataclass(frozen=True)
class Estimate:
    """Mean of ``n`` values with its t interval [lo, hi] and t-test p-value (None for n < 2); ``p_holm``
    is set by :func:`with_holm` once the comparisons of a table are known."""

    mean: float | None
    lo: float | None
    hi: float | None
    n: int
    method: str
    values: tuple = ()
    p: float | None = None
    p_holm: float | None = None

    @property
    def resolved(self) -> bool:
        """The (uncorrected) interval excludes 0."""
        return self.lo is not None and (self.lo > 0 or self.hi < 0)

    @property
    def resolved_holm(self) -> bool:
        """Holm-adjusted p < 0.05 (False before :func:`with_holm`)."""
        return self.p_holm is not None and self.p_holm < ALPHA and self.resolved

    @property
    def sign(self) -> int:
        """+1 / -1 when resolved above / below 0, else 0."""
        return 0 if not self.resolved else (1 if self.lo > 0 else -1)

    def to_dict(self) -> dict:
        return dict(asdict(self), values=list(self.values), resolved=self.resolved,
                    resolved_holm=self.resolved_holm)


def estimate(values, confidence: float = CONFIDENCE) -> Estimate:
    """The mean of ``values`` (floats, one per seed) with its Student t interval and p-value."""
    xs = [float(v) for v in values]
    n = len(xs)
    if n == 0:
        return Estimate(None, None, None, 0, "no value")
    m = statistics.fmean(xs)
    if n == 1:
        return Estimate(m, None, None, 1, "one value: no interval", tuple(xs))
    if max(xs) == min(xs):  # no spread: the interval is the value
        return Estimate(m, m, m, n, "no spread", tuple(xs), p=0.0 if m != 0 else 1.0)
    from scipy import stats

    se = statistics.stdev(xs) / math.sqrt(n)
    half = float(stats.t.ppf(0.5 + confidence / 2, n - 1)) * se
    p = float(2 * stats.t.sf(abs(m) / se, n - 1))
    return Estimate(m, m - half, m + half, n, f"{METHOD} (n−1 = {n - 1} degrees of freedom)", tuple(xs), p=p)


def paired(a: dict, b: dict) -> Estimate:
    """:func:`estimate` of ``a[s] − b[s]`` over the seeds ``s`` both have (dicts seed -> value)."""
    return estimate([a[s] - b[s] for s in sorted(set(a) & set(b))])


def holm(pvalues) -> list[float | None]:
    """Holm's step-down adjusted p-values, in the order given (None stays None and does not count
    as a comparison): sort the m p-values ascending, multiply the i-th (from 0) by m − i, take the
    running maximum, cap at 1."""
    ps = list(pvalues)
    idx = sorted((i for i, p in enumerate(ps) if p is not None), key=lambda i: ps[i])
    m, out, running = len(idx), [None] * len(ps), 0.0
    for rank, i in enumerate(idx):
        running = max(running, min(1.0, (m - rank) * ps[i]))
        out[i] = running
    return out


def with_holm(estimates) -> list[Estimate]:
    """The estimates of one table's comparisons with ``p_holm`` set across them."""
    ests = list(estimates)
    return [replace(e, p_holm=q) for e, q in zip(ests, holm(e.p for e in ests))]


def censored_median(values) -> tuple[float | None, int, int]:
    """(median, reached, n) of per-seed times where None marks a seed that never reached the
    target (censored: ranked after every reached one). The median is None when it falls on a
    censored seed (fewer than half reached, or the even-n midpoint needs one)."""
    vals = list(values)
    n = len(vals)
    hit = sorted(float(v) for v in vals if v is not None)
    if n == 0:
        return None, 0, 0
    ranked = hit + [math.inf] * (n - len(hit))
    mid = ranked[(n - 1) // 2], ranked[n // 2]
    med = None if math.inf in mid else (mid[0] + mid[1]) / 2
    return med, len(hit), n


def fmt_p(p: float | None) -> str:
    """A p-value as a table prints it: three significant digits below 0.1, two decimals above, "<0.001" below."""
    if p is None:
        return "—"
    return "<0.001" if p < 0.001 else f"{p:.3g}" if p < 0.1 else f"{p:.2f}"
