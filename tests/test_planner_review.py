"""Placement-planner cases from a review pass (each test failed before its fix): LRMoE's threshold
search with a replica floor (min_rows > 1), LRMoE fitting the memory budget by raising the threshold
before shrinking quotas or splitting, UltraEP's EPLB-like fallback across fast domains, and SYMI's
slot-count ties in exact arithmetic."""
import math
from fractions import Fraction

import numpy as np
import pytest

import lrmoe.planning.lrmoe_plan as L
from baselines.symi import symi_slot_counts
from lrmoe.planning import Cluster, ModelDims
from lrmoe.planning.policies import plan_placement


# --- LRMoE: the threshold with a replica floor --------------------------------------------------

def test_lrmoe_min_rows_hand_case():
    """min_rows=3 used to end at tau 84 (no replica) although a 4-row replica meets tau 72."""
    d = np.array([[5, 9], [15, 19]])
    cluster, dims = Cluster(2, 2), ModelDims(8, 4, 2, 2)
    for min_rows in (1, 3):
        p = plan_placement("lrmoe", d, cluster, dims, math.inf, min_rows=min_rows)
        assert p.info["threshold"] == 72, min_rows
        assert (p.rows_N[p.is_replica_N] >= min_rows).all()


def _greedy_args(d_GE, cluster, dims, min_rows, drop_ratio=0.0):
    """The arguments _plan_with_quota passes to _greedy (no budget)."""
    G, E = d_GE.shape
    epr = E // G
    d_E = d_GE.sum(0)
    q_E = L._quota(d_E, L.retained_total(int(d_E.sum()), drop_ratio), "waterfill", {}, drop_ratio)
    frac = np.divide(q_E, d_E, out=np.zeros(E), where=d_E > 0)
    w_E = np.where(d_E > 0, 1.0 + 2.0 * frac, 0.0)
    L_E = d_E + 2.0 * q_E
    owner = np.arange(E) // epr
    cost = np.bincount(owner, weights=L_E, minlength=G)
    return cost, (cost, np.zeros(G), d_E, w_E, L_E, np.zeros(E), owner,
                  np.full(G, cluster.slots_per_rank - epr), cluster.domain_G, 0, math.inf, min_rows)


@pytest.mark.parametrize("min_rows", [2, 3, 10])
def test_lrmoe_threshold_is_the_smallest_the_greedy_meets(min_rows):
    """Brute force over every integer tau: the planner's threshold is the smallest one the greedy
    meets, also with a floor on replica rows."""
    rng = np.random.default_rng(min_rows)
    for _ in range(40):
        G = int(rng.integers(2, 4))
        E = G * int(rng.integers(1, 3))
        d = rng.integers(0, 25, (G, E))
        d[:, rng.integers(E)] += rng.integers(0, 60, G)
        cluster, dims = Cluster(G, E // G + 1), ModelDims(8, 4, E, 2)
        p = plan_placement("lrmoe", d, cluster, dims, math.inf, min_rows=min_rows, drop_ratio=0.2)
        cost, args = _greedy_args(d, cluster, dims, min_rows, 0.2)
        lo, top = math.floor(cost.sum() / G), math.ceil(cost.max())
        smallest = next(t for t in range(lo, top + 1) if L._greedy(t, *args) is not None)
        assert p.info["threshold"] == smallest, d.tolist()


# --- LRMoE: memory before quotas --------------------------------------------------------------

@pytest.mark.parametrize("d, S, budget", [
    ([[2, 9, 48, 0, 4, 7], [1, 6, 31, 9, 11, 4], [5, 5, 24, 2, 5, 0]], 3, 36460),
    ([[2, 0, 46], [0, 2, 10], [5, 2, 36]], 2, 22060),
    ([[9, 35, 5], [0, 25, 8], [4, 20, 11]], 2, 23011),
])
def test_lrmoe_raises_the_threshold_to_fit_memory_before_shrinking_quotas(d, S, budget):
    """Over the budget at the cost-optimal threshold, a higher threshold leaves the slack to move
    rows off the ranks over the budget: the plan fits with the full quota (it used to shrink it)."""
    d = np.array(d)
    G, E = d.shape
    cluster, dims = Cluster(G, S), ModelDims(16, 8, E, 2)
    p = plan_placement("lrmoe", d, cluster, dims, budget, drop_ratio=0.2)
    assert p.fallback == "none" and p.fits and p.memory.peak <= budget
    assert p.kept_N.sum() == L.retained_total(int(d.sum()), 0.2)
    assert p.info["threshold"] > p.info["threshold_cost"]  # the cost-optimal threshold did not fit


def test_lrmoe_splits_only_when_shrinking_cannot_fit():
    """A microbatch split is the last resort: whenever LRMoE splits, even the largest drop ratio
    it may shrink to (max_drop_ratio) does not fit unsplit."""
    rng = np.random.default_rng(7)
    splits = 0
    for _ in range(60):
        G = int(rng.integers(2, 4))
        E = G * int(rng.integers(1, 3))
        d = rng.integers(0, 12, (G, E))
        d[:, rng.integers(E)] += rng.integers(0, 40, G)
        cluster, dims = Cluster(G, E // G + int(rng.integers(0, 3))), ModelDims(16, 8, E, 2)
        free = plan_placement("lrmoe", d, cluster, dims, math.inf, drop_ratio=0.2)
        static = free.memory.base_G.max()
        for frac in (0.5, 0.3, 0.1):
            budget = static + frac * (free.memory.peak - static)
            p = plan_placement("lrmoe", d, cluster, dims, budget, drop_ratio=0.2)
            assert p.fits or p.fallback == "oom"
            if p.fallback.startswith("split"):
                splits += 1
                most = plan_placement("lrmoe", d, cluster, dims, budget, drop_ratio=0.9, fallback="oom")
                assert not most.fits, (d.tolist(), frac)
    assert splits > 0  # the scan reaches the split fallback


# --- UltraEP's EPLB-like fallback across fast domains -------------------------------------------

def test_ultraep_greedy_uses_free_slots_of_every_domain():
    """Replicas were counted against the global free slots: the full domain (0, 1) took them all,
    they were dropped in placement, and the straggler's domain (2, 3) kept its free slots."""
    load = [60, 60, 20, 60, 60, 20, 50, 50, 50, 0, 0, 0]
    d = np.vstack([load, np.zeros((3, 12), dtype=int)])
    cluster = Cluster(4, 4, fast_domains=((0, 1), (2, 3)))
    p = plan_placement("ultraep_greedy", d, cluster, ModelDims(16, 8, 12, 1), math.inf)
    hosts = {(inst.expert, inst.rank) for inst in p.instances if inst.is_replica}
    assert (6, 3) in hosts  # the straggler's hottest expert, on the idle rank of its domain
    assert p.rows_G[2] < 150  # the straggler's load went down


# --- SYMI slot counts: exact ties -------------------------------------------------------------

def symi_exact(pop, slots):
    """SYMI's published allocation in rational arithmetic (ties to the lower index)."""
    if sum(pop) == 0:
        pop = [1] * len(pop)
    goal = [Fraction(p, sum(pop)) * slots for p in pop]
    cnt = [max(math.floor(g), 1) for g in goal]
    diff = [c - g for c, g in zip(cnt, goal)]
    while sum(cnt) > slots:
        i = max((j for j in range(len(cnt)) if cnt[j] > 1), key=lambda j: (diff[j], -j))
        cnt[i] -= 1
        diff[i] -= 1
    while sum(cnt) < slots:
        i = min(range(len(cnt)), key=lambda j: (diff[j], j))
        cnt[i] += 1
        diff[i] += 1
    return cnt


def test_symi_slot_count_ties_go_to_the_lower_index():
    assert symi_slot_counts([1, 7, 1], 12).tolist() == [2, 9, 1]  # float rounding gave [1, 10, 1]
    assert symi_slot_counts([13, 32, 11], 8).tolist() == [2, 5, 1]  # float rounding gave [2, 4, 2]
    rng = np.random.default_rng(5)
    for _ in range(2000):
        E = int(rng.integers(1, 9))
        slots = int(rng.integers(E, 3 * E + 4))
        pop = rng.integers(0, 50, E).tolist()
        if rng.random() < 0.3:
            pop[rng.integers(E)] += int(rng.integers(100, 10000))
        assert symi_slot_counts(pop, slots).tolist() == symi_exact(pop, slots), (pop, slots)
