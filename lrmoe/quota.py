"""Backward retention quotas: how many routed pairs each expert keeps in backward.

A quota policy is a pure function ``fn(demand_E, n_keep, **kwargs) -> quota_E`` over integer
tensors (any device, no host synchronisation needed by the built-in policies). Contract, checked
by :func:`compute_quota` on CPU tensors:

* ``0 <= quota[e] <= demand[e]`` for every expert e;
* ``quota.sum() == n_keep`` exactly, where ``n_keep = retained_total(demand.sum(), drop_ratio)``.

This is the single-process layer's fast path. The planners (the expert-parallel runtime, the
simulator) use the numpy twins in :mod:`lrmoe.planning.quota`, which give the same quotas
exactly; the drop-ratio arithmetic (:func:`check_drop_ratio`, :func:`retained_total`) lives there
once. A user policy registered here is used by the layer; register a numpy version with
``lrmoe.planning.quota.register_quota_policy`` too for the planners to use it.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from .planning.quota import (accepts_drop_ratio, check_drop_ratio, check_min_keep, check_quota, keep_fraction,
                             retained_total)
from .kernels.host import host_reads_free
from .registry import Registry

__all__ = ["check_drop_ratio", "compute_quota", "get_quota_policy", "kept_pairs", "keep_parts", "proportional_quota",
           "quota_for", "quota_policies", "register_quota_policy", "retained_total", "waterfill_quota"]

QuotaFn = Callable[..., torch.Tensor]


@torch.compiler.assume_constant_result  # a constant of drop_ratio: torch.compile bakes it in, no Fraction traced
def keep_parts(drop_ratio: float) -> tuple[int, int]:
    """(numerator, denominator) of :func:`lrmoe.planning.quota.keep_fraction` (1 - drop_ratio, exact)."""
    keep = keep_fraction(drop_ratio)
    return keep.numerator, keep.denominator


def kept_pairs(num_pairs: int, drop_ratio: float) -> int:
    """:func:`retained_total` in integer arithmetic only, so that torch.compile can trace it (also for
    a symbolic number of pairs): round((1 - drop_ratio) * P) with halves rounded up."""
    num, den = keep_parts(drop_ratio)
    return min(num_pairs, (2 * num * num_pairs + den) // (2 * den))


def _top_ranks(priority_E: torch.Tensor, eligible_E: torch.Tensor) -> torch.Tensor:
    """Rank of each expert when ordering eligible experts by descending priority, ties to lower index.

    Ineligible experts get rank >= number of eligible ones."""
    E = priority_E.numel()
    key = torch.where(eligible_E, priority_E, torch.full_like(priority_E, -1))
    order = torch.argsort(key, descending=True, stable=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(E, device=order.device)
    return rank


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
        num, den = keep_parts(drop_ratio)
        den = torch.full((), den, dtype=torch.int64, device=d.device)  # (a fill: no blocking host copy)
    else:
        num, den = n_keep, torch.clamp(d.sum(), min=1)
    base = (d * num) // den  # exact integer floor of the target share
    rem = (d * num) % den  # remainder numerators, comparable across experts
    missing = n_keep - base.sum()
    rank = _top_ranks(rem, rem > 0)
    return base + (rank < missing).to(torch.int64)


def waterfill_quota(demand_E: torch.Tensor, n_keep: int, min_keep: int = 0) -> torch.Tensor:
    """A common cap tau: every expert keeps min(d_e, tau) (tau or tau+1 for rounding).

    The hottest experts are trimmed first, which lowers the straggler's backward load directly.
    ``min_keep`` is an optional per-expert floor: every expert keeps at least min(d_e, min_keep)
    (when n_keep allows it; otherwise the floor itself is shared by waterfilling)."""
    d = demand_E.to(torch.int64)
    if check_min_keep(min_keep) > 0:
        floor_E = torch.clamp(d, max=min_keep)
        fsum = floor_E.sum()
        # If the floors alone exceed n_keep, waterfill n_keep inside the floors instead.
        inner = waterfill_quota(floor_E, n_keep)
        rest = waterfill_quota(d - floor_E, torch.clamp(n_keep - fsum, min=0))
        return torch.where(fsum >= n_keep, inner, floor_E + rest)
    n_keep_t = (n_keep.to(torch.int64) if isinstance(n_keep, torch.Tensor)
                else torch.full((), n_keep, dtype=torch.int64, device=d.device))  # (a fill: no blocking host copy)
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


_QUOTA_POLICIES = Registry("quota policy", builtins={"proportional": proportional_quota, "waterfill": waterfill_quota})
#: ``register_quota_policy(name, fn, *, override=False)`` or ``@register_quota_policy(name)``:
#: ``fn(demand_E, n_keep, **kwargs) -> quota_E`` over int64 tensors.
register_quota_policy = _QUOTA_POLICIES.register
unregister_quota_policy = _QUOTA_POLICIES.unregister
#: Names of the registered quota policies.
quota_policies = _QUOTA_POLICIES.names
get_quota_policy = _QUOTA_POLICIES.get


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
    if drop_ratio is not None and accepts_drop_ratio(fn):
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
    if host_reads_free(d) and not torch.compiler.is_compiling():  # (no host reads in a traced graph)
        check_quota(d.numpy(), q.numpy(), n_keep, policy)
    return q

