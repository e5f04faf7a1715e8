"""Backward retention quotas: how many routed pairs each expert keeps in backward.

A quota policy is a pure function ``fn(demand_E, n_keep, **kwargs) -> quota_E`` over integer
tensors (any device, no host synchronisation needed by the built-in policies). Contract, checked
by :func:`compute_quota` on CPU tensors:

* ``0 <= quota[e] <= demand[e]`` for every expert e;
* ``quota.sum() == n_keep`` exactly, where ``n_keep = retained_total(demand.sum(), drop_ratio)``.

The same functions are used by the single-process layer, the expert-parallel planners and the
cluster simulator (planners call them with numpy arrays; they are converted and returned as numpy).
"""
from __future__ import annotations

import numbers
import inspect
import math
from fractions import Fraction
from typing import Callable

import numpy as np
import torch

from .registry import Registry

QuotaFn = Callable[..., torch.Tensor]
_QUOTA_POLICIES = Registry("quota policy")
#: ``register_quota_policy(name, fn)`` or ``@register_quota_policy(name)``:
#: ``fn(demand_E, n_keep, **kwargs) -> quota_E``.
register_quota_policy = _QUOTA_POLICIES.register
#: Names of the registered quota policies.
quota_policies = _QUOTA_POLICIES.names
get_quota_policy = _QUOTA_POLICIES.get


def check_drop_ratio(drop_ratio: float) -> float:
    if isinstance(drop_ratio, bool) or not isinstance(drop_ratio, numbers.Real) or not (0.0 <= drop_ratio < 1.0):
        raise ValueError(f"drop_ratio must be a number in [0, 1), got {drop_ratio!r}")
    return float(drop_ratio)


def keep_fraction(drop_ratio: float) -> Fraction:
    """1 - drop_ratio as an exact fraction: of the decimal the user wrote (0.3 -> 7/10, i.e. the
    shortest decimal that reads back as the float), or of a simple fraction when the float is
    exactly that fraction's nearest float (1/3 -> 2/3; 0.1666667 stays 1666667/10^7, not 1/6).

    Rounding on the float product instead would turn 31.5 into 31.499999 (P=45, rho=0.3)."""
    rho = check_drop_ratio(drop_ratio)
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
    return min(int(num_pairs), math.floor(keep * int(num_pairs) + Fraction(1, 2)))


def _top_ranks(priority_E: torch.Tensor, eligible_E: torch.Tensor) -> torch.Tensor:
    """Rank of each expert when ordering eligible experts by descending priority, ties to lower index.

    Ineligible experts get rank >= number of eligible ones."""
    E = priority_E.numel()
    key = torch.where(eligible_E, priority_E, torch.full_like(priority_E, -1))
    order = torch.argsort(key, descending=True, stable=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(E, device=order.device)
    return rank


@register_quota_policy("proportional")
def proportional_quota(demand_E: torch.Tensor, n_keep: int, drop_ratio: float | None = None) -> torch.Tensor:
    """Every expert keeps the same fraction of its demand, rounded by largest remainder.

    With ``drop_ratio`` (and n_keep = retained_total(P, drop_ratio)) the fraction is exactly
    1 - drop_ratio, so |q_e - (1 - drop_ratio) d_e| < 1 for every expert; without it (e.g. a
    planner that shrank n_keep) the fraction is n_keep / P. Remainder ties go to the lower
    expert index. Exact integer arithmetic, no host synchronisation."""
    d = demand_E.to(torch.int64)
    if int(n_keep) == 0:
        return torch.zeros_like(d)
    if drop_ratio is not None:
        keep = keep_fraction(drop_ratio)
        num, den = keep.numerator, torch.as_tensor(keep.denominator, dtype=torch.int64, device=d.device)
    else:
        num, den = n_keep, torch.clamp(d.sum(), min=1)
    base = (d * num) // den  # exact integer floor of the target share
    rem = (d * num) % den  # remainder numerators, comparable across experts
    missing = n_keep - base.sum()
    rank = _top_ranks(rem, rem > 0)
    return base + (rank < missing).to(torch.int64)


@register_quota_policy("waterfill")
def waterfill_quota(demand_E: torch.Tensor, n_keep: int, min_keep: int = 0) -> torch.Tensor:
    """A common cap tau: every expert keeps min(d_e, tau) (tau or tau+1 for rounding).

    The hottest experts are trimmed first, which lowers the straggler's backward load directly.
    ``min_keep`` is an optional per-expert floor: every expert keeps at least min(d_e, min_keep)
    (when n_keep allows it; otherwise the floor itself is shared by waterfilling)."""
    d = demand_E.to(torch.int64)
    if isinstance(min_keep, bool) or not isinstance(min_keep, numbers.Integral) or min_keep < 0:
        raise ValueError(f"min_keep must be an int >= 0, got {min_keep!r}")
    if min_keep > 0:
        floor_E = torch.clamp(d, max=min_keep)
        fsum = floor_E.sum()
        # If the floors alone exceed n_keep, waterfill n_keep inside the floors instead.
        inner = waterfill_quota(floor_E, n_keep)
        rest = waterfill_quota(d - floor_E, torch.clamp(n_keep - fsum, min=0))
        return torch.where(fsum >= n_keep, inner, floor_E + rest)
    n_keep_t = torch.as_tensor(n_keep, dtype=torch.int64, device=d.device)
    # f(tau) = sum_e min(d_e, tau) at every breakpoint tau in {0} U {d_e}.
    bps = torch.cat([d.new_zeros(1), d])
    f_bp = torch.minimum(d[None, :], bps[:, None]).sum(1)
    ok = f_bp <= n_keep_t
    # The largest breakpoint b with f(b) <= n_keep (f is non-decreasing in b).
    b = torch.where(ok, bps, torch.full_like(bps, -1)).max()
    f_b = torch.minimum(d, b).sum()
    above = (d > b).sum()
    tau = b + torch.where(above > 0, (n_keep_t - f_b) // torch.clamp(above, min=1), torch.zeros_like(b))
    q = torch.minimum(d, tau)
    missing = n_keep_t - q.sum()  # < number of experts with d > tau
    rank = _top_ranks(d, d > tau)  # the hottest experts get the +1 first
    return q + (rank < missing).to(torch.int64)


def compute_quota(demand_E, drop_ratio: float, policy: str = "waterfill", **kwargs):
    """Per-expert retention quotas for ``drop_ratio``; accepts and returns torch tensors or numpy arrays."""
    get_quota_policy(policy)
    as_numpy = isinstance(demand_E, np.ndarray)
    d = torch.as_tensor(np.asarray(demand_E) if as_numpy else demand_E).to(torch.int64)
    if d.dim() != 1:
        raise ValueError(f"demand must be a 1-D per-expert count, got shape {tuple(d.shape)}")
    n_keep = retained_total(int(d.sum()), drop_ratio)
    q = quota_for(d, n_keep, policy, drop_ratio=drop_ratio, **kwargs)
    return q.numpy() if as_numpy else q


def quota_for(demand_E: torch.Tensor, n_keep: int, policy: str = "waterfill", *, drop_ratio: float | None = None,
              **kwargs) -> torch.Tensor:
    """Quotas summing to ``n_keep`` (host-known), without host synchronisation on accelerators.

    ``drop_ratio`` (pass it when n_keep == retained_total(P, drop_ratio)) reaches the policies
    whose signature accepts it. The contract is checked when the demand lives on the CPU."""
    fn = get_quota_policy(policy)
    d = demand_E.to(torch.int64)
    if drop_ratio is not None and _accepts_drop_ratio(fn):
        kwargs["drop_ratio"] = drop_ratio
    q = fn(d, n_keep, **kwargs)
    if not isinstance(q, torch.Tensor):  # numpy arrays and lists are accepted
        try:
            q = torch.as_tensor(np.asarray(q), device=d.device)
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(f"quota policy {policy!r} must return a tensor of per-expert counts, "
                             f"got {type(q).__name__}") from None
    if q.is_floating_point() or q.is_complex() or q.dtype == torch.bool:
        raise ValueError(f"quota policy {policy!r} must return integer quotas, got dtype {q.dtype}")
    q = q.to(torch.int64)
    if d.device.type == "cpu":
        _check_quota(d, q, n_keep, policy)
    return q


def _accepts_drop_ratio(fn) -> bool:
    """Whether the quota policy ``fn`` takes ``drop_ratio`` (any callable, hashable or not)."""
    params = inspect.signature(fn).parameters
    return "drop_ratio" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _check_quota(d: torch.Tensor, q: torch.Tensor, n_keep: int, policy: str) -> None:
    if q.shape != d.shape:
        raise ValueError(f"quota policy {policy!r} returned shape {tuple(q.shape)}, expected {tuple(d.shape)}")
    if bool((q < 0).any()) or bool((q > d).any()):
        raise ValueError(f"quota policy {policy!r} returned quotas outside [0, demand]: {q.tolist()} vs {d.tolist()}")
    if int(q.sum()) != n_keep:
        raise ValueError(f"quota policy {policy!r} returned sum {int(q.sum())}, expected exactly {n_keep}")
