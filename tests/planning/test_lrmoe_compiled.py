"""The compiled LRMoE planner (lrmoe.planning.lrmoe_jit) against plain Python on fresh random inputs:
its float reductions against numpy's sum and math.fsum, its quota policies against
lrmoe.planning.quota, its max flow against scipy's (edge by edge), its instance quotas and greedy
against the frozen reference's, and whole plans against the frozen reference planner, edge cases
included (empty experts, all-zero demand, one hot expert, one token, odd sizes, one rank, no
replica slots, a replica floor, memory pressure down to the split fallback)."""
from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import maximum_flow

from lrmoe.planning import Cluster, ModelDims
from lrmoe.planning import lrmoe_jit as K
from lrmoe.planning import lrmoe_plan as L
from lrmoe.planning.policies import plan_placement
from lrmoe.planning.quota import (keep_fraction, proportional_quota, quota_policies, register_quota_policy,
                                  retained_total, unregister_quota_policy, waterfill_quota)
from lrmoe.planning.reference import lrmoe_plan as R
from lrmoe.planning.reference import reference_plan


# ----------------------------------------------------------------------------- float reductions
def float_arrays(rng, count):
    """Random arrays of every kind the planner sums, and some it never does (signs, cancellation,
    wide exponents, ties at a rounding boundary)."""
    for k in range(count):
        n = int(rng.integers(0, 300))
        kind = k % 5
        if kind == 0:
            yield rng.integers(0, 5000, n) * (rng.integers(0, 1000, n) / rng.integers(1, 1000, n))
        elif kind == 1:
            yield rng.standard_normal(n) * 10.0 ** rng.integers(-20, 20, n)
        elif kind == 2:  # cancellation: the sum is far smaller than its terms
            a = rng.standard_normal(n) * 1e16
            yield np.r_[a, -a[::-1], rng.standard_normal(3)]
        elif kind == 3:  # 1 + 2^-53 ties: half-even rounding across partials
            yield np.r_[np.ones(n % 7), np.full(n % 5, 2.0 ** -53), [1e-16, 1.0, 1e16][: n % 4]]
        else:
            yield rng.integers(0, 50, n).astype(np.float64)


def test_np_sum_is_numpys_pairwise_sum():
    rng = np.random.default_rng(0)
    for a in float_arrays(rng, 600):
        assert K.np_sum(a) == a.sum(), a.size
    for n in (127, 128, 129, 1000, 8191, 8192, 8193, 20000):  # block and split boundaries
        a = rng.standard_normal(n) * 10.0 ** rng.integers(-8, 8, n)
        assert K.np_sum(a) == a.sum(), n


def test_exact_sums_are_math_fsum():
    rng = np.random.default_rng(1)
    for a in float_arrays(rng, 1500):
        want = math.fsum(a.tolist())
        assert K.fsum(a) == want and K.exact_sum(a) == want, a.tolist()[:8]
    for _ in range(200):  # the planner's rows: d_GE[r] * frac_E, all ranks at once
        G, E = int(rng.integers(1, 70)), int(rng.integers(1, 200))
        d = rng.integers(0, 3000, (G, E))
        frac = np.where(rng.random(E) < 0.3, 1.0, rng.integers(0, 997, E) / rng.integers(1, 997, E))
        got = K.exact_row_sums(np.ascontiguousarray(d.T), frac)
        assert got.tolist() == [math.fsum((d[r] * frac).tolist()) for r in range(G)]


# ----------------------------------------------------------------------------- quota policies
def demands(rng, count):
    """Per-expert demands: random, empty experts, one hot expert, one token, all zero, odd sizes."""
    for k in range(count):
        E = int(rng.integers(1, 40))
        d = rng.integers(0, 500, E)
        kind = k % 6
        if kind == 1:
            d[rng.random(E) < 0.5] = 0
        elif kind == 2:
            d[int(rng.integers(E))] += 20000
        elif kind == 3:
            d[:] = 0
            d[int(rng.integers(E))] = 1
        elif kind == 4:
            d[:] = 0
        yield d.astype(np.int64)


@pytest.mark.parametrize("rho", (0.0, 0.1, 0.2, 1 / 3, 0.5, 0.9))
def test_compiled_quotas_equal_the_numpy_policies(rho):
    rng = np.random.default_rng(int(rho * 1000))
    keep = keep_fraction(rho)
    for d in demands(rng, 120):
        P = int(d.sum())
        # the same demand as a piece of two ranks (the kept-pair search's quotas read its sorted copy)
        half = rng.integers(0, d + 1)
        piece = K.piece_sums(np.ascontiguousarray(np.stack([half, d - half]), dtype=np.int64))
        np.testing.assert_array_equal(piece[0], d)
        for n_keep in {retained_total(P, rho), int(rng.integers(0, P + 1)), 0, P}:
            exact = n_keep == retained_total(P, rho)
            for min_keep in (0, 1, 7):
                want = waterfill_quota(d, n_keep, min_keep=min_keep) if n_keep < P else d
                got = K.quota(d, n_keep, K.WATERFILL, min_keep, keep.numerator, keep.denominator, exact)
                np.testing.assert_array_equal(got, want)
                got = K.quota_of(piece, n_keep, K.WATERFILL, min_keep, keep.numerator, keep.denominator, exact)
                np.testing.assert_array_equal(got, want)
            want = (proportional_quota(d, n_keep, drop_ratio=rho if exact else None) if n_keep < P else d)
            got = K.quota(d, n_keep, K.PROPORTIONAL, 0, keep.numerator, keep.denominator, exact)
            np.testing.assert_array_equal(got, want)
            np.testing.assert_array_equal(
                K.quota_of(piece, n_keep, K.PROPORTIONAL, 0, keep.numerator, keep.denominator, exact), want)
            assert K.quota_status(d, got, n_keep) == K.QUOTA_OK


def test_quota_status_refuses_a_broken_quota():
    d = np.array([3, 4, 5])
    assert K.quota_status(d, np.array([3, 4, 5]), 12) == K.QUOTA_OK
    for q, n in (([4, 4, 4], 12), ([-1, 4, 5], 8), ([3, 4, 4], 12)):
        assert K.quota_status(d, np.array(q), n) == K.QUOTA_BAD


def test_largest_remainder_selection_is_a_stable_sort():
    """The quotas' selection (plan.add_top) picks the same entries as a stable argsort of the
    remainders (ties: lower index)."""
    rng = np.random.default_rng(4)
    for _ in range(3000):
        n = int(rng.integers(1, 90))
        rem = rng.integers(0, int(rng.integers(1, 6)), n)
        k = int(rng.integers(0, n + 2))
        out = np.zeros(n, dtype=np.int64)
        K._add_top(out, rem, k)
        want = np.zeros(n, dtype=np.int64)
        want[np.argsort(-rem, kind="stable")[:k]] = 1
        np.testing.assert_array_equal(out, want)


# ----------------------------------------------------------------------------- max flow and instance quotas
def test_dinic_flow_is_scipys_edge_by_edge():
    rng = np.random.default_rng(5)
    for _ in range(300):
        n = int(rng.integers(2, 14))
        dense = rng.integers(0, 4, (n, n)) * (rng.random((n, n)) < 0.4)
        np.fill_diagonal(dense, 0)
        dense[rng.random((n, n)) < 0.1] = 0
        graph = csr_matrix(dense.astype(np.int32))
        graph.sort_indices()
        src, sink = 0, n - 1
        want = maximum_flow(graph, src, sink)
        ptr, heads, caps, rev = K._reverse_edges(n, graph.indptr.astype(np.int64), graph.indices.astype(np.int64),
                                                 graph.data.astype(np.int64))
        flows = K.dinic_flow(ptr, heads, caps, rev, src, sink)
        got = csr_matrix((flows, heads, ptr), shape=(n, n)).toarray()
        np.testing.assert_array_equal(got, want.flow.toarray())


def random_layout(rng, G, E):
    """Owners (e // (E/G)) then up to 3 replicas per expert on distinct other ranks, with rows."""
    epr = E // G
    d = rng.integers(0, 40, E)
    d[rng.random(E) < 0.2] = 0
    expert, rank, rows = list(range(E)), [e // epr for e in range(E)], []
    reps = []
    for e in range(E):
        others = [r for r in range(G) if r != e // epr]
        for t in rng.permutation(others)[: int(rng.integers(0, min(3, len(others)) + 1))]:
            reps.append((e, int(t)))
    rows_E = [[] for _ in range(E)]
    for e in range(E):
        k = 1 + sum(1 for x, _ in reps if x == e)
        cuts = np.sort(rng.integers(0, d[e] + 1, k - 1))
        rows_E[e] = np.diff(np.r_[0, cuts, d[e]]).tolist()
    rows = [rows_E[e][0] for e in range(E)]
    seen = [1] * E
    for e, t in sorted(reps, key=lambda x: x[0]):
        expert.append(e)
        rank.append(t)
        rows.append(rows_E[e][seen[e]])
        seen[e] += 1
    return np.array(expert), np.array(rank), np.array(rows, dtype=np.int64), d


def test_instance_quotas_equal_the_reference_and_use_the_flow():
    """Small demands, large drops and thresholds at the exact cost make the max flow decide often."""
    rng = np.random.default_rng(6)
    flows = 0
    for _ in range(400):
        G = int(rng.integers(1, 7))
        E = G * int(rng.integers(1, 4))
        expert_N, rank_N, rows_N, d_E = random_layout(rng, G, E)
        q_E = np.array([int(rng.integers(0, x + 1)) for x in d_E])
        cols_E = [np.flatnonzero(expert_N == e) for e in range(E)]
        F = np.bincount(rank_N, weights=rows_N, minlength=G)
        shares = np.bincount(rank_N, weights=rows_N * q_E[expert_N] / np.maximum(d_E[expert_N], 1), minlength=G)
        for bw in (0.0, 1.0, 2.0):
            for tau in (math.floor((F + bw * shares).max(initial=0)), 0.0, math.inf):
                want = R._instance_quotas(q_E, [rows_N[c] for c in cols_E], [rank_N[c] for c in cols_E], G, bw, tau)
                got = L._instance_quotas_flat(q_E, rows_N, expert_N, rank_N, G, bw, tau)
                for c, k in zip(cols_E, want):
                    np.testing.assert_array_equal(got[c], k)
                largest = np.concatenate(want + [np.zeros(0)]) if want else np.zeros(0)
                flows += bool(bw and (F + bw * np.bincount(rank_N[np.concatenate(cols_E)], weights=largest,
                                                            minlength=G)).max(initial=0) > tau)
    assert flows > 20  # the cases exercised the flow, not only largest remainder


# ----------------------------------------------------------------------------- whole plans
def case(rng, kind):
    """(cluster, dims, demand) of one random planning case; odd sizes and edge cases by kind."""
    G = int(rng.choice([1, 2, 3, 4, 5, 8]))
    E = G * int(rng.integers(1, 4))
    domains = None
    if G >= 4 and rng.random() < 0.5:
        domains = (tuple(range(G // 2)), tuple(range(G // 2, G)))
    cl = Cluster(num_ranks=G, slots_per_rank=E // G + int(rng.integers(0, 4)), fast_domains=domains)
    dims = ModelDims(hidden=int(rng.choice([8, 24, 64])), intermediate=int(rng.choice([4, 12, 32])),
                     num_experts=E, top_k=min(2, E), optimizer_bytes_per_param=int(rng.choice([0, 12])))
    d = rng.poisson(np.exp(rng.normal(0, 1, E)) * rng.integers(1, 60), (G, E))
    if kind == "empty_experts":
        d[:, rng.random(E) < 0.5] = 0
    elif kind == "hot_expert":
        d[:, int(rng.integers(E))] += rng.integers(100, 2000, G)
    elif kind == "one_token":
        d[:] = 0
        d[int(rng.integers(G)), rng.permutation(E)[: min(2, E)]] = 1
    elif kind == "zero":
        d[:] = 0
    elif kind == "zero_rank":
        d[int(rng.integers(G))] = 0
    return cl, dims, d


def same(live, ref, where):
    for a in ("send_GN", "backward_quota_GN", "dropped_GE", "demand_GE"):
        np.testing.assert_array_equal(getattr(live, a), getattr(ref, a), err_msg=f"{where}: {a}")
    assert live.instances == ref.instances, where
    for f in ("base_G", "replicas_G", "dispatch_G", "saved_G", "backward_G"):
        np.testing.assert_array_equal(getattr(live.memory, f), getattr(ref.memory, f), err_msg=f"{where}: {f}")
    assert (live.fallback, live.num_splits, live.over_budget) == (ref.fallback, ref.num_splits, ref.over_budget), where
    # the reference has no tolerance option
    info, ref_info = ({k: v for k, v in p.info.items() if k != "search_tolerance"} for p in (live, ref))
    assert info.keys() == ref_info.keys(), where
    for k in info:
        assert np.array_equal(info[k], ref_info[k]), (where, k, info[k], ref_info[k])


KINDS = ("random", "empty_experts", "hot_expert", "one_token", "zero", "zero_rank")


@pytest.mark.parametrize("kind", KINDS)
def test_compiled_plans_equal_the_reference(kind):
    """Fresh random cases, every budget from none to hopeless, both quota policies and a floor,
    replica slots and min_rows varied: the compiled planner's plans are the reference's, field by field."""
    rng = np.random.default_rng(list(KINDS).index(kind) + 900)
    pressured = splits = 0
    for i in range(10):
        cl, dims, d = case(rng, kind)
        R_max = cl.slots_per_rank - dims.num_experts // cl.num_ranks
        opts = {"drop_ratio": float(rng.choice([0.0, 0.2, 0.5])),
                "quota_policy": str(rng.choice(["waterfill", "proportional"])),
                "replica_slots": int(rng.integers(0, R_max + 1)), "min_rows": int(rng.choice([1, 1, 5]))}
        if opts["quota_policy"] == "waterfill" and i % 3 == 0:
            opts["quota_options"] = {"min_keep": 3}
        peak = reference_plan("lrmoe", d, cl, dims, math.inf, **opts).memory.peak
        for frac in (None, 0.95, 0.8, 0.6, 0.3):
            budget = math.inf if frac is None else max(frac * peak, 1.0)
            ref = reference_plan("lrmoe", d, cl, dims, budget, **opts)
            live = plan_placement("lrmoe", d, cl, dims, budget, **opts)
            same(live, ref, f"{kind} case {i} budget {frac} {opts}")
            pressured += ref.fallback != "none"
            splits += ref.num_splits > 1
    if kind not in ("zero", "one_token"):
        assert pressured >= 5  # the budgets exercised the kept-pair search and the split fallback
        # split probes ask only whether some kept-pair count fits; the chosen piece is then searched
        assert splits >= 3


def test_user_quota_policy_takes_the_python_kept_pair_search():
    """A quota policy the compiled code does not know (registered by the user) gives its quotas from
    Python; the searches are the same, so a copy of waterfill plans exactly as waterfill."""
    register_quota_policy("waterfill_copy", lambda demand_E, n_keep: waterfill_quota(demand_E, n_keep))
    try:
        rng = np.random.default_rng(11)
        for i in range(6):
            cl, dims, d = case(rng, "hot_expert" if i % 2 else "random")
            peak = plan_placement("lrmoe", d, cl, dims, math.inf, drop_ratio=0.2).memory.peak
            for frac in (None, 0.8, 0.5):
                budget = math.inf if frac is None else frac * peak
                a = plan_placement("lrmoe", d, cl, dims, budget, drop_ratio=0.2)
                b = plan_placement("lrmoe", d, cl, dims, budget, drop_ratio=0.2, quota_policy="waterfill_copy")
                b = type(b)(**{**b.__dict__, "info": {**b.info, "quota_policy": "waterfill"}})
                same(b, a, f"case {i} budget {frac}")
    finally:
        unregister_quota_policy("waterfill_copy")


def test_checked_options_are_remembered_per_call_not_across_types_or_policies():
    """plan_lrmoe checks its options once per distinct call (lrmoe_plan._options): a bad option
    still raises on every call, also after the same value of another type (True after 1, in
    quota_options too, and (1.0, 2.0) after (1, 2)) was accepted; a quota policy registered again
    under its name is used; unhashable quota options (a user policy's array) and options given as
    pairs take the unremembered path and plan the same."""
    rng = np.random.default_rng(12)
    cl, dims, d = case(rng, "hot_expert")
    for _ in range(2):
        plan_placement("lrmoe", d, cl, dims, math.inf, min_rows=1)
        with pytest.raises(ValueError, match="min_rows must be an integer >= 1, got True"):
            plan_placement("lrmoe", d, cl, dims, math.inf, min_rows=True)
        plan_placement("lrmoe", d, cl, dims, math.inf, quota_options={"min_keep": 1})
        with pytest.raises(ValueError, match="min_keep must be an int >= 0, got True"):
            plan_placement("lrmoe", d, cl, dims, math.inf, quota_options={"min_keep": True})
        with pytest.raises(ValueError, match=r"max_drop_ratio \(0.1\) must be >= drop_ratio \(0.2\)"):
            plan_placement("lrmoe", d, cl, dims, math.inf, drop_ratio=0.2, max_drop_ratio=0.1)

    def last(demand_E, n_keep):  # the last experts' pairs first
        r = demand_E[::-1]
        return np.minimum(r, np.maximum(n_keep - np.cumsum(r) + r, 0))[::-1]

    try:
        kept = []
        # waterfill itself (the compiled search computes its quotas), then a policy of its own
        for fn in (waterfill_quota, last):
            register_quota_policy("test_order", fn, override=True)
            p = plan_placement("lrmoe", d, cl, dims, math.inf, drop_ratio=0.5, quota_policy="test_order")
            kept.append(p.info["quota_E"])
            assert np.array_equal(p.info["quota_E"], fn(d.sum(0), int(p.info["n_keep"])))
        assert not np.array_equal(*kept)  # the second registration was used, not the first one's options

        def scaled(demand_E, n_keep, weights):
            return waterfill_quota(demand_E, n_keep)

        register_quota_policy("test_weights", scaled)
        w = np.ones(dims.num_experts)  # an array option: unhashable
        a = plan_placement("lrmoe", d, cl, dims, math.inf, drop_ratio=0.2, quota_policy="test_weights",
                           quota_options={"weights": w})
        b = plan_placement("lrmoe", d, cl, dims, math.inf, drop_ratio=0.2)
        assert np.array_equal(a.backward_quota_GN, b.backward_quota_GN) and np.array_equal(a.send_GN, b.send_GN)

        # a container option equal to another of other element types ((1, 2) == (1.0, 2.0)): checked
        # again, and the policy gets the caller's objects
        seen = []

        def strict(demand_E, n_keep, weights):
            if not all(isinstance(x, int) for x in weights):
                raise ValueError(f"weights must be ints, got {weights}")
            seen.append(type(weights[0]))
            return waterfill_quota(demand_E, n_keep)

        register_quota_policy("test_strict", strict)
        plan_placement("lrmoe", d, cl, dims, 0.7 * b.memory.peak, quota_policy="test_strict",
                       quota_options={"weights": (1, 2)}, drop_ratio=0.2)
        with pytest.raises(ValueError, match=r"weights must be ints, got \(1.0, 2.0\)"):
            plan_placement("lrmoe", d, cl, dims, 0.7 * b.memory.peak, quota_policy="test_strict",
                           quota_options={"weights": (1.0, 2.0)}, drop_ratio=0.2)
        assert set(seen) == {int}
        # quota options given as pairs, as dict() reads them; a bad drop ratio is still reported first
        c = plan_placement("lrmoe", d, cl, dims, math.inf, quota_options=[("min_keep", 0)], drop_ratio=0.2)
        assert np.array_equal(c.backward_quota_GN, b.backward_quota_GN)
        with pytest.raises(ValueError, match="drop_ratio must be a number in"):
            plan_placement("lrmoe", d, cl, dims, math.inf, quota_options=[("min_keep", 0)], drop_ratio=2.0)
    finally:
        for name in {"test_order", "test_weights", "test_strict"} & set(quota_policies()):
            unregister_quota_policy(name)


def test_greedy_at_thresholds_with_one_rank_and_no_slots():
    """Edge layouts of the greedy: one rank (no receiver), no replica slot, every expert empty."""
    for G, E, S, zero in ((1, 3, 5, False), (3, 9, 3, False), (2, 4, 4, True)):
        cl = Cluster(num_ranks=G, slots_per_rank=S)
        dims = ModelDims(hidden=16, intermediate=8, num_experts=E, top_k=1)
        d = np.zeros((G, E), dtype=np.int64) if zero else np.arange(G * E).reshape(G, E) ** 2
        q = L._quota(d.sum(0), int(0.8 * d.sum()), "waterfill", {}, 0.2)
        kw = dict(free_G=np.full(G, S - E // G), owner_E=np.arange(E) // (E // G), backward_weight=2.0, min_rows=1,
                  info={})
        s = L._QuotaSearch(d, q, cl, dims, math.inf, **kw)
        for tau in range(s.lo, s.top + 1, max(1, (s.top - s.lo) // 20)):
            assert L._greedy(tau, *s.args, context=s.context) == R._greedy(tau, *s.args)


def split_case(rng, k, sources):
    """(kept [N], send [N, G]) of the quota-matrix tests: case k of small counts, ties everywhere
    (k % 4 == 1), or counts >= 2**26; zero rows, kept 0..rows, kept == rows."""
    N, G = int(rng.integers(1, 40)), int(rng.choice(sources))
    send = rng.integers(0, [50, 3, 2**28][k % 3], (N, G))
    send[rng.random(N) < 0.2] = 0
    if k % 4 == 1:
        send[:, :] = int(rng.integers(0, 3))  # ties everywhere
    rows = send.sum(1)
    kept = np.array([int(rng.integers(0, r + 1)) if r else 0 for r in rows])
    kept = np.where(rng.random(N) < 0.15, rows, kept)
    return kept, np.ascontiguousarray(send)


def test_quota_matrix_equals_largest_remainder_cols():
    """The candidates' backward quotas per (instance, source): every column's largest remainder
    split (plan.largest_remainder_cols), zeros, ties, kept == rows, one source, counts >= 2**26."""
    from lrmoe.planning.plan import largest_remainder_cols
    rng = np.random.default_rng(995)
    for k in range(400):
        kept, send = split_case(rng, k, [1, 2, 3, 8, 64])
        np.testing.assert_array_equal(K.quota_matrix(kept, send),
                                      largest_remainder_cols(kept, send.T).T)


def test_sent_kept_exact_equals_the_quota_matrix_sums():
    """candidate_fits' exact kept rows sent by the ranks its bounds leave open: the column sums of
    quota_matrix for any subset of sources, with zeros, ties, kept == rows, one source, counts
    >= 2**26 and 64 sources."""
    rng = np.random.default_rng(997)
    for k in range(300):
        kept, send = split_case(rng, k, [1, 2, 3, 8, 17, 64])
        G = send.shape[1]
        full = K.quota_matrix(kept, send).sum(0)
        sources = rng.choice(G, int(rng.integers(1, G + 1)), replace=False).astype(np.int64)
        np.testing.assert_array_equal(K.sent_kept_exact(kept, send, sources), full[sources])


def test_largest_remainder_col_equals_the_definition():
    """largest_remainder_col (every short split: up to 16 entries, the remainders one largest at a
    time as unique keys) against the plain definition: 1-16 and 40 entries, ties, zeros, totals 0,
    1, W and in between, and counts on both sides of the float quotient's 2**26 bound."""
    from planner_cases import plain_largest_remainder
    rng = np.random.default_rng(998)
    for k in range(600):
        n = int(rng.choice([1, 2, 3, 5, 8, 13, 16, 40]))
        w = rng.integers(0, [50, 3, 2**27][k % 3], n).astype(np.int64)
        if k % 5 == 1:
            w[:] = int(rng.integers(0, 3))
        W = int(w.sum())
        total = int(rng.choice([0, 1, W, int(rng.integers(0, W + 1))])) if W else 0
        out = np.empty(n, dtype=np.int64)
        K.largest_remainder_col(total, w, out, np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64))
        np.testing.assert_array_equal(out, plain_largest_remainder(total, w), err_msg=f"{w} {total}")


def test_instances_by_expert_equal_a_stable_argsort():
    """instance_quotas' grouping: the candidates' layout (owners, then replicas sorted by expert)
    without a sort, any other layout by the sort; both equal np.argsort(kind="stable")."""
    rng = np.random.default_rng(990)
    for _ in range(300):
        E = int(rng.integers(1, 12))
        reps = np.sort(rng.integers(0, E, int(rng.integers(0, 3 * E))))
        candidate_layout = np.r_[np.arange(E), reps].astype(np.int64)
        shuffled = rng.permutation(candidate_layout).astype(np.int64)
        for expert_N in (candidate_layout, shuffled, candidate_layout[: int(rng.integers(0, E + 1))]):
            np.testing.assert_array_equal(K._by_expert(expert_N, E), np.argsort(expert_N, kind="stable"))


def bisection(qs, prob, work):
    """The reference's threshold search (lrmoe_jit.threshold): bisection over [lo, top] (top is met)."""
    lo, hi = qs[10], qs[11]
    while hi > lo:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if K.greedy(mid, qs, prob, work) >= 0 else (mid + 1, hi)
    return hi


def search_case(rng, cl, dims, d, n_keep, budget, min_rows=1):
    """(qs, prob, work) of one quota search: waterfill quotas of n_keep pairs, random replica slots."""
    G, E = d.shape
    q = K.quota(d.sum(0), int(n_keep), K.WATERFILL, 0, 4, 5, False)
    R = int(rng.integers(0, cl.slots_per_rank - E // G + 1))
    prob = L._planner_problem(cl, dims, budget, R, 2.0, min_rows, 0.0)
    return K.search_setup(d, q, prob), prob, K.workspace(prob)


@pytest.mark.parametrize("kind", KINDS)
def test_threshold_search_from_the_domain_floor(kind):
    """The threshold search from below (lrmoe_jit.threshold_from_floor): every threshold at or below
    the domain floor minus 1 fails (the floor is a proof, checked here by running the greedy there),
    the threshold found is met and the one below it is not (or it is lo), and it is the bisection's
    wherever the greedy's feasibility grows with the threshold over [lo, top] (every threshold of
    the range run when it is short)."""
    rng = np.random.default_rng(list(KINDS).index(kind) + 980)
    compared = 0
    for i in range(30):
        cl, dims, d = case(rng, kind)
        qs, prob, work = search_case(rng, cl, dims, d, d.sum() * 4 // 5, math.inf if i % 2 else 1e12,
                                     min_rows=int(rng.choice([1, 5])))
        lo, top = qs[10], qs[11]
        thr = K.threshold_from_floor(qs, prob, work)
        assert lo <= thr <= top and K.greedy(thr, qs, prob, work) >= 0
        assert thr == lo or K.greedy(thr - 1, qs, prob, work) < 0
        floor = math.floor(K.domain_floor(qs[5], prob[1], prob[2])) - 1
        for tau in range(max(lo, floor - 40), min(floor, top - 1) + 1):
            assert K.greedy(tau, qs, prob, work) < 0, (tau, floor)
        if top - lo <= 3000:
            met = [K.greedy(t, qs, prob, work) >= 0 for t in range(lo, top)] + [True]
            if all(met[met.index(True):]):  # monotone: both searches find the first threshold met
                assert thr == bisection(qs, prob, work) == K.threshold(qs, prob, work) == lo + met.index(True)
                compared += 1
    assert compared >= 10


# cases (of 40) whose threshold search skipped a midpoint (domains of half the ranks, about 4 per kind;
# an all-zero or one-token demand has no midpoint below the floor)
SKIPS_AT_LEAST = {"random": 2, "empty_experts": 1, "hot_expert": 2, "one_token": 0, "zero": 0, "zero_rank": 2}


@pytest.mark.parametrize("kind", KINDS)
def test_threshold_bisection_skips_only_failing_midpoints(kind):
    """lrmoe_jit.threshold answers midpoints below the domain floor without a greedy pass: its
    threshold is the plain bisection's (every midpoint run) in every case, monotone or not, and
    the skip is exercised (fewer greedy passes in some cases)."""
    rng = np.random.default_rng(list(KINDS).index(kind) + 1400)
    skipped = 0
    for i in range(40):
        cl, dims, d = case(rng, kind)
        qs, prob, work = search_case(rng, cl, dims, d, d.sum() * 4 // 5, math.inf if i % 2 else 1e12)
        lo, top = qs[10], qs[11]
        passes = prob[14][0]
        thr = K.threshold(qs, prob, work)
        passes = prob[14][0] - passes
        assert thr == bisection(qs, prob, work)
        n_mid, a, b = 0, lo, top  # the bisection's midpoints, counted
        while b > a:
            mid = (a + b) // 2
            n_mid += 1
            a, b = (a, mid) if K.greedy(mid, qs, prob, work) >= 0 else (mid + 1, b)
        assert passes <= n_mid
        skipped += passes < n_mid
    assert skipped >= SKIPS_AT_LEAST[kind], skipped


@pytest.mark.parametrize("kind", ("random", "hot_expert", "empty_experts"))
def test_kept_pair_probes_in_either_order(kind):
    """A kept-pair probe answers the same whichever candidate it tries first (cost-optimal or top),
    what keep_search infers of the top candidate from the answer (_top_verdict) is what the top
    candidate does, and keep_search (which picks the order from those verdicts) returns the count
    of the plain bisection whose every probe tries the cost-optimal candidate first."""
    rng = np.random.default_rng(list(KINDS).index(kind) + 940)
    keep = keep_fraction(0.2)
    verdicts, searches = {0: 0, 1: 0}, 0
    for i in range(12):
        cl, dims, d = case(rng, kind)
        G, E = d.shape
        P = int(d.sum())
        if P < 20:
            continue
        R = cl.slots_per_rank - E // G
        peak = plan_placement("lrmoe", d, cl, dims, math.inf, drop_ratio=0.2).memory.peak
        budget = float(rng.uniform(0.5, 0.97)) * peak
        prob = L._planner_problem(cl, dims, budget, R, 2.0, 1, 0.0)
        piece, work = K.piece_sums(d), K.workspace(prob)
        d_E = piece[0]
        hi, lo = retained_total(P, 0.2), retained_total(P, 0.9)
        args = (d, piece, prob, work, K.WATERFILL, 0, keep.numerator, keep.denominator, hi)

        def probe(n, top_first):
            return K.fits_keep(*args, n, np.bool_(top_first))

        for n in {lo, hi, int(rng.integers(lo, hi + 1)), int(rng.integers(lo, hi + 1))}:
            q = K.quota(d_E, n, K.WATERFILL, 0, keep.numerator, keep.denominator, n == hi)
            qs = K.search_setup(d, q, prob)
            top_fits = K.candidate_fits(qs[11], qs, prob, work) == 1
            for top_first in (False, True):
                fit, thr, thr_fits, _ = probe(n, top_first)
                assert fit == probe(n, not top_first)[0], (kind, i, n)
                v = K._top_verdict(top_first, fit, thr, thr_fits)
                if v >= 0 and not K.over_memory_floor(prob, G, P, n):
                    assert v == int(top_fits), (kind, i, n, top_first)
                    verdicts[v] += 1
        plain_hi, plain_lo = hi, lo  # the plain bisection, cost-optimal candidate first at every probe
        if not probe(hi, False)[0] and probe(lo, True)[0]:
            while plain_hi - plain_lo > 1:
                mid = (plain_lo + plain_hi) // 2
                plain_lo, plain_hi = (mid, plain_hi) if probe(mid, False)[0] else (plain_lo, mid)
            searches += 1
            expect = plain_lo
        else:
            expect = hi if probe(hi, False)[0] else -1
        got = K.keep_search(d, prob, K.WATERFILL, 0, keep.numerator, keep.denominator, hi, lo, np.bool_(True))[0]
        assert got == expect, (kind, i, got, expect)
    assert searches >= 3 and verdicts[0] >= 3 and verdicts[1] >= 3, (searches, verdicts)


@pytest.mark.parametrize("kind", KINDS)
def test_peak_bounds_bracket_the_candidate_peak(kind):
    """candidate_fits decides from bounds on every rank's memory where they decide, and from the
    exact kept rows of the ranks they leave open: the bounds hold every rank's kept rows sent and
    the exact peak (low <= peak <= high) at every threshold and kept-pair count, base + kept rows
    sent is each rank's exact total, and the verdict equals the full candidate's at budgets around
    the peak."""
    rng = np.random.default_rng(list(KINDS).index(kind) + 960)
    decided = 0
    for i in range(12):
        cl, dims, d = case(rng, kind)
        G, E = d.shape
        for n_keep in {0, d.sum() // 3, d.sum()}:
            q = K.quota(d.sum(0), int(n_keep), K.WATERFILL, 0, 4, 5, False)
            qs, prob, work = search_case(rng, cl, dims, d, n_keep, math.inf)
            for tau in sorted({qs[10], qs[11], (qs[10] + qs[11]) // 2}):
                n = K.greedy(tau, qs, prob, work)
                if n < 0:
                    continue
                expert_N, rank_N, send, quota, mem, peak = K.candidate(tau, qs, prob, work, n)
                kept_N = quota.sum(1)
                low, high = K.peak_bounds(prob, G, E, rank_N, send, kept_N, qs[16])
                assert low <= peak <= high, (kind, i, tau, low, peak, high)
                base, lo, hi = K.source_bounds(prob, G, E, rank_N, send, kept_N, qs[16])
                kept_sent = quota.sum(0)  # every rank's kept rows sent, inside its own bounds
                assert (lo <= kept_sent).all() and (kept_sent <= hi).all()
                total = mem[0] + mem[1] + mem[2] + mem[3] + mem[4]  # the rank totals, exactly
                np.testing.assert_array_equal(base + prob[6] * kept_sent, total)
                for budget in (peak - 1, peak, (low + high) / 2, high, low - 1):
                    if budget <= 0:
                        continue
                    # the greedy's memory pass reads the budget: the candidate at this budget is its own
                    bp = prob[:10] + (float(budget),) + prob[11:]
                    qb = K.search_setup(d, q, bp)
                    nb = K.greedy(tau, qb, bp, K.workspace(bp))
                    if nb < 0:
                        continue
                    _, rank_b, send_b, quota_b, _, peak_b = K.candidate(tau, qb, bp, K.workspace(bp), nb)
                    low_b, high_b = K.peak_bounds(bp, G, E, rank_b, send_b, quota_b.sum(1), qb[16])
                    assert low_b <= peak_b <= high_b
                    assert K.candidate_fits(tau, qb, bp, K.workspace(bp)) == (1 if peak_b <= budget else 0)
                    decided += budget >= high_b or budget < low_b
    assert decided > 20


@pytest.mark.parametrize("name", ("fixed", "symi", "ultraep", "ultraep_greedy"))
def test_compiled_selection_quotas_equal_the_plain_loop(name):
    """Baseline plans' selective-backward quotas: the compiled split against its plain loop."""
    from lrmoe.planning.selection import selection_quota_matrix_py, selection_quotas
    rng = np.random.default_rng(20 + len(name))
    for i in range(12):
        cl, dims, d = case(rng, KINDS[i % len(KINDS)])
        if dims.num_experts % cl.num_ranks or (name == "symi" and cl.slots_per_rank * cl.num_ranks < dims.num_experts):
            continue
        plan = plan_placement(name, d, cl, dims, math.inf)
        for rho in (0.0, 0.3, 0.7):
            got = selection_quotas(plan, dims, rho, "waterfill")
            q_E = got.info["quota_E"]
            want = selection_quota_matrix_py(q_E, plan.expert_N, plan.rows_N, plan.send_GN)
            np.testing.assert_array_equal(got.backward_quota_GN, want)
