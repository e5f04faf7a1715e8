"""The benchmark scripts run end to end at tiny shapes and write what their docs say (no timing is
asserted: benchmarks are where speed is judged, not tests)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from lrmoe.bench import layer

ROOT = Path(__file__).resolve().parents[1]


def _script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_layer_bench_smoke(tmp_path):
    layer.main(["--shape", "smoke", "--repeats", "1", "--warmup", "0", "--out", str(tmp_path)])
    d = json.loads((tmp_path / "bench_layer_cpu.json").read_text())
    variants = [r["variant"] for r in d["rows"]]
    assert variants == [v for v, _, _ in layer.VARIANTS]
    c20 = next(r for r in d["rows"] if r["variant"] == "C20_compact")
    assert c20["kept_fraction"] == 410 / 512  # round(0.8 * 512) of the smoke shape's 512 pairs
    assert abs(c20["buffer_vs_C0"] - c20["kept_fraction"]) < 1e-9  # buffers proportional to kept rows
    assert len(d["targets"]) == 5 and all(t.startswith(("[PASS]", "[MISS]")) for t in d["targets"])


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
