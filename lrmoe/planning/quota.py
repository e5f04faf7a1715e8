"""Backward retention quotas for the planners, in numpy: how many routed pairs each expert keeps.

A quota policy is a pure function ``fn(demand_E, n_keep, **kwargs) -> quota_E`` over int64
arrays. Contract (checked by :func:`quota_for` on every call):

* ``0 <= quota[e] <= demand[e]`` for every expert e;
* ``quota.sum() == n_keep`` exactly, where ``n_keep = retained_total(demand.sum(), drop_ratio)``.

The single-process layer uses the torch twins of these policies (:mod:`lrmoe.quota`: any device,
no host synchronisation), which import :func:`check_drop_ratio`, :func:`keep_fraction` and
:func:`retained_total` from here; the built-in policies of both give the same quotas exactly. A
user policy is used by the planners (the expert-parallel runtime, the simulator) only once it is
registered here with :func:`register_quota_policy`; one registered for the layer alone
(``lrmoe.quota.register_quota_policy``) is not seen by the planners.
"""
from __future__ import annotations

import functools
import inspect
import math
import numbers
from fractions import Fraction

import numpy as np

from ..registry import Registry


def check_drop_ratio(drop_ratio: float) -> float:
    if type(drop_ratio) is float and 0.0 <= drop_ratio < 1.0:  # the common case, without the ABC checks
        return drop_ratio
    if isinstance(drop_ratio, bool) or not isinstance(drop_ratio, numbers.Real) or not (0.0 <= drop_ratio < 1.0):
        raise ValueError(f"drop_ratio must be a number in [0, 1), got {drop_ratio!r}")
    return float(drop_ratio)


def check_min_keep(min_keep) -> int:
    if isinstance(min_keep, bool) or not isinstance(min_keep, numbers.Integral) or min_keep < 0:
        raise ValueError(f"min_keep must be an int >= 0, got {min_keep!r}")
    return int(min_keep)


def keep_fraction(drop_ratio: float) -> Fraction:
    """1 - drop_ratio as an exact fraction: of the decimal the user wrote (0.3 -> 7/10, i.e. the
    shortest decimal that reads back as the float), or of a simple fraction when the float is
    exactly that fraction's nearest float (1/3 -> 2/3; 0.1666667 stays 1666667/10^7, not 1/6).

    Rounding on the float product instead would turn 31.5 into 31.499999 (P=45, rho=0.3). Computed
    once per drop ratio (the planners ask for it on every call)."""
    return _keep_fraction(check_drop_ratio(drop_ratio))


@functools.lru_cache(maxsize=256)
def _keep_fraction(rho: float) -> Fraction:
    exact = Fraction(repr(rho))
    simple = exact.limit_denominator(1_000_000)
    if float(simple) == rho:
        return 1 - simple
    # Decimals of up to 9 digits are exact; longer ones (e.g. a float computed by a program) are
    # taken to the nearest fraction with denominator <= 10^9, which keeps the integer arithmetic
    # of the quota policies (demand x numerator) inside int64.
    return 1 - (exact if exact.denominator <= 10**9 else exact.limit_denominator(10**9))


def retained_total(num_pairs: int, drop_ratio: float) -> int:
    """round((1 - drop_ratio) * num_pairs), halves rounded up, in exact arithmetic: the number of pairs kept."""
    keep = keep_fraction(drop_ratio)
    if num_pairs < 0:
        raise ValueError(f"num_pairs must be >= 0, got {num_pairs}")
    return retained_count(int(num_pairs), keep.numerator, keep.denominator)


def retained_count(num_pairs: int, num: int, den: int) -> int:
    """:func:`retained_total` of ``num_pairs >= 0`` (an int) with the keep fraction num / den already
    made (:func:`keep_fraction`; for callers that hold it): floor(keep * P + 1/2) in integers."""
    return min(num_pairs, (2 * num * num_pairs + den) // (2 * den))


def _top_ranks(priority_E: np.ndarray, eligible_E: np.ndarray) -> np.ndarray:
    """Rank of each expert when ordering eligible experts by descending priority, ties to lower index.

    Ineligible experts get rank >= number of eligible ones."""
    key = np.where(eligible_E, priority_E, -1)
    order = np.argsort(-key, kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(key.size)
    return rank


def proportional_quota(demand_E: np.ndarray, n_keep: int, drop_ratio: float | None = None) -> np.ndarray:
    """Every expert keeps the same fraction of its demand, rounded by largest remainder.

    With ``drop_ratio`` (and n_keep = retained_total(P, drop_ratio)) the fraction is exactly
    1 - drop_ratio, so |q_e - (1 - drop_ratio) d_e| < 1 for every expert; without it (e.g. a
    planner that shrank n_keep) the fraction is n_keep / P. Remainder ties go to the lower
    expert index. Exact integer arithmetic."""
    d = np.asarray(demand_E, dtype=np.int64)
    n_keep = int(n_keep)
    if n_keep == 0:
        return np.zeros_like(d)
    if drop_ratio is not None:
        keep = keep_fraction(drop_ratio)
        num, den = keep.numerator, keep.denominator
    else:
        num, den = n_keep, max(int(d.sum()), 1)
    base = (d * num) // den  # exact integer floor of the target share
    rem = (d * num) % den  # remainder numerators, comparable across experts
    missing = n_keep - int(base.sum())
    return base + (_top_ranks(rem, rem > 0) < missing).astype(np.int64)


def waterfill_quota(demand_E: np.ndarray, n_keep: int, min_keep: int = 0) -> np.ndarray:
    """A common cap tau: every expert keeps min(d_e, tau) (tau or tau+1 for rounding).

    The hottest experts are trimmed first, which lowers the straggler's backward load directly.
    ``min_keep`` is an optional per-expert floor: every expert keeps at least min(d_e, min_keep)
    (when n_keep allows it; otherwise the floor itself is shared by waterfilling)."""
    d = np.asarray(demand_E, dtype=np.int64)
    n_keep = int(n_keep)
    if check_min_keep(min_keep) > 0:
        floor_E = np.minimum(d, min_keep)
        fsum = int(floor_E.sum())
        if fsum >= n_keep:  # the floors alone exceed n_keep: waterfill n_keep inside the floors
            return waterfill_quota(floor_E, n_keep)
        return floor_E + waterfill_quota(d - floor_E, n_keep - fsum)
    # f(tau) = sum_e min(d_e, tau) at every breakpoint tau in {0} U {d_e}; f is non-decreasing.
    bps = np.r_[np.zeros(1, dtype=np.int64), d]
    f_bp = np.minimum(d[None, :], bps[:, None]).sum(1)
    b = int(bps[f_bp <= n_keep].max())  # the largest breakpoint b with f(b) <= n_keep
    above = int((d > b).sum())
    tau = b + ((n_keep - int(np.minimum(d, b).sum())) // above if above else 0)
    q = np.minimum(d, tau)
    missing = n_keep - int(q.sum())  # < number of experts with d > tau
    return q + (_top_ranks(d, d > tau) < missing).astype(np.int64)  # the hottest experts get the +1 first


_QUOTA_POLICIES = Registry("planner quota policy", builtins={
    "proportional": proportional_quota, "waterfill": waterfill_quota})
#: ``register_quota_policy(name, fn, *, override=False)`` or ``@register_quota_policy(name)``:
#: ``fn(demand_E, n_keep, **kwargs) -> quota_E`` over int64 numpy arrays.
register_quota_policy = _QUOTA_POLICIES.register
unregister_quota_policy = _QUOTA_POLICIES.unregister
#: Names of the quota policies the planners can use (built-in ones included).
quota_policies = _QUOTA_POLICIES.names


def get_quota_policy(name: str):
    """The planners' quota policy ``name``; a clear ValueError for a name registered elsewhere only."""
    if isinstance(name, str) and name in _QUOTA_POLICIES:
        return _QUOTA_POLICIES.get(name)
    raise ValueError(f"unknown quota policy {name!r} for the planners; registered in lrmoe.planning.quota: "
                     f"{quota_policies()}. The planners (the expert-parallel runtime and "
                     f"the simulator) use numpy policies only: a policy registered with lrmoe.quota."
                     f"register_quota_policy (torch, the single-process layer) must also be registered with "
                     f"lrmoe.planning.quota.register_quota_policy")


def accepts_drop_ratio(fn) -> bool:
    """Whether the quota policy ``fn`` takes ``drop_ratio`` (any callable, hashable or not)."""
    params = inspect.signature(fn).parameters
    return "drop_ratio" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def check_quota(demand_E: np.ndarray, quota_E: np.ndarray, n_keep: int, policy: str) -> None:
    """The contract: quotas in [0, demand] per expert, summing to exactly n_keep (ValueError otherwise)."""
    d, q = np.asarray(demand_E), np.asarray(quota_E)
    if q.shape != d.shape:
        raise ValueError(f"quota policy {policy!r} returned shape {tuple(q.shape)}, expected {tuple(d.shape)}")
    if bool((q < 0).any()) or bool((q > d).any()):
        raise ValueError(f"quota policy {policy!r} returned quotas outside [0, demand]: {q.tolist()} vs {d.tolist()}")
    if int(q.sum()) != int(n_keep):
        raise ValueError(f"quota policy {policy!r} returned sum {int(q.sum())}, expected exactly {int(n_keep)}")


def check_quota_dtype(q, policy: str) -> None:
    """ValueError unless the policy's result has an integer dtype."""
    kind = getattr(getattr(q, "dtype", None), "kind", None)
    if kind is not None and kind not in "iu":
        raise ValueError(f"quota policy {policy!r} must return integer quotas, got dtype {q.dtype}")


def quota_for(demand_E, n_keep: int, policy: str = "waterfill", *, drop_ratio: float | None = None,
              **kwargs) -> np.ndarray:
    """Quotas summing to ``n_keep`` (int64 array), checked against the contract.

    ``drop_ratio`` (pass it when n_keep == retained_total(P, drop_ratio)) reaches the policies
    whose signature accepts it."""
    fn = get_quota_policy(policy)
    d = np.ascontiguousarray(demand_E, dtype=np.int64)
    if drop_ratio is not None and accepts_drop_ratio(fn):
        kwargs["drop_ratio"] = drop_ratio
    q = fn(d, int(n_keep), **kwargs)
    try:
        q = np.asarray(q)
    except (TypeError, ValueError):
        raise ValueError(f"quota policy {policy!r} must return an array of per-expert counts, "
                         f"got {type(q).__name__}") from None
    if q.dtype.kind in "OUSV":  # objects, strings, bytes, records
        raise ValueError(f"quota policy {policy!r} must return an array of per-expert counts, got {type(q).__name__}")
    check_quota_dtype(q, policy)
    q = q.astype(np.int64)
    check_quota(d, q, n_keep, policy)
    return q


def compute_quota(demand_E, drop_ratio: float, policy: str = "waterfill", **kwargs) -> np.ndarray:
    """Per-expert retention quotas for ``drop_ratio`` over the 1-D per-expert demand."""
    get_quota_policy(policy)
    d = np.asarray(demand_E)
    if d.ndim != 1:
        raise ValueError(f"demand must be a 1-D per-expert count, got shape {tuple(d.shape)}")
    n_keep = retained_total(int(d.sum()), drop_ratio)
    return quota_for(d, n_keep, policy, drop_ratio=drop_ratio, **kwargs)
