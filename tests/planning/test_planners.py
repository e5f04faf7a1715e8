"""Placement planners: the interface, shared invariants, each baseline's defining property
(Megatron-LM fixed ownership, SYMI, UltraEP), budgets and fallbacks. LRMoE's planner:
test_lrmoe_plan.py."""
import math
from fractions import Fraction

import numpy as np
import pytest

from baselines.megatron import megatron_capacity
from baselines.symi import SymiState, symi_slot_counts
from baselines.ultraep import ultraep_feasible, ultraep_threshold
from lrmoe.planning import Cluster, ModelDims
from lrmoe.planning.policies import placement_policies, plan_placement, register_placement, unregister_placement
from lrmoe.planning.memory import instance_bytes
from planner_cases import CLUSTER, DIMS, DROPLESS, KINDS, SEEDS, make_demand, plan


def expected_memory(p, dims=DIMS, optimizer_on_gpu=True):
    """Plain-loop oracle of the memory model (docs/placement.md)."""
    H, I, b = dims.hidden, dims.intermediate, dims.dtype_bytes
    P = 3 * H * I
    G = p.demand_GE.shape[0]
    out = np.zeros(G, dtype=np.int64)
    for n, inst in enumerate(p.instances):
        per_param = b + dims.grad_bytes
        if optimizer_on_gpu and not inst.is_replica:
            per_param += dims.optimizer_bytes_per_param
        out[inst.rank] += P * per_param
        out[inst.rank] += p.send_GN[:, n].sum() * (H + 2 * I) * b  # expert side: X, GU per received row
        out[inst.rank] += p.backward_quota_GN[:, n].sum() * (3 * H + 6 * I) * b
    out += 2 * H * b * (p.send_GN.sum(1) + p.backward_quota_GN.sum(1))
    out += H * b * p.demand_GE.sum(1)  # token side: the combined outputs O of every routed pair
    return out


# ----------------------------------------------------------------------------- interface
def test_registry_lists_builtins_and_rejects_unknown():
    assert {"fixed", "symi", "ultraep", "ultraep_greedy", "lrmoe"} <= set(placement_policies())
    with pytest.raises(ValueError, match="unknown placement policy 'nope'.*fixed"):
        plan_placement("nope", np.zeros((4, 8)), CLUSTER, DIMS, 1e9)


def test_register_custom_policy():
    calls = []

    @register_placement("mine")
    def mine(demand_GE, cluster, dims, budget_bytes, *, state=None, knob=1):
        calls.append(knob)
        return plan_placement("fixed", demand_GE, cluster, dims, budget_bytes)

    try:
        assert "mine" in placement_policies()
        plan_placement("mine", np.ones((4, 8), dtype=int), CLUSTER, DIMS, 1e9, knob=3)
        assert calls == [3]
        with pytest.raises(ValueError, match=r"unknown options \['other'\]; accepted: \['knob'\]"):
            plan_placement("mine", np.ones((4, 8), dtype=int), CLUSTER, DIMS, 1e9, other=1)
        with pytest.raises(ValueError, match="'mine' is already registered.*override=True"):
            register_placement("mine", lambda *a, **k: None)
        with pytest.raises(ValueError, match="'fixed' is already registered"):
            register_placement("fixed", mine)
    finally:
        unregister_placement("mine")
    assert "mine" not in placement_policies()


@pytest.mark.parametrize("args, match", [
    (dict(d=np.ones((4, 7))), r"shape \[G=4, E=8\]"),
    (dict(d=np.ones(8)), r"shape \[G=4, E=8\]"),
    (dict(d=-np.ones((4, 8))), ">= 0"),
    (dict(d=np.full((4, 8), 0.5)), "whole-number"),
    (dict(d=np.ones((4, 8), dtype=bool)), "integer counts"),
    # over 2^31 routed pairs: in total (int64 and float), in one entry, in one far past int64 (float)
    (dict(d=np.full((4, 8), 2**31 // 32 + 1)), r"holds 2,147,483,680 routed pairs; the planners support at most "
                                                r"2,147,483,648 per MoE layer"),
    (dict(d=np.full((4, 8), 2**31 // 32 + 1, dtype=np.float64)), "holds 2,147,483,680 routed pairs"),
    (dict(d=np.eye(4, 8, dtype=np.int64) * 2**40), "holds 4,398,046,511,104 routed pairs"),
    (dict(d=np.eye(4, 8) * 1e30), r"holds 4,000,000,000,000,000,079,538,499,354,624 routed pairs"),
    (dict(d=np.full((4, 8), 2**59)), r"holds 18,446,744,073,709,551,616 routed pairs"),  # the int64 sum wraps to 0
    (dict(budget=0), "budget_bytes must be a number > 0"),
    (dict(budget=-5.0), "budget_bytes must be a number > 0"),
    (dict(budget=float("nan")), "budget_bytes must be a number > 0"),
    (dict(cluster=Cluster(3, 4)), "divisible"),
    (dict(cluster=Cluster(4, 4), dims=ModelDims(64, 32, 6)), "divisible"),
    (dict(cluster=Cluster(4, 1)), "slots_per_rank"),
    (dict(fallback="retry"), "fallback must be one of"),
])
@pytest.mark.parametrize("name", ["fixed", "ultraep", "lrmoe"])
def test_bad_inputs(name, args, match):
    dims = args.get("dims", DIMS)
    cluster = args.get("cluster", CLUSTER)
    d = args.get("d", np.ones((cluster.num_ranks, dims.num_experts), dtype=int))
    kw = {"fallback": args["fallback"]} if "fallback" in args else {}
    if name == "lrmoe" and "fallback" in args:
        match = "fallback must be 'split' or 'oom'"
    with pytest.raises(ValueError, match=match):
        plan(name, d, args.get("budget", 1e9), cluster=cluster, dims=dims, **kw)


def test_bad_descriptions_and_options():
    with pytest.raises(ValueError, match="partition ranks 0..3"):
        Cluster(4, 2, fast_domains=((0, 1), (1, 2, 3)))
    with pytest.raises(ValueError, match="num_ranks must be an integer >= 1"):
        Cluster(0, 2)
    with pytest.raises(ValueError, match="hidden must be an integer >= 1"):
        ModelDims(0, 4, 4)
    d = np.ones((4, 8), dtype=int)
    with pytest.raises(ValueError, match="SYMI needs at least one slot per expert"):
        plan("symi", d, cluster=Cluster(4, 1))
    with pytest.raises(ValueError, match="SymiState"):
        plan("symi", d, state=[1, 2])
    with pytest.raises(ValueError, match="capacity_factor"):
        plan("fixed", d, capacity_factor=0)
    with pytest.raises(ValueError, match="drop_ratio must be a number in"):
        plan("lrmoe", d, drop_ratio=1.0)
    with pytest.raises(ValueError, match="unknown quota policy"):
        plan("lrmoe", d, quota_policy="nope")
    with pytest.raises(ValueError, match=r"redundant_slots must be an integer in \[0, S - E/G = 2\]"):
        plan("ultraep", d, redundant_slots=3)
    with pytest.raises(ValueError, match="min_tokens"):
        plan("ultraep", d, min_tokens=0)


def test_plan_check_refuses_inconsistent_instances():
    """Plan.check names each inconsistency: bad expert / rank / slot, two instances in one slot,
    an expert without an instance, two owners of one expert."""
    import dataclasses
    from lrmoe.planning.plan import Instance
    p = plan("ultraep", make_demand("skewed", 0))
    assert p.check() is p
    inst = list(p.instances)
    last = inst[-1]
    bad = {
        "expert out of range": Instance(8, last.rank, last.slot, last.is_replica),
        "negative expert": Instance(-1, last.rank, last.slot, last.is_replica),
        "rank out of range": Instance(last.expert, 4, last.slot, last.is_replica),
        "negative slot": Instance(last.expert, last.rank, -1, last.is_replica),
        "slot taken": Instance(last.expert, inst[0].rank, inst[0].slot, last.is_replica),
    }
    for why, b in bad.items():
        with pytest.raises(ValueError, match="valid experts, ranks and distinct slots"):
            dataclasses.replace(p, instances=tuple(inst[:-1] + [b])).check()
            pytest.fail(f"accepted: {why}")
    extra_owner = Instance(inst[0].expert, inst[0].rank, 99, False)  # expert 0 owned twice, all else intact
    zero = np.zeros((p.send_GN.shape[0], 1), dtype=np.int64)
    with pytest.raises(ValueError, match="at most one owner"):
        dataclasses.replace(p, instances=tuple(inst + [extra_owner]), send_GN=np.hstack([p.send_GN, zero]),
                            backward_quota_GN=np.hstack([p.backward_quota_GN, zero])).check()
    none_of_1 = [i if i.expert != 1 else Instance(0, i.rank, i.slot, True) for i in inst]
    with pytest.raises(ValueError, match="every expert needs an instance"):
        dataclasses.replace(p, instances=tuple(none_of_1)).check()


# ----------------------------------------------------------------------------- shared invariants
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ["fixed", "symi", "ultraep", "ultraep_greedy", "lrmoe"])
def test_every_pair_assigned_once_and_memory_reported(name, kind):
    for seed in SEEDS:
        d = make_demand(kind, seed)
        p = plan(name, d)
        p.check()
        assert p.fallback == "none" and not p.over_budget and p.fits and p.num_splits == 1
        ex = p.expert_N
        for e in range(8):  # every pair is sent to exactly one instance of its expert, or dropped
            np.testing.assert_array_equal(p.send_GN[:, ex == e].sum(1) + p.dropped_GE[:, e], d[:, e])
        if name in DROPLESS:
            assert p.dropped_GE.sum() == 0
        if name != "lrmoe":
            np.testing.assert_array_equal(p.backward_quota_GN, p.send_GN)  # baselines keep everything
        assert (np.bincount(p.rank_N, minlength=4) <= CLUSTER.slots_per_rank).all()
        np.testing.assert_array_equal(p.memory.total_G, expected_memory(p, optimizer_on_gpu=name != "symi"))


def test_memory_terms_by_hand():
    from lrmoe.experts import buffer_bytes

    dims = ModelDims(hidden=16, intermediate=8, num_experts=2, top_k=1, dtype_bytes=2, grad_bytes=4,
                     optimizer_bytes_per_param=12)
    d = np.array([[3, 1], [0, 2]])
    p = plan_placement("fixed", d, Cluster(2, 1), dims, math.inf)
    params = 3 * 16 * 8
    np.testing.assert_array_equal(p.memory.base_G, [params * 18, params * 18])
    np.testing.assert_array_equal(p.memory.dispatch_G, [2 * 16 * 2 * (4 + 4), 2 * 16 * 2 * (2 + 2)])
    # expert side X + GU (H + 2I) per received row (3 each); token side O (H) per own pair (4 and 2)
    np.testing.assert_array_equal(p.memory.saved_G, [(16 + 16) * 2 * 3 + 16 * 2 * 4, (16 + 16) * 2 * 3 + 16 * 2 * 2])
    np.testing.assert_array_equal(p.memory.backward_G, [buffer_bytes(3, 16, 8, 2)] * 2)
    assert instance_bytes(dims, replica=True) == params * 6
    assert p.memory.summary()["total"] == p.memory.peak == int(p.memory.total_G.max())


# ----------------------------------------------------------------------------- Megatron
@pytest.mark.parametrize("seed", SEEDS)
def test_fixed_equals_megatron_mapping(seed):
    G, E = 4, 8
    d = make_demand("random", seed)
    p = plan("fixed", d)
    layout = [(i.expert, i.rank, i.slot, i.is_replica) for i in p.instances]
    assert layout == [(e, e // 2, e % 2, False) for e in range(E)]
    np.testing.assert_array_equal(p.send_GN, d)
    for cf in (0.5, 1.0, 1.5):
        p = plan("fixed", d, capacity_factor=cf)
        cap = [math.ceil(d[r].sum() * cf / E) for r in range(G)]
        np.testing.assert_array_equal(megatron_capacity(d, cf), cap)
        np.testing.assert_array_equal(p.dropped_GE, np.maximum(d - np.array(cap)[:, None], 0))


# ----------------------------------------------------------------------------- SYMI
@pytest.mark.parametrize("pop, slots, expected", [
    ([6, 1, 1, 0], 8, [5, 1, 1, 1]),  # goal [6,1,1,0] -> cnt [6,1,1,1]; only expert 0 can give one back
    ([1, 1, 1, 1], 6, [2, 2, 1, 1]),  # goal 1.5 each -> [1,1,1,1]; argmin(diff) ties: lower index first
    ([10, 30, 60], 4, [1, 1, 2]),  # goal [0.4,1.2,2.4] -> floor(max(goal,1)) already sums to 4
    ([5, 3, 2], 5, [3, 1, 1]),  # goal [2.5,1.5,1] -> [2,1,1]; diff [-.5,-.5,0] -> expert 0
    ([40, 35, 20, 5], 8, [3, 3, 1, 1]),  # goal [3.2,2.8,1.6,.4] -> [3,2,1,1]; diff[1] = -.8 smallest
    ([1, 1, 1, 50, 47], 6, [1, 1, 1, 2, 1]),  # goal [.06,.06,.06,3,2.82] -> [1,1,1,3,2]: sum 8 > 6;
    # among cnt > 1 argmax diff: expert 3 (0 > -.82) -> 2 (diff -1); then expert 4 (-.82 > -1) -> 1
    ([0, 0, 0], 5, [2, 2, 1]),  # no popularity: uniform
])
def test_symi_slot_counts_hand_worked(pop, slots, expected):
    np.testing.assert_array_equal(symi_slot_counts(pop, slots), expected)


def test_symi_plans_from_previous_popularity():
    d_prev = np.zeros((4, 8), dtype=int)
    d_prev[:, 2] = 50
    d_prev[:, [0, 1, 3, 4, 5, 6, 7]] = 1
    d_now = make_demand("skewed", 7)
    first = plan("symi", d_prev)
    assert first.state is not None
    np.testing.assert_array_equal(first.info["slot_counts_E"], [2] * 8)  # no history: even placement
    np.testing.assert_array_equal(first.state.popularity_E, d_prev.sum(0))
    second = plan("symi", d_now, state=first.state)  # placement follows last step, not this one
    np.testing.assert_array_equal(second.info["slot_counts_E"], symi_slot_counts(d_prev.sum(0), 16))
    assert second.info["slot_counts_E"][2] == 9
    experts = [i.expert for i in second.instances]
    assert experts == sorted(experts)  # contiguous slots: replicas share a rank first
    assert [(i.rank, i.slot) for i in second.instances] == [(j // 4, j % 4) for j in range(16)]
    np.testing.assert_array_equal(second.state.popularity_E, d_now.sum(0))


@pytest.mark.parametrize("seed", SEEDS)
def test_symi_even_split_and_capacity(seed):
    d = make_demand("skewed", seed)
    state = SymiState(make_demand("random", seed + 100).sum(0))
    free = plan("symi", d, state=state, capacity_factor=None)
    assert free.dropped_GE.sum() == 0 and free.info["mode"] == "dropless"
    rows = free.rows_N
    for e in range(8):
        r = rows[free.expert_N == e]
        assert r.max() - r.min() <= 1  # an expert's pairs are split evenly over its slots
    capped = plan("symi", d, state=state)
    cap = math.ceil(d.sum() / 16)
    assert capped.info["capacity_rows"] == cap and capped.rows_N.max() <= cap
    np.testing.assert_array_equal(capped.rows_N, np.minimum(rows, cap))  # overflow dropped, nothing else
    assert capped.dropped_GE.sum() == np.maximum(rows - cap, 0).sum()


# SYMI slot counts: exact ties

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


def test_symi_plan_assembled_with_its_route_equals_make_plans_and_reports_a_broken_layout(monkeypatch):
    """SYMI assembles its plan in the routing's compiled call; make_plan builds the same plan from the
    same counts, and a layout the assembly refuses (two instances in one slot) gets make_plan's error."""
    import baselines.symi as symi
    from lrmoe.bench.planner_check import differences
    from lrmoe.planning.plan import Instances, make_plan

    cluster, dims = Cluster(num_ranks=4, slots_per_rank=4), ModelDims(hidden=64, intermediate=32, num_experts=8, top_k=2)
    d = np.random.default_rng(7).integers(0, 60, (4, 8))
    state = SymiState(np.random.default_rng(8).integers(1, 90, 8))
    plan = plan_placement("symi", d, cluster, dims, math.inf, state=state)
    same = make_plan("symi", d, cluster, dims, math.inf, plan.instances, plan.send_GN, optimizer_on_gpu=False,
                     info=plan.info, state=plan.state)
    assert differences(plan, same) == [] and plan.backward_quota_GN is plan.send_GN
    real = symi.symi_counts_layout

    def two_in_one_slot(*args):
        counts, inst = real(*args)
        slot_N = inst.slot_N.copy()
        slot_N[1] = slot_N[0]  # instances 0 and 1 share rank 0 (contiguous slots)
        return counts, Instances.trusted(inst.expert_N, inst.rank_N, slot_N, inst.is_replica_N)

    monkeypatch.setattr(symi, "symi_counts_layout", two_in_one_slot)
    with pytest.raises(ValueError, match="distinct slots"):
        plan_placement("symi", d, cluster, dims, math.inf, state=state)


# ----------------------------------------------------------------------------- UltraEP
def _brute_force_threshold(load, owner, free, domain, min_tokens):
    rank_load = np.bincount(owner, weights=load, minlength=len(free))
    lo, hi = math.ceil(rank_load.sum() / len(free)), int(rank_load.max())
    return next(t for t in range(lo, hi + 1) if ultraep_feasible(t, load, owner, free, domain, min_tokens) is not None)


@pytest.mark.parametrize("seed", range(8))
def test_ultraep_threshold_is_smallest_feasible(seed):
    rng = np.random.default_rng(seed)
    for _ in range(40):
        G = int(rng.integers(2, 6))
        epr = int(rng.integers(1, 4))
        load = rng.integers(0, 30, G * epr)
        if rng.random() < 0.6:
            load[rng.integers(G * epr)] += int(rng.integers(20, 150))
        owner = np.arange(G * epr) // epr
        free = np.full(G, int(rng.integers(0, 3)))
        domain = np.zeros(G, dtype=int) if rng.random() < 0.5 else np.arange(G) % 2
        min_tokens = int(rng.choice([1, 2, 5]))
        for fast in (True, False):
            tau, reps = ultraep_threshold(load, owner, free, domain, min_tokens, fast_path=fast)
            assert tau == _brute_force_threshold(load, owner, free, domain, min_tokens)
            assert reps == ultraep_feasible(tau, load, owner, free, domain, min_tokens)


def test_ultraep_literal_floor_is_not_monotone():
    """docs/placement.md: read literally, the min_tokens floor fails at a larger threshold."""
    load, owner, free, domain = np.array([7, 29, 5, 9]), np.arange(4), np.ones(4, dtype=int), np.zeros(4, dtype=int)
    assert ultraep_feasible(17, load, owner, free, domain, 10, overshoot=False) is not None
    assert ultraep_feasible(20, load, owner, free, domain, 10, overshoot=False) is None  # need 9 < 10
    assert ultraep_feasible(20, load, owner, free, domain, 10) is not None
    assert ultraep_threshold(load, owner, free, domain, 10, overshoot=False)[0] == 29  # binary search misses 17
    assert ultraep_threshold(load, owner, free, domain, 10)[0] == 17


@pytest.mark.parametrize("kind", KINDS)
def test_ultraep_plan_meets_threshold_with_constraints(kind):
    cluster = Cluster(4, 4, fast_domains=((0, 1), (2, 3)))
    for seed in SEEDS:
        d = make_demand(kind, seed)
        p = plan("ultraep", d, cluster=cluster)
        assert p.rows_G.max() <= p.info["threshold"]
        assert p.info["threshold"] == _brute_force_threshold(d.sum(0), np.arange(8) // 2, np.full(4, 2),
                                                              cluster.domain_G, 4)
        assert (p.num_replicas_G <= 2).all()
        rows, ex, rk = p.rows_N, p.expert_N, p.rank_N
        for n, inst in enumerate(p.instances):
            if not inst.is_replica:
                assert d[:, inst.expert].sum() == 0 or rows[n] >= 1  # the master keeps at least one token
                continue
            owner = inst.expert // 2
            assert cluster.domain_G[inst.rank] == cluster.domain_G[owner]  # inside the fast domain
            assert rows[n] >= 4  # min_tokens
            assert p.send_GN[inst.rank, n] == min(rows[n], d[inst.rank, inst.expert])  # locality first
        for e in range(8):
            assert len(set(rk[ex == e])) == (ex == e).sum()  # at most one copy per rank


@pytest.mark.parametrize("kind", KINDS)
def test_ultraep_greedy_even_split(kind):
    for seed in SEEDS:
        d = make_demand(kind, seed)
        p = plan("ultraep_greedy", d)
        assert (p.num_replicas_G <= 2).all()
        for e in range(8):
            r = p.rows_N[p.expert_N == e]
            assert r.max() - r.min() <= 1
        assert p.rows_G.max() <= plan("fixed", d).rows_G.max()


# UltraEP's EPLB-like fallback across fast domains

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


# ----------------------------------------------------------------------------- baseline fallbacks
@pytest.mark.parametrize("name", ["fixed", "symi", "ultraep", "ultraep_greedy"])
def test_baseline_fallbacks(name):
    for seed in SEEDS:
        d = make_demand("skewed", seed)
        free = plan(name, d)
        static = (free.memory.base_G + free.memory.replicas_G).max()
        budget = static + 0.5 * (free.memory.peak - static)
        split = plan(name, d, budget)
        n = split.num_splits
        assert split.over_budget and split.fits and split.fallback == f"split_microbatch:{n}" and n >= 2
        np.testing.assert_array_equal(split.demand_GE, -(-d // n))  # the largest of n pieces
        smaller = plan(name, -(-d // (n - 1)), budget, fallback="oom")
        assert smaller.fallback == "oom" and not smaller.fits  # n is the fewest pieces that fit
        drop = plan(name, d, budget, fallback="drop")
        assert drop.fits and drop.fallback == "drop_over_capacity" and drop.dropped_GE.sum() > 0
        assert drop.rows_N.max() <= drop.info["row_cap"]
        oom = plan(name, d, budget, fallback="oom")
        assert oom.over_budget and not oom.fits and oom.fallback == "oom"
        assert plan(name, d, static * 0.5).fallback == "oom"


def test_compiled_heap_pops_in_heapq_order():
    """plan.heap_push / heap_pop (the compiled planners' priority queue, SYMI's slot counts and
    UltraEP's EPLB fallback) pop (key, index) pairs in heapq's tuple order: random keys, many ties,
    one entry, pops interleaved with pushes."""
    import heapq
    from lrmoe.planning.plan import heap_pop, heap_push
    rng = np.random.default_rng(4107)
    for case in range(300):
        n = int(rng.integers(1, 200))
        keys_in = rng.integers(0, [3, 50, 10**6][case % 3], n).astype(np.float64) * (-1) ** case
        keys, idx = np.empty(n), np.empty(n, dtype=np.int64)
        size, ref, popped, expect = 0, [], [], []
        for i in rng.permutation(n):
            size = heap_push(keys, idx, size, float(keys_in[i]), int(i))
            heapq.heappush(ref, (float(keys_in[i]), int(i)))
            if rng.random() < 0.3:
                j, size = heap_pop(keys, idx, size)
                popped.append(j)
                expect.append(heapq.heappop(ref)[1])
        while size:
            j, size = heap_pop(keys, idx, size)
            popped.append(j)
            expect.append(heapq.heappop(ref)[1])
        assert popped == expect, case


def test_every_policy_plans_the_reference_at_the_routed_pair_limit():
    """At exactly plan.MAX_ROUTED_PAIRS (2^31) routed pairs, one expert holding most of them, the
    compiled planners' int64 arithmetic (two counts multiplied) gives the frozen reference's plans,
    unpressured and at 0.8 of the unpressured peak; one more pair is refused (test_bad_inputs)."""
    from lrmoe.bench.planners import same_plan
    from lrmoe.planning.plan import MAX_ROUTED_PAIRS
    from lrmoe.planning.reference import reference_plan

    rng = np.random.default_rng(5)
    for G, epr, slots in ((1, 3, 4), (2, 2, 3), (4, 1, 3)):
        cluster, dims = Cluster(G, slots), ModelDims(hidden=16, intermediate=16, num_experts=G * epr, top_k=1)
        d = np.floor(rng.dirichlet(np.full(G * epr, 0.3), size=G) * (MAX_ROUTED_PAIRS // G)).astype(np.int64)
        d[0, 0] += MAX_ROUTED_PAIRS - d.sum()
        peak = plan_placement("fixed", d, cluster, dims, math.inf).memory.peak
        for name, kw in (("fixed", {}), ("symi", {}), ("ultraep", {}), ("ultraep_greedy", {}),
                         ("lrmoe", {"drop_ratio": 0.3}), ("lrmoe", {"drop_ratio": 0.3, "quota_policy": "proportional"})):
            for budget in (math.inf, 0.8 * peak):
                live, ref = (f(name, d, cluster, dims, budget, **kw) for f in (plan_placement, reference_plan))
                live.check()
                assert same_plan(live, ref), (G, epr, name, kw, budget)
                if live.num_splits == 1:  # a split plan is one piece's
                    assert live.send_GN.sum() + live.dropped_GE.sum() == MAX_ROUTED_PAIRS


def test_planning_from_threads_gives_the_sequential_plans():
    """The compiled planners release the GIL (numba nogil) and share read-only constants (the cached
    problem arrays, replica layouts, checked options; the greedy-pass counter the tests read is
    shared too, and unreliable under threads): every policy planned from four threads at once,
    pressured and not, first with those caches empty, gives the plans (and memory) of the same calls
    made one at a time."""
    from concurrent.futures import ThreadPoolExecutor

    from lrmoe.bench.planners import same_plan

    rng = np.random.default_rng(21)
    calls = []
    for _ in range(16):
        G = int(rng.choice([2, 4, 8]))
        epr = int(rng.integers(1, 4))
        cluster = Cluster(G, epr + int(rng.integers(1, 3)))
        dims = ModelDims(hidden=64, intermediate=32, num_experts=G * epr, top_k=2)
        d = rng.multinomial(int(rng.integers(50, 5000)), rng.dirichlet(np.full(G * epr, 0.4)), size=G)
        peak = plan_placement("fixed", d, cluster, dims, math.inf).memory.peak
        for name, kw in (("fixed", {}), ("symi", {}), ("ultraep", {}), ("ultraep_greedy", {}),
                         ("lrmoe", {"drop_ratio": 0.2}), ("lrmoe", {"drop_ratio": 0.3, "quota_policy": "proportional"})):
            calls += [(name, d, cluster, dims, budget, kw) for budget in (math.inf, 0.85 * peak, 0.6 * peak)]

    def run(call):
        name, d, cluster, dims, budget, kw = call
        return plan_placement(name, d, cluster, dims, budget, **kw)

    alone = [run(c) for c in calls]
    from lrmoe.planning import lrmoe_plan

    for cache in (lrmoe_plan._cached_options, lrmoe_plan._planner_problem, lrmoe_plan._layout, lrmoe_plan._receivers):
        cache.cache_clear()  # the threads fill them concurrently
    with ThreadPoolExecutor(4) as pool:
        for _ in range(2):
            together = list(pool.map(run, calls))
            assert all(same_plan(a, b) and a.memory.peak == b.memory.peak and a.fallback == b.fallback
                       for a, b in zip(alone, together))


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.int8, np.uint64])
def test_demands_of_every_numeric_dtype_plan_without_warnings(dtype):
    """A demand of small counts in any integer or float dtype plans as its int64 copy does, with no
    warning (the routed-pair limit is compared as a Python number: float16 cannot hold 2^31)."""
    import warnings

    d = np.arange(32).reshape(4, 8) % 7
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = plan_placement("fixed", d.astype(dtype), CLUSTER, DIMS, math.inf)
    assert np.array_equal(got.send_GN, plan_placement("fixed", d, CLUSTER, DIMS, math.inf).send_GN)
