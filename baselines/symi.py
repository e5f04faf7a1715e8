"""SYMI (NSDI 2026, arXiv 2504.19925): expert weights decoupled from optimizer state ("symi").

Every expert's optimizer state is offloaded to host memory (sharded over all ranks, never
moves), so the GPUs hold only a pool of G*S weight slots (plus gradients) whose contents change
every step and layer. The slot counts come from SYMI's allocation over the *previous* step's
popularity (:func:`symi_slot_counts`); slots are filled contiguously (an expert's replicas share
a rank first). Tokens of an expert are split evenly over its slots; each slot holds at most
``ceil(cf * P / (G*S))`` rows (cf = 1.0: overflow dropped), or everything with
``capacity_factor=None`` (dropless). Every computed pair is kept in backward.

State: :class:`SymiState` with the popularity (all-reduced per-expert counts) of the step just
planned; pass ``plan.state`` to the next call. Without a state (first step) every expert is
equally popular, which gives SYMI's static even placement.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from lrmoe.planning.memory import plan_memory
from lrmoe.planning.plan import Instance, cap_rows, make_plan, prefix_split_experts, resolve_budget


@dataclass(frozen=True)
class SymiState:
    """popularity_E: per-expert routed pairs of the previous step (all ranks summed)."""

    popularity_E: np.ndarray


def symi_slot_counts(popularity_E, total_slots: int) -> np.ndarray:
    """SYMI's slot allocation: how many of the ``total_slots`` = G*S slots each expert gets.

        goal = pop / sum(pop) * G*S
        cnt  = floor(max(goal, 1)); diff = cnt - goal
        while sum(cnt) > G*S: i = argmax(diff) among experts with cnt > 1; cnt[i] -= 1; diff[i] -= 1
        while sum(cnt) < G*S: i = argmin(diff); cnt[i] += 1; diff[i] += 1

    (The published loop takes argmax over all experts and skips those at one slot; restricting
    the argmax to cnt > 1 gives the same counts and cannot spin.) Ties go to the lower index.
    All-zero popularity counts as uniform."""
    pop = np.asarray(popularity_E, dtype=np.float64)
    E = pop.size
    if pop.ndim != 1 or (pop < 0).any() or not np.isfinite(pop).all():
        raise ValueError(f"popularity must be a 1-D array of counts >= 0, got {popularity_E!r}")
    if total_slots < E:
        raise ValueError(f"SYMI needs at least one slot per expert: G*S = {total_slots} < E = {E}")
    if pop.sum() <= 0:
        pop = np.ones(E)
    # Exact arithmetic: ties that are exact (e.g. three goals of k + 1/3) must go to the lower
    # index, which float rounding of goal - floor(goal) would decide instead. With diff scaled by
    # den = sum(pop), goal = num / den and diff = cnt - goal are integers (popularity is counted in
    # pairs; other values are made integers by their exact common denominator).
    if (pop == np.floor(pop)).all():  # counts (the usual case): the integers themselves
        ints = [int(p) for p in pop.tolist()]
    else:
        fr = [Fraction(float(p)) for p in pop]
        scale = math.lcm(*(f.denominator for f in fr))
        ints = [int(f * scale) for f in fr]
    den = sum(ints)
    num = [p * total_slots for p in ints]
    cnt = [max(n // den, 1) for n in num]
    diff = [c * den - n for c, n in zip(cnt, num)]  # den * (cnt - goal), exact Python ints
    excess = sum(cnt) - total_slots
    # Each loop step of the published rule as a heap pop: the largest diff among cnt > 1 (ties to
    # the lower index) loses a slot, or the smallest diff (ties to the lower index) gains one.
    if excess > 0:
        heap = [(-x, i) for i, x in enumerate(diff) if cnt[i] > 1]
        heapq.heapify(heap)
        for _ in range(excess):
            i = heapq.heappop(heap)[1]
            cnt[i] -= 1
            diff[i] -= den
            if cnt[i] > 1:
                heapq.heappush(heap, (-diff[i], i))
    elif excess < 0:
        heap = [(x, i) for i, x in enumerate(diff)]
        heapq.heapify(heap)
        for _ in range(-excess):
            i = heapq.heappop(heap)[1]
            cnt[i] += 1
            diff[i] += den
            heapq.heappush(heap, (diff[i], i))
    return np.array(cnt, dtype=np.int64)


def symi_instances(slot_counts_E, slots_per_rank: int) -> list[Instance]:
    """Contiguous slot layout: global slot j holds expert ``repeat(arange(E), cnt)[j]`` on rank j // S;
    the first slot of each expert is its primary instance, the others are replicas."""
    experts = np.repeat(np.arange(len(slot_counts_E)), slot_counts_E)
    first = np.r_[True, experts[1:] != experts[:-1]]
    return [Instance(int(e), j // slots_per_rank, j % slots_per_rank, not bool(f))
            for j, (e, f) in enumerate(zip(experts, first))]


def plan_symi(demand_GE, cluster, dims, budget_bytes, *, state: SymiState | None = None,
              capacity_factor: float | None = 1.0, fallback: str = "split", max_split: int = 256):
    """SYMI placement from the previous step's popularity. capacity_factor: 1.0 (SYMI's setting:
    drops over capacity) or None (dropless). fallback under budget pressure: ``split``, ``drop``, ``oom``."""
    if state is not None and not isinstance(state, SymiState):
        raise ValueError(f"symi state must be None (first step) or the SymiState of the previous plan, got {state!r}")
    if capacity_factor is not None and not (isinstance(capacity_factor, (int, float)) and capacity_factor > 0):
        raise ValueError(f"capacity_factor must be None (dropless) or a number > 0, got {capacity_factor!r}")
    G, S, E = cluster.num_ranks, cluster.slots_per_rank, dims.num_experts
    popularity = np.ones(E) if state is None else np.asarray(state.popularity_E)
    if popularity.shape != (E,):
        raise ValueError(f"symi state popularity must have shape [E={E}], got {popularity.shape}")
    counts = symi_slot_counts(popularity, G * S)
    instances = symi_instances(counts, S)
    expert_N = np.array([i.expert for i in instances])
    new_state = SymiState(demand_GE.sum(0))

    rank_N = np.array([i.rank for i in instances])
    replica_N = np.array([i.is_replica for i in instances], dtype=bool)

    def route(d_GE, row_cap):
        # each expert's pairs split evenly over its slots (largest remainder of equal weights: the
        # first d_e mod c_e slots take one more), then routed by ordinal prefix
        d_E = d_GE.sum(0)
        c_E = np.bincount(expert_N, minlength=E)
        j_N = np.arange(expert_N.size) - np.searchsorted(expert_N, expert_N)  # slot index within its expert
        quota_N = d_E[expert_N] // c_E[expert_N] + (j_N < d_E[expert_N] % c_E[expert_N])
        send = prefix_split_experts(d_GE, expert_N, quota_N)
        cap = None if capacity_factor is None else math.ceil(capacity_factor * int(d_GE.sum()) / (G * S))
        caps = [c for c in (cap, row_cap) if c is not None]
        return (cap_rows(send, min(caps)) if caps else send), cap

    def build(d_GE, row_cap):
        send, cap = route(d_GE, row_cap)
        info = {"slot_counts_E": counts, "popularity_E": popularity, "capacity_rows": cap,
                "mode": "dropless" if capacity_factor is None else f"capacity_factor={capacity_factor}"}
        return make_plan("symi", d_GE, cluster, dims, budget_bytes, instances, send, optimizer_on_gpu=False,
                         info=info, state=new_state)

    def fits(d_GE, row_cap):
        # the memory of build's plan (every pair sent is kept) without assembling it: the probes
        # of the budget fallbacks read only this
        send, _ = route(d_GE, row_cap)
        return plan_memory(dims, G, rank_N, replica_N, send, send, optimizer_on_gpu=False,
                           pairs_G=d_GE.sum(1)).peak <= budget_bytes

    return resolve_budget(build, demand_GE, budget_bytes, fallback, max_split, fits=fits)
