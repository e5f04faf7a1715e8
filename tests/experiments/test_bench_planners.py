"""`lrmoe bench planners` runs end to end at tiny sizes and writes what its docstring says (no timing
is asserted: the benchmark is where planner speed is judged)."""
from __future__ import annotations

import json

import pytest

from lrmoe.bench import planners
from lrmoe.bench.cli import TARGETS

ROW_KEYS = {"cell", "model", "ep", "ranks", "budget_gib", "routing", "policy", "pressured", "target_ms", "target_met",
            "speedup", "same_plans", "layout_median_ms", "host_median_ms", "host_target_met"} | {f"{who}_{k}" for who in ("live", "ref") for k in (
                "median_ms", "p95_ms", "cost", "peak_gib", "kept", "replicas", "over_budget_steps", "fallback",
                "samples_ms")}


def test_quick_run_writes_every_policy_with_the_reference(tmp_path, capsys):
    # 64 tokens per rank, budgets of 1 GiB (fits) and 0.3 GiB (below the experts' own weights: a fallback)
    planners.main(["--quick", "--steps", "2", "--tokens", "64", "--budgets", "1,0.3", "--out", str(tmp_path)])
    d = json.loads((tmp_path / "bench_planners_cpu.json").read_text())
    assert {"benchmark", "options", "scenarios", "environment", "rows", "summary", "notes"} <= d.keys()
    assert d["options"]["steps"] == 2 and d["options"]["quick"] and d["options"]["budgets_gib"] == [1.0, 0.3]
    rows = d["rows"]
    assert len(rows) == 2 * 2 * len(planners.POLICIES)  # budgets x routings x policies
    assert {r["policy"] for r in rows} == set(planners.POLICIES)
    for r in rows:
        assert ROW_KEYS <= r.keys(), ROW_KEYS - r.keys()
        assert len(r["live_samples_ms"]) == len(r["ref_samples_ms"]) == 4  # two timed calls per step
        assert r["same_plans"] == 2  # live plans equal the reference (tests/planning/test_reference.py)
        assert r["pressured"] == (r["budget_gib"] == 0.3)
        assert (r["live_fallback"] == "none") == (r["budget_gib"] == 1.0)
        lrmoe = r["policy"].startswith("lrmoe")
        assert r["target_ms"] == ((1.0 if lrmoe else 0.5) if r["pressured"] else (0.1 if lrmoe else 0.05))
        assert r["target_met"] == (r["live_median_ms"] <= r["target_ms"])
        assert r["layout_median_ms"] > 0 and r["host_median_ms"] == r["live_median_ms"] + r["layout_median_ms"]
        assert r["host_target_met"] == (r["host_median_ms"] <= 0.15)  # EP8 cells
    out = capsys.readouterr().out
    assert "| model/EP/budget/routing | policy |" in out and "targets met in" in out and "plan + layout" in out
    md = (tmp_path / "bench_planners_cpu.md").read_text()
    exact = [r for r in rows if r["policy"] != "lrmoe_waterfill_tol1e-3"]
    assert f"exact policies: live plans identical to the reference in {2 * len(exact)} of {2 * len(exact)}" in md
    # at these sizes the approximate searches give the exact plans (the thresholds' slack is one unit, and
    # no kept-pair bisection runs: at 0.3 GiB even the max_drop_ratio floor does not fit, so the call splits)
    assert ("approximate searches (lrmoe_waterfill_tol1e-3; their reference is the exact live planner): identical "
            "in 8 of 8, mean kept pairs +0.00% to +0.00%") in md
    assert "**qwen3-30b-a3b, EP8**" in md and "| policy | 1 GiB | 0.3 GiB |" in md
    for pol in planners.POLICIES:  # one grid row per policy: live (ref) met/routings fallbacks
        row = next(line for line in md.splitlines() if line.startswith(f"| {pol} | ") and "/2 " in line)
        assert row.count("/2 ") == 2, row


def test_only_selects_cells_and_no_reference_skips_it(tmp_path):
    d = planners.main(["--steps", "1", "--tokens", "32", "--only", "glm.*EP64/80GiB/hot_rank/(fixed|symi)$",
                       "--no-reference", "--out", str(tmp_path)])
    assert [(r["model"], r["ep"], r["routing"], r["policy"]) for r in d["rows"]] == [
        ("glm-4.5-air", "EP64", "hot_rank", "fixed"), ("glm-4.5-air", "EP64", "hot_rank", "symi")]
    assert all(r["ranks"] == 64 and r["target_ms"] == 0.05 and r["host_target_met"] is None and "ref_median_ms" not in r
               for r in d["rows"])


def test_drifting_trace_is_seeded_and_keeps_pairs_per_rank():
    a = planners.drifting_trace("lognormal", 16, 4, 100, 3, seed=5)
    b = planners.drifting_trace("lognormal", 16, 4, 100, 3, seed=5)
    assert all((x == y).all() for x, y in zip(a, b)) and not (a[0] == a[2]).all()
    assert all(x.shape == (4, 16) and (x.sum(1) == 100).all() for x in a)
    hot = planners.drifting_trace("hot_expert", 64, 4, 10_000, 1, seed=0)[0]
    assert abs(hot[:, 0].sum() / hot.sum() - 0.1) < 0.02 and hot[:, 0].sum() > 4 * hot[:, 1:].sum(0).max()
    rank = planners.drifting_trace("hot_rank", 64, 4, 10_000, 1, seed=0)[0]
    assert rank[:, :16].sum(0).min() > 2 * rank[:, 16:].sum(0).max()


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps must be >= 1"),
    (["--budgets", "80,x"], "--budgets must be numbers > 0"),
    (["--only", "("], "--only is not a valid regular expression"),
    (["--only", "no-such-cell"], "matches no cell"),
    (["--bogus"], "unrecognized arguments"),
])
def test_bad_options_exit_2_with_a_message(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        planners.main([*argv, "--out", str(tmp_path)])
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "bench_planners_cpu.json").exists()


def test_the_cli_knows_the_target():
    assert TARGETS["planners"] == "lrmoe.bench.planners"


def test_the_approximate_row_is_timed_against_the_exact_live_planner(tmp_path, monkeypatch):
    calls = []
    real = planners.plan_placement

    def counting(*a, **k):
        calls.append(k.get("search_tolerance"))
        return real(*a, **k)

    monkeypatch.setattr(planners, "plan_placement", counting)
    d = planners.main(["--steps", "1", "--tokens", "32", "--only", "qwen3.*EP8/80GiB/balanced/lrmoe_waterfill_tol",
                       "--out", str(tmp_path)])
    assert [r["policy"] for r in d["rows"]] == ["lrmoe_waterfill_tol1e-3"]
    assert sorted(calls[-4:], key=str) == [1e-3, 1e-3, None, None]  # the cell: 2 approximate, 2 exact calls


def test_rounds_pool_every_pass_of_a_cell(tmp_path, capsys):
    d = planners.main(["--steps", "2", "--rounds", "3", "--tokens", "32",
                       "--only", "qwen3.*EP8/80GiB/balanced/(fixed|symi)$", "--out", str(tmp_path)])
    assert d["options"]["rounds"] == 3 and [r["policy"] for r in d["rows"]] == ["fixed", "symi"]
    for r in d["rows"]:
        assert len(r["live_samples_ms"]) == len(r["ref_samples_ms"]) == 3 * 2 * 2  # rounds x steps x two calls
        assert r["same_plans"] == 2  # counted once (the first pass): of steps, not of rounds x steps
    err = capsys.readouterr().err
    assert err.index("fixed (round 1/3)") < err.index("symi (round 1/3)") < err.index("fixed (round 2/3)")


def test_rounds_must_be_positive(tmp_path):
    with pytest.raises(SystemExit):
        planners.main(["--rounds", "0", "--out", str(tmp_path)])
