"""The benchmark scripts run end to end at tiny shapes and write what their docs say (no timing is
asserted: benchmarks are where speed is judged, not tests)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from lrmoe.bench import layer

ROOT = Path(__file__).resolve().parents[2]


def _script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


TARGETS = [  # (variant, row key, bound, comparison): the checks of lrmoe.bench.layer.check_targets, in order
    ("C0_full", "total_vs_hf", 0.90, "<="), ("C20_compact", "bwd_vs_C0", 0.82, "<="),
    ("C50_compact", "bwd_vs_C0", 0.55, "<="), ("C20_mask", "bwd_vs_C0", 0.95, ">="),
    ("C50_mask", "bwd_vs_C0", 0.95, ">="), ("C20_compact", "select_compact_share_of_C0_bwd", 0.03, "<=")]


def expected_verdicts(rows) -> list[str]:
    by = {r["variant"]: r for r in rows}
    return ["PASS" if (by[v][k] <= b if op == "<=" else by[v][k] >= b) else "MISS" for v, k, b, op in TARGETS]


def test_layer_bench_targets_follow_the_measured_values():
    """check_targets on rows with chosen values: each verdict is the one the value determines (a
    value equal to its bound passes)."""
    values = {("C0_full", "total_vs_hf"): 0.90, ("C20_compact", "bwd_vs_C0"): 0.83,
              ("C50_compact", "bwd_vs_C0"): 0.40, ("C20_mask", "bwd_vs_C0"): 1.10, ("C50_mask", "bwd_vs_C0"): 0.94,
              ("C20_compact", "select_compact_share_of_C0_bwd"): 0.031}
    rows = []
    for v, _, _ in layer.VARIANTS:
        row = {"shape": "s", "variant": v, "valid": True, "c0_vs_hf_rel_err": {"y": 0.0}}
        row.update({k: x for (vv, k), x in values.items() if vv == v})
        rows.append(row)
    lines = layer.check_targets(rows)
    assert [line[:6] for line in lines] == ["[PASS]", "[MISS]", "[PASS]", "[PASS]", "[MISS]", "[MISS]"]
    assert lines[1] == "[MISS] s: compact C20 bwd <= 0.82x C0: measured 0.830"
    for r in rows:  # LRMoE differing from the transformers block: nothing is judged
        r["valid"], r["c0_vs_hf_rel_err"] = False, {"y": 0.5}
    lines = layer.check_targets(rows)
    assert len(lines) == 1 and lines[0].startswith("[MISS] s: LRMoE C0 differs") and "not judged" in lines[0]


def test_layer_bench_smoke(tmp_path):
    layer.main(["--shape", "smoke", "--repeats", "1", "--warmup", "0", "--out", str(tmp_path)])
    d = json.loads((tmp_path / "bench_layer_cpu.json").read_text())
    variants = [r["variant"] for r in d["rows"]]
    assert variants == [v for v, _, _ in layer.VARIANTS]
    c20 = next(r for r in d["rows"] if r["variant"] == "C20_compact")
    assert c20["kept_fraction"] == 410 / 512  # round(0.8 * 512) of the smoke shape's 512 pairs
    assert abs(c20["buffer_vs_C0"] - c20["kept_fraction"]) < 1e-9  # buffers proportional to kept rows
    # each target's verdict is the one its measured value determines
    assert [t[:6] for t in d["targets"]] == [f"[{v}]" for v in expected_verdicts(d["rows"])]
    by = {r["variant"]: r for r in d["rows"]}
    assert all(t.endswith(f"measured {by[v][k]:.3f}") for t, (v, k, _, _) in zip(d["targets"], TARGETS))
    # LRMoE C0 was checked against the transformers block (output and every gradient) before timing
    errs = c20["c0_vs_hf_rel_err"]
    assert c20["valid"] and {"y", "x_grad", "gate.weight", "experts.gate_up_proj", "experts.down_proj"} <= set(errs)
    assert max(errs.values()) <= 1e-4


def test_layer_bench_does_not_judge_a_wrong_layer(tmp_path, monkeypatch):
    """If LRMoE's output disagreed with the transformers block, no speed target is judged."""
    real = layer.check_against_hf
    monkeypatch.setattr(layer, "check_against_hf", lambda *a: {**real(*a), "y": 0.5})
    d = layer.main(["--shape", "smoke", "--repeats", "1", "--warmup", "0", "--out", str(tmp_path)])
    assert len(d["targets"]) == 1 and d["targets"][0].startswith("[MISS]") and "not judged" in d["targets"][0]


def test_gemm_scaling_smoke(tmp_path, capsys):
    bench = _script("bench_gemm_scaling")
    assert bench.main(["--shape", "smoke", "--repeats", "1", "--warmup", "0", "--out", str(tmp_path)]) == 0
    d = json.loads((tmp_path / "bench_gemm_scaling_cpu.json").read_text())
    assert {(r["backend"], r["fraction"]) for r in d["rows"]} == {(b, f) for b in ("torch", "loop")
                                                                  for f in (1.0, 0.8, 0.5)}
    full = [r for r in d["rows"] if r["fraction"] == 1.0]
    assert all(r["total_vs_full"] == 1.0 for r in full)
    assert [r["rows_per_expert"] for r in d["rows"][:3]] == [64, 51, 32]  # smoke: T*K = 512 pairs, E = 8
    assert "| dh / full |" in capsys.readouterr().out
    # every backend was checked against the per-group loop before timing
    assert d["invalid"] == [] and all(r["valid"] and r["max_rel_err"] <= d["tolerance"] for r in d["rows"])


def test_grouped_gemm_bench_checks_results_before_timing(tmp_path, monkeypatch):
    """Every timed GEMM is first compared with F.grouped_mm; a wrong kernel is reported, and its
    pass is a MISS whatever its speed. (The Triton kernels are replaced by F.grouped_mm here, exact
    or off by one, so no interpreter run is needed.)"""
    import torch.nn.functional as F

    bench = _script("bench_grouped_gemm")

    def exact(a, b, offs, **kw):
        return F.grouped_mm(a, b, offs=offs)

    monkeypatch.setattr(bench.tgg, "grouped_mm", exact)
    good = bench.main(["--smoke", "--sections", "gemm", "--reps", "2", "--out", str(tmp_path)])
    assert good["invalid"] == [] and all(r["valid"] and r["max_rel_err"] == 0 for r in good["gemm"])
    assert all(len(r["triton_samples_ms"]) == good["reps"] >= 1 for r in good["gemm"])  # samples kept, not medians only
    monkeypatch.setattr(bench.tgg, "grouped_mm", lambda a, b, offs, **kw: exact(a, b, offs) * 1.1)
    bad = bench.main(["--smoke", "--sections", "gemm", "--reps", "1", "--out", str(tmp_path)])
    assert len(bad["invalid"]) == len(bad["gemm"]) > 0
    lines = bench.targets(bad["passes"], peak=None)
    assert lines and all(line.startswith("[MISS]") and "differs" in line for line in lines)
