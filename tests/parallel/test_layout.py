"""The device layout (:class:`lrmoe.parallel.layout.Layout`) against its plain numpy reference
(:class:`~lrmoe.parallel.layout.ReferenceLayout`) on fresh random plans: the planners' plans on random
demands (empty experts, one hot expert, one token, odd sizes, replicas) and synthetic plans with
every instance pattern (replicas on the owner's rank, two instances of one expert on one rank, forward
drops, backward quotas below the sends). Both the CPU path (numpy repeats) and the accelerator path
(torch ``repeat_interleave``, under :func:`lrmoe.kernels.host.emulate_accelerator`) are compared."""
from __future__ import annotations

import contextlib
import math

import numpy as np
import pytest
import torch

from lrmoe.kernels.host import emulate_accelerator
from lrmoe.parallel.layout import Layout, ReferenceLayout, instance_columns, layout_counts
from lrmoe.planning.plan import Cluster, Instance, ModelDims, Plan
from lrmoe.planning.policies import plan_placement

CPU = torch.device("cpu")


def assert_same(new: Layout, ref: ReferenceLayout, where: str) -> None:
    for k, want in vars(ref).items():
        if k == "fetched":  # the reference's per-rank lists; the device layout keeps what the runtime reads
            continue
        got = getattr(new, k)
        if k in ("kept_send_chunk_off", "kept_recv_chunk_off") and not ref.compacts:
            assert got is None, (where, k)
            continue
        if isinstance(want, torch.Tensor) or isinstance(got, torch.Tensor):
            got_t = got if isinstance(got, torch.Tensor) else torch.as_tensor(got)
            want_t = want if isinstance(want, torch.Tensor) else torch.as_tensor(want)
            assert got_t.device == want_t.device and got_t.dtype == want_t.dtype, (where, k, got_t.dtype, want_t.dtype)
            assert torch.equal(got_t, want_t), (where, k, got_t, want_t)
        elif isinstance(want, np.ndarray):
            assert np.array_equal(got, want), (where, k, got, want)
        else:
            assert got == want and type(got) is type(want), (where, k, got, want)


def compare(plan: Plan, El: int, where: str) -> None:
    G = plan.send_GN.shape[0]
    for mode in (contextlib.nullcontext, emulate_accelerator):
        with mode():
            for r in range(G):
                for compacts in (False, True):
                    assert_same(Layout(plan, r, El, compacts, CPU), ReferenceLayout(plan, r, El, compacts, CPU),
                                f"{where} rank {r} compacts {compacts} {mode.__name__}")


def random_demand(rng, G, E, K, kind) -> np.ndarray:
    if kind == "one_token":
        d = np.zeros((G, E), dtype=np.int64)
        d[rng.integers(G), rng.choice(E, K, replace=False)] = 1
        return d
    T = int(rng.integers(1, 40))
    if kind == "hot":
        p = np.full(E, 1.0)
        p[rng.integers(E)] = 10.0 * E
    elif kind == "empty_experts":
        p = rng.random(E) * (rng.random(E) < 0.4)
        p[rng.integers(E)] += 1.0
    else:
        p = rng.lognormal(0, 1.0, E)
    d = rng.multinomial(T * K, p / p.sum(), size=G).astype(np.int64)
    if kind == "empty_rank":
        d[rng.integers(G)] = 0
    return d


POLICIES = [("fixed", {}), ("fixed", {"capacity_factor": 1.0}), ("symi", {"capacity_factor": None}),
            ("symi", {"capacity_factor": 1.0}), ("ultraep", {"min_tokens": 1}), ("ultraep_greedy", {}),
            ("lrmoe", {"drop_ratio": 0.25})]


@pytest.mark.parametrize("seed", range(6))
def test_planners_plans(seed):
    rng = np.random.default_rng(1000 + seed)
    for G, El, extra in ((2, 2, 2), (3, 1, 2), (4, 3, 1), (1, 5, 0), (3, 2, 0)):
        E, K = G * El, min(2, G * El)
        cluster = Cluster(G, El + extra)
        dims = ModelDims(8, 4, E, K, 2, 4, 0)
        for kind in ("lognormal", "hot", "empty_experts", "one_token", "empty_rank"):
            d = random_demand(rng, G, E, K, kind)
            name, opts = POLICIES[int(rng.integers(len(POLICIES)))]
            if name == "symi" and opts.get("capacity_factor") is None and extra == 0:
                continue
            plan = plan_placement(name, d, cluster, dims, math.inf, **opts)
            compare(plan, El, f"{name}{opts} G{G} El{El} {kind}")


def synthetic_plan(rng, G, El) -> Plan:
    """Owners plus random extra instances anywhere (the owner's rank included, repeated experts on
    one rank), random sends (forward drops included) and backward quotas <= the sends."""
    E = G * El
    inst = [(e, e // El, False) for e in range(E)]
    for _ in range(int(rng.integers(0, 2 * E + 1))):
        inst.append((int(rng.integers(E)), int(rng.integers(G)), True))
    order = rng.permutation(len(inst))  # instance indices in any order
    inst = [inst[i] for i in order]
    slots = [0] * G
    instances = []
    for e, t, rep in inst:
        instances.append(Instance(e, t, slots[t], rep))
        slots[t] += 1
    N = len(instances)
    ex = np.array([i.expert for i in instances])
    demand = rng.integers(0, 6, size=(G, E)) * (rng.random((G, E)) < 0.7)
    send = np.zeros((G, N), dtype=np.int64)
    for s in range(G):
        for e in range(E):
            cols = np.flatnonzero(ex == e)
            kept = int(rng.integers(0, demand[s, e] + 1)) if rng.random() < 0.3 else int(demand[s, e])
            send[s, cols] = rng.multinomial(kept, np.ones(len(cols)) / len(cols))
    quota = (send * rng.random(send.shape)).round().astype(np.int64)
    dropped = demand - np.stack([np.bincount(ex, weights=send[s], minlength=E) for s in range(G)]).astype(np.int64)
    return Plan("synthetic", demand.astype(np.int64), tuple(instances), send, quota, dropped, None,
                math.inf).check()


@pytest.mark.parametrize("seed", range(20))
def test_synthetic_plans(seed):
    rng = np.random.default_rng(seed)
    G = int(rng.integers(1, 6))
    El = int(rng.integers(1, 4))
    compare(synthetic_plan(rng, G, El), El, f"synthetic seed {seed} G{G} El{El}")


def test_compiled_counts_equal_python():
    """The compiled host arithmetic equals numba's uncompiled Python function (the same source)."""
    rng = np.random.default_rng(7)
    for _ in range(5):
        G, El = int(rng.integers(1, 5)), int(rng.integers(1, 4))
        plan = synthetic_plan(rng, G, El)
        ex, rk = instance_columns(plan)
        for r in range(G):
            args = (ex, rk, plan.send_GN.astype(np.int64), plan.backward_quota_GN.astype(np.int64),
                    plan.demand_GE[r].astype(np.int64), r, El, bool(rng.integers(2)))
            for a, b in zip(layout_counts(*args), layout_counts.py_func(*args)):
                assert np.array_equal(a, b)


def test_paper_scale_plan():
    """EP8 at 32,768 tokens per rank (E 128, top-8): the layout of a lognormal step equals the reference's."""
    from lrmoe.bench.planners import cluster_of, dims_of, drifting_trace

    dims = dims_of("qwen3-30b-a3b")
    cluster = cluster_of("EP8", dims.num_experts)
    d = drifting_trace("lognormal", dims.num_experts, 8, 32768 * 8, 1, 0)[0]
    plan = plan_placement("lrmoe", d, cluster, dims, 6 * 2**30, drop_ratio=0.2)
    for r in (0, 5):
        assert_same(Layout(plan, r, 16, True, CPU), ReferenceLayout(plan, r, 16, True, CPU), f"rank {r}")
