"""The README verdict's rule (paper_figures.verdict) on hand-made result files: every row says one of
the three defined words; a comparison over seeds is decided by its Holm-corrected p; a simulated
claim by the 15 % band at its own condition and across the simulated conditions."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from paper_figures import verdict

ROOT = Path(__file__).resolve().parents[2]


def test_every_committed_row_uses_a_defined_verdict():
    for r in verdict.rows(ROOT):
        word = r["verdict"].split(":")[0]
        assert word in verdict.VERDICTS, (r["claim"], r["verdict"])


def _est(mean, p_holm, resolved=True):
    return {"mean": mean, "lo": mean - 1 if resolved else -1.0, "hi": mean + 1 if resolved else 1.0, "n": 3,
            "p": p_holm / 4, "p_holm": p_holm, "resolved": resolved,
            "resolved_holm": p_holm is not None and p_holm < 0.05 and resolved}


@pytest.mark.parametrize("ests, want", [
    ([_est(30, 0.01), _est(25, 0.02)], ("reproduced", 2, 0)),
    ([_est(-8.2, 0.18)], ("not decided", 0, 0)),  # the interval excludes 0 uncorrected; Holm p 0.18 decides nothing
    ([_est(-30, 0.01), _est(5, 0.5, resolved=False)], ("contradicted", 0, 1)),
    ([_est(-30, 0.01), _est(30, 0.01)], ("not decided", 1, 1)),  # resolved both ways
    ([_est(30, 0.01), {"mean": 40.0, "lo": None, "hi": None, "n": 1, "p": None}], ("not decided", 1, 0)),  # one seed
    ([], ("not decided", 0, 0)),
])
def test_ordering_verdict_reads_the_holm_p(ests, want):
    assert verdict.ordering_verdict(ests) == want


def test_ordering_verdict_direction():
    assert verdict.ordering_verdict([_est(-0.07, 0.01)], direction=-1)[0] == "reproduced"
    assert verdict.ordering_verdict([_est(-0.07, 0.01)], direction=1)[0] == "contradicted"


def _t3_cell(baseline, frac, est, per_seed, bounds=0):
    return {"fraction": frac, "baseline": baseline, "n": 3, "simulated_pct": est, "simulated_bounds": bounds,
            "simulated_lrmoe_not_reached": 0,
            "simulated_per_seed": [{"seed": i, "pct": v, "lower_bound": b} for i, (v, b) in enumerate(per_seed)]}


def _write(root: Path, rel: str, data: dict) -> None:
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    (root / rel).write_text(json.dumps(data))


def test_t3_rows_one_per_symi_variant_decided_by_holm(tmp_path):
    fams = []
    for fam in ("qwen3", "glm4"):
        cells = [
            # dropless: LRMoE resolved faster at both targets -> reproduced
            _t3_cell("symi-dropless", 0.5, _est(33.0, 0.01), [(30.0, False), (36.0, False), (33.0, False)]),
            _t3_cell("symi-dropless", 0.98, _est(25.0, 0.04), [(25.0, False), (24.0, False), (26.0, False)]),
            # 1.25: resolved slower at one target, the other a censored lower bound -> contradicted
            _t3_cell("symi-cf125", 0.5, _est(-20.0, 0.03), [(-27.0, False), (-15.0, False), (-18.0, False)]),
            _t3_cell("symi-cf125", 0.98, {"mean": 5.0, "lo": None, "hi": None, "n": 3, "p": None},
                     [(2.0, True), (5.0, True), (8.0, True)], bounds=3),
            # 1.0: LRMoE slower in every seed, interval excludes 0 uncorrected, Holm p 0.18 -> not decided
            _t3_cell("symi", 0.5, _est(-8.2, 0.18), [(-11.7, False), (-7.1, False), (-5.8, False)]),
        ]
        steps = [{"fraction": 0.98, "symi": v, "n": 3, "symi_fewer": 1, "equal": 0, "symi_more": 2}
                 for v in ("symi", "symi-cf125", "symi-dropless")]
        fams.append({"family": fam, "fractions": [0.5, 0.98], "seeds": [{}, {}, {}], "lrmoe_vs": cells,
                     "steps_vs_lrmoe": steps})
    _write(tmp_path, verdict.T3, {"families": fams})
    rows = {r["claim"].split("vs ")[-1]: r for r in verdict.time_to_target_rows(tmp_path)}
    assert list(rows) == ["SYMI dropless", "SYMI at capacity factor 1.25", "SYMI at capacity factor 1.0"]
    assert rows["SYMI dropless"]["verdict"] == "reproduced"
    # the censored target has an estimate but no test: 2 comparisons tested, not 4
    assert rows["SYMI at capacity factor 1.25"]["verdict"].startswith("contradicted: LRMoE resolved slower in 2 of 2")
    assert rows["SYMI at capacity factor 1.0"]["verdict"] == "not decided: none of 2 comparisons resolved after Holm"
    kit = rows["SYMI dropless"]["kit"]
    assert "qwen3 +24.0 to +36.0 % in 6 seed-targets both reach" in kit and "lowest Holm p 0.01" in kit
    assert "(3 more where only LRMoE does)" in rows["SYMI at capacity factor 1.25"]["kit"]
    assert "SYMI fewer steps to the late target in 1/3 (qwen3), 1/3 (glm4) seeds" in kit


def _conditions(savings, base_workload="lognormal σ 1"):
    return {"rows": [{"workload": w, "accounting": "all", "gemm_tflops": 242.0, "lrmoe_vs_fixed_memory": x,
                      "cells": {"T4/lrmoe": 16.0 * (1 + x)}, "within": {"T4/lrmoe": False}}
                     for w, x in savings]}


@pytest.mark.parametrize("base, savings, want", [
    (-0.56, [("balanced", -0.13)], "reproduced"),  # the row's own condition within 15 % of -57.8 %
    (-0.32, [("balanced", -0.13), ("hot rank", -0.566)], "not decided: the saving within 15 % in 1 of 2 simulated "
                                                           "conditions (hot rank 1/1), not at the row's own"),
    (-0.32, [("balanced", -0.13), ("lognormal σ 2", -0.43)], "contradicted: the saving more than 15 % off in the "
                                                               "paper's disfavour in all 2 simulated conditions"),
    (-0.32, [("balanced", -0.13), ("hot rank", -0.80)], "not decided: the saving within 15 % in none of 2 simulated "
                                                         "conditions, not always in the paper's disfavour"),
])
def test_memory_row_follows_the_simulated_rule(tmp_path, base, savings, want):
    _write(tmp_path, "results/sim/paper-qwen3/simulation.json",
           {"methods": {"fixed": {"memory_gib": {"subtotal": 16.0}}, "lrmoe": {"memory_gib": {"subtotal": 16.0 * (1 + base)}}}})
    _write(tmp_path, verdict.CONDITIONS, _conditions(savings))
    assert verdict.memory(tmp_path)["verdict"] == want


def _heldout(effects: dict, above: dict) -> dict:
    """A hand-made held-out ablation.json: effects {drop: (mean, p_holm)} of LRM vs C0, and the
    comparisons C30 vs {0.1, 0.2} as {drop: (C30 − it, p_holm)} (stored as drop − C30, as the grid does)."""
    def m(mean, p):
        return {"deval_loss": _est(mean, p, resolved=p < 0.05)}

    return {"effects": [{"variant": {"drop_ratio": d, "scorer": "lrm"}, "metrics": m(*v)} for d, v in effects.items()],
            "comparisons": [{"a": d, "b": 0.3, "context": {"family": "qwen3", "scorer": "lrm"},
                             "metrics": m(-v[0], v[1])} for d, v in above.items()]}


@pytest.mark.parametrize("effects, above, want", [
    # C10-C20 free, C30 resolved above C0, C10 and C20: the paper's T1 in full
    ({0.1: (0.01, 0.9), 0.2: (0.01, 0.9), 0.3: (0.2, 0.01)}, {0.1: (0.19, 0.01), 0.2: (0.19, 0.02)},
     "reproduced: no penalty at C10-C20 resolved; C30's loss resolved (Holm) above C0, C10, C20"),
    # the committed shape: C30 above C10 and C20 only
    ({0.1: (0.02, 0.9), 0.2: (0.01, 0.9), 0.3: (0.11, 0.5)}, {0.1: (0.1, 0.04), 0.2: (0.1, 0.04)},
     "not decided: no penalty at C10-C20 resolved; C30's loss resolved (Holm) above C10, C20"),
    # a resolved penalty at C20 contradicts "10-20 % leaves convergence intact"
    ({0.1: (0.02, 0.9), 0.2: (0.08, 0.01), 0.3: (0.2, 0.01)}, {0.1: (0.1, 0.5), 0.2: (0.1, 0.5)},
     "contradicted: a penalty at C10-C20 survives Holm"),
])
def test_convergence_row_follows_the_rule(tmp_path, effects, above, want):
    _write(tmp_path, "results/ablations/heldout/ablation.json", _heldout(effects, above))
    assert verdict.convergence(tmp_path)["verdict"] == want
