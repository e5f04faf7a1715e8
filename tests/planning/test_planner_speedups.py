"""The vectorised planner helpers equal their plain-loop definitions on fresh random inputs
(empty experts, one hot expert, odd sizes), and the fast paths of the LRMoE planner give the
plans of the reference planners (lrmoe.planning.reference, the code before the speed-ups)."""
import math

import numpy as np
import pytest

from lrmoe.planning import Cluster, ModelDims
from lrmoe.planning import lrmoe_plan as L
from lrmoe.planning.plan import (largest_remainder, largest_remainder_cols, largest_remainder_groups, locality_split,
                                 locality_split_replicas)
from lrmoe.planning.policies import plan_placement
from lrmoe.planning.reference import reference_plan


def weights(rng, G, N, kind):
    w = rng.integers(0, 50, (G, N))
    if kind == "empty":
        w[:, rng.random(N) < 0.5] = 0
    elif kind == "hot":
        w[:, int(rng.integers(N))] += rng.integers(1000, 5000, G)
    elif kind == "ties":
        w = np.ones((G, N), dtype=np.int64) * rng.integers(0, 3)
    return w


KINDS = ("random", "empty", "hot", "ties")


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("kind", KINDS)
def test_largest_remainder_cols_equals_loop(seed, kind):
    rng = np.random.default_rng(seed)
    G, N = int(rng.integers(1, 10)), int(rng.integers(1, 40))
    w = weights(rng, G, N, kind)
    total = np.array([int(rng.integers(0, c + 1)) if c else 0 for c in w.sum(0)])
    got = largest_remainder_cols(total, w)
    want = np.stack([largest_remainder(int(t), w[:, n]) for n, t in enumerate(total)], 1)
    np.testing.assert_array_equal(got, want)


def test_largest_remainder_cols_refuses_zero_weights():
    with pytest.raises(ValueError, match="zero weights"):
        largest_remainder_cols([0, 3], np.array([[1, 0], [2, 0]]))
    np.testing.assert_array_equal(largest_remainder_cols([0, 0], np.zeros((3, 2), dtype=np.int64)), 0)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("kind", KINDS)
def test_largest_remainder_groups_equals_loop(seed, kind):
    rng = np.random.default_rng(seed)
    K = int(rng.integers(1, 20))
    group = np.sort(rng.integers(0, K, int(rng.integers(K, 4 * K + 1))))
    group = rng.permutation(group) if seed % 2 else group  # groups need not be contiguous
    w = weights(rng, 1, group.size, kind)[0]
    W = np.bincount(group, weights=w, minlength=K).astype(np.int64)
    total = np.array([int(rng.integers(0, c + 1)) if c else 0 for c in W])
    got = largest_remainder_groups(total, w, group)
    want = np.zeros_like(w)
    for k in range(K):
        idx = np.flatnonzero(group == k)
        if idx.size:
            want[idx] = largest_remainder(int(total[k]), w[idx])
    np.testing.assert_array_equal(got, want)


def random_layout(rng, G, E, kind):
    """Demand and an owner-plus-replicas layout (replicas on distinct non-owner ranks) with row quotas."""
    d = weights(rng, G, E, kind)
    epr = max(E // G, 1)
    owner = np.minimum(np.arange(E) // epr, G - 1)
    expert_N, rank_N = list(range(E)), list(owner)
    for e in range(E):
        others = [r for r in range(G) if r != owner[e]]
        k = int(rng.integers(0, min(len(others), 3) + 1))
        for r in rng.permutation(others)[:k]:
            expert_N.append(e)
            rank_N.append(int(r))
    expert_N, rank_N = np.array(expert_N), np.array(rank_N)
    quota_N = np.zeros(expert_N.size, dtype=np.int64)
    for e in range(E):
        cols = np.flatnonzero(expert_N == e)
        cuts = np.sort(rng.integers(0, int(d[:, e].sum()) + 1, cols.size - 1))
        quota_N[cols] = np.diff(np.r_[0, cuts, int(d[:, e].sum())])
    return d, expert_N, rank_N, quota_N


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("kind", KINDS)
def test_locality_split_replicas_equals_loop(seed, kind):
    rng = np.random.default_rng(100 + seed)
    G = int(rng.integers(1, 9))
    E = G * int(rng.integers(1, 5)) + (int(rng.integers(0, 3)) if G == 1 else 0)
    d, expert_N, rank_N, quota_N = random_layout(rng, G, E, kind)
    got = locality_split_replicas(d, expert_N, rank_N, quota_N)
    want = np.zeros_like(got)
    for e in range(E):
        cols = np.flatnonzero(expert_N == e)
        want[:, cols] = locality_split(d[:, e], rank_N[cols], quota_N[cols])
    np.testing.assert_array_equal(got, want)


def test_locality_split_replicas_refuses_wrong_quotas():
    with pytest.raises(ValueError, match="quotas sum"):
        locality_split_replicas(np.array([[3, 1]]), [0, 1], [0, 0], [2, 1])


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("kind", KINDS)
def test_instance_quotas_flat_equals_lists(seed, kind):
    rng = np.random.default_rng(200 + seed)
    G = int(rng.integers(1, 9))
    E = G * int(rng.integers(1, 5))
    d, expert_N, rank_N, rows_N = random_layout(rng, G, E, kind)
    d_E = d.sum(0)
    q_E = np.array([int(rng.integers(0, x + 1)) for x in d_E])
    cols_E = [np.flatnonzero(expert_N == e) for e in range(E)]
    F_G = np.bincount(rank_N, weights=rows_N, minlength=G)
    for bw in (0.0, 2.0):
        for tau in (0.0, float(F_G.max(initial=0.0)) + bw * float(q_E.max(initial=0)), math.inf):
            want = L._instance_quotas(q_E, [rows_N[c] for c in cols_E], [rank_N[c] for c in cols_E], G, bw, tau)
            got = L._instance_quotas_flat(q_E, rows_N, expert_N, rank_N, G, bw, tau)
            for c, k in zip(cols_E, want):
                np.testing.assert_array_equal(got[c], k)


def skewed_demand(rng, G, E, kind):
    pop = rng.lognormal(0, 1, E)
    if kind == "hot":
        pop[int(rng.integers(E))] *= 30
    d = np.stack([rng.multinomial(int(rng.integers(0, 400)), pop / pop.sum()) for _ in range(G)])
    if kind == "empty":
        d[:, rng.random(E) < 0.4] = 0
    return d


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("kind", ("random", "empty", "hot"))
def test_fast_planners_equal_reference(seed, kind):
    """lrmoe (both quota policies, pressured budgets), ultraep and ultraep_greedy: the plans of the
    frozen reference, field by field."""
    rng = np.random.default_rng(300 + seed)
    G, epr = (2, 4, 8)[seed % 3], int(rng.integers(1, 4))
    E = G * epr
    dims = ModelDims(hidden=32, intermediate=16, num_experts=E, top_k=2, optimizer_bytes_per_param=0)
    domains = None if G < 4 else (tuple(range(G // 2)), tuple(range(G // 2, G)))
    cl = Cluster(num_ranks=G, slots_per_rank=epr + int(rng.integers(0, 4)), fast_domains=domains)
    d = skewed_demand(rng, G, E, kind)
    peak = plan_placement("lrmoe", d, cl, dims, math.inf).memory.peak
    for frac in (math.inf, 0.95, 0.8, 0.6):
        budget = frac * max(peak, 1)
        for name, opts in (("lrmoe", {"drop_ratio": 0.1}), ("lrmoe", {"quota_policy": "proportional"}),
                           ("ultraep", {"min_tokens": 4}), ("ultraep_greedy", {})):
            p = plan_placement(name, d, cl, dims, budget, **opts)
            r = reference_plan(name, d, cl, dims, budget, **opts)
            for a in ("send_GN", "backward_quota_GN", "dropped_GE", "expert_N", "rank_N", "is_replica_N"):
                np.testing.assert_array_equal(getattr(p, a), getattr(r, a), err_msg=f"{name} {opts} {frac} {a}")
            np.testing.assert_array_equal(p.memory.total_G, r.memory.total_G)
            assert (p.fallback, p.num_splits, p.over_budget) == (r.fallback, r.num_splits, r.over_budget)
