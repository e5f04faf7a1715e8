"""The live planners (lrmoe.planning.policies) against the frozen reference (lrmoe.planning.reference,
the planners as of revision 2cf58af) on seeded random small cases, for every built-in policy.

As long as the live planners only got faster, every plan equals the reference's field by field.
Where a live plan differs, the test says which is better and by how much (slowest rank's cost =
forward rows + 2 x kept rows, peak memory, kept pairs, forward drops) and fails only if the live
plan is worse in the decided order: over the budget where the reference fits it, else more forward
drops, else fewer kept pairs, else a slower slowest rank.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from lrmoe.bench.planner_check import differences, quality, verdict
from lrmoe.planning import Cluster, ModelDims
from lrmoe.planning.policies import plan_placement
from lrmoe.planning.reference import REFERENCE_PLANNERS, reference_plan

DIMS = ModelDims(hidden=64, intermediate=32, num_experts=8, top_k=2)
CLUSTERS = {"G4": Cluster(num_ranks=4, slots_per_rank=4),
            "G4x2dom": Cluster(num_ranks=4, slots_per_rank=4, fast_domains=((0, 1), (2, 3))),
            "G2": Cluster(num_ranks=2, slots_per_rank=6)}
OPTIONS = {"fixed": {}, "fixed_cf": {"capacity_factor": 1.0}, "symi": {}, "ultraep": {"min_tokens": 4},
           "ultraep_greedy": {}, "lrmoe": {"drop_ratio": 0.2},
           "lrmoe_prop": {"drop_ratio": 0.2, "quota_policy": "proportional"}}
POLICY = {"fixed_cf": "fixed", "lrmoe_prop": "lrmoe"}
SEEDS = range(8)


def demand(seed, G, E=8):
    rng = np.random.default_rng(seed)
    kind = seed % 4
    d = rng.integers(0, 60, (G, E))
    if kind == 1:  # one hot expert
        d[:, int(rng.integers(E))] += rng.integers(100, 300, G)
    elif kind == 2:  # a hot rank
        d[int(rng.integers(G))] *= 4
    elif kind == 3:  # log-normal popularity, some experts empty
        d = rng.poisson(np.exp(rng.normal(0, 1, E)) * 20, (G, E))
        d[:, rng.permutation(E)[:2]] = 0
    return d


def judge(live, ref, where: str) -> None:
    """Pass when equal; otherwise pass only if the live plan is not worse in the decided order
    (lrmoe.bench.planner_check.verdict: the first criterion on which the plans differ decides), and
    say how they differ."""
    diff = differences(live, ref)
    if not diff:
        return
    ql, qr = quality(live), quality(ref)
    judged, criterion = verdict(ql, qr)
    worse = judged == "worse"
    said = f"WORSE: {criterion}" if worse else (f"better ({criterion})" if criterion else "as good")
    msg = (f"{where}: live plan differs from the reference in {diff}; {said}; "
           f"cost {ql['cost']:.0f} vs {qr['cost']:.0f} ({ql['cost'] - qr['cost']:+.0f}), "
           f"peak {ql['peak']} vs {qr['peak']} ({ql['peak'] - qr['peak']:+d} B), "
           f"kept {ql['kept']} vs {qr['kept']}, drops {ql['dropped']} vs {qr['dropped']}, "
           f"replicas {ql['replicas']} vs {qr['replicas']}, fallback {ql['fallback']} vs {qr['fallback']}")
    assert not worse, msg
    print(msg)  # a divergence that is not worse is reported (pytest -s / -rA) but passes


def test_reference_covers_every_builtin_policy():
    from lrmoe.planning.policies import placement_policies
    builtin = {"fixed", "symi", "ultraep", "ultraep_greedy", "lrmoe"}
    assert builtin <= set(placement_policies()) and set(REFERENCE_PLANNERS) == builtin
    with pytest.raises(ValueError, match="no reference planner"):
        reference_plan("nope", np.zeros((4, 8), dtype=np.int64), CLUSTERS["G4"], DIMS, math.inf)


@pytest.mark.parametrize("cluster_name", sorted(CLUSTERS))
@pytest.mark.parametrize("case", sorted(OPTIONS))
def test_live_plans_equal_the_reference_or_are_not_worse(case, cluster_name):
    name, options, cluster = POLICY.get(case, case), OPTIONS[case], CLUSTERS[cluster_name]
    for seed in SEEDS:
        d = demand(seed, cluster.num_ranks)
        free = reference_plan(name, d, cluster, DIMS, math.inf, **options)
        # unpressured, tight (fallbacks of the baselines, lrmoe shrinks quotas) and hopeless budgets
        for scale in (None, 0.85, 0.6, 0.05):
            budget = math.inf if scale is None else scale * free.memory.peak
            live_state = ref_state = None
            for step in range(2):  # symi plans from the previous step's popularity
                d_step = d if step == 0 else np.roll(d, 1, axis=1)
                ref = reference_plan(name, d_step, cluster, DIMS, budget, state=ref_state, **options)
                live = plan_placement(name, d_step, cluster, DIMS, budget, state=live_state, **options)
                judge(live, ref, f"{case} {cluster_name} seed {seed} budget {scale} step {step}")
                live_state, ref_state = live.state, ref.state


def test_judge_fails_on_a_worse_plan_and_passes_a_better_one():
    """The comparison can fail: a plan with a slower slowest rank is worse, the reverse is better."""
    cluster = CLUSTERS["G4"]
    d = demand(1, 4)
    fixed = reference_plan("fixed", d, cluster, DIMS, math.inf)
    balanced = reference_plan("ultraep", d, cluster, DIMS, math.inf, min_tokens=4)
    assert balanced.cost_G().max() < fixed.cost_G().max()
    with pytest.raises(AssertionError, match="WORSE: slowest rank's cost"):
        judge(fixed, balanced, "fixed vs ultraep")
    judge(balanced, fixed, "ultraep vs fixed")
    judge(fixed, fixed, "same")


def test_differences_ignore_only_the_exact_default_of_live_only_info():
    """An exact LRMoE plan equals the reference's field by field (the live planner's
    search_tolerance = 0.0 is the reference's behaviour); another tolerance is a difference."""
    cluster, d = CLUSTERS["G4"], demand(0, 4)
    live = plan_placement("lrmoe", d, cluster, DIMS, math.inf, drop_ratio=0.2)
    ref = reference_plan("lrmoe", d, cluster, DIMS, math.inf, drop_ratio=0.2)
    assert live.info["search_tolerance"] == 0.0 and "search_tolerance" not in ref.info
    assert differences(live, ref) == []
    tolerant = dataclasses.replace(live, info={**live.info, "search_tolerance": 1e-3})
    assert differences(tolerant, ref) == ["info"]
    assert differences(ref, live) == ["info"]  # only the live plan's extra key is forgiven


def test_judge_follows_the_decided_order():
    """More kept pairs beat a lower slowest rank; fitting beats more kept pairs."""
    cluster, d = CLUSTERS["G4"], demand(2, 4)
    keep_all = reference_plan("lrmoe", d, cluster, DIMS, math.inf, drop_ratio=0.0)
    keep_less = reference_plan("lrmoe", d, cluster, DIMS, math.inf, drop_ratio=0.5)
    ql, qm = quality(keep_less), quality(keep_all)
    assert ql["kept"] < qm["kept"] and ql["cost"] < qm["cost"]
    judge(keep_all, keep_less, "more kept, slower")
    with pytest.raises(AssertionError, match="WORSE: kept pairs"):
        judge(keep_less, keep_all, "fewer kept, faster")
    budget = (ql["peak"] + qm["peak"]) / 2  # keep_less fits it, keep_all does not
    assert ql["peak"] <= budget < qm["peak"]
    tight_less = dataclasses.replace(keep_less, budget_bytes=budget)
    tight_all = dataclasses.replace(keep_all, budget_bytes=budget)
    judge(tight_less, tight_all, "fits, fewer kept")
    with pytest.raises(AssertionError, match="WORSE: over budget where the other fits"):
        judge(tight_all, tight_less, "over, more kept")
