"""The measured GPU preset (lrmoe.sim.measured) from grouped-GEMM benchmark rows."""
import json

import pytest

from lrmoe.sim.hardware import get_hardware
from lrmoe.sim.measured import fit_gemm, main, measured_hardware


def _rows(rate_tflops, call_s, flops, backend="triton_ms"):
    return [{"flop": f, backend: 1e3 * (f / (rate_tflops * 1e12) + call_s), "valid": True} for f in flops]


def test_fit_recovers_rate_and_call_cost():
    rows = _rows(600.0, 12e-6, [1e11, 3e11, 7e11, 2e12])
    rate, call = fit_gemm(rows)
    assert rate == pytest.approx(600.0, rel=1e-9) and call == pytest.approx(12e-6, rel=1e-6)
    rows.append({"flop": 5e11, "triton_ms": 1e6, "valid": False})  # a row that did not match: left out
    assert fit_gemm(rows)[0] == pytest.approx(600.0, rel=1e-9)
    with pytest.raises(ValueError, match="needs 2"):
        fit_gemm(rows[:1])
    with pytest.raises(ValueError, match="unknown backend"):
        fit_gemm(rows, "cublas")


def test_measured_preset_keeps_the_base_constants(tmp_path):
    bench = {"benchmark": "grouped_gemm", "smoke": False, "gemm": _rows(550.0, 0.0, [1e11, 1e12, 4e12]),
             "environment": {"gpu": "NVIDIA H200", "git": "abc123"}}
    hw = measured_hardware(bench)
    base = get_hardware("h200-sxm")
    assert hw.name == "h200-sxm-measured" and hw.gemm_tflops == pytest.approx(550.0)
    assert (hw.hbm_bytes_per_s, hw.fast_bytes_per_s, hw.tile_rows) == \
        (base.hbm_bytes_per_s, base.fast_bytes_per_s, base.tile_rows)
    assert "NVIDIA H200" in hw.source and "abc123" in hw.source
    with pytest.raises(ValueError, match="smoke"):
        measured_hardware(dict(bench, smoke=True))
    with pytest.raises(ValueError, match="grouped_gemm"):
        measured_hardware({"benchmark": "layer"})
    src, out = tmp_path / "b.json", tmp_path / "h200-sxm-measured.json"
    src.write_text(json.dumps(bench))
    assert main([str(src), str(out)]) == 0
    assert get_hardware(str(out)) == hw  # the written file is a preset
    assert main([str(tmp_path / "missing.json"), str(out)]) == 2
