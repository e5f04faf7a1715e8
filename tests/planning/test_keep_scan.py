"""``kept_pairs_fit`` (the kept-pair search's probe at any count) and ``lrmoe bench keep-scan``:
the probe agrees with the planner's answers, refuses what it cannot decide, and the scan's rows
describe their grid."""
import math

import numpy as np
import pytest

from lrmoe.bench import keep_scan
from lrmoe.planning import Cluster, ModelDims
from lrmoe.planning.lrmoe_plan import kept_pairs_fit
from lrmoe.planning.plan import split_piece
from lrmoe.planning.policies import plan_placement
from lrmoe.planning.quota import retained_total

from planner_cases import skewed_demand

DIMS = ModelDims(hidden=32, intermediate=16, num_experts=16, top_k=2, optimizer_bytes_per_param=0)
CLUSTER = Cluster(num_ranks=4, slots_per_rank=6)


def pressured_cases(n, seed=0):
    """(demand, budget) pairs whose LRMoE plan shrinks its quotas: budgets 0.80-0.97 of the unpressured peak."""
    rng = np.random.default_rng(seed)
    found = []
    while len(found) < n:
        d = skewed_demand(rng, 4, 16, ("random", "hot", "empty")[len(found) % 3]) * 20
        peak = plan_placement("lrmoe", d, CLUSTER, DIMS, math.inf, drop_ratio=0.2).memory.peak
        budget = float(rng.uniform(0.8, 0.97)) * peak
        found.append((d, budget))
    return found


@pytest.mark.parametrize("policy", ["waterfill", "proportional"])
def test_the_probe_agrees_with_the_planners_answer(policy):
    """Where the search shrank the quotas, its count fits and the next one does not (the bisection's
    last bracket); where it kept every requested pair, that count fits. For the piece it planned."""
    shrunk = 0
    for i, (d, budget) in enumerate(pressured_cases(40, seed=3)):
        p = plan_placement("lrmoe", d, CLUSTER, DIMS, budget, drop_ratio=0.2, quota_policy=policy)
        if p.fallback == "oom":
            continue
        piece = split_piece(d, p.num_splits) if p.num_splits > 1 else d
        hi = retained_total(int(piece.sum()), 0.2)
        k = int(p.backward_quota_GN.sum())
        counts = [k, k + 1] if k < hi else [k]
        fit = kept_pairs_fit(piece, CLUSTER, DIMS, budget, counts, drop_ratio=0.2, quota_policy=policy)
        assert fit.dtype == bool and fit.shape == (len(counts),)
        assert fit[0], f"case {i}: the planner's count {k} does not fit"
        if k < hi:
            shrunk += 1
            assert not fit[1], f"case {i}: the count after the planner's {k} fits (its bisection said it does not)"
    assert shrunk >= 10  # the sample exercises the kept-pair search


def test_the_probe_refuses_what_it_cannot_decide():
    d, budget = pressured_cases(1)[0]
    P = int(d.sum())
    with pytest.raises(ValueError, match=r"counts must be in \[1, routed pairs = "):
        kept_pairs_fit(d, CLUSTER, DIMS, budget, [P + 1], drop_ratio=0.2)
    with pytest.raises(ValueError, match="counts must be in"):
        kept_pairs_fit(d, CLUSTER, DIMS, budget, [0], drop_ratio=0.2)
    with pytest.raises(ValueError, match="built-in quota policy"):
        kept_pairs_fit(d, CLUSTER, DIMS, budget, [1], drop_ratio=0.2, quota_options={"bogus": 1})
    assert kept_pairs_fit(d, CLUSTER, DIMS, budget, [], drop_ratio=0.2).shape == (0,)


def test_a_scan_row_describes_its_grid():
    """scan_step's row: the grid string has the planner's count (fitting) in its middle, the offsets
    and shares are those of the grid, monotone means no fit above and no failure below."""
    rows = 0
    for d, budget in pressured_cases(30, seed=7):
        row = keep_scan.scan_step(d, CLUSTER, DIMS, budget, {"drop_ratio": 0.2, "quota_policy": "waterfill"},
                                  window=40, stride=4)
        if row is None:
            continue
        rows += 1
        offsets = np.arange(-10, 11) * 4
        hi = retained_total(row["pairs"], 0.2)
        offsets = offsets[(row["kept"] + offsets >= 1) & (row["kept"] + offsets <= hi)]
        grid = np.array([c == "1" for c in row["grid"]])
        assert grid.size == offsets.size and grid[offsets == 0].all()
        fit_above = offsets[(offsets > 0) & grid]
        nofit_below = offsets[(offsets < 0) & ~grid]
        assert row["highest_fit_offset"] == (fit_above.max() if fit_above.size else 0)
        assert row["lowest_nofit_offset"] == (nofit_below.min() if nofit_below.size else None)
        assert row["monotone"] == (not fit_above.size and not nofit_below.size)
        if (offsets > 0).any():
            assert row["fit_above_share"] == pytest.approx(grid[offsets > 0].mean())
        assert 0 < row["kept"] < hi
    assert rows >= 5


def test_the_scan_refuses_bad_options(capsys):
    for argv, msg in ((["--stride", "0"], "--stride must be >= 1"),
                      (["--only", "nothing-matches"], "matches no cell"),
                      (["--only", "("], "not a valid regular expression")):
        with pytest.raises(SystemExit):
            keep_scan.main(argv)
        assert msg in capsys.readouterr().err
