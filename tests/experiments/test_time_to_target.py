"""T3 / F4 (paper_figures.time_to_target): the per-step simulated time equals the simulator's total,
targets and reach steps by hand, and the tables/figure from synthetic E3 run folders (128 experts,
8 ranks: real planners and cost model on synthetic routing)."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from lrmoe.files import write_json
from lrmoe.run_folder import TRACE
from lrmoe.sim.scenarios import get_scenario
from lrmoe.sim.simulate import PAPER_METHODS, run_method
from lrmoe.sim.hardware import get_hardware
from lrmoe.sim.trace import save_trace
from lrmoe.sim.workloads import synthetic_trace
from paper_figures import Results
from paper_figures import time_to_target as ttt
from paper_figures.results import paper_numbers

STEPS, LAYERS, TOKENS = 12, 2, 64


def _trace(seed, steps=STEPS):
    return synthetic_trace("lognormal", steps=steps, layers=LAYERS, num_ranks=8, num_experts=128,
                           tokens_per_rank=TOKENS, top_k=8, seed=seed)


@pytest.mark.parametrize("budget_scale", [None, 0.6])
def test_per_step_seconds_sum_to_the_simulators_total(budget_scale):
    sc = get_scenario("paper-qwen3")
    counts = _trace(3, steps=3).scaled(sc.tokens_per_rank * 8).counts
    from lrmoe.sim.scenarios import budget_bytes_for

    budget = budget_bytes_for(sc, counts) * (budget_scale or 1.0)  # 0.6: splits (and oom for some)
    hw = get_hardware("h100-sxm")
    for m in PAPER_METHODS:
        mine = ttt.simulated_step_seconds(m, counts, sc.cluster(), sc.dims(), hw, budget, include_planning=False)
        ref = run_method(m, counts, sc.cluster(), sc.dims(), hw, budget, include_planning=False)
        assert len(mine["step_s"]) == 3 and mine["oom_plans"] == ref["oom"]
        assert math.isclose(sum(mine["step_s"]), ref["moe_seconds"], rel_tol=1e-9), m.name


def test_smoothing_targets_and_reach_by_hand():
    assert ttt.smoothed([4.0, None, 2.0, 0.0], 2) == [4.0, 4.0, 2.0, 1.0]
    assert ttt.window_of(12) == 3 and ttt.window_of(200) == 10
    curve = [10.0 - i for i in range(10)]  # 10 .. 1
    assert ttt.targets(curve) == [6.0, 3.0, 2.0, 1.0]  # steps 5, 8, 9, 10 of 10
    assert ttt.first_reach(curve, 3.0) == 7 and ttt.first_reach(curve, 0.5) is None


def _run_folder(root, placement, losses, moe_s, trace_seed, seed=0, torchrun=False, name=None, ep_options=None):
    d = root / f"qwen3-E3-{name or placement}-s{seed}"
    d.mkdir()
    cfg = {"model": "qwen3-moe-small", "steps": len(losses), "placement": placement, "virtual_ep": 8, "seed": seed,
           "drop_ratio": 0.2 if placement == "lrmoe" else 0.0, "grad_accum": 1, "ep_options": ep_options or {},
           "model_overrides": {"num_local_experts": 128, "num_experts_per_tok": 8}}
    env = {"cpu_model": "test CPU"}
    extra = {}
    if torchrun:  # a paper-preset run: EP8 under torchrun on GPUs
        cfg.update(virtual_ep=1, ep=8, device="cuda")
        env = {"device": "cuda", "gpu": "NVIDIA H100 80GB HBM3", "cpu_model": "host CPU"}
        extra = {"distributed": {"world_size": 8, "ep": 8}}
    (d / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "loss": x, "moe_fwd_s": moe_s / 2,
                                                         "moe_bwd_s": moe_s / 2}) + "\n"
                                             for i, x in enumerate(losses)))
    write_json(d / "summary.json", {"status": "done", "steps_done": len(losses), "config": cfg,
                                    "model": {"family": "qwen3_moe"}, "environment": env, **extra})
    save_trace(d / TRACE, _trace(trace_seed, steps=len(losses)))


def test_t3_and_f4_from_run_folders(tmp_path, monkeypatch):
    base = [10.0 - 0.75 * i for i in range(STEPS)]
    _run_folder(tmp_path, "fixed", base, 1.0, 1)
    _run_folder(tmp_path, "ultraep", base, 1.2, 2)
    _run_folder(tmp_path, "symi", [base[0]] * 2 + base[:-2], 1.0, 3)  # 2 steps behind
    _run_folder(tmp_path, "lrmoe", base, 0.5, 4)
    res = Results.load(tmp_path)
    paper = paper_numbers()
    files = ttt.make_t3(res, paper, tmp_path)
    assert {f.name for f in files} == {"T3_time_to_target.md", "T3_time_to_target.tex", "T3_time_to_target.json"}
    fam = json.loads((tmp_path / "tables" / "T3_time_to_target.json").read_text())["families"][0]
    assert [sd["seed"] for sd in fam["seeds"]] == [0]
    data = fam["seeds"][0]
    curve = ttt.smoothed(base, 3)
    assert data["targets"] == pytest.approx(ttt.targets(curve)) and data["window"] == 3
    want = [ttt.first_reach(curve, t) + 1 for t in data["targets"]]
    m = data["methods"]
    assert [r["step"] for r in m["fixed"]["reach"]] == want
    symi = [w + 2 if w + 2 <= STEPS else None for w in want]  # the last target: past SYMI's run
    assert [r["step"] for r in m["symi"]["reach"]] == symi and symi[-1] is None
    assert "(SYMI not reached)" in (tmp_path / "tables" / "T3_time_to_target.md").read_text()
    for j, w in enumerate(want):
        assert m["lrmoe"]["reach"][j]["measured_s"] == pytest.approx(0.5 * w)
        if symi[j] is None:  # SYMI needs more than its whole run (12 steps x 1 s): a lower bound
            assert m["lrmoe"]["reach"][j]["measured_vs_symi_pct"] is None
            assert m["lrmoe"]["reach"][j]["measured_vs_symi_pct_at_least"] == pytest.approx(100 * (1 - 0.5 * w / 12))
            continue
        assert m["lrmoe"]["reach"][j]["measured_vs_symi_pct_at_least"] is None
        no_plan = [m[pl]["reach"][j]["simulated_no_planning_s"] for pl in ("lrmoe", "symi")]
        assert 0 < no_plan[0] <= m["lrmoe"]["reach"][j]["simulated_s"]
        assert m["lrmoe"]["reach"][j]["simulated_no_planning_vs_symi_pct"] == pytest.approx(
            100 * (1 - no_plan[0] / no_plan[1]))
        assert m["lrmoe"]["reach"][j]["measured_vs_symi_pct"] == pytest.approx(100 * (1 - 0.5 * w / (w + 2)))
        assert m["ultraep"]["reach"][j]["measured_vs_symi_pct"] == pytest.approx(100 * (1 - 1.2 * w / (w + 2)))
        sim = [m[pl]["reach"][j]["simulated_s"] for pl in ("lrmoe", "symi")]
        assert m["lrmoe"]["reach"][j]["simulated_vs_symi_pct"] == pytest.approx(100 * (1 - sim[0] / sim[1]))
        for pl in ("fixed", "symi", "lrmoe", "ultraep"):
            assert m[pl]["reach"][j]["simulated_s"] > 0
        sim = m["lrmoe"]["simulated_cum_s"]
        assert m["lrmoe"]["reach"][j]["simulated_s"] == pytest.approx(sim[w - 1])
    for pl in m:  # one seed: the summary is that seed's numbers, without an interval
        for j, cell in enumerate(fam["summary"][pl]):
            rc = m[pl]["reach"][j]
            assert cell["n"] == 1 and cell["reached"] == (rc["step"] is not None)
            assert cell["measured_s"]["mean"] == rc["measured_s"] and cell["measured_s"]["lo"] is None
    md = (tmp_path / "tables" / "T3_time_to_target.md").read_text()
    assert "simulated" in md and "h100-sxm" in md and "42.5" in md and "64.6 min" in md and "test CPU" in md
    cached = sorted(p.name for p in (tmp_path / "sim" / "e3").iterdir())
    assert cached == [f"qwen3-E3-{pl}-s0.json" for pl in ("fixed", "lrmoe", "symi", "ultraep")]
    # a second table reads the cache: nothing is replayed
    monkeypatch.setattr(ttt, "simulated_step_seconds", lambda *a, **k: pytest.fail("replayed despite the cache"))
    figs = ttt.make_f4(Results.load(tmp_path), paper, tmp_path)
    assert sorted(f.suffix for f in figs) == [".pdf", ".png"] and all(f.stat().st_size > 0 for f in figs)


def test_seeds_are_paired_and_summarised_with_t_intervals(tmp_path):
    """Three seeds: each seed's reduction against its own SYMI run, their mean and t interval;
    a seed where SYMI never reaches the last target makes that cell a lower bound; a seed where
    LRMoE misses a target is left out of its mean and counted."""
    base = [10.0 - 0.75 * i for i in range(STEPS)]
    lrmoe_s = {0: 0.5, 1: 0.6, 2: 0.4}
    for seed in (0, 1, 2):
        _run_folder(tmp_path, "fixed", base, 1.0, 10 + seed, seed)
        lag = 1 if seed == 2 else 2  # seed 2's SYMI is only one step behind: it reaches every target
        _run_folder(tmp_path, "symi", [base[0]] * lag + base[:-lag], 1.0, 20 + seed, seed)
        lr = base if seed != 1 else base[:9] + [base[8]] * 3  # seed 1's LRMoE never reaches the last target
        _run_folder(tmp_path, "lrmoe", lr, lrmoe_s[seed], 30 + seed, seed)
    ttt.make_t3(Results.load(tmp_path), paper_numbers(), tmp_path)
    fam = json.loads((tmp_path / "tables" / "T3_time_to_target.json").read_text())["families"][0]
    assert [sd["seed"] for sd in fam["seeds"]] == [0, 1, 2]
    want = [ttt.first_reach(ttt.smoothed(base, 3), t) + 1 for t in fam["seeds"][0]["targets"]]
    for j, w in enumerate(want[:2]):  # every seed's SYMI reaches the first two targets
        cell = fam["summary"]["lrmoe"][j]
        vals = [100 * (1 - lrmoe_s[s] * w / (w + (1 if s == 2 else 2))) for s in (0, 1, 2)]
        e = cell["measured_vs_symi_pct"]
        assert cell["n"] == cell["reached"] == 3 and cell["measured_vs_symi_bounds"] == 0
        assert e["values"] == pytest.approx(vals) and e["mean"] == pytest.approx(np.mean(vals))
        half = 4.302652729911275 * np.std(vals, ddof=1) / math.sqrt(3)  # t(0.975, 2)
        assert (e["lo"], e["hi"]) == pytest.approx((np.mean(vals) - half, np.mean(vals) + half))
        assert cell["steps"]["mean"] == pytest.approx(w)
    last = fam["summary"]["lrmoe"][2]
    assert last["n"] == 3 and last["reached"] == 2  # seed 1 missed it
    assert last["measured_vs_symi_bounds"] == 1  # seed 0's SYMI never reached it: a lower bound
    assert last["measured_vs_symi_pct"]["n"] == 2
    md = (tmp_path / "tables" / "T3_time_to_target.md").read_text()
    # every seed counts: seed 1 is censored (ranked last), the median of (w, w, never) is w
    assert last["steps_median"] == want[2] and last["measured_median_s"] is not None
    assert "(reached 2/3)" in md and "(SYMI not reached in 1/2; 2/3 seeds)" in md and "seeds 0, 1, 2" in md
    assert "censored" in md and "Holm p" in md
    # LRMoE against each baseline: its own table, the main table's LRMoE "vs SYMI" cells the same comparison
    vs = {(c["fraction"], c["baseline"]): c for c in fam["lrmoe_vs"]}
    assert {b for _, b in vs} == {"fixed", "symi"}
    for j, frac in enumerate(fam["fractions"]):
        assert vs[frac, "symi"]["measured_pct"] == fam["summary"]["lrmoe"][j]["measured_vs_symi_pct"]
    fixed0 = vs[fam["fractions"][0], "fixed"]["measured_pct"]  # fixed: 1 s per step, LRMoE 0.5/0.6/0.4 s, same steps
    assert fixed0["values"] == pytest.approx([50.0, 40.0, 60.0]) and fixed0["p_holm"] >= fixed0["p"]
    assert "**LRMoE against each baseline**" in md and "| vs Fixed ownership (Megatron) % | vs SYMI (capacity 1.0) % |" in md
    figs = ttt.make_f4(Results.load(tmp_path), paper_numbers(), tmp_path)
    assert all(f.stat().st_size > 0 for f in figs)


def test_torchrun_runs_are_labelled_measured_on_their_gpus(tmp_path):
    """The paper preset's E3 runs (EP8 under torchrun): column (a) is their logged time, labelled
    measured on 8 GPUs with the GPU they name, and their traces are replayed beside it."""
    base = [10.0 - 0.75 * i for i in range(STEPS)]
    for pl, lag, s in (("fixed", 0, 1.0), ("symi", 2, 0.8), ("ultraep", 0, 0.9), ("lrmoe", 0, 0.6)):
        _run_folder(tmp_path, pl, [base[0]] * lag + base[:len(base) - lag], s, 5, torchrun=True)
    ttt.make_t3(Results.load(tmp_path), paper_numbers(), tmp_path)
    fam = json.loads((tmp_path / "tables" / "T3_time_to_target.json").read_text())["families"][0]
    assert fam["torchrun"] and fam["ep"] == 8 and fam["measured_on"] == ["8x NVIDIA H100 80GB HBM3, EP8"]
    m = fam["seeds"][0]["methods"]
    assert m["lrmoe"]["reach"][0]["measured_s"] == pytest.approx(0.6 * m["lrmoe"]["reach"][0]["step"])
    assert m["lrmoe"]["reach"][0]["simulated_s"] > 0
    md = (tmp_path / "tables" / "T3_time_to_target.md").read_text()
    assert "*(a) measured, 8 × GPU*" in md and "8x NVIDIA H100 80GB HBM3, EP8" in md and "EP8 under torchrun" in md
    assert "virtual" not in md.split("| Model family")[0].split("*(b)")[0]
    assert ttt.make_f4(Results.load(tmp_path), paper_numbers(), tmp_path)


def test_no_e3_runs_no_table(tmp_path):
    res = Results.load(tmp_path)
    assert ttt.make_t3(res, paper_numbers(), tmp_path) is None and ttt.make_f4(res, paper_numbers(), tmp_path) is None


def test_method_names_of_configs():
    assert ttt.method_of({"placement": "symi"}) == "symi"
    assert ttt.method_of({"placement": "symi", "ep_options": {"capacity_factor": 1.0}}) == "symi"
    assert ttt.method_of({"placement": "symi", "ep_options": {"capacity_factor": 1.25}}) == "symi-cf125"
    assert ttt.method_of({"placement": "symi", "ep_options": {"capacity_factor": None}}) == "symi-dropless"
    assert ttt.method_of({"placement": "ultraep", "ep_options": {"min_tokens": 4}}) == "ultraep"
    assert ttt.paper_method("symi-dropless").options["capacity_factor"] is None
    assert ttt.paper_method("symi-cf125").options["capacity_factor"] == 1.25
    assert ttt.paper_method("symi").placement == "symi" and ttt.paper_method("nope") is None


def test_symi_variants_and_steps_against_lrmoe(tmp_path):
    """SYMI at 1.25 and dropless appear beside SYMI 1.0 (each simulated with its own capacity factor);
    the steps table pairs each variant with LRMoE per seed: a variant one step ahead is "fewer", one
    that never reaches the late target counts as "more"."""
    base = [10.0 - 0.75 * i for i in range(STEPS)]
    _run_folder(tmp_path, "fixed", base, 1.0, 1)
    _run_folder(tmp_path, "lrmoe", [base[0]] + base[:-1], 0.5, 4)  # 1 step behind fixed
    _run_folder(tmp_path, "symi", [base[0]] * 3 + base[:-3], 1.0, 3)  # 3 behind: never reaches the late target
    _run_folder(tmp_path, "symi", base, 1.0, 3, name="symi-dropless", ep_options={"capacity_factor": None})
    _run_folder(tmp_path, "symi", [base[0]] + base[:-1], 1.0, 3, name="symi-cf125", ep_options={"capacity_factor": 1.25})
    files = ttt.make_t3(Results.load(tmp_path), paper_numbers(), tmp_path)
    fam = json.loads(next(f for f in files if f.suffix == ".json").read_text())["families"][0]
    assert list(fam["summary"]) == ["fixed", "symi", "symi-cf125", "symi-dropless", "lrmoe"]
    cached = {p.stem: json.loads(p.read_text())["settings"]["method"] for p in (tmp_path / "sim" / "e3").iterdir()}
    assert cached["qwen3-E3-symi-dropless-s0"]["options"]["capacity_factor"] is None
    assert cached["qwen3-E3-symi-cf125-s0"]["options"]["capacity_factor"] == 1.25
    at90 = {c["symi"]: c for c in fam["steps_vs_lrmoe"] if c["fraction"] == 0.9}  # fixed reaches it at step 11
    assert (at90["symi-dropless"]["symi_fewer"], at90["symi-cf125"]["equal"], at90["symi"]["symi_more"]) == (1, 1, 1)
    assert at90["symi"]["symi_median"] is None and at90["symi-dropless"]["symi_median"] == 11
    assert at90["symi-cf125"]["symi_median"] == at90["symi-cf125"]["lrmoe_median"] == 12
    late = {c["symi"]: c for c in fam["steps_vs_lrmoe"] if c["fraction"] == ttt.TARGET_FRACTIONS[-1]}
    assert late["symi-dropless"]["symi_fewer"] == 1 and late["symi"]["equal"] == 1  # neither reaches: equal
    md = next(f for f in files if f.suffix == ".md").read_text()
    assert "SYMI (dropless)" in md and "SYMI (capacity 1.25)" in md
    assert "Qwen3-MoE: SYMI needs fewer steps than LRMoE in more seeds than not for SYMI (dropless)." in md


def _hand_seed(seed, times, totals):
    """One seed as seed_data gives it, by hand: per method the time to each target (None: never
    reached; every kind the same) and the whole run's time."""
    return {"seed": seed, "methods": {
        pl: {"reach": [{"step": None if t is None else 1, **{f"{k}_s": t for k in ttt.KINDS}} for t in ts],
             **{f"{k}_cum_s": [totals[pl]] for k in ttt.KINDS}} for pl, ts in times.items()}}


def test_lrmoe_against_each_baseline_by_hand():
    """LRMoE's paired reduction against every baseline, per target: exact where both reach it, a
    lower bound from the baseline's whole run where only LRMoE does, nothing (counted) where LRMoE
    does not; Holm across every tested comparison of the table, per time column."""
    from lrmoe.stats import estimate, holm

    totals = {"lrmoe": 20.0, "fixed": 10.0, "symi-dropless": 20.0}
    seeds = [_hand_seed(0, {"lrmoe": [1.0, 3.0], "fixed": [2.0, 6.0], "symi-dropless": [1.0, 3.0]}, totals),
             _hand_seed(1, {"lrmoe": [2.0, None], "fixed": [4.0, 8.0], "symi-dropless": [4.0, 5.0]}, totals),
             _hand_seed(2, {"lrmoe": [1.5, 4.0], "fixed": [3.0, None], "symi-dropless": [2.0, 8.0]}, totals)]
    fam = {"family": "qwen3", "fractions": [0.5, 0.9], "seeds": seeds, "summary": {}}
    fam["lrmoe_vs"] = ttt.lrmoe_against(fam)
    ttt._holm([fam])
    cells = {(c["fraction"], c["baseline"]): c for c in fam["lrmoe_vs"]}
    assert list(dict.fromkeys(c["baseline"] for c in fam["lrmoe_vs"])) == ["fixed", "symi-dropless"]  # BASELINES order
    f0, f1 = cells[0.5, "fixed"], cells[0.9, "fixed"]
    assert f0["simulated_pct"]["values"] == [50.0, 50.0, 50.0] and f0["simulated_bounds"] == 0
    # seed 1: LRMoE never reaches 0.9 (no value, counted); seed 2: fixed never does (its whole run, 10 s: >= 60 %)
    assert [x["pct"] for x in f1["simulated_per_seed"]] == [50.0, None, 60.0]
    assert [x["lower_bound"] for x in f1["simulated_per_seed"]] == [False, False, True]
    assert f1["simulated_bounds"] == 1 and f1["simulated_lrmoe_not_reached"] == 1 and f1["n"] == 3
    d0, d1 = cells[0.5, "symi-dropless"], cells[0.9, "symi-dropless"]
    assert d0["measured_pct"]["values"] == pytest.approx([0.0, 50.0, 25.0])
    assert d0["measured_pct"]["mean"] == pytest.approx(25.0) and d0["measured_pct"]["lo"] == pytest.approx(
        estimate([0.0, 50.0, 25.0]).lo)
    assert d1["measured_pct"]["values"] == pytest.approx([0.0, 50.0])
    tested = [f0, d0, d1]  # f1 holds a lower bound: no test
    want = holm([c["simulated_pct"]["p"] for c in tested])
    assert [c["simulated_pct"]["p_holm"] for c in tested] == pytest.approx(want)
    assert f1["simulated_pct"].get("p_holm") is None
    assert f0["simulated_pct"]["resolved_holm"] and not d0["simulated_pct"]["resolved_holm"]
    assert ttt._against(f1, "simulated") == "> +55.0 (baseline not reached in 1/2; LRMoE not reached in 1/3)"
    assert ttt._against(f0, "simulated").startswith("+50.0 [+50.0, +50.0]; Holm p <0.001")
    s = ttt.against_summary(fam)
    assert s["fixed"] == {"tested": 1, "faster": 1, "slower": 0, "exact": [50.0, 50.0, 50.0, 50.0], "bounds": 1,
                          "lrmoe_not_reached": 1}
    assert s["symi-dropless"]["tested"] == 2 and s["symi-dropless"]["faster"] == 0
