#!/usr/bin/env bash
# One-GPU check (Hopper, e.g. one H200), in at most 8 minutes (480 s, the sum of the steps' limits; planned
# from the first run on an H200, results/gpu/20261204-NVIDIA-H200/steps.txt: the benchmarks and training
# steps took 213 s, the cold compiles of compile_cuda and pytest_cuda outran 60 and 75 s), with
# only what the machine has preinstalled (no network, no `datasets`):
#
#   bench_grouped_gemm  Triton grouped GEMM vs F.grouped_mm at both paper models' EP8 rank shapes (bf16)
#   sim_preset          the simulator's measured preset fitted from those rows (docs/simulator.md)
#   bench_layer         one MoE layer at Qwen3-30B-A3B's dimensions: C0..C50 compact and mask vs HF
#   train_step          steps of the gpu1 preset's Qwen3 C20 run: peak memory, host syncs per MoE layer
#   train_step_fsdp     the same run with --fsdp --activation-checkpointing (FSDP2 on one NCCL rank: bf16
#                       compute, fp32 master weights; every decoder layer recomputed in the backward)
#   compile_cuda        torch.compile (inductor, fullgraph) of one MoE block vs eager, bf16; the Triton
#                       grouped GEMM's custom op compiled (fullgraph) vs eager
#   pytest_cuda         the CUDA tests (pytest -m cuda; in parallel where pytest-xdist is installed)
#   bench_gemm_scaling  the backward GEMMs alone vs the fraction of rows kept (the compaction limit)
#
#     bash scripts/gpu_check.sh      # results under results/gpu/<date>-<gpu>/ (or $GPU_CHECK_DIR)
#     GPU_CHECK_STEPS=train_step,compile_cuda bash scripts/gpu_check.sh   # a subset (a rerun)
#     GPU_CHECK_LIMITS=compile_cuda=180,pytest_cuda=150 bash scripts/gpu_check.sh   # other time limits (s)
#
# Steps run in the order above (the most informative first), each under its own time limit
# (SIGINT first, so pytest still writes its junit XML; SIGKILL 5 s later), with its log next to its
# JSON, and a summary of the step is printed as it ends. Every step's results leave as it ends: when
# $OUT is set (the lent machine's output folder, which brings back a few files), the results folder
# is re-packed into $OUT/gpu_check.tgz after each step (written aside, then renamed: never half an
# archive), with steps.txt, summary.txt and env.txt beside it, so a run killed at any point still
# returns every step that finished. Triton's cache (autotuning included) lives in the results'
# parent folder and is shared by the steps: the first step pays the cold compile.
# Without a CUDA GPU the plumbing runs (the `no-gpu` dry run, tests/cli/test_gpu_check.py):
# a tiny training step and the smoke grouped GEMM under the Triton interpreter; the others say
# "skipped". On a copied working tree set LRMOE_GIT_REV to the revision: it wins over the copy's .git,
# which may be stale (the first H200 run recorded the session's starting revision, not the one it ran).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export TRITON_CACHE_AUTOTUNING=1  # later steps reuse the autotune results of earlier ones
PY=${PYTHON:-python3}
ALL_STEPS="bench_grouped_gemm,sim_preset,bench_layer,train_step,train_step_fsdp,compile_cuda,pytest_cuda,bench_gemm_scaling"
WANT=${GPU_CHECK_STEPS:-$ALL_STEPS}
for s in ${WANT//,/ }; do
    case ",$ALL_STEPS," in *",$s,"*) ;; *) echo "unknown step '$s' in GPU_CHECK_STEPS; accepted: $ALL_STEPS" >&2; exit 2 ;; esac
done

gpu=$($PY -c "import torch; print(torch.cuda.get_device_name().replace(' ', '-'))" 2>/dev/null || echo no-gpu)
RES=${GPU_CHECK_DIR:-results/gpu/$(date +%Y%m%d-%H%M%S)-$gpu}
mkdir -p "$RES"
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$(cd "$RES/.." && pwd)/.triton-cache}
if [ "$gpu" = no-gpu ]; then
    export TRITON_INTERPRET=1  # the kernels run on CPU tensors (the dry run of the plumbing)
fi
{
    nvidia-smi 2>&1 || echo "nvidia-smi: not available"
    $PY -c "import sys, torch, triton, transformers, numpy; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__, 'numpy', numpy.__version__)"
    $PY -c "import numba; print('numba', numba.__version__)" 2>/dev/null || echo "numba: not installed"
    $PY -c "import xdist; print('pytest-xdist', xdist.__version__)" 2>/dev/null || echo "pytest-xdist: not installed"
    echo "revision ${LRMOE_GIT_REV:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
    echo "steps $WANT"
} >"$RES/env.txt" 2>&1
cat "$RES/env.txt" | grep -E '^(python|revision|steps|NVIDIA|\|.*H[12]00)' | head -5

pack() {  # bring the results back through $OUT (a few files at most): one archive + the texts
    [ -n "${OUT:-}" ] && [ "$OUT" != "$RES" ] || return 0
    mkdir -p "$OUT"
    tar czf "$OUT/.gpu_check.tgz.part" --exclude='*.pt' --exclude='*.safetensors' --exclude='synthetic_alpaca.json' \
        -C "$(dirname "$RES")" "$(basename "$RES")" && mv -f "$OUT/.gpu_check.tgz.part" "$OUT/gpu_check.tgz"
    for f in env.txt steps.txt summary.txt; do
        [ -f "$RES/$f" ] && cp "$RES/$f" "$OUT/.$f.part" && mv -f "$OUT/.$f.part" "$OUT/$f"
    done
    return 0
}

: >"$RES/steps.txt"
: >"$RES/summary.txt"
T_START=$SECONDS
step() {  # step NAME SECONDS CMD...: run with a time limit, log to $RES/NAME.log, record rc and time, pack
    local name=$1 limit=$2 t0=$SECONDS rc over
    shift 2
    case ",$WANT," in *",$name,"*) ;; *) return 0 ;; esac
    over=$(echo ",${GPU_CHECK_LIMITS:-}," | sed -n "s/.*,$name=\([0-9][0-9]*\),.*/\1/p")
    limit=${over:-$limit}
    echo "== $name (limit ${limit}s, $((SECONDS - T_START))s into the check)"
    timeout --signal=INT --kill-after=5 "$limit" "$@" >"$RES/$name.log" 2>&1
    rc=$?
    echo "$name rc=$rc $((SECONDS - t0))s (limit ${limit}s)" | tee -a "$RES/steps.txt"
    { echo "-- $name (rc=$rc, $((SECONDS - t0))s)"; $PY scripts/gpu_check_summary.py "$RES" "$name"; } 2>&1 \
        | tee -a "$RES/summary.txt"
    pack
}
skip() {  # skip NAME WHY: a step this machine cannot run
    case ",$WANT," in *",$1,"*) ;; *) return 0 ;; esac
    echo "$1 skipped: $2" | tee -a "$RES/steps.txt"
    pack
}

# synthetic Alpaca-style records (no network, no `datasets`) for the training step
data="$RES/synthetic_alpaca.json"
$PY - "$data" <<'SYNEOF'
import json, random, sys
rng = random.Random(0)
words = [f"w{i}" for i in range(2000)]
recs = [{"instruction": " ".join(rng.choices(words, k=rng.randint(5, 30))), "input": "",
         "output": " ".join(rng.choices(words, k=rng.randint(20, 200)))} for _ in range(3000)]
json.dump(recs, open(sys.argv[1], "w"))
SYNEOF

COMPILE_TEST="tests/train/test_hf_compile.py::test_inductor_fullgraph_moe_block_compact[cuda-bf16]"
XDIST=""
if $PY -c "import xdist" 2>/dev/null; then XDIST="-n 6"; fi  # the cold Triton compiles in parallel
if [ "$gpu" = no-gpu ]; then  # only the plumbing can be checked without a GPU
    echo "no CUDA GPU: a dry run of the plumbing (a tiny training step, smoke shapes; the fast step first)"
    step train_step 55 $PY scripts/gpu_train_step.py --allow-cpu --preset smoke --run qwen3-C20-lrm-s0 --steps 1 \
        --data "$data" --out "$RES/train_step"
    step bench_grouped_gemm 90 $PY scripts/bench_grouped_gemm.py --smoke --sections gemm --reps 1 --out "$RES"
    skip sim_preset "needs the CUDA grouped-GEMM rows"
    skip bench_layer "needs CUDA"
    skip train_step_fsdp "needs CUDA (NCCL)"
    skip compile_cuda "needs CUDA"
    skip pytest_cuda "needs CUDA"
    skip bench_gemm_scaling "needs CUDA"
else
    step bench_grouped_gemm 90 $PY scripts/bench_grouped_gemm.py --reps 5 --out "$RES"
    base=h200-sxm; case "$gpu" in *H100*) base=h100-sxm ;; esac
    step sim_preset 10 $PY -m lrmoe.sim.measured "$RES/bench_grouped_gemm_cuda.json" "$RES/$base-measured.json" $base
    step bench_layer 40 $PY scripts/bench_layer.py --device cuda --repeats 5 --warmup 1 --out "$RES"
    step train_step 55 $PY scripts/gpu_train_step.py --preset gpu1 --run qwen3-C20-lrm-s0 --steps 2 \
        --data "$data" --out "$RES/train_step"
    step train_step_fsdp 50 $PY scripts/gpu_train_step.py --preset gpu1 --run qwen3-C20-lrm-s0 --steps 1 \
        --set fsdp=true --set activation_checkpointing=true --data "$data" --out "$RES/train_step_fsdp"
    step compile_cuda 100 $PY -m pytest -v -p no:cacheprovider $XDIST "$COMPILE_TEST" \
        tests/kernels/test_triton_custom_op.py -k "inductor or compiled" --junitxml="$RES/compile_cuda.xml"
    step pytest_cuda 115 $PY -m pytest -v -m cuda tests -p no:cacheprovider $XDIST --deselect "$COMPILE_TEST" \
        --junitxml="$RES/pytest_cuda.xml"
    step bench_gemm_scaling 20 $PY scripts/bench_gemm_scaling.py --device cuda --backend torch --backend triton \
        --repeats 5 --out "$RES"
fi

$PY scripts/gpu_check_summary.py "$RES" >"$RES/summary.txt" 2>&1
cat "$RES/summary.txt"
pack
echo "results: $RES ($((SECONDS - T_START))s)"
