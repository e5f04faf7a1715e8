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

import math
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
    if isinstance(drop_ratio, bool) or not isinstance(drop_ratio, (int, float)) or not (0.0 <= drop_ratio < 1.0):
        raise ValueError(f"drop_ratio must be a number in [0, 1), got {drop_ratio!r}")
    return float(drop_ratio)


def retained_total(num_pairs: int, drop_ratio: float) -> int:
    """round((1 - drop_ratio) * num_pairs), halves rounded up: the exact number of pairs kept."""
    check_drop_ratio(drop_ratio)
    if num_pairs < 0:
        raise ValueError(f"num_pairs must be >= 0, got {num_pairs}")
    return min(int(num_pairs), int(math.floor((1.0 - drop_ratio) * num_pairs + 0.5)))


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
def proportional_quota(demand_E: torch.Tensor, n_keep: int) -> torch.Tensor:
    """Every expert keeps (n_keep / P) of its demand, rounded by largest remainder.

    |q_e - d_e * n_keep / P| < 1 for every expert; remainder ties go to the lower expert index."""
    d = demand_E.to(torch.int64)
    P = d.sum()
    if int(n_keep) == 0:
        return torch.zeros_like(d)
    P_safe = torch.clamp(P, min=1)
    base = (d * n_keep) // P_safe  # exact integer floor of d * n_keep / P
    rem = (d * n_keep) % P_safe  # remainder numerators, comparable across experts
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
    if min_keep < 0:
        raise ValueError(f"min_keep must be >= 0, got {min_keep}")
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
    q = quota_for(d, n_keep, policy, **kwargs)
    return q.numpy() if as_numpy else q


def quota_for(demand_E: torch.Tensor, n_keep: int, policy: str = "waterfill", **kwargs) -> torch.Tensor:
    """Quotas summing to ``n_keep`` (host-known), without host synchronisation on accelerators.

    The contract is checked when the demand lives on the CPU (where checking is free)."""
    fn = get_quota_policy(policy)
    d = demand_E.to(torch.int64)
    q = fn(d, n_keep, **kwargs).to(torch.int64)
    if d.device.type == "cpu":
        _check_quota(d, q, n_keep, policy)
    return q


def _check_quota(d: torch.Tensor, q: torch.Tensor, n_keep: int, policy: str) -> None:
    if q.shape != d.shape:
        raise ValueError(f"quota policy {policy!r} returned shape {tuple(q.shape)}, expected {tuple(d.shape)}")
    if bool((q < 0).any()) or bool((q > d).any()):
        raise ValueError(f"quota policy {policy!r} returned quotas outside [0, demand]: {q.tolist()} vs {d.tolist()}")
    if int(q.sum()) != n_keep:
        raise ValueError(f"quota policy {policy!r} returned sum {int(q.sum())}, expected exactly {n_keep}")
