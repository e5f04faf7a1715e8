"""resolve_budget's ``unfit``: a caller that knows the whole demand's plan does not fit skips building
it; the plan returned is the same (the split piece's, the drop fallback's, or the whole plan reported
as oom when the fallback fails), and the whole plan is built only for that report. LRMoE passes it
when even max_drop_ratio's kept pairs are over the memory floor."""
from __future__ import annotations

import math

import numpy as np
import pytest

from lrmoe.planning import Cluster, ModelDims
from lrmoe.planning import lrmoe_plan
from lrmoe.planning import plan as P
from lrmoe.planning.policies import plan_placement


def case(rng):
    G = int(rng.choice([2, 4]))
    E = G * int(rng.integers(1, 4))
    dims = ModelDims(hidden=32, intermediate=16, num_experts=E, top_k=2, optimizer_bytes_per_param=0)
    cl = Cluster(num_ranks=G, slots_per_rank=E // G + int(rng.integers(0, 3)))
    d = rng.poisson(np.exp(rng.normal(0, 1.5, E)) * 300, (G, E)).astype(np.int64)
    return cl, dims, d


def same(a, b):
    assert (a.fallback, a.num_splits, a.over_budget) == (b.fallback, b.num_splits, b.over_budget)
    for f in ("demand_GE", "send_GN", "backward_quota_GN", "dropped_GE", "expert_N", "rank_N"):
        np.testing.assert_array_equal(getattr(a, f), getattr(b, f))


@pytest.mark.parametrize("fallback,max_split", [("split", 256), ("split", 2), ("drop", 256), ("oom", 256)])
def test_unfit_changes_no_plan_and_skips_the_whole_plan(fallback, max_split):
    rng = np.random.default_rng(len(fallback) + max_split)
    skipped = reported = 0
    for _ in range(12):
        cl, dims, d = case(rng)
        whole = plan_placement("ultraep", d, cl, dims, math.inf, min_tokens=4)
        for frac in (0.7, 0.4, 0.2):
            budget = frac * whole.memory.peak
            calls = []

            def build(d_GE, row_cap):  # a toy build that ignores row caps: only the control flow matters here
                calls.append((d_GE.shape, int(d_GE.sum()), row_cap))
                return plan_placement("ultraep", d_GE, cl, dims, budget, min_tokens=4, fallback="oom")

            first = build(d, None)
            if first.fits:
                continue
            calls.clear()
            want = P.resolve_budget(build, d, budget, fallback, max_split)
            got = P.resolve_budget(build, d, budget, fallback, max_split, unfit=True)
            same(got, want)
            whole_built = [c for c in calls if c == (d.shape, int(d.sum()), None)]
            if got.fallback == "oom" or fallback == "drop":
                reported += 1  # built for the report (or for the drop fallback's largest row count)
            else:
                skipped += len(whole_built) == 1  # only the first call (unfit=False) built it
    assert skipped + reported >= 5
    if fallback == "split" and max_split == 256:
        assert skipped >= 3


def test_lrmoe_passes_unfit_when_every_count_is_over_the_memory_floor(monkeypatch):
    """The planner's own use: its plans with the hint equal those without, and the hint was given."""
    real = P.resolve_budget
    hints = []

    def without(build, demand_GE, budget_bytes, fallback="split", max_split=256, fits=None, unfit=False):
        hints.append(unfit)
        return real(build, demand_GE, budget_bytes, fallback, max_split, fits=fits, unfit=False)

    rng = np.random.default_rng(7)
    plans = []
    for _ in range(10):
        cl, dims, d = case(rng)
        peak = plan_placement("lrmoe", d, cl, dims, math.inf, drop_ratio=0.2).memory.peak
        for frac in (0.8, 0.5, 0.3, 0.15):
            for split in (256, 1):
                plans.append((cl, dims, d, frac * peak, split,
                              plan_placement("lrmoe", d, cl, dims, frac * peak, drop_ratio=0.2, max_split=split)))
    monkeypatch.setattr(lrmoe_plan, "resolve_budget", without)
    for cl, dims, d, budget, split, p in plans:
        same(p, plan_placement("lrmoe", d, cl, dims, budget, drop_ratio=0.2, max_split=split))
    assert sum(hints) >= 5 and not all(hints)
