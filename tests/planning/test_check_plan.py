"""lrmoe_jit.check_plan, the compiled Plan.check of LRMoE's plans, against the plain definition on
fresh random plans (the drops, routed and kept pairs) and on broken ones (each rule's code)."""
from __future__ import annotations

import math

import numpy as np

from lrmoe.planning import Cluster, ModelDims
from lrmoe.planning import lrmoe_jit as K
from lrmoe.planning.policies import plan_placement


def random_plans(rng, count):
    for i in range(count):
        G = int(rng.choice([1, 2, 4, 8]))
        E = G * int(rng.integers(1, 5))
        cl = Cluster(num_ranks=G, slots_per_rank=E // G + int(rng.integers(0, 4)))
        dims = ModelDims(hidden=16, intermediate=8, num_experts=E, top_k=min(2, E))
        d = rng.poisson(np.exp(rng.normal(0, 1.5, E)) * 40, (G, E)).astype(np.int64)
        if i % 4 == 1:
            d[:, rng.integers(E)] = 0  # an empty expert
        if i % 4 == 2:
            d[:, 0] += 2000  # one hot expert: replicas
        plan = plan_placement("lrmoe", d, cl, dims, math.inf, drop_ratio=float(rng.choice([0.0, 0.3])))
        inst = plan.instances
        yield (np.ascontiguousarray(plan.demand_GE), inst.expert_N.copy(), inst.rank_N.copy(), inst.slot_N.copy(),
               plan.send_GN.copy(), plan.backward_quota_GN.copy())


def definition(d, expert_N, send, quota):
    dropped = d.copy()
    for c in range(expert_N.size):
        dropped[:, expert_N[c]] -= send[:, c]
    return dropped, int(d.sum()), int(quota.sum())


def test_check_plan_matches_the_definition():
    rng = np.random.default_rng(31)
    replicated = 0
    for d, expert_N, rank_N, slot_N, send, quota in random_plans(rng, 60):
        code, dropped, is_rep, pairs, kept = K.check_plan(d, expert_N, rank_N, slot_N, send, quota)
        want, want_pairs, want_kept = definition(d, expert_N, send, quota)
        assert code == 0
        np.testing.assert_array_equal(dropped, want)
        np.testing.assert_array_equal(is_rep, np.arange(expert_N.size) >= d.shape[1])
        assert (pairs, kept) == (want_pairs, want_kept)
        replicated += expert_N.size > d.shape[1]
    assert replicated >= 5


def test_check_plan_codes_for_broken_plans():
    rng = np.random.default_rng(32)
    for d, expert_N, rank_N, slot_N, send, quota in random_plans(rng, 40):
        G, E = d.shape
        N = expert_N.size

        def code(**change):
            a = dict(d=d, expert_N=expert_N, rank_N=rank_N, slot_N=slot_N, send=send, quota=quota) | change
            return K.check_plan(a["d"], a["expert_N"], a["rank_N"], a["slot_N"], a["send"], a["quota"])[0]

        s, c = int(rng.integers(G)), int(rng.integers(N))
        bad = expert_N.copy()
        bad[c] = E
        assert code(expert_N=bad) == 1
        if N > 1:
            taken = slot_N.copy()
            other = int(np.flatnonzero(rank_N == rank_N[c])[0])
            if other != c:
                taken[c] = slot_N[other]
                assert code(slot_N=taken) == 2
        if E > 1:
            orphan = expert_N.copy()
            orphan[expert_N == 0] = 1  # expert 0 without an instance (and expert 1 with two owners)
            assert code(expert_N=orphan) == 3
        neg = send.copy()
        neg[s, c] = -1
        assert code(send=neg, quota=np.minimum(quota, neg)) == 4
        over = send.copy()
        over[s, c] += d[s, expert_N[c]] + 1  # more sent than routed: a negative drop
        assert code(send=over) == 4
        q = quota.copy()
        q[s, c] = send[s, c] + 1
        assert code(quota=q) == 5
        q[s, c] = -1
        assert code(quota=q) == 5
