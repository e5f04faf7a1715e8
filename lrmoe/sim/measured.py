"""A measured GPU preset from the grouped-GEMM benchmark that ``scripts/gpu_check.sh`` runs.

``scripts/bench_grouped_gemm.py`` times the six grouped GEMMs of one EP8 rank's experts layer
(Qwen3-30B-A3B and GLM-4.5-Air shapes; balanced, skewed and C20-compacted group sizes) on the lent
GPU. :func:`measured_hardware` fits the cost model's two GEMM constants to those rows by least
squares, ``t = flop / rate + call_s`` per GEMM call (the row tiles are not padded in the fit: the
benchmark's groups hold thousands of rows, so the partial last tile is under 1 % of the work), for
the backend the runtime uses on CUDA (Triton, ``backend="auto"``), and keeps every other constant of
the base preset (HBM, NVLink, network, latencies: the check does not measure them). The result is
the ``<base>-measured`` preset (e.g. ``h200-sxm-measured``), written as a calibration file that
:func:`lrmoe.sim.hardware.get_hardware` reads like ``cpu-local``.

    python -m lrmoe.sim.measured RES/bench_grouped_gemm_cuda.json results/sim/h200-sxm-measured.json
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np

from ..files import read_json, write_json
from .hardware import Hardware, get_hardware

BACKEND_COLUMNS = {"triton": "triton_ms", "torch": "torch_ms"}


def fit_gemm(rows: list[dict], backend: str = "triton") -> tuple[float, float]:
    """(TFLOP/s, seconds per call) fitted to benchmark rows ``{"flop", "<backend>_ms", "valid"}``;
    rows whose result did not match the reference are left out."""
    col = BACKEND_COLUMNS.get(backend)
    if col is None:
        raise ValueError(f"unknown backend {backend!r}; accepted: {sorted(BACKEND_COLUMNS)}")
    use = [r for r in rows if r.get("valid", True) and r.get(col) and r.get("flop")]
    if len(use) < 2:
        raise ValueError(f"the benchmark has {len(use)} valid '{col}' GEMM rows; the fit needs 2 or more")
    x = np.array([[float(r["flop"]), 1.0] for r in use])
    t = np.array([r[col] / 1e3 for r in use])
    (inv_rate, call_s), *_ = np.linalg.lstsq(x, t, rcond=None)
    if inv_rate <= 0:
        raise ValueError("the fitted GEMM time does not grow with the FLOPs; the benchmark rows are not usable")
    if call_s < 0:  # a negative intercept is noise around 0: refit through the origin
        inv_rate, call_s = float(t @ x[:, 0] / (x[:, 0] @ x[:, 0])), 0.0
    return 1.0 / inv_rate / 1e12, float(call_s)


def measured_hardware(bench: dict, base: str | Hardware = "h200-sxm", backend: str = "triton") -> Hardware:
    """The ``<base>-measured`` Hardware from a ``bench_grouped_gemm`` JSON payload."""
    if not isinstance(bench, dict) or bench.get("benchmark") != "grouped_gemm":
        raise ValueError("not a grouped_gemm benchmark result (its 'benchmark' entry is not 'grouped_gemm')")
    if bench.get("smoke"):
        raise ValueError("a --smoke benchmark (CPU interpreter, tiny shapes) cannot calibrate a GPU preset")
    hw = get_hardware(base)
    rate, call_s = fit_gemm(bench.get("gemm") or [], backend)
    env = bench.get("environment") or {}
    gpu = env.get("gpu") or "the lent GPU"
    rev = env.get("git") or "unknown revision"
    return dataclasses.replace(hw, name=f"{hw.name}-measured", gemm_tflops=rate, gemm_call_s=call_s,
                               source=f"grouped GEMMs ({backend}) measured by scripts/gpu_check.sh on {gpu} at {rev}; "
                                      f"other constants from {hw.name}")


def write_measured_preset(bench_path: str | Path, out: str | Path, base: str = "h200-sxm") -> Hardware:
    bench = read_json(Path(bench_path))
    if bench is None:
        raise ValueError(f"{bench_path} does not exist")
    hw = measured_hardware(bench, base)
    write_json(Path(out), {"hardware": dataclasses.asdict(hw), "from": str(bench_path)})
    return hw


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) not in (2, 3):
        print("usage: python -m lrmoe.sim.measured BENCH_JSON OUT_JSON [BASE_PRESET]", file=sys.stderr)
        return 2
    try:
        hw = write_measured_preset(*argv)
    except ValueError as e:
        print(f"lrmoe.sim.measured: error: {e}", file=sys.stderr)
        return 2
    print(f"{hw.name}: grouped GEMM {hw.gemm_tflops:.0f} TFLOP/s, {1e6 * hw.gemm_call_s:.1f} us per call -> {argv[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
