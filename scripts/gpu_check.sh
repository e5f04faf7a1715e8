#!/usr/bin/env bash
# One-GPU check (Hopper: one H100 or H200), at most 8 minutes in the worst case: start-up (<= 15 s) +
# the steps' limits (438 s) + 3 s per step (2 s from SIGINT to SIGKILL, 1 s for its summary and pack) +
# 3 s at the end = 480 s. Limits planned from the first run on an H200, results/gpu/20261204-NVIDIA-H200/
# steps.txt (times in brackets), with margin for an H100 (slower memory; the compiles are CPU-bound),
# with only what the machine has preinstalled (no network, no `datasets`):
#
#   bench_grouped_gemm  100 s (78)  Triton grouped GEMM vs F.grouped_mm at both paper models' EP8 rank shapes
#   sim_preset            5 s  (0)  the simulator's measured preset fitted from those rows (docs/simulator.md)
#   bench_layer          48 s (35)  one MoE layer at Qwen3-30B-A3B's dimensions: C0..C50 compact and mask vs HF
#   train_step           70 s (44, before the layer sync check)  steps of the gpu1 preset's Qwen3 C20 run:
#                                   peak memory, host syncs per MoE layer, the MoE layer under sync "error" mode
#   train_step_fsdp      50 s (41)  the same run with --fsdp --activation-checkpointing (FSDP2 on one NCCL rank:
#                                   bf16 compute, fp32 master weights; every decoder layer recomputed); the layer
#                                   sync check is train_step's alone
#   bench_gemm_scaling   20 s (15)  the backward GEMMs alone vs the fraction of rows kept (the compaction limit)
#   compile_cuda         85 s (cut at 60, ~60 s of it waiting for the planners)  torch.compile (inductor,
#                                   fullgraph) of one MoE block vs eager, bf16; the custom op compiled vs eager
#   pytest_cuda          60 s (cut at 75, likewise)  the CUDA tests (pytest -m cuda; -n 6 with pytest-xdist)
#
#     bash scripts/gpu_check.sh      # results under results/gpu/<date>-<gpu>/ (or $GPU_CHECK_DIR)
#     GPU_CHECK_STEPS=train_step,compile_cuda bash scripts/gpu_check.sh   # a subset (a rerun)
#     GPU_CHECK_LIMITS=compile_cuda=180,pytest_cuda=150 bash scripts/gpu_check.sh   # other time limits (s)
#
# The planned worst case is printed before the first step. Each step runs under its own limit (SIGINT, then
# SIGKILL 2 s later), its log next to its JSON, and its summary is printed as it ends. The pytest steps stop
# themselves in time (pytest-timeout: no test starts after --session-timeout, none runs longer than
# --timeout), so their junit XML (per-test times) is written; their summary line counts passed and failed
# tests from it (from the log when there is none). numba's cache of the planners does not travel with the
# working tree: tests/warm_planners.py compiles them in the background (niced) from the start (~95 s cold
# on one core; the CPUs are idle during the benchmarks), train_step (its layer sync check plans) waits for it
# (at most until 152 s after the start: before its worst-case start, so the wait never adds to the plan),
# and the pytest processes do not warm again (LRMOE_WARM_PLANNERS=0; set it to 0 here to skip the warm-up).
# Results leave as they come: when $OUT is set (the lent machine's output folder, which brings back a few
# files), the results folder is packed into $OUT/gpu_check.tgz after each step and every
# $GPU_CHECK_PACK_EVERY s (default 20) during one, under a lock, written aside then renamed (never half an
# archive), with steps.txt, summary.txt and env.txt beside it: a run killed at any point (SIGKILL: no trap
# runs) returns every finished step and the running step's log so far. Triton's cache (autotuning
# included) lives in the results' parent folder and is shared by the steps: the first step pays the cold
# compile. env.txt records the versions, the revision and `git status --porcelain` (the dirty tree).
# Without a CUDA GPU (or with CUDA_VISIBLE_DEVICES='') the plumbing runs (the `no-gpu` dry run,
# tests/cli/test_gpu_check.py): a tiny training step, the smoke grouped GEMM under the Triton
# interpreter and the compile step's pytest plumbing (its one test skipped); the others say "skipped".
# When nvidia-smi lists a GPU that torch cannot initialise, the script prints torch's error and exits 3.
# On a copied working tree set LRMOE_GIT_REV to the revision: it wins over the copy's .git, which may be
# stale (the first H200 run recorded the session's starting revision, not the one it ran).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export TRITON_CACHE_AUTOTUNING=1  # later steps reuse the autotune results of earlier ones
PY=${PYTHON:-python3}
ALL_STEPS="bench_grouped_gemm,sim_preset,bench_layer,train_step,train_step_fsdp,bench_gemm_scaling,compile_cuda,pytest_cuda"
declare -A LIMIT=([bench_grouped_gemm]=100 [sim_preset]=5 [bench_layer]=48 [train_step]=70 [train_step_fsdp]=50
                  [bench_gemm_scaling]=20 [compile_cuda]=85 [pytest_cuda]=60)  # seconds
GRACE=2        # SIGINT at a step's limit, SIGKILL this much later
STEP_COST=1    # a step's summary and pack after it
END_COST=3     # the final summary and pack
PLAN_MAX=480   # the lent machine's budget for this check (its command limit is 600 s)
WARM_LIMIT=150 # the planners' warm-up, from the start: ends before train_step's worst-case start (see plan)
PACK_EVERY=${GPU_CHECK_PACK_EVERY:-20}
WANT=${GPU_CHECK_STEPS:-$ALL_STEPS}
known() { case ",$ALL_STEPS," in *",$2,"*) ;; *) echo "unknown step '$2' in $1; accepted: $ALL_STEPS" >&2; exit 2 ;; esac; }
for s in ${WANT//,/ }; do known GPU_CHECK_STEPS "$s"; done
GPU_CHECK_LIMITS=${GPU_CHECK_LIMITS:-}
for kv in ${GPU_CHECK_LIMITS//,/ }; do
    s=${kv%%=*} v=${kv#*=}
    known GPU_CHECK_LIMITS "$s"
    case "$v" in ''|*[!0-9]*) echo "GPU_CHECK_LIMITS: '$kv' is not STEP=SECONDS" >&2; exit 2 ;; esac
    LIMIT[$s]=$v
done
wants() { case ",$WANT," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }

TMPD=$(mktemp -d)
gpu=$($PY -c "import torch; print(torch.cuda.get_device_name().replace(' ', '-'))" 2>"$TMPD/cuda_error") || gpu=no-gpu
# a GPU that torch cannot use is a failure, not a dry run (unless CUDA_VISIBLE_DEVICES='' asks for one)
if [ "$gpu" = no-gpu ] && [ -n "${CUDA_VISIBLE_DEVICES-unset}" ] && nvidia-smi -L 2>/dev/null | grep '^GPU ' >/dev/null
then
    {   echo "nvidia-smi lists a GPU, but torch cannot initialise CUDA" \
             "(CUDA_VISIBLE_DEVICES='' makes the no-gpu dry run on purpose):"
        nvidia-smi -L 2>&1 | head -4
        echo "torch said:"
        tail -n 12 "$TMPD/cuda_error"
    } >&2
    rm -rf "$TMPD"
    exit 3
fi
REV=${LRMOE_GIT_REV:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
if DIRTY=$(git status --porcelain 2>/dev/null); then  # before the results folder exists (it is not ignored)
    N_DIRTY=$(printf '%s' "$DIRTY" | grep -c .)
    TREE="tree $([ "$N_DIRTY" = 0 ] && echo clean || echo "dirty: $N_DIRTY paths")"
    TREE+=" (git status --porcelain against the copy's HEAD $(git rev-parse --short HEAD 2>/dev/null))"
else
    DIRTY="" TREE="tree unknown (no git)"
fi

RES=${GPU_CHECK_DIR:-results/gpu/$(date +%Y%m%d-%H%M%S)-$gpu}
mkdir -p "$RES"
: >"$RES/steps.txt"
: >"$RES/summary.txt"
WARM_PID=""
if [ "${LRMOE_WARM_PLANNERS:-1}" != 0 ]; then  # numba's cache of the planners, compiled beside the benchmarks
    T_WARM=$SECONDS
    timeout --kill-after=$GRACE $WARM_LIMIT nice -n 10 $PY tests/warm_planners.py >"$RES/warm_planners.log" 2>&1 &
    WARM_PID=$!
fi
export LRMOE_WARM_PLANNERS=0  # the pytest processes (tests/conftest.py) do not warm again
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$(cd "$RES/.." && pwd)/.triton-cache}
if [ "$gpu" = no-gpu ]; then
    export TRITON_INTERPRET=1  # the kernels run on CPU tensors (the dry run of the plumbing)
fi
{
    nvidia-smi 2>&1 || echo "nvidia-smi: not available"
    $PY - <<'VEOF'
import importlib.metadata as md
import sys

import torch

print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, end="")
for name in ("triton", "transformers", "numpy", "numba", "pytest", "pytest-xdist", "pytest-timeout"):
    try:
        print(f" {name} {md.version(name)}", end="")
    except md.PackageNotFoundError:
        print(f" {name} not-installed", end="")
print()
VEOF
    echo "revision $REV"
    echo "$TREE"
    [ -z "$DIRTY" ] || printf '%s\n' "$DIRTY" | head -n 100 | sed 's/^/    /'
    echo "steps $WANT"
} >"$RES/env.txt" 2>&1
grep -E '^(python|revision|tree|steps|NVIDIA|\|.*H[12]00)' "$RES/env.txt" | head -6

HAVE_FLOCK=$(command -v flock || true)
pack() {  # bring the results back through $OUT (a few files at most): one archive + the texts, one pack at a time
    [ -n "${OUT:-}" ] && [ "$OUT" != "$RES" ] || return 0
    mkdir -p "$OUT"
    (
        [ -z "$HAVE_FLOCK" ] || flock 9
        # exit 1: a file changed while read (a running step's log): the archive is whole, that file as it was
        tar czf "$OUT/.gpu_check.tgz.part" --warning=no-file-changed --warning=no-file-removed \
            --exclude='*.pt' --exclude='*.safetensors' --exclude='synthetic_alpaca.json' \
            -C "$(dirname "$RES")" "$(basename "$RES")"
        [ $? -le 1 ] && mv -f "$OUT/.gpu_check.tgz.part" "$OUT/gpu_check.tgz"
        for f in env.txt steps.txt summary.txt; do
            [ -f "$RES/$f" ] && cp "$RES/$f" "$OUT/.$f.part" && mv -f "$OUT/.$f.part" "$OUT/$f"
        done
    ) 9>>"$TMPD/pack.lock"
    return 0
}
packer() {  # pack every $PACK_EVERY s (a running step's log so far); TERM stops it between two packs
    local nap=""
    trap '[ -z "$nap" ] || kill "$nap" 2>/dev/null; exit 0' TERM
    while :; do
        sleep "$PACK_EVERY" &
        nap=$!
        wait "$nap"
        pack
    done
}
PACKER=""
if [ -n "${OUT:-}" ] && [ "$OUT" != "$RES" ] && [ -n "$HAVE_FLOCK" ]; then
    packer &
    PACKER=$!
fi
stop_background() {  # the packer and an unfinished warm-up (no later step needs it); idempotent
    if [ -n "$PACKER" ]; then
        kill -TERM "$PACKER" 2>/dev/null
        wait "$PACKER" 2>/dev/null
        PACKER=""
    fi
    if [ -n "$WARM_PID" ]; then
        local rc
        kill -TERM "$WARM_PID" 2>/dev/null  # timeout passes it on to the warm-up
        wait "$WARM_PID"
        rc=$?
        echo "warm_planners rc=$rc (limit ${WARM_LIMIT}s; background, no step waited; rc 143: stopped at the end," \
            "${SECONDS}s into the check): $(tail -n 1 "$RES/warm_planners.log")" >>"$RES/steps.txt"
        WARM_PID=""
    fi
}
trap 'stop_background; rm -rf "$TMPD"' EXIT
planners_ready() {  # wait for the planners' warm-up (before the first step that plans)
    [ -n "$WARM_PID" ] || return 0
    local t0=$SECONDS rc
    echo "== waiting for the planners' warm-up (started $((SECONDS - T_WARM))s ago, limit ${WARM_LIMIT}s)"
    wait "$WARM_PID"
    rc=$?
    WARM_PID=""
    echo "warm_planners rc=$rc $((SECONDS - T_WARM))s (limit ${WARM_LIMIT}s; background, waited $((SECONDS - t0))s):" \
        "$(tail -n 1 "$RES/warm_planners.log")" | tee -a "$RES/steps.txt"
}

declare -A JUNIT=()
pytest_counts() {  # one line: a pytest step's tests counted from its junit XML, else from its -v log
    $PY - "$RES" "$1" <<'CEOF'
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

res, name = Path(sys.argv[1]), sys.argv[2]
log_file = res / f"{name}.log"
log = log_file.read_text(errors="replace") if log_file.exists() else ""
sizes = re.findall(r"collected (\d+) items?(?: / (\d+) deselected)?(?: / (\d+) selected)?"
                   r"|\d+ workers \[(\d+) items?\]", log)
if sizes:  # the tests selected to run (xdist's workers count those alone)
    total, deselected, chosen, workers = (int(n) if n else None for n in sizes[-1])
    selected = workers if workers is not None else chosen if chosen is not None else total - (deselected or 0)
else:
    selected = None
n = dict.fromkeys(("passed", "failed", "timed out", "errors", "skipped"), 0)
try:
    cases = list(ET.parse(res / f"{name}.xml").getroot().iter("testcase"))
    for case in cases:
        kinds = {c.tag for c in case}
        if "failure" in kinds:
            n["failed"] += 1
            n["timed out"] += "Timeout" in (case.find("failure").get("message") or "")
        elif "error" in kinds:
            n["errors"] += 1
        elif "skipped" in kinds:
            n["skipped"] += 1
        else:
            n["passed"] += 1
    ran = len(cases)
    source = f"junit {name}.xml, {sum(float(c.get('time') or 0) for c in cases):.0f} s in tests"
except (OSError, ET.ParseError):  # cut before pytest wrote it: the -v log's progress lines
    words = {"PASSED": "passed", "XPASS": "passed", "FAILED": "failed", "ERROR": "errors", "SKIPPED": "skipped",
             "XFAIL": "skipped"}
    pattern = re.compile(r"^(?:\[gw\d+\] \[ *\d+%\] (\w+) |\S+::\S+ (\w+)\b)")
    ran = 0
    for line in log.splitlines():
        m = pattern.match(line)
        word = m and (m.group(1) or m.group(2))
        if word in words:
            n[words[word]] += 1
            ran += 1
    source = f"no junit XML: counted from {name}.log"
not_run = f"; {selected - ran} not run" if selected is not None and selected > ran else ""
stopped = "; stopped by its --session-timeout" if "session-timeout:" in log else ""
print(f"[gpu_check] pytest: {n['passed']} passed, {n['failed']} failed ({n['timed out']} timed out), "
      f"{n['errors']} errors, {n['skipped']} skipped of {selected if selected is not None else '?'} selected"
      f"{not_run}{stopped} ({source})")
CEOF
}

step() {  # step NAME CMD...: run with the step's time limit, log to $RES/NAME.log, record rc and time, pack
    local name=$1 limit=${LIMIT[$1]} t0=$SECONDS rc
    shift
    wants "$name" || return 0
    echo "== $name (limit ${limit}s, ${SECONDS}s into the check)"
    timeout --signal=INT --kill-after=$GRACE "$limit" "$@" >"$RES/$name.log" 2>&1
    rc=$?
    [ -z "${JUNIT[$name]:-}" ] || pytest_counts "$name" >>"$RES/$name.log" 2>&1
    echo "$name rc=$rc $((SECONDS - t0))s (limit ${limit}s)" | tee -a "$RES/steps.txt"
    { echo "-- $name (rc=$rc, $((SECONDS - t0))s)"; $PY scripts/gpu_check_summary.py "$RES" "$name"; } 2>&1 \
        | tee -a "$RES/summary.txt"
    pack
}
PYTEST_TIMEOUT=""
if $PY -c "import pytest_timeout as t; t.SESSION_TIMEOUT_DESC" 2>/dev/null; then PYTEST_TIMEOUT=1; fi  # >= 2.3
XDIST=""
if $PY -c "import xdist" 2>/dev/null; then XDIST="-n 6"; fi  # the cold Triton compiles in parallel
pytest_step() {  # pytest_step NAME PER_TEST_S ARGS...: pytest that stops itself before the step's limit
    local name=$1 per_test=$2 limit=${LIMIT[$1]} session
    shift 2
    local flags=(-v -p no:cacheprovider --junitxml="$RES/$name.xml")
    if [ -n "$PYTEST_TIMEOUT" ]; then
        # a test starts at most `session` s after a (worker) process's start-up (~5 s) and runs at most
        # `per_test` s: pytest writes its junit before the step's limit
        [ "$per_test" -le $((limit / 2)) ] || per_test=$((limit / 2))
        session=$((limit - per_test - 7))
        [ "$session" -ge 1 ] || session=1
        flags+=(--session-timeout="$session" --timeout="$per_test" --timeout-method=signal)
    fi
    JUNIT[$name]=1
    step "$name" $PY -m pytest "${flags[@]}" $XDIST "$@"
}
skip() {  # skip NAME WHY: a step this machine cannot run
    wants "$1" || return 0
    echo "$1 skipped: $2" | tee -a "$RES/steps.txt"
    pack
}
plan() {  # plan STEP...: the worst case of these steps (in this order), each at its limit, from now
    local t=$SECONDS s line=""
    for s in "$@"; do
        wants "$s" || continue
        if [ "$s" = train_step ] && [ -n "$WARM_PID" ] && [ "$gpu" != no-gpu ]; then
            [ "$t" -ge $((T_WARM + WARM_LIMIT + GRACE)) ] || t=$((T_WARM + WARM_LIMIT + GRACE))
        fi
        t=$((t + LIMIT[$s] + GRACE + STEP_COST))
        line+=" $s ${LIMIT[$s]}"
    done
    t=$((t + END_COST))
    echo "plan (limits, s):$line; worst case ${t}s from the start (start-up ${SECONDS}s so far, +$GRACE s kill" \
        "grace and +$STEP_COST s summary/pack per step, +$END_COST s at the end; budget ${PLAN_MAX}s)"
    [ "$t" -le "$PLAN_MAX" ] || echo "WARNING: the plan's worst case ${t}s is over the ${PLAN_MAX}s budget"
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
if [ "$gpu" = no-gpu ]; then  # only the plumbing can be checked without a GPU
    echo "no CUDA GPU: a dry run of the plumbing (a tiny training step, smoke shapes; the fast step first)"
    plan train_step bench_grouped_gemm compile_cuda
    step train_step $PY scripts/gpu_train_step.py --allow-cpu --preset smoke --run qwen3-C20-lrm-s0 --steps 1 \
        --data "$data" --out "$RES/train_step"
    step bench_grouped_gemm $PY scripts/bench_grouped_gemm.py --smoke --sections gemm --reps 1 --out "$RES"
    pytest_step compile_cuda 20 "$COMPILE_TEST"  # skipped without a GPU: pytest-timeout, junit and counts
    skip sim_preset "needs the CUDA grouped-GEMM rows"
    skip bench_layer "needs CUDA"
    skip train_step_fsdp "needs CUDA (NCCL)"
    skip bench_gemm_scaling "needs CUDA"
    skip pytest_cuda "needs CUDA"
else
    plan ${ALL_STEPS//,/ }
    step bench_grouped_gemm $PY scripts/bench_grouped_gemm.py --reps 5 --out "$RES"
    base=h200-sxm; case "$gpu" in *H100*) base=h100-sxm ;; esac
    step sim_preset $PY -m lrmoe.sim.measured "$RES/bench_grouped_gemm_cuda.json" "$RES/$base-measured.json" $base
    step bench_layer $PY scripts/bench_layer.py --device cuda --repeats 5 --warmup 1 --out "$RES"
    wants train_step && planners_ready  # its layer sync check plans (expert-parallel, LRMoE placement)
    step train_step $PY scripts/gpu_train_step.py --preset gpu1 --run qwen3-C20-lrm-s0 --steps 2 \
        --data "$data" --out "$RES/train_step"
    step train_step_fsdp $PY scripts/gpu_train_step.py --preset gpu1 --run qwen3-C20-lrm-s0 --steps 1 \
        --set fsdp=true --set activation_checkpointing=true --no-layer-sync-check --data "$data" \
        --out "$RES/train_step_fsdp"
    step bench_gemm_scaling $PY scripts/bench_gemm_scaling.py --device cuda --backend torch --backend triton \
        --repeats 5 --out "$RES"
    pytest_step compile_cuda 40 "$COMPILE_TEST" tests/kernels/test_triton_custom_op.py -k "inductor or compiled"
    pytest_step pytest_cuda 28 -m cuda tests --deselect "$COMPILE_TEST"
fi

stop_background
$PY scripts/gpu_check_summary.py "$RES" >"$RES/summary.txt" 2>&1
cat "$RES/summary.txt"
pack
echo "results: $RES (${SECONDS}s)"
