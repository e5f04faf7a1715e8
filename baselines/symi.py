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

from lrmoe.planning.jit import njit
from lrmoe.planning.memory import MemoryBreakdown, memory_constants
from lrmoe.planning.plan import (Instance, Instances, assemble, cap_columns, heap_pop, heap_push, keep_all_peak,
                                 make_plan, new_plan, prefix_split_ranges, resolve_budget)


@dataclass(frozen=True)
class SymiState:
    """popularity_E: per-expert routed pairs of the previous step (all ranks summed)."""

    popularity_E: np.ndarray


@njit
def slot_counts_kernel(pop_E, total_slots):
    """:func:`symi_slot_counts` for integer popularity (int64 counts, sum > 0, small enough that
    den * (total_slots + 1) fits in 62 bits): the same exact integer arithmetic and heap order."""
    E = pop_E.size
    den = 0
    for e in range(E):
        den += pop_E[e]
    cnt = np.empty(E, np.int64)
    diff = np.empty(E, np.int64)
    excess = -total_slots
    for e in range(E):
        n = pop_E[e] * total_slots
        c = n // den
        if c < 1:
            c = 1
        cnt[e] = c
        diff[e] = c * den - n
        excess += c
    keys = np.empty(E, np.int64)
    idx = np.empty(E, np.int64)
    size = 0
    if excess > 0:  # the largest diff among cnt > 1 loses a slot (ties to the lower index)
        for e in range(E):
            if cnt[e] > 1:
                size = heap_push(keys, idx, size, -diff[e], e)
        for _ in range(excess):
            i, size = heap_pop(keys, idx, size)
            cnt[i] -= 1
            diff[i] -= den
            if cnt[i] > 1:
                size = heap_push(keys, idx, size, -diff[i], i)
    elif excess < 0:  # the smallest diff gains one
        for e in range(E):
            size = heap_push(keys, idx, size, diff[e], e)
        for _ in range(-excess):
            i, size = heap_pop(keys, idx, size)
            cnt[i] += 1
            diff[i] += den
            size = heap_push(keys, idx, size, diff[i], i)
    return cnt


@njit
def popularity_kind(pop_E):
    """0: nonnegative finite integers below 2**53 with a positive sum; 1: all zero; 2: other
    finite nonnegative values; 3: a negative or non-finite value."""
    total = 0.0
    whole = True
    for e in range(pop_E.size):
        p = pop_E[e]
        if not (p >= 0) or p == np.inf:
            return 3
        if p != np.floor(p) or p >= 2.0 ** 53:
            whole = False
        total += p
    if total <= 0:
        return 1
    return 0 if whole else 2


def symi_slot_counts(popularity_E, total_slots: int) -> np.ndarray:
    """SYMI's slot allocation: how many of the ``total_slots`` = G*S slots each expert gets.

        goal = pop / sum(pop) * G*S
        cnt  = floor(max(goal, 1)); diff = cnt - goal
        while sum(cnt) > G*S: i = argmax(diff) among experts with cnt > 1; cnt[i] -= 1; diff[i] -= 1
        while sum(cnt) < G*S: i = argmin(diff); cnt[i] += 1; diff[i] += 1

    (The published loop takes argmax over all experts and skips those at one slot; restricting
    the argmax to cnt > 1 gives the same counts and cannot spin.) Ties go to the lower index.
    All-zero popularity counts as uniform."""
    pop = np.ascontiguousarray(popularity_E, dtype=np.float64)
    E = pop.size
    kind = popularity_kind(pop) if pop.ndim == 1 else 3
    if kind == 3:
        raise ValueError(f"popularity must be a 1-D array of counts >= 0, got {popularity_E!r}")
    if total_slots < E:
        raise ValueError(f"SYMI needs at least one slot per expert: G*S = {total_slots} < E = {E}")
    if kind == 1:
        pop = np.ones(E)
        kind = 0
    if kind == 0:
        if float(pop.sum()) * (total_slots + 1) < 2.0**61:  # the kernel's int64 products cannot overflow
            return slot_counts_kernel(pop.astype(np.int64), int(total_slots))
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
    return list(symi_layout(slot_counts_E, slots_per_rank))


@njit
def layout_kernel(counts_E, slots_per_rank):
    N = 0
    for c in counts_E:
        N += c
    expert_N = np.empty(N, np.int64)
    rank_N = np.empty(N, np.int64)
    slot_N = np.empty(N, np.int64)
    replica_N = np.empty(N, np.bool_)
    j = 0
    for e in range(counts_E.size):
        for k in range(counts_E[e]):
            expert_N[j] = e
            rank_N[j] = j // slots_per_rank
            slot_N[j] = j % slots_per_rank
            replica_N[j] = k > 0
            j += 1
    return expert_N, rank_N, slot_N, replica_N


@njit
def counted_layout_kernel(pop_E, total_slots, slots_per_rank):
    """:func:`symi_slot_counts` and :func:`symi_layout` in one call for int64 popularity, when the
    counts kernel applies (every count >= 0, a positive sum, no int64 overflow): (True, counts,
    layout arrays); else (False, ...) and the caller takes the general path (which also reads counts
    of 2**53 and more as floats, as it does)."""
    total = 0
    for e in range(pop_E.size):
        if pop_E[e] < 0:
            total = -1
            break
        total += pop_E[e]
    if total <= 0 or total >= 2**53 or float(total) * (total_slots + 1) >= 2.0**61:
        z = np.zeros(0, np.int64)
        return False, z, z, z, z, np.zeros(0, np.bool_)
    counts = slot_counts_kernel(pop_E, total_slots)
    expert_N, rank_N, slot_N, replica_N = layout_kernel(counts, slots_per_rank)
    return True, counts, expert_N, rank_N, slot_N, replica_N


def symi_counts_layout(popularity_E, total_slots: int, slots_per_rank: int) -> tuple[np.ndarray, Instances]:
    """(:func:`symi_slot_counts`, :func:`symi_layout` of them): one compiled call for counted popularity."""
    if isinstance(popularity_E, np.ndarray) and popularity_E.dtype == np.int64 and popularity_E.ndim == 1 \
            and total_slots >= popularity_E.size:
        ok, counts, *layout = counted_layout_kernel(np.ascontiguousarray(popularity_E), int(total_slots),
                                                    int(slots_per_rank))
        if ok:
            return counts, Instances.trusted(*layout)
    counts = symi_slot_counts(popularity_E, total_slots)
    return counts, symi_layout(counts, slots_per_rank)


def symi_layout(slot_counts_E, slots_per_rank: int) -> Instances:
    """:func:`symi_instances` as :class:`Instances`."""
    return Instances(*layout_kernel(np.ascontiguousarray(slot_counts_E, dtype=np.int64), int(slots_per_rank)))


@njit
def route_kernel(d_GE, expert_N, counts_E, capacity_factor, row_cap):
    """Each expert's pairs split evenly over its (contiguous) slots, the first d_e mod c_e taking
    one more, routed by ordinal prefix; then at most ``cap`` rows per slot, cap the smaller of
    ``ceil(capacity_factor * pairs / slots)`` and ``row_cap`` (each < 0: none). Returns (send, the
    capacity rows or -1)."""
    G, E = d_GE.shape
    N = expert_N.size
    quota_N = np.empty(N, np.int64)
    d_E = np.zeros(E, np.int64)
    for g in range(G):
        for e in range(E):
            d_E[e] += d_GE[g, e]
    P = 0
    n = 0
    for e in range(E):
        d = d_E[e]
        P += d
        c = counts_E[e]
        base, extra = d // c, d % c
        for j in range(c):
            quota_N[n] = base + (j < extra)
            n += 1
    capacity = -1
    if capacity_factor >= 0:  # as plan_symi's Python did: ceil(cf * P / slots) in float64
        capacity = np.int64(math.ceil(capacity_factor * float(P) / float(N)))
    cap = capacity if row_cap < 0 else (row_cap if capacity < 0 else min(capacity, row_cap))
    send, lo_N, hi_N = prefix_split_ranges(d_GE, expert_N, quota_N)
    if cap >= 0:  # a slot receives its quota: those over the cap are trimmed
        cap_columns(send, quota_N > cap, lo_N, hi_N, np.full(N, cap, np.int64))
    return send, capacity


@njit
def route_plan_kernel(d_GE, expert_N, counts_E, capacity_factor, row_cap, rank_N, slot_N, is_replica_N, consts):
    """:func:`route_kernel` and the plan's assembly (:func:`lrmoe.planning.plan.assemble`, every sent pair
    kept) in one call: (send, the capacity rows or -1, the assembly's outputs)."""
    send, capacity = route_kernel(d_GE, expert_N, counts_E, capacity_factor, row_cap)
    return send, capacity, assemble(d_GE, send, send, True, expert_N, rank_N, slot_N, is_replica_N, d_GE.shape[1],
                                    consts)


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
    counts, instances = symi_counts_layout(popularity, G * S, S)
    expert_N, rank_N, replica_N = instances.expert_N, instances.rank_N, instances.is_replica_N
    new_state = SymiState(demand_GE.sum(0))
    mode = "dropless" if capacity_factor is None else f"capacity_factor={capacity_factor}"
    consts = memory_constants(dims, False)

    cf = -1.0 if capacity_factor is None else float(capacity_factor)

    def build(d_GE, row_cap):
        # make_plan's assembly in the routing's compiled call (SYMI's own layout: the instance check passes)
        send, cap, (dropped, *memory, peak, err) = route_plan_kernel(
            d_GE, expert_N, counts, cf, -1 if row_cap is None else int(row_cap), rank_N, instances.slot_N, replica_N,
            consts)
        info = {"slot_counts_E": counts, "popularity_E": popularity, "capacity_rows": None if cap < 0 else cap,
                "mode": mode}
        if err:  # never for SYMI's layout: make_plan says what is wrong
            return make_plan("symi", d_GE, cluster, dims, budget_bytes, instances, send, optimizer_on_gpu=False,
                             info=info, state=new_state)
        return new_plan("symi", d_GE, instances, send, send, dropped, MemoryBreakdown.of(*memory, peak), budget_bytes,
                        over_budget=peak > budget_bytes, info=info, state=new_state)

    def fits(d_GE, row_cap):
        # the memory of build's plan (every pair sent is kept) without assembling it: the budget
        # fallbacks' probes read only this
        send, _ = route_kernel(d_GE, expert_N, counts, cf, -1 if row_cap is None else int(row_cap))
        return keep_all_peak(d_GE, send, rank_N, replica_N, consts) <= budget_bytes

    return resolve_budget(build, demand_GE, budget_bytes, fallback, max_split, fits=fits)
