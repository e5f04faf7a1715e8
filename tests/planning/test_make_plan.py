"""make_plan's compiled assembly (plan.assemble) against the plain numpy definition, on fresh random
plans: the drops, the five memory terms and the peak, and Plan.check's verdict for broken counts.

Layouts: owners in columns 0..E-1 then replicas (fixed, UltraEP, LRMoE), SYMI's contiguous slots
(an expert's instances side by side: no identity prefix), a shuffled column order, one rank, one
expert, empty columns and all-zero demand."""
from __future__ import annotations

import numpy as np
import pytest

from lrmoe.planning.memory import memory_constants
from lrmoe.planning.plan import Cluster, Instances, ModelDims, make_plan

DIMS = ModelDims(hidden=64, intermediate=32, num_experts=8, top_k=2, dtype_bytes=2, grad_bytes=4,
                 optimizer_bytes_per_param=0)


def dims_for(E: int) -> ModelDims:
    return ModelDims(hidden=DIMS.hidden, intermediate=DIMS.intermediate, num_experts=E, top_k=min(2, E),
                     dtype_bytes=2, grad_bytes=4, optimizer_bytes_per_param=0)


def layout(kind: str, G: int, E: int, rng):
    """(expert_N, rank_N, slot_N, is_replica_N) of a valid layout of the given kind."""
    epr = E // G
    if kind == "symi":  # contiguous slots: expert e's instances side by side, the first its primary
        counts = 1 + rng.integers(0, 3, E)
        expert_N = np.repeat(np.arange(E), counts)
        is_rep = np.r_[[k > 0 for c in counts for k in range(c)]].astype(bool)
        N = expert_N.size
        S = -(-N // G)
        j = np.arange(N)
        return expert_N, j // S, j % S, is_rep
    # owners first (expert e on rank e // epr, slot e % epr), then replicas on other ranks
    expert_N, rank_N, slot_N, is_rep = list(range(E)), [e // epr for e in range(E)], [e % epr for e in range(E)], [False] * E
    used = np.full(G, epr)
    for e in rng.permutation(E)[: rng.integers(0, E + 1)]:
        for r in rng.permutation(G)[: rng.integers(0, G)]:
            if r != e // epr:
                expert_N.append(e), rank_N.append(r), slot_N.append(used[r]), is_rep.append(True)
                used[r] += 1
    cols = [np.array(x) for x in (expert_N, rank_N, slot_N, is_rep)]
    if kind == "shuffled":  # the same instances, columns in a random order (owners not first)
        perm = rng.permutation(len(expert_N))
        cols = [c[perm] for c in cols]
    return tuple(cols)


def random_plan(kind: str, G: int, E: int, rng, *, zero_demand=False):
    expert_N, rank_N, slot_N, is_rep = layout(kind, G, E, rng)
    N = expert_N.size
    demand = np.zeros((G, E), np.int64) if zero_demand else rng.integers(0, 50, (G, E))
    demand[:, rng.integers(0, E)] = 0  # an empty expert
    send = np.zeros((G, N), np.int64)
    for g in range(G):
        for e in range(E):  # a random split of what the source sends of e over e's instances, some dropped
            cols = np.flatnonzero(expert_N == e)
            sent = rng.integers(0, demand[g, e] + 1) if rng.random() < 0.3 else demand[g, e]
            if sent:
                send[g, cols] = rng.multinomial(sent, np.full(cols.size, 1.0 / cols.size))
    quota = np.minimum(send, rng.integers(0, 60, send.shape))
    return demand, send, quota, (expert_N, rank_N, slot_N, is_rep)


def reference(demand, send, quota, inst, G, E, consts):
    """The plain definition: drops per (source, expert) and the memory terms (memory.py's docstring)."""
    expert_N, rank_N, _, is_rep = inst
    dropped = demand.copy()
    for n in range(expert_N.size):
        dropped[:, expert_N[n]] -= send[:, n]
    owner_b, replica_b, dispatch_b, saved_b, output_b, backward_b = consts
    per_rank = lambda w: np.bincount(rank_N, weights=w, minlength=G).astype(np.int64)  # noqa: E731
    base = owner_b * np.bincount(rank_N[~is_rep], minlength=G)
    reps = replica_b * np.bincount(rank_N[is_rep], minlength=G)
    dispatch = dispatch_b * (send.sum(1) + quota.sum(1))
    saved = saved_b * per_rank(send.sum(0)) + output_b * demand.sum(1)
    backward = backward_b * per_rank(quota.sum(0))
    total = base + reps + dispatch + saved + backward
    return dropped, (base, reps, dispatch, saved, backward), int(total.max(initial=0))


@pytest.mark.parametrize("kind", ["owners", "symi", "shuffled"])
@pytest.mark.parametrize("G,E", [(1, 1), (1, 5), (2, 4), (4, 8), (3, 9), (8, 16)])
@pytest.mark.parametrize("separate_quota", [False, True])
def test_make_plan_matches_definition(kind, G, E, separate_quota):
    rng = np.random.default_rng([G, E, separate_quota, len(kind)])
    dims = dims_for(E)
    for trial in range(6):
        demand, send, quota, inst = random_plan(kind, G, E, rng, zero_demand=trial == 0)
        S = int(max(inst[2].max() + 1, E // G))
        cluster = Cluster(num_ranks=G, slots_per_rank=S)
        q = quota if separate_quota else None
        plan = make_plan("test", demand, cluster, dims, 1e18, Instances(*inst), send, q)
        dropped, terms, peak = reference(demand, send, send if q is None else quota, inst, G, E,
                                         memory_constants(dims, True))
        np.testing.assert_array_equal(plan.dropped_GE, dropped)
        m = plan.memory
        for got, want in zip((m.base_G, m.replicas_G, m.dispatch_G, m.saved_G, m.backward_G), terms):
            np.testing.assert_array_equal(got, want)
        assert m.peak == peak
        plan.check()  # the compiled verdict agrees with Plan.check


@pytest.mark.parametrize("kind", ["owners", "symi", "shuffled"])
def test_make_plan_refuses_broken_counts(kind):
    """A negative send, more sent than the demand (a negative drop) and a quota over its send are
    refused with Plan.check's messages, wherever in the matrix they are."""
    rng = np.random.default_rng(len(kind))
    G, E = 4, 8
    dims = dims_for(E)
    for _ in range(10):
        demand, send, quota, inst = random_plan(kind, G, E, rng)
        cluster = Cluster(num_ranks=G, slots_per_rank=int(max(inst[2].max() + 1, E // G)))
        g, n = rng.integers(0, G), rng.integers(0, send.shape[1])
        bad = send.copy()
        bad[g, n] = -1
        with pytest.raises(ValueError, match="negative send or dropped counts"):
            make_plan("test", demand, cluster, dims, 1e18, Instances(*inst), bad)
        over = send.copy()
        over[g, n] += demand[g, inst[0][n]] - send[g, np.flatnonzero(inst[0] == inst[0][n])].sum() + 1
        with pytest.raises(ValueError, match="negative send or dropped counts"):
            make_plan("test", demand, cluster, dims, 1e18, Instances(*inst), over)
        q = np.minimum(quota, send)
        q[g, n] = send[g, n] + 1
        with pytest.raises(ValueError, match=r"backward quotas must be in \[0, send\]"):
            make_plan("test", demand, cluster, dims, 1e18, Instances(*inst), send, q)
