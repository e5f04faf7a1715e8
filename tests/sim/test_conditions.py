"""lrmoe.sim.conditions: the systems tables across workloads, buffer accountings and GEMM rates, with
each cell marked against the paper's and, per paper cell, the configurations that reproduce it."""
import json

import pytest

from lrmoe.sim import conditions


def test_a_small_sweep_marks_every_cell(monkeypatch, tmp_path):
    monkeypatch.setattr(conditions, "WORKLOADS", (("balanced", "balanced", {}), ("hot rank", "hot_rank", {})))
    monkeypatch.setattr(conditions, "GEMM_TFLOPS", (242.0, 483.0))
    from paper_figures.results import paper_numbers

    paper = conditions.paper_cells(paper_numbers())
    assert paper[("T4", "lrmoe")] == 5.44 and paper[("T5", "fixed")] == 29.64 and paper[("F3", "ultraep")] == 58.4
    r = conditions.run_conditions(paper, steps=1, layers=1)
    assert len(r["rows"]) == 2 * 2 * 2  # workloads x rates x accountings
    for row in r["rows"]:
        assert set(row["cells"]) == set(r["paper"]) == {f"{a}/{m}" for a, m in paper}
        for c, v in row["cells"].items():
            assert row["within"][c] == (abs(v / r["paper"][c] - 1) <= 0.15)
        assert row["cells"]["T5/ratio"] == pytest.approx(row["cells"]["T5/fixed"] / row["cells"]["T5/lrmoe"])
    by = {(x["workload"], x["accounting"], x["gemm_tflops"]): x for x in r["rows"]}
    # accounting changes only the memory cells; the rate only the time cells
    a, c = by[("hot rank", "all", 242.0)], by[("hot rank", "compacted", 242.0)]
    assert c["cells"]["T4/lrmoe"] < a["cells"]["T4/lrmoe"] and c["cells"]["T5/lrmoe"] == a["cells"]["T5/lrmoe"]
    fast = by[("hot rank", "all", 483.0)]
    assert fast["cells"]["T4/lrmoe"] == a["cells"]["T4/lrmoe"] and fast["cells"]["T5/lrmoe"] < a["cells"]["T5/lrmoe"]
    md = conditions.markdown(r)
    assert md.count("\n| balanced |") == 4 and "configurations within 15 %" in md
    json.dumps(r)  # JSON-able


def test_reproducers_name_each_configuration_once_and_say_none():
    rows = [{"workload": w, "accounting": acc, "gemm_tflops": g,
             "within": {"T4/lrmoe": w == "hot rank" and acc == "compacted", "T5/ratio": g == 483.0}}
            for w in ("balanced", "hot rank") for acc in ("all", "compacted") for g in (242.0, 483.0)]
    for r in rows:
        r["cells"] = dict.fromkeys(r["within"], 1.0)
    rep = conditions.reproducers(rows)
    assert rep["T4/lrmoe"] == ["hot rank, compacted buffers"]
    assert rep["T5/ratio"] == ["balanced, 483 TFLOP/s", "hot rank, 483 TFLOP/s"]
    rows2 = [dict(r, within={k: False for k in r["within"]}) for r in rows]
    assert conditions.reproducers(rows2) == {"T4/lrmoe": [], "T5/ratio": []}
