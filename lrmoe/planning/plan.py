"""Placement planners: one interface for LRMoE and every baseline (pure functions, numpy only).

A planner maps this step's per-rank per-expert routed demand to a :class:`Plan`::

    plan = plan_placement(name, demand_GE, cluster, dims, budget_bytes, state=prev.state, **options)

* ``demand_GE[r, e]``: routed (token, expert) pairs of expert e that originate on rank r.
* ``cluster``: G ranks, S expert slots per rank, fast-interconnect domains (:class:`Cluster`).
* ``dims``: model dimensions and byte sizes (:class:`ModelDims`).
* ``budget_bytes``: what this MoE layer may use per GPU (see :mod:`lrmoe.planning.memory`).
* ``state``: planners are pure; a stateful one (SYMI, which plans from the *previous* step's
  popularity) returns the state for the next call in ``plan.state``. Pass ``state=None`` on
  the first step. Stateless planners return ``state=None``.

A plan lists expert instances (owner or replica, by rank and slot), how many pairs each
source rank sends to each instance, how many of them each (source, instance) keeps in backward,
the forward drops, and the per-rank memory the plan needs. When the policy's first-choice plan
does not fit the budget the plan says so (``over_budget``) and carries what the policy did
(``fallback``): ``none``, ``split_microbatch:N`` (the plan is for the largest of N pieces),
``drop_over_capacity`` (a per-instance row cap), ``shrink_quota`` (LRMoE keeps fewer pairs in
backward) or ``oom`` (nothing fits: the real system fails).

This module holds the interface types and the small routing helpers the planners share
(largest-remainder splits, capacity caps, the budget fallbacks). The registry of policies and
:func:`plan_placement` live in :mod:`lrmoe.planning.policies`; the built-in policies in
``baselines/`` (fixed, symi, ultraep, ultraep_greedy) and :mod:`lrmoe.planning.lrmoe_plan` (lrmoe).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from .memory import MemoryBreakdown, plan_memory

__all__ = ["Cluster", "ModelDims", "Instance", "Plan", "MemoryBreakdown", "check_inputs"]


# ----------------------------------------------------------------------------- descriptions
@dataclass(frozen=True)
class Cluster:
    """G expert-parallel ranks with S expert weight slots each.

    ``slots_per_rank`` counts every expert instance a rank can hold (owned experts included):
    owner-based policies use E/G of them for owned experts and the rest for replicas; SYMI fills
    all G*S slots. ``fast_domains`` partitions the ranks into groups that share a fast
    interconnect (e.g. NVLink islands); None means one domain of all ranks."""

    num_ranks: int
    slots_per_rank: int
    fast_domains: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self):
        for name in ("num_ranks", "slots_per_rank"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"Cluster.{name} must be an integer >= 1, got {v!r}")
        G = int(self.num_ranks)
        domains = self.fast_domains if self.fast_domains is not None else (tuple(range(G)),)
        if not _is_int_groups(domains):
            raise ValueError(f"Cluster.fast_domains must be None or groups of integer ranks, e.g. ((0, 1), (2, 3)), "
                             f"got {self.fast_domains!r}")
        domains = tuple(tuple(int(r) for r in dom) for dom in domains)
        if sorted(r for dom in domains for r in dom) != list(range(G)) or any(not dom for dom in domains):
            raise ValueError(f"Cluster.fast_domains must partition ranks 0..{G - 1} into non-empty groups, "
                             f"got {self.fast_domains!r}")
        object.__setattr__(self, "fast_domains", domains)

    @property
    def domain_G(self) -> np.ndarray:
        """Fast-domain id of every rank."""
        dom = np.empty(self.num_ranks, dtype=np.int64)
        for i, ranks in enumerate(self.fast_domains):
            dom[list(ranks)] = i
        return dom


@dataclass(frozen=True)
class ModelDims:
    """What the planners need of the model: one MoE layer of E SwiGLU experts.

    dtype_bytes: weights and activations (2 for bf16). grad_bytes: expert gradients (4: fp32
    main grads as Megatron-LM keeps them). optimizer_bytes_per_param: optimizer state per
    parameter where it lives on the GPU (12: AdamW fp32 master + m + v; divide by the
    distributed-optimizer shard count yourself; 0 excludes it, as the paper's memory table
    appears to)."""

    hidden: int
    intermediate: int
    num_experts: int
    top_k: int = 1
    dtype_bytes: int = 2
    grad_bytes: int = 4
    optimizer_bytes_per_param: int = 12

    def __post_init__(self):
        for name in ("hidden", "intermediate", "num_experts", "top_k", "dtype_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"ModelDims.{name} must be an integer >= 1, got {v!r}")
        for name in ("grad_bytes", "optimizer_bytes_per_param"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
                raise ValueError(f"ModelDims.{name} must be an integer >= 0, got {v!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"ModelDims.top_k must be <= num_experts = {self.num_experts} (each token picks top_k "
                             f"distinct experts), got {self.top_k}")


def _is_int_groups(domains) -> bool:
    """Whether ``domains`` is an iterable of iterables of integers (bools and strings excluded)."""
    def ints(dom):
        return not isinstance(dom, (str, bytes)) and hasattr(dom, "__iter__") and all(
            isinstance(r, (int, np.integer)) and not isinstance(r, bool) for r in dom)
    return not isinstance(domains, (str, bytes)) and hasattr(domains, "__iter__") and all(ints(d) for d in domains)


@dataclass(frozen=True)
class Instance:
    """One copy of an expert's weights in slot ``slot`` of rank ``rank``."""

    expert: int
    rank: int
    slot: int
    is_replica: bool


@dataclass(frozen=True)
class Plan:
    """What a placement policy decided for one step of one MoE layer (N = len(instances)).

    demand_GE: the demand this plan serves (a piece of the input demand when the microbatch was
        split, see ``num_splits``).
    send_GN[s, i]: pairs source rank s sends to instance i (forward; every one computed).
    backward_quota_GN[s, i] <= send_GN[s, i]: of those, how many are kept in backward.
    dropped_GE[s, e]: pairs of expert e from source s dropped in forward (over capacity);
        ``sum_{i of e} send_GN[s, i] + dropped_GE[s, e] == demand_GE[s, e]`` always.
    memory: per-rank memory (:class:`MemoryBreakdown`). over_budget: the policy's first-choice
    plan did not fit ``budget_bytes``; fallback: what the policy then did (module docstring).
    info: policy-specific facts (threshold, slot counts, capacity, quotas...). state: pass it as
    ``state=`` to the next call (stateful policies only)."""

    policy: str
    demand_GE: np.ndarray
    instances: tuple[Instance, ...]
    send_GN: np.ndarray
    backward_quota_GN: np.ndarray
    dropped_GE: np.ndarray
    memory: MemoryBreakdown
    budget_bytes: float
    over_budget: bool = False
    fallback: str = "none"
    num_splits: int = 1
    info: dict = field(default_factory=dict)
    state: Any = None

    # The names for the three count matrices.
    send = property(lambda self: self.send_GN)
    backward_quota = property(lambda self: self.backward_quota_GN)
    dropped = property(lambda self: self.dropped_GE)

    @property
    def expert_N(self) -> np.ndarray:
        return np.array([i.expert for i in self.instances], dtype=np.int64)

    @property
    def rank_N(self) -> np.ndarray:
        return np.array([i.rank for i in self.instances], dtype=np.int64)

    @property
    def is_replica_N(self) -> np.ndarray:
        return np.array([i.is_replica for i in self.instances], dtype=bool)

    @property
    def rows_N(self) -> np.ndarray:
        """Forward rows each instance computes."""
        return self.send_GN.sum(0)

    @property
    def kept_N(self) -> np.ndarray:
        """Backward rows each instance computes."""
        return self.backward_quota_GN.sum(0)

    def per_rank(self, values_N) -> np.ndarray:
        return np.bincount(self.rank_N, weights=values_N, minlength=len(self.memory.base_G)).astype(np.int64)

    @property
    def rows_G(self) -> np.ndarray:
        return self.per_rank(self.rows_N)

    @property
    def kept_G(self) -> np.ndarray:
        return self.per_rank(self.kept_N)

    @property
    def kept_E(self) -> np.ndarray:
        return np.bincount(self.expert_N, weights=self.kept_N, minlength=self.demand_GE.shape[1]).astype(np.int64)

    def cost_G(self, backward_weight: float = 2.0) -> np.ndarray:
        """Per-rank expert work in forward-row units: rows + backward_weight * kept rows."""
        return self.rows_G + backward_weight * self.kept_G

    @property
    def num_replicas_G(self) -> np.ndarray:
        return np.bincount(self.rank_N[self.is_replica_N], minlength=len(self.memory.base_G))

    @property
    def fits(self) -> bool:
        return self.memory.peak <= self.budget_bytes

    def check(self) -> "Plan":
        """Raise ValueError unless the plan is internally consistent; return self."""
        G, E = self.demand_GE.shape
        N = len(self.instances)
        if self.send_GN.shape != (G, N) or self.backward_quota_GN.shape != (G, N) or self.dropped_GE.shape != (G, E):
            raise ValueError(f"plan {self.policy}: count matrices have the wrong shapes")
        slots = {(i.rank, i.slot) for i in self.instances}
        if len(slots) != N or any(not (0 <= i.expert < E and 0 <= i.rank < G and i.slot >= 0) for i in self.instances):
            raise ValueError(f"plan {self.policy}: instances must have valid experts, ranks and distinct slots")
        ex = self.expert_N
        owners_E = np.bincount(ex[~self.is_replica_N], minlength=E)
        if np.bincount(ex, minlength=E).min(initial=1) < 1 or owners_E.max(initial=0) > 1:
            raise ValueError(f"plan {self.policy}: every expert needs an instance and at most one owner")
        if (self.send_GN < 0).any() or (self.dropped_GE < 0).any():
            raise ValueError(f"plan {self.policy}: negative send or dropped counts")
        if ((self.backward_quota_GN < 0) | (self.backward_quota_GN > self.send_GN)).any():
            raise ValueError(f"plan {self.policy}: backward quotas must be in [0, send]")
        if not np.array_equal(expert_sum(self.send_GN, ex, E) + self.dropped_GE, self.demand_GE):
            raise ValueError(f"plan {self.policy}: sent + dropped pairs do not equal the demand")
        return self


PlanFn = Callable[..., Plan]


def check_inputs(demand_GE, cluster: Cluster, dims: ModelDims, budget_bytes) -> np.ndarray:
    """Validate the planner inputs; return the demand as an int64 array."""
    if not isinstance(cluster, Cluster) or not isinstance(dims, ModelDims):
        raise ValueError(f"cluster must be a Cluster and dims a ModelDims, got {type(cluster).__name__} "
                         f"and {type(dims).__name__}")
    G, E = cluster.num_ranks, dims.num_experts
    d = np.asarray(demand_GE)
    if d.shape != (G, E):
        raise ValueError(f"demand_GE must have shape [G={G}, E={E}] (ranks x experts), got {d.shape}")
    if d.dtype == bool or not (np.issubdtype(d.dtype, np.integer) or np.issubdtype(d.dtype, np.floating)):
        raise ValueError(f"demand_GE must hold integer counts, got dtype {d.dtype}")
    if np.issubdtype(d.dtype, np.floating) and not (np.isfinite(d).all() and (d == np.round(d)).all()):
        raise ValueError("demand_GE must hold whole-number counts")
    if (d < 0).any():
        raise ValueError(f"demand_GE counts must be >= 0, got minimum {d.min()}")
    check_budget(budget_bytes)
    return d.astype(np.int64)


def check_budget(budget_bytes) -> float:
    """ValueError unless ``budget_bytes`` is a number > 0 (math.inf: no budget)."""
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, (int, float, np.integer, np.floating)) \
            or math.isnan(budget_bytes) or budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be a number > 0 (math.inf for no budget), got {budget_bytes!r}")
    return budget_bytes


# ----------------------------------------------------------------------------- shared helpers
def expert_sum(x_GN: np.ndarray, expert_N: np.ndarray, num_experts: int) -> np.ndarray:
    """Sum the instance columns of x_GN per expert -> [G, E]."""
    x_GN = np.asarray(x_GN, dtype=np.int64)
    expert_N = np.asarray(expert_N, dtype=np.int64)
    if x_GN.ndim != 2 or x_GN.shape[1] != expert_N.size:
        raise ValueError(f"x_GN must have one column per instance ({expert_N.size}), got shape {x_GN.shape}")
    if expert_N.size and (expert_N.min() < 0 or expert_N.max() >= num_experts):
        raise ValueError(f"instance experts must be in [0, {num_experts}), got {expert_N.min()}..{expert_N.max()}")
    out = np.zeros((x_GN.shape[0], num_experts), dtype=np.int64)
    np.add.at(out.T, expert_N, x_GN.T)
    return out


def domain_peers(domain_G) -> list[list[int]]:
    """For every rank, the ranks of its fast domain (itself included), in rank order."""
    dom = np.asarray(domain_G).tolist()
    members = {d: [t for t in range(len(dom)) if dom[t] == d] for d in set(dom)}
    return [members[d] for d in dom]


def experts_by_load_per_rank(load_E, owner_E, num_ranks: int) -> list[list[int]]:
    """For every rank, the experts it owns by descending load (ties to the lower expert index)."""
    owner_E = np.asarray(owner_E)
    by_load = np.argsort(-np.asarray(load_E), kind="stable")
    by_rank = by_load[np.argsort(owner_E[by_load], kind="stable")].tolist()
    starts = np.r_[0, np.cumsum(np.bincount(owner_E, minlength=num_ranks))].tolist()
    return [by_rank[starts[r]:starts[r + 1]] for r in range(num_ranks)]


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


def prefix_split_experts(d_GE, expert_N, quota_N) -> np.ndarray:
    """:func:`prefix_split` of every expert at once: ``send[:, cols_e] == prefix_split(d_GE[:, e],
    quota_N[cols_e])`` for every expert e, cols_e its instance columns in ascending order."""
    d_GE = np.asarray(d_GE, dtype=np.int64)
    expert_N = np.asarray(expert_N, dtype=np.int64)
    quota_N = np.asarray(quota_N, dtype=np.int64)
    s_end_GN = np.cumsum(d_GE, 0)[:, expert_N]
    s_start_GN = s_end_GN - d_GE[:, expert_N]
    order = np.argsort(expert_N, kind="stable")
    csum = np.cumsum(quota_N[order])
    group_start = np.searchsorted(expert_N[order], expert_N[order])  # first position of each one's expert
    before = np.where(group_start > 0, csum[np.maximum(group_start - 1, 0)], 0)
    n_end_N = np.empty_like(quota_N)
    n_end_N[order] = csum - before
    n_start_N = n_end_N - quota_N
    return np.clip(np.minimum(s_end_GN, n_end_N[None, :]) - np.maximum(s_start_GN, n_start_N[None, :]), 0, None)


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


def largest_remainder_cols(total_N, w_GN) -> np.ndarray:
    """Column-wise :func:`largest_remainder`: ``out[:, n] == largest_remainder(total_N[n], w_GN[:, n])``
    for every column n, in one pass (same ties: the lower row index)."""
    w = np.asarray(w_GN, dtype=np.int64)
    t = np.broadcast_to(np.asarray(total_N, dtype=np.int64), (w.shape[1],))
    W = w.sum(0)
    bad = (W <= 0) & (t != 0)
    if bad.any():
        n = int(np.flatnonzero(bad)[0])
        raise ValueError(f"cannot split {int(t[n])} over zero weights")
    base, rem = np.divmod(w * t, np.where(W > 0, W, 1))
    missing = t - base.sum(0)
    order = np.argsort(-rem, axis=0, kind="stable")
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(w.shape[0])[:, None], axis=0)
    return base + (rank < missing)


def largest_remainder_groups(total_K, w_M, group_M) -> np.ndarray:
    """Grouped :func:`largest_remainder` over a flat array: the elements of group k (``group_M == k``,
    in array order) get ``largest_remainder(total_K[k], w_M[group_M == k])``."""
    w = np.asarray(w_M, dtype=np.int64)
    g = np.asarray(group_M, dtype=np.int64)
    t_K = np.asarray(total_K, dtype=np.int64)
    W_K = np.bincount(g, weights=w, minlength=len(t_K)).astype(np.int64)
    bad = (W_K <= 0) & (t_K != 0)
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        raise ValueError(f"cannot split {int(t_K[k])} over zero weights")
    t, W = t_K[g], np.where(W_K > 0, W_K, 1)[g]
    base, rem = np.divmod(w * t, W)
    missing_K = t_K - np.bincount(g, weights=base, minlength=len(t_K)).astype(np.int64)
    order = np.lexsort((np.arange(w.size), -rem, g))  # by group, then descending remainder, then index
    start_K = np.searchsorted(g[order], np.arange(len(t_K)))
    rank = np.empty_like(order)
    rank[order] = np.arange(w.size) - start_K[g[order]]
    return base + (rank < missing_K[g])


def locality_split_replicas(d_GE, expert_N, rank_N, quota_N) -> np.ndarray:
    """:func:`locality_split` of every expert at once, for the owner-plus-replicas layout of
    :func:`replica_instances` (instance e is expert e's owner, the ``rest``; replicas follow in
    order). Returns send [G, N]; ``send[:, cols_e] == locality_split(d_GE[:, e], rank_N[cols_e],
    quota_N[cols_e])`` for every expert e with instance columns cols_e (owner first)."""
    d_GE = np.asarray(d_GE, dtype=np.int64)
    expert_N = np.asarray(expert_N, dtype=np.int64)
    rank_N = np.asarray(rank_N, dtype=np.int64)
    quota_N = np.asarray(quota_N, dtype=np.int64)
    G, E = d_GE.shape
    N = expert_N.size
    q_E = np.bincount(expert_N, weights=quota_N, minlength=E).astype(np.int64)
    bad = np.flatnonzero(q_E != d_GE.sum(0))
    if bad.size:
        e = int(bad[0])
        raise ValueError(f"instance quotas sum to {int(q_E[e])}, demand to {int(d_GE[:, e].sum())}")
    rem = d_GE.copy()
    send = np.zeros((G, N), dtype=np.int64)
    reps = np.arange(E, N)
    # j-th replica of its expert: replicas of one expert are contiguous and in order
    rep_ex = expert_N[reps]
    first = np.searchsorted(rep_ex, rep_ex)
    j_R = np.arange(reps.size) - first
    rounds = [reps[j_R == j] for j in range(int(j_R.max(initial=-1)) + 1)]
    for cols in rounds:  # pass 1: pairs already on the host rank (in replica order per expert)
        e, r = expert_N[cols], rank_N[cols]
        take = np.minimum(quota_N[cols], rem[r, e])
        send[r, cols] = take
        rem[r, e] -= take
    for cols in rounds:  # pass 2: the rest of each quota, largest remainder over the sources' pairs
        e = expert_N[cols]
        alloc = largest_remainder_cols(quota_N[cols] - send[:, cols].sum(0), rem[:, e])
        send[:, cols] += alloc
        rem[:, e] -= alloc
    send[:, :E] = rem
    return send


def cap_rows(send_GN: np.ndarray, cap) -> np.ndarray:
    """Drop over capacity: each instance keeps at most ``cap`` rows (scalar or [N]), trimmed
    proportionally over its sources (largest remainder)."""
    send = send_GN.copy()
    cap_N = np.broadcast_to(np.asarray(cap, dtype=np.int64), (send.shape[1],))
    over = np.flatnonzero(send.sum(0) > cap_N)
    if over.size:
        send[:, over] = largest_remainder_cols(cap_N[over], send[:, over])
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
    """The owned instances of fixed ownership: expert e in slot e % (E/G) of rank e // (E/G)."""
    return list(_owner_instances(dims.num_experts, owned_layout(cluster, dims, policy)))


@functools.lru_cache(maxsize=64)
def _owner_instances(num_experts: int, experts_per_rank: int) -> tuple[Instance, ...]:
    # Built once per layout (Instance is frozen, so sharing is safe): constructing 128 of them
    # costs more than a small plan.
    return tuple(Instance(e, e // experts_per_rank, e % experts_per_rank, False) for e in range(num_experts))


def replica_instances(cluster: Cluster, dims: ModelDims, hosts_E,
                      policy: str) -> tuple[list[Instance], list[list[int]]]:
    """Owner instances (index e) followed by replicas of expert e on the ranks ``hosts_E[e]``,
    in the slots after the owned ones. Returns the instances and each expert's instance columns
    (owner first)."""
    instances = owner_instances(cluster, dims, policy)
    used = [len(instances) // cluster.num_ranks] * cluster.num_ranks  # slots taken per rank
    S = cluster.slots_per_rank
    cols_E = [[e] for e in range(dims.num_experts)]
    for e, hosts in enumerate(hosts_E):
        for t in hosts:
            t = int(t)
            if used[t] >= S:
                raise ValueError(f"{policy}: rank {t} has no free slot for a replica of expert {e}")
            cols_E[e].append(len(instances))
            instances.append(Instance(e, t, used[t], True))
            used[t] += 1
    return instances, cols_E


def replica_columns(replicas, load_E, owner_E) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per instance column of :func:`replica_instances` for ``replicas`` = (expert, host, rows)
    (owners, then every expert's replicas in the order given): its expert, its rank
    (``owner_E[e]`` for the owner) and its rows (a replica its own, an owner its expert's load
    less its replicas' rows)."""
    E = len(load_E)
    rep = np.array(replicas, dtype=np.int64).reshape(-1, 3)
    rep = rep[np.argsort(rep[:, 0], kind="stable")]  # replica columns follow expert order
    rows_N = np.concatenate([np.asarray(load_E, dtype=np.int64), rep[:, 2]])
    np.subtract.at(rows_N, rep[:, 0], rep[:, 2])
    return (np.concatenate([np.arange(E), rep[:, 0]]), np.concatenate([np.asarray(owner_E, dtype=np.int64), rep[:, 1]]),
            rows_N)


def domain_receivers(domain_G) -> list[list[int]]:
    """For every rank, the other ranks of its fast domain (those it can place replicas on), in rank order."""
    return [[u for u in peers if u != r] for r, peers in enumerate(domain_peers(domain_G))]


def make_plan(policy: str, demand_GE, cluster: Cluster, dims: ModelDims, budget_bytes: float, instances,
              send_GN, backward_quota_GN=None, *, optimizer_on_gpu: bool = True, info: dict | None = None,
              state: Any = None) -> Plan:
    """Assemble and check a plan: drops and memory are derived from the counts.
    ``backward_quota_GN`` defaults to ``send_GN`` (keep every pair)."""
    instances = tuple(instances)
    send_GN = np.asarray(send_GN, dtype=np.int64)
    quota_GN = send_GN if backward_quota_GN is None else np.asarray(backward_quota_GN, dtype=np.int64)
    ex = np.array([i.expert for i in instances], dtype=np.int64)
    mem = plan_memory(dims, cluster.num_ranks, [i.rank for i in instances], [i.is_replica for i in instances],
                      send_GN, quota_GN, optimizer_on_gpu=optimizer_on_gpu, pairs_G=np.asarray(demand_GE).sum(1))
    plan = Plan(policy, demand_GE, instances, send_GN, quota_GN, demand_GE - expert_sum(send_GN, ex, dims.num_experts),
                mem, budget_bytes, over_budget=mem.peak > budget_bytes, info=dict(info or {}), state=state)
    return plan.check()


def split_piece(demand_GE: np.ndarray, n: int) -> np.ndarray:
    """The largest of n microbatch pieces: every count split as evenly as possible (ceil)."""
    return -(-demand_GE // n)


FALLBACKS = ("split", "drop", "oom")


def resolve_budget(build: Callable[[np.ndarray, int | None], Plan], demand_GE: np.ndarray, budget_bytes: float,
                   fallback: str = "split", max_split: int = 256,
                   fits: Callable[[np.ndarray, int | None], bool] | None = None) -> Plan:
    """Apply a policy's fallback when its plan does not fit the budget.

    ``build(demand_GE, row_cap)`` plans a demand with an optional per-instance row cap.
    split: the smallest number N <= max_split of microbatch pieces whose largest piece fits
        (doubling, then bisection; memory is assumed not to grow as N grows);
    drop: the largest per-instance row cap that fits (bisection);
    oom: report the over-budget plan. Any fallback that cannot fit ends as ``oom``.

    ``fits(demand_GE, row_cap)``, when given, must equal ``build(demand_GE, row_cap).fits``; the
    searches then probe it and build only the plan they return (for planners whose ``fits`` is
    cheaper than their plan). Without it every probe builds its plan."""
    if fallback not in FALLBACKS:
        raise ValueError(f"fallback must be one of {FALLBACKS}, got {fallback!r}")
    if isinstance(max_split, bool) or not isinstance(max_split, int) or max_split < 1:
        raise ValueError(f"max_split must be an integer >= 1, got {max_split!r}")
    plan = build(demand_GE, None)
    if plan.fits:
        return plan
    oom = dataclasses.replace(plan, over_budget=True, fallback="oom")
    built: dict[tuple, Plan] = {}  # every probe's plan when fits is not given (the answer is one of them)

    def plan_of(d_GE, row_cap) -> Plan:
        key = (d_GE.tobytes(), row_cap)
        if key not in built:
            built[key] = build(d_GE, row_cap)
        return built[key]

    if fits is None:
        def fits(d_GE, row_cap):
            return plan_of(d_GE, row_cap).fits
    if fallback == "drop":
        if not fits(demand_GE, 0):
            return oom
        lo, hi = 0, int(plan.rows_N.max())  # cap lo fits, cap hi does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(demand_GE, mid) else (lo, mid)
        best = plan_of(demand_GE, lo)
        return dataclasses.replace(best, over_budget=True, fallback="drop_over_capacity",
                                   info={**best.info, "row_cap": lo})
    if fallback == "split":
        lo, hi = 1, None  # lo pieces do not fit, hi pieces do
        while hi is None and lo < max_split:
            n = min(2 * lo, max_split)
            if fits(split_piece(demand_GE, n), None):
                hi = n
            else:
                lo = n
        if hi is None:
            return oom
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if fits(split_piece(demand_GE, mid), None) else (mid, hi)
        best = plan_of(split_piece(demand_GE, hi), None)
        return dataclasses.replace(best, over_budget=True, fallback=f"split_microbatch:{hi}", num_splits=hi)
    return oom
