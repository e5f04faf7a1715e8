#!/usr/bin/env bash
# One-GPU check (Hopper, e.g. one H200): the CUDA tests, the grouped GEMM benchmark, the layer
# benchmark, the backward-GEMM scaling and a 30-step training smoke run (bf16 autocast, Triton
# experts, synthetic Alpaca-style records), in under 9 minutes, with only what the machine has
# preinstalled (no network).
#
#     bash scripts/gpu_check.sh            # writes under $OUT, default results/gpu/<date>-<gpu name>/
#
# Each step runs under its own time limit (so the whole check stays under 9 minutes) and writes
# its log next to its JSON; a short table of the results is printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}

gpu=$($PY -c "import torch; print(torch.cuda.get_device_name().replace(' ', '-'))" 2>/dev/null || echo no-gpu)
OUT=${OUT:-results/gpu/$(date +%Y%m%d-%H%M%S)-$gpu}
mkdir -p "$OUT"
{
    nvidia-smi
    $PY -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
    $PY -c "import transformers; print('transformers', transformers.__version__)"
    git rev-parse HEAD 2>/dev/null
} >"$OUT/env.txt" 2>&1

: >"$OUT/steps.txt"
step() {  # step NAME SECONDS CMD...: run with a time limit, log to $OUT/NAME.log, record rc and time
    local name=$1 limit=$2 t0=$SECONDS rc
    shift 2
    echo "== $name (limit ${limit}s)"
    timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$OUT/steps.txt"
    tail -n 3 "$OUT/$name.log"
}

step pytest_cuda 120 $PY -m pytest -q -m cuda tests -p no:cacheprovider --junitxml="$OUT/pytest_cuda.xml"
if [ "$gpu" = no-gpu ]; then  # only the plumbing can be checked without a GPU
    echo "no CUDA GPU: the CUDA tests are skipped and the benchmark runs its --smoke shapes"
    step bench_grouped_gemm 210 $PY scripts/bench_grouped_gemm.py --smoke --out "$OUT"
else
    step bench_grouped_gemm 180 $PY scripts/bench_grouped_gemm.py --reps 5 --out "$OUT"
    if [ -f scripts/bench_layer.py ]; then
        step bench_layer 90 $PY scripts/bench_layer.py --device cuda --out "$OUT"
    fi
    step bench_gemm_scaling 60 $PY scripts/bench_gemm_scaling.py --device cuda --shape qwen3-30b-a3b --out "$OUT"
    # training end to end on the GPU: synthetic records (no network), C20, bf16 autocast, Triton experts
    $PY - "$OUT/synthetic_alpaca.json" <<'SYNEOF'
import json, random, sys
rng = random.Random(0)
words = [f"w{i}" for i in range(300)]
recs = [{"instruction": " ".join(rng.choices(words, k=rng.randint(5, 20))), "input": "",
         "output": " ".join(rng.choices(words, k=rng.randint(10, 60)))} for _ in range(600)]
json.dump(recs, open(sys.argv[1], "w"))
SYNEOF
    step train_smoke 75 $PY -m lrmoe.cli train --out "$OUT/train_smoke" --data "$OUT/synthetic_alpaca.json" \
        --model qwen3-moe-tiny --steps 30 --micro-batch 8 --seq-len 256 --drop-ratio 0.2 --device cuda \
        --eval-interval 0 --no-progress
fi

$PY - "$OUT" <<'PYEOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
print(f"\n==== GPU check summary ({out}) ====")
print(out.joinpath("steps.txt").read_text().strip())
log = out / "pytest_cuda.log"
if log.exists():
    lines = [l for l in log.read_text().splitlines() if l.strip()]
    print("pytest -m cuda:", lines[-1] if lines else "(no output)")
for f in sorted(out.glob("bench_grouped_gemm_*.json")):
    d = json.loads(f.read_text())
    peak = d.get("peak_tflops_measured")
    print(f"\ngrouped GEMM, {d['dtype']} ({'complete' if d.get('complete') else 'INCOMPLETE'}; measured peak "
          f"{peak and round(peak)} TFLOP/s; TMA {'FAILED: ' + d['tma_failed'][0][:80] if d.get('tma_failed') else 'ok'})")
    print(f"{'model':14} {'sizes':13} {'pass':6} {'TFLOP/s':>8} {'%peak':>6} {'xF.gmm':>7}")
    for r in d["passes"]:
        pct = f"{r['pct_peak']:.0f}" if r.get("pct_peak") else "-"
        print(f"{r['model']:14} {r['sizes']:13} {r['pass_']:6} {r['triton_tflops']:8.0f} {pct:>6} {r['vs_torch']:7.2f}")
    for r in d["fused"]:
        print(f"fused {r['model']:14} {r['sizes']:11} {r['op']:30} x{r['fused_speedup']:.2f} vs gather+triton")
    for r in d["experts"]:
        print(f"experts {r['model']:14} {r['sizes']:9} {r['variant']:20} {r['fwd_bwd_ms']:8.2f} ms  x{r['vs_hf']:.3f} of HF")
    for e in d.get("errors", []):
        print("ERROR", e[:200])
    misses = [t for t in d.get("targets", []) if t.startswith("[MISS]")]
    print(f"targets: {len(d.get('targets', [])) - len(misses)} pass, {len(misses)} miss")
    for t in misses:
        print("  " + t)
f = out / "bench_gemm_scaling_cuda.json"
if f.exists():
    d = json.loads(f.read_text())
    print("\nbackward GEMMs alone vs rows kept (ideal = the fraction):")
    for r in d["rows"]:
        print(f"  {r['shape']:14} {r['backend']:7} {r['fraction']:.2f}  total {r['total_ms']:8.2f} ms  x{r['total_vs_full']:.3f}")
f = out / "train_smoke" / "metrics.jsonl"
if f.exists():
    rows = [json.loads(l) for l in f.read_text().splitlines() if l.strip()]
    steps = [r for r in rows if "loss" in r]
    if steps:
        print(f"\ntraining smoke (GPU, bf16 autocast, C20): {len(steps)} steps, loss {steps[0]['loss']:.3f} -> "
              f"{steps[-1]['loss']:.3f}")
f = out / "bench_layer_cuda.json"
if f.exists():
    d = json.loads(f.read_text())
    print("\nlayer benchmark:")
    for t in d.get("targets", []):
        print("  " + t)
PYEOF
