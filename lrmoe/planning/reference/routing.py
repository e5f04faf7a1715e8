"""The routing helpers and budget fallbacks of :mod:`lrmoe.planning.plan` as of revision 2cf58af,
copied unchanged so that the reference planners stay frozen while the live ones are optimised.

The interface types and plan assembly (Instance, Plan, make_plan and the memory model) are
imported from :mod:`lrmoe.planning.plan`: they define what a plan is, not how it is searched.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from lrmoe.planning.plan import Cluster, Instance, ModelDims, Plan


def largest_remainder(total: int, weights) -> np.ndarray:
    """Split ``total`` into integers proportional to ``weights``; remainders to the largest
    fractional parts (ties: lower index). Each part is <= its weight when total <= sum(weights)."""
    w = np.asarray(weights, dtype=np.int64)
    W = int(w.sum())
    if total == 0:
        return np.zeros_like(w)
    if W <= 0:
        raise ValueError(f"cannot split {total} over zero weights")
    base, rem = np.divmod(w * int(total), W)
    missing = int(total) - int(base.sum())
    base[np.argsort(-rem, kind="stable")[:missing]] += 1
    return base


def prefix_split(d_G, quota_N) -> np.ndarray:
    """Ordinal routing: pairs of one expert are numbered source-major; instance n takes the
    ordinals in the n-th interval of the quota prefix sums. Returns send [G, N]."""
    d_G = np.asarray(d_G, dtype=np.int64)
    quota_N = np.asarray(quota_N, dtype=np.int64)
    s_end = np.cumsum(d_G)
    n_end = np.cumsum(quota_N)
    lo = np.maximum((s_end - d_G)[:, None], (n_end - quota_N)[None, :])
    return np.clip(np.minimum(s_end[:, None], n_end[None, :]) - lo, 0, None)


def locality_split(d_G, rank_N, quota_N, rest: int = 0) -> np.ndarray:
    """Per-source split of one expert's pairs over its instances (UltraEP's rule).

    Every instance except ``rest`` is filled first by pairs already on its host rank, then the
    rest of its quota is shared among the source ranks' remaining pairs by largest-remainder
    proportional rounding; instance ``rest`` (the owner) takes what is left. Returns send [G, N]."""
    rem = np.array(d_G, dtype=np.int64)
    quota_N = np.asarray(quota_N, dtype=np.int64)
    if int(quota_N.sum()) != int(rem.sum()):
        raise ValueError(f"instance quotas sum to {int(quota_N.sum())}, demand to {int(rem.sum())}")
    send = np.zeros((rem.size, quota_N.size), dtype=np.int64)
    others = [n for n in range(quota_N.size) if n != rest]
    for n in others:
        r = rank_N[n]
        send[r, n] = take = min(int(quota_N[n]), int(rem[r]))
        rem[r] -= take
    for n in others:
        need = int(quota_N[n]) - int(send[:, n].sum())
        if need:
            alloc = largest_remainder(need, rem)
            send[:, n] += alloc
            rem -= alloc
    send[:, rest] = rem
    return send


def cap_rows(send_GN: np.ndarray, cap) -> np.ndarray:
    """Drop over capacity: each instance keeps at most ``cap`` rows (scalar or [N]), trimmed
    proportionally over its sources (largest remainder)."""
    send = send_GN.copy()
    cap_N = np.broadcast_to(np.asarray(cap, dtype=np.int64), (send.shape[1],))
    for n in np.flatnonzero(send.sum(0) > cap_N):
        send[:, n] = largest_remainder(int(cap_N[n]), send[:, n])
    return send


def owned_layout(cluster: Cluster, dims: ModelDims, policy: str) -> int:
    """Experts per rank for owner-based policies (expert e owned by rank e // (E/G), slot e % (E/G))."""
    G, E, S = cluster.num_ranks, dims.num_experts, cluster.slots_per_rank
    if E % G:
        raise ValueError(f"{policy}: num_experts ({E}) must be divisible by num_ranks ({G}) for fixed ownership")
    if E // G > S:
        raise ValueError(f"{policy}: slots_per_rank ({S}) must be >= experts per rank E/G = {E // G}")
    return E // G


def owner_instances(cluster: Cluster, dims: ModelDims, policy: str) -> list[Instance]:
    epr = owned_layout(cluster, dims, policy)
    return [Instance(e, e // epr, e % epr, False) for e in range(dims.num_experts)]


def replica_instances(cluster: Cluster, dims: ModelDims, hosts_E,
                      policy: str) -> tuple[list[Instance], list[list[int]]]:
    """Owner instances (index e) followed by replicas of expert e on the ranks ``hosts_E[e]``,
    in the slots after the owned ones. Returns the instances and each expert's instance columns
    (owner first)."""
    instances = owner_instances(cluster, dims, policy)
    used = np.full(cluster.num_ranks, len(instances) // cluster.num_ranks)
    cols_E = [[e] for e in range(dims.num_experts)]
    for e, hosts in enumerate(hosts_E):
        for t in hosts:
            if used[t] >= cluster.slots_per_rank:
                raise ValueError(f"{policy}: rank {t} has no free slot for a replica of expert {e}")
            cols_E[e].append(len(instances))
            instances.append(Instance(e, int(t), int(used[t]), True))
            used[t] += 1
    return instances, cols_E


def split_piece(demand_GE: np.ndarray, n: int) -> np.ndarray:
    """The largest of n microbatch pieces: every count split as evenly as possible (ceil)."""
    return -(-demand_GE // n)


FALLBACKS = ("split", "drop", "oom")


def resolve_budget(build: Callable[[np.ndarray, int | None], Plan], demand_GE: np.ndarray, budget_bytes: float,
                   fallback: str = "split", max_split: int = 256) -> Plan:
    """Apply a policy's fallback when its plan does not fit the budget.

    ``build(demand_GE, row_cap)`` plans a demand with an optional per-instance row cap.
    split: the smallest number N <= max_split of microbatch pieces whose largest piece fits
        (doubling, then bisection; memory is assumed not to grow as N grows);
    drop: the largest per-instance row cap that fits (bisection);
    oom: report the over-budget plan. Any fallback that cannot fit ends as ``oom``."""
    if fallback not in FALLBACKS:
        raise ValueError(f"fallback must be one of {FALLBACKS}, got {fallback!r}")
    if isinstance(max_split, bool) or not isinstance(max_split, int) or max_split < 1:
        raise ValueError(f"max_split must be an integer >= 1, got {max_split!r}")
    plan = build(demand_GE, None)
    if plan.fits:
        return plan
    oom = dataclasses.replace(plan, over_budget=True, fallback="oom")
    if fallback == "drop":
        best = build(demand_GE, 0)
        if not best.fits:
            return oom
        lo, hi = 0, int(plan.rows_N.max())  # cap lo fits, cap hi does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            p = build(demand_GE, mid)
            lo, hi, best = (mid, hi, p) if p.fits else (lo, mid, best)
        return dataclasses.replace(best, over_budget=True, fallback="drop_over_capacity",
                                   info={**best.info, "row_cap": lo})
    if fallback == "split":
        lo, hi, best = 1, None, None  # lo pieces do not fit, hi pieces do
        while best is None and lo < max_split:
            n = min(2 * lo, max_split)
            p = build(split_piece(demand_GE, n), None)
            if p.fits:
                hi, best = n, p
            else:
                lo = n
        if best is None:
            return oom
        while hi - lo > 1:
            mid = (lo + hi) // 2
            p = build(split_piece(demand_GE, mid), None)
            lo, hi, best = (lo, mid, p) if p.fits else (mid, hi, best)
        return dataclasses.replace(best, over_budget=True, fallback=f"split_microbatch:{hi}", num_splits=hi)
    return oom
