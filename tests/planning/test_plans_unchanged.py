"""The plans of every placement policy (and the baseline selection quotas) on seeded demands are
bit-identical to the plans the kit made before the planners moved to lrmoe.planning and the
quotas to numpy.

EXPECTED holds, per group of cases, a SHA-256 over the per-case digests (demand, send and
backward-quota matrices, instance experts/ranks/replica flags, per-rank memory, policy, fallback,
number of splits, over-budget flag); it was computed with this file's ``case_digests`` on the code
before that change (lrmoe.parallel.plan_placement, lrmoe.parallel.runtime.selection_quotas with
a BackwardPolicy carrying the same drop ratio, quota policy and options)."""
import hashlib
import json
import math

import numpy as np
import pytest

from lrmoe.planning import Cluster, ModelDims
from lrmoe.planning.policies import plan_placement
from lrmoe.planning.selection import selection_quotas

EXPECTED = {
    "fixed": "e82af36ad277e7dce4a4fd4e86810a0970a245fc22233180e8d92cb71d5337af",
    "symi": "8160a590f0852b38680e41634b362f483b4b2bc89b4ca1ec8feb0a301eaf6bf8",
    "symi_from_state": "9130ef79f0c6ea4f587e8f4f5216f5cbaa36dda1af2391d0d1be5ee602982ef6",
    "ultraep": "23d090c415c9fbdf26aec0bf782d79dbd9852151d948d8d59539afdaa2920a82",
    "ultraep_greedy": "b087ad8d768f760b8587336600e90026249013ab2c43d7cc4e2b5bb0a6bfc5e4",
    "lrmoe": "1fb9c33a1f328c608356db2b7023750fd670285ed8b1046025950fa559c72f4a",
    "selection": "c300b329beb03a26671765958cad33d406be422970e5c7715c8404a77d53db9c",
    "budget": "895be0c8357a429dff672e3f7c2b49b2eb550b37c0aa4182b3b96ec7c1c45acb",
}


def digest(p) -> str:
    h = hashlib.sha256()
    for a in (p.demand_GE, p.send_GN, p.backward_quota_GN, p.expert_N, p.rank_N, p.is_replica_N, p.memory.total_G):
        a = np.ascontiguousarray(np.asarray(a, dtype=np.int64))
        h.update(str(a.shape).encode())
        h.update(a.tobytes())
    h.update(repr((p.policy, p.fallback, p.num_splits, bool(p.over_budget))).encode())
    return h.hexdigest()[:16]


def demand(seed, G, E, kind):
    rng = np.random.default_rng(seed)
    d = rng.integers(0, 40, (G, E))
    if kind == "skewed":
        d[:, int(rng.integers(E))] += rng.integers(100, 300, G)
    elif kind == "empty":
        d[:, rng.permutation(E)[: E // 2]] = 0
    return d


def case_digests() -> dict[str, dict[str, str]]:
    """group -> {case: digest}: 2 cluster shapes x 3 seeds x 3 demand kinds; every policy; the
    selection quotas of each baseline at 3 drop ratios x 3 quota settings; LRMoE at 3 x 3; SYMI
    from the previous step's state; fixed, LRMoE and UltraEP's fallback under two memory budgets."""
    out = {k: {} for k in EXPECTED}
    for G, E, S in ((4, 8, 4), (2, 6, 5)):
        dims = ModelDims(hidden=64, intermediate=32, num_experts=E, top_k=2)
        cl = Cluster(num_ranks=G, slots_per_rank=S)
        for seed in (11, 12, 13):
            for kind in ("random", "skewed", "empty"):
                d = demand(seed, G, E, kind)
                key = f"G{G}E{E}s{seed}{kind}"
                p1 = plan_placement("symi", d, cl, dims, math.inf)
                out["symi_from_state"][key] = digest(plan_placement("symi", demand(seed + 100, G, E, kind), cl, dims,
                                                                    math.inf, state=p1.state))
                for name, opts in (("fixed", {}), ("symi", {}), ("ultraep", {"min_tokens": 4}), ("ultraep_greedy", {})):
                    p = plan_placement(name, d, cl, dims, math.inf, **opts)
                    out[name][key] = digest(p)
                    for rho in (0.0, 0.3, 0.5):
                        for q, kw in (("waterfill", {}), ("proportional", {}), ("waterfill", {"min_keep": 3})):
                            out["selection"][f"{key}/{name}/{rho}{q}{kw}"] = digest(selection_quotas(p, dims, rho, q, kw))
                for rho in (0.0, 0.25, 0.5):
                    for q, kw in (("waterfill", {}), ("proportional", {}), ("waterfill", {"min_keep": 2})):
                        p = plan_placement("lrmoe", d, cl, dims, math.inf, drop_ratio=rho, quota_policy=q,
                                           quota_options=kw)
                        out["lrmoe"][f"{key}/{rho}{q}{kw}"] = digest(p)
                peak = int(max(plan_placement("lrmoe", d, cl, dims, math.inf, drop_ratio=0.2).memory.total_G))
                for frac in (0.9, 0.7):
                    for name in ("fixed", "lrmoe", "ultraep_greedy"):
                        opts = {"drop_ratio": 0.2} if name == "lrmoe" else {}
                        out["budget"][f"{key}/{name}{frac}"] = digest(plan_placement(name, d, cl, dims, peak * frac,
                                                                                     **opts))
    return out


def group_digest(cases: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(cases, sort_keys=True).encode()).hexdigest()


@pytest.fixture(scope="module")
def digests():
    return case_digests()


@pytest.mark.parametrize("group", sorted(EXPECTED))
def test_plans_are_bit_identical_to_the_reference(digests, group):
    assert len(digests[group]) >= 18
    assert group_digest(digests[group]) == EXPECTED[group], f"the {group} plans changed"


def test_budget_cases_exercise_the_fallbacks():
    d = demand(11, 4, 8, "skewed")
    cl, dims = Cluster(4, 4), ModelDims(hidden=64, intermediate=32, num_experts=8, top_k=2)
    peak = int(max(plan_placement("lrmoe", d, cl, dims, math.inf, drop_ratio=0.2).memory.total_G))
    assert plan_placement("lrmoe", d, cl, dims, peak * 0.7, drop_ratio=0.2).fallback == "shrink_quota"
    assert plan_placement("fixed", d, cl, dims, peak * 0.7).num_splits > 1
