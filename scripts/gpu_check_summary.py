#!/usr/bin/env python
"""The GPU check's summary (scripts/gpu_check.sh): what each step's files say, in a few lines.

    python scripts/gpu_check_summary.py RESULTS_DIR          # every step, then the steps' table
    python scripts/gpu_check_summary.py RESULTS_DIR STEP     # one step (printed as it ends)

Reads only the files the steps wrote; a missing or malformed file never hides the other steps."""
from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path


def _log_tail(out: Path, name: str) -> str:
    log = out / f"{name}.log"
    lines = [ln for ln in log.read_text().splitlines() if ln.strip()] if log.exists() else []
    return lines[-1] if lines else "(no output)"


def pytest_cuda(out: Path):
    print("pytest -m cuda:", _log_tail(out, "pytest_cuda"))


def compile_cuda(out: Path):
    print("torch.compile block, bf16, vs eager:", _log_tail(out, "compile_cuda"))


def bench_grouped_gemm(out: Path):
    files = sorted(out.glob("bench_grouped_gemm_*.json"))
    if not files:
        print("grouped GEMM: no JSON written;", _log_tail(out, "bench_grouped_gemm"))
    for f in files:
        d = json.loads(f.read_text())
        peak = d.get("peak_tflops_measured")
        tma = "FAILED: " + d["tma_failed"][0][:80] if d.get("tma_failed") else "ok"
        print(f"grouped GEMM, {d['dtype']} ({'complete' if d.get('complete') else 'INCOMPLETE'}; measured peak "
              f"{peak and round(peak)} TFLOP/s; TMA {tma}; results checked against F.grouped_mm: "
              f"{len(d.get('invalid', []))} wrong)")
        for bad in d.get("invalid", []):
            print("  WRONG RESULT:", bad)
        print(f"{'model':14} {'sizes':13} {'pass':6} {'TFLOP/s':>8} {'%peak':>6} {'xF.gmm':>7}")
        for r in d.get("passes", []):
            pct = f"{r['pct_peak']:.0f}" if r.get("pct_peak") else "-"
            print(f"{r['model']:14} {r['sizes']:13} {r['pass_']:6} {r['triton_tflops']:8.0f} {pct:>6} "
                  f"{r['vs_torch']:7.2f}")
        for r in d.get("fused", []):
            print(f"fused {r['model']:14} {r['sizes']:11} {r['op']:30} x{r['fused_speedup']:.2f} vs gather+triton")
        for r in d.get("experts", []):
            print(f"experts {r['model']:14} {r['sizes']:9} {r['variant']:20} {r['fwd_bwd_ms']:8.2f} ms  "
                  f"x{r['vs_hf']:.3f} of HF")
        for e in d.get("errors", []):
            print("ERROR", e[:200])
        misses = [t for t in d.get("targets", []) if t.startswith("[MISS]")]
        print(f"targets: {len(d.get('targets', [])) - len(misses)} pass, {len(misses)} miss")
        for t in misses:
            print("  " + t)


def sim_preset(out: Path):
    files = sorted(out.glob("*-measured.json"))
    print("simulator preset fitted:", ", ".join(f.name for f in files) if files else "none;",
          "" if files else _log_tail(out, "sim_preset"))


def bench_layer(out: Path):
    f = out / "bench_layer_cuda.json"
    if not f.exists():
        print("layer benchmark: no JSON written;", _log_tail(out, "bench_layer"))
        return
    d = json.loads(f.read_text())
    print("layer benchmark:")
    for t in d.get("targets", []):
        print("  " + t)


def bench_gemm_scaling(out: Path):
    f = out / "bench_gemm_scaling_cuda.json"
    if not f.exists():
        print("backward-GEMM scaling: no JSON written;", _log_tail(out, "bench_gemm_scaling"))
        return
    d = json.loads(f.read_text())
    print(f"backward GEMMs alone vs rows kept (ideal = the fraction; wrong results: {d.get('invalid')}):")
    for r in d["rows"]:
        print(f"  {r['shape']:14} {r['backend']:7} {r['fraction']:.2f}  total {r['total_ms']:8.2f} ms  "
              f"x{r['total_vs_full']:.3f}")


def train_step(out: Path, name: str = "train_step"):
    f = out / name / "gpu_train_step.json"
    if not f.exists():
        print(f"{name}: no JSON written;", _log_tail(out, name))
        return
    d = json.loads(f.read_text())
    fsdp = " --fsdp" if d.get("config", {}).get("fsdp") else ""
    print(f"training step, {d['preset']} {d['run']}{fsdp} on {d.get('device')} ({'complete' if d.get('complete') else 'INCOMPLETE'};"
          f" {d.get('parameters', 0) / 1e9:.2f} B parameters, {d.get('moe_layers')} MoE layers; estimate: "
          f"{d.get('estimate')}):")
    for s in d.get("steps", []):
        mem = s.get("max_allocated_gib")
        print(f"  {s['step']:8} {s['wall_s']:7.2f} s  loss {s['loss']}  peak allocated "
              f"{'-' if mem is None else f'{mem:.2f} GiB'}")
    if d.get("state"):
        print("  state: " + ", ".join(f"{k} {v:.2f}" for k, v in d["state"].items()))
    if d.get("syncs"):
        s = d["syncs"]
        print(f"  host syncs in one step: {s['total']} = {s['per_moe_layer_call']:.1f} per MoE layer call "
              f"({s['moe_layer_calls']} calls); most frequent:")
        for place, n in list(s["by_place"].items())[:6]:
            print(f"    {n:5d}  {place}")


STEPS = {"pytest_cuda": pytest_cuda, "compile_cuda": compile_cuda, "bench_grouped_gemm": bench_grouped_gemm,
         "sim_preset": sim_preset, "bench_layer": bench_layer, "train_step": train_step,
         "train_step_fsdp": lambda out: train_step(out, "train_step_fsdp"),
         "bench_gemm_scaling": bench_gemm_scaling}


def summarise(out: Path, name: str) -> None:
    try:
        STEPS[name](out)
    except Exception:  # noqa: BLE001 - one step's bad file must not hide the others
        print(f"[{name}: could not summarise] {traceback.format_exc(limit=1).strip().splitlines()[-1]}")


def main(argv: list[str]) -> int:
    if not argv or len(argv) > 2 or (len(argv) == 2 and argv[1] not in STEPS):
        print(f"usage: gpu_check_summary.py RESULTS_DIR [STEP]; steps: {', '.join(STEPS)}", file=sys.stderr)
        return 2
    out = Path(argv[0])
    if len(argv) == 2:
        summarise(out, argv[1])
        return 0
    print(f"\n==== GPU check summary ({out}) ====")
    env = out / "env.txt"
    if env.exists():
        print(*[ln for ln in env.read_text().splitlines() if ln.startswith(("python ", "revision"))], sep="\n")
    for name in STEPS:
        if (out / f"{name}.log").exists():
            print()
            summarise(out, name)
    steps = out / "steps.txt"
    print("\nsteps (rc 124/137: stopped by its time limit):")
    print(steps.read_text().strip() if steps.exists() else "(none ran)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
