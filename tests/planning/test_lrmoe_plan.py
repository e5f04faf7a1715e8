"""LRMoE's joint quota + placement planner (lrmoe.planning.lrmoe_plan): exact quotas without
memory pressure, the rounding of instance quotas against the threshold, retained demand driving
replicas, the threshold search with a replica floor (min_rows > 1), and fitting the memory budget
by raising the threshold before shrinking quotas, and shrinking before splitting."""
import itertools
import math
from fractions import Fraction

import numpy as np
import pytest

import lrmoe.planning.lrmoe_plan as L
from lrmoe.planning import Cluster, ModelDims
from lrmoe.planning.plan import largest_remainder
from lrmoe.planning.policies import plan_placement
from lrmoe.planning.quota import compute_quota, retained_total
from planner_cases import KINDS, SEEDS, make_demand, plan


# ----------------------------------------------------------------------------- LRMoE
@pytest.mark.parametrize("policy", ["waterfill", "proportional"])
@pytest.mark.parametrize("kind", KINDS)
def test_lrmoe_keeps_exactly_the_quota_without_pressure(kind, policy):
    for seed in SEEDS:
        for rho in (0.0, 0.1, 0.3):
            d = make_demand(kind, seed)
            p = plan("lrmoe", d, drop_ratio=rho, quota_policy=policy)
            np.testing.assert_array_equal(p.kept_E, compute_quota(d.sum(0), rho, policy))
            assert p.kept_N.sum() == retained_total(int(d.sum()), rho)
            assert p.dropped_GE.sum() == 0  # the forward is complete
            # balancing never makes the slowest rank slower than fixed ownership with the same quotas
            fixed_cost = np.bincount(np.arange(8) // 2, weights=d.sum(0) + 2 * p.kept_E, minlength=4)
            assert p.cost_G().max() <= fixed_cost.max()
            assert p.cost_G().max() <= p.info["threshold"] + 2 * len(p.instances)  # rounding of kept rows


def _roundings(shares):
    """Every way to round the exact shares (Fractions) of one expert's instances to integers,
    each floor or ceil, keeping the expert's total (brute force)."""
    floors = [math.floor(x) for x in shares]
    units = round(sum(shares)) - sum(floors)
    frac = [j for j, x in enumerate(shares) if x != math.floor(x)]
    for pick in itertools.combinations(frac, units):
        yield [f + (j in pick) for j, f in enumerate(floors)]


def test_lrmoe_rounding_of_instance_quotas_meets_the_threshold():
    """A counter-example to plain largest-remainder rounding (it gave rank 0 a cost of 23 with tau = 22),
    then random small cases against a brute force over every rounding of the instances' shares."""
    d = np.array([[3, 6], [9, 3]])
    p = plan_placement("lrmoe", d, Cluster(2, 2), ModelDims(8, 4, 2, 2, 8), math.inf, drop_ratio=0.5)
    assert p.cost_G(2.0).max() <= p.info["threshold"] == 22
    rng = np.random.default_rng(7)
    checked = flow_cases = 0
    for _ in range(300):  # small demands and large drop ratios make rounding matter (~5 % of cases)
        G = int(rng.integers(2, 5))
        E = G * int(rng.integers(1, 3))
        d = rng.integers(0, 6, (G, E))
        d[:, int(rng.integers(E))] += rng.integers(0, 15, G)  # a hot expert, so replicas appear
        rho = float(rng.choice([0.3, 0.5, 0.7]))
        cluster, dims = Cluster(G, E // G + 2), ModelDims(8, 4, E, 2, 8)
        p = plan_placement("lrmoe", d, cluster, dims, math.inf, drop_ratio=rho)
        tau = p.info["threshold"]
        rows_G = p.rows_G.astype(float)
        # every instance within 1 of its exact share, expert totals exact
        per_expert = [np.flatnonzero(p.expert_N == e) for e in range(E)]
        options = []
        for e, cols in enumerate(per_expert):
            dE = int(p.rows_N[cols].sum())
            shares = [Fraction(int(p.kept_E[e]) * int(p.rows_N[n]), dE) if dE else Fraction(0) for n in cols]
            assert all(abs(p.kept_N[n] - x) < 1 for n, x in zip(cols, shares))
            options.append(list(_roundings(shares)))
        best = math.inf
        for combo in itertools.product(*options):
            K = np.zeros(G)
            for cols, parts in zip(per_expert, combo):
                np.add.at(K, p.rank_N[cols], parts)
            best = min(best, (rows_G + 2 * K).max())
        got = p.cost_G(2.0).max()
        lr_kept = [largest_remainder(int(p.kept_E[e]), p.rows_N[cols]) for e, cols in enumerate(per_expert)]
        K_lr = np.zeros(G)
        for cols, parts in zip(per_expert, lr_kept):
            np.add.at(K_lr, p.rank_N[cols], parts)
        if (rows_G + 2 * K_lr).max() <= tau:  # largest remainder is kept when it meets tau
            assert all((p.kept_N[cols] == parts).all() for cols, parts in zip(per_expert, lr_kept))
        else:  # otherwise the smallest achievable maximum (within tau whenever any rounding is)
            assert got == best, (d.tolist(), rho, got, best)
            flow_cases += 1
        assert got <= tau or best > tau
        checked += 1
    assert checked == 300 and flow_cases >= 5


def test_lrmoe_retained_demand_drives_replicas():
    """The paper's figure: loads [4, 2, 3]; after trimming, the hot expert needs no replica."""
    d = np.array([[2, 1, 1], [1, 1, 1], [1, 0, 1]])
    dims, cluster = ModelDims(64, 32, 3), Cluster(3, 2)
    full = plan_placement("lrmoe", d, cluster, dims, math.inf)
    trimmed = plan_placement("lrmoe", d, cluster, dims, math.inf, drop_ratio=1 / 3)
    assert full.is_replica_N.sum() == 1 and full.instances[3].expert == 0
    np.testing.assert_array_equal(trimmed.kept_E, [2, 2, 2])
    assert trimmed.is_replica_N.sum() == 0
    for seed in SEEDS:
        d = make_demand("skewed", seed)
        n_replicas = [plan("lrmoe", d, drop_ratio=rho).is_replica_N.sum() for rho in (0.5, 0.0)]
        assert n_replicas[0] <= n_replicas[1]


@pytest.mark.parametrize("kind", KINDS)
def test_lrmoe_never_exceeds_budget_nor_keeps_too_few(kind):
    shrunk = 0
    for seed in SEEDS:
        d = make_demand(kind, seed)
        free = plan("lrmoe", d)
        static = free.memory.base_G.max()
        for frac in (0.95, 0.8, 0.6, 0.4):
            budget = static + frac * (free.memory.peak - static)
            p = plan("lrmoe", d, budget)
            assert p.fits and p.memory.peak <= budget
            assert p.dropped_GE.sum() == 0
            kept, P = int(p.kept_N.sum()), int(p.demand_GE.sum())
            if not p.over_budget:  # placement alone made it fit: the quota is untouched
                assert p.fallback == "none" and kept == retained_total(P, 0.2)
            elif p.fallback == "shrink_quota":  # keeping one more pair would not fit
                assert kept < retained_total(P, 0.2)
                rho = 1 - (kept + 1) / P
                more = plan("lrmoe", d, budget, drop_ratio=rho, max_drop_ratio=rho, fallback="oom")
                assert int(more.kept_N.sum()) == kept + 1 and more.over_budget and not more.fits
                shrunk += 1
            else:
                assert p.fallback.startswith("split_microbatch:") and kept <= retained_total(P, 0.2)
        oom = plan("lrmoe", d, static * 0.5)
        assert oom.fallback == "oom" and oom.over_budget and not oom.fits
    assert shrunk > 0


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
