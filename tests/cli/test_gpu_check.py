"""The GPU check's plumbing on CPU (scripts/gpu_check.sh, no-gpu branch): every step's output appears
under a fake $OUT as the step ends, also when the whole command is killed (SIGKILL, as the lent
machine does at its limit: no trap runs), and the summary reads what the steps wrote."""
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def env_for(tmp_path: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "GPU_CHECK_STEPS", "GPU_CHECK_DIR")}
    env.update(OUT=str(tmp_path / "out"), GPU_CHECK_DIR=str(tmp_path / "res" / "run"), PYTHON=sys.executable,
               CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="2", LRMOE_CACHE=str(tmp_path / "cache"),
               TRITON_CACHE_DIR=str(tmp_path / "triton"), **extra)
    return env


def archive_names(out: Path) -> set[str]:
    with tarfile.open(out / "gpu_check.tgz") as t:
        return set(t.getnames())


def test_dry_run_brings_back_every_step(tmp_path):
    p = subprocess.run(["bash", str(SCRIPT)], env=env_for(tmp_path), cwd=ROOT, capture_output=True, text=True,
                       timeout=400)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out = tmp_path / "out"
    assert {f.name for f in out.iterdir()} == {"gpu_check.tgz", "env.txt", "steps.txt", "summary.txt"}
    names = archive_names(out)
    assert {"run/bench_grouped_gemm_cpu.json", "run/train_step/gpu_train_step.json", "run/train_step.log"} <= names
    assert "run/synthetic_alpaca.json" not in names
    steps = (out / "steps.txt").read_text().splitlines()
    # every step is accounted for: ran (with its rc) or skipped with a reason
    assert [s.split()[0] for s in steps] == ["train_step", "bench_grouped_gemm", "sim_preset", "bench_layer",
                                             "train_step_fsdp", "compile_cuda", "pytest_cuda", "bench_gemm_scaling"]
    assert "train_step rc=0" in steps[0] and "bench_grouped_gemm rc=0" in steps[1]
    assert all("skipped: " in s for s in steps if s.split()[0] not in ("bench_grouped_gemm", "train_step"))
    # the grouped-GEMM bench ran end to end at its --smoke shapes (scripts/bench_grouped_gemm.py; its own
    # helpers are tested in tests/kernels/test_triton_grouped_gemm.py)
    bench = json.loads((tmp_path / "res" / "run" / "bench_grouped_gemm_cpu.json").read_text())
    assert bench["complete"] and {r["pass_"] for r in bench["passes"]} == {"fwd", "dgrad", "wgrad"}
    res = json.loads((tmp_path / "res" / "run" / "train_step" / "gpu_train_step.json").read_text())
    assert res["complete"] and len(res["steps"]) == 2 and all(s["loss"] > 0 for s in res["steps"])
    summary = (out / "summary.txt").read_text()
    assert "training step, smoke qwen3-C20-lrm-s0 on cpu (complete" in summary
    assert "results checked against F.grouped_mm: 0 wrong" in summary
    # each step's summary was printed as it ended, before the next step started
    assert p.stdout.index("-- train_step (rc=0") < p.stdout.index("== bench_grouped_gemm")


def test_killed_run_keeps_the_finished_steps(tmp_path):
    """SIGKILL to the whole process group while the second step runs: the first step's results are in $OUT."""
    env = env_for(tmp_path, GPU_CHECK_STEPS="train_step,bench_grouped_gemm")
    proc = subprocess.Popen(["bash", str(SCRIPT)], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    steps = tmp_path / "out" / "steps.txt"
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            if steps.exists() and "train_step rc=" in steps.read_text():
                break
            time.sleep(0.2)
        assert proc.poll() is None, "the script ended before it could be killed: " + proc.stdout.read()[-2000:]
        assert "train_step rc=0" in steps.read_text()
        time.sleep(1.0)  # the second step (the grouped GEMM under the interpreter, ~15 s) is running
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    names = archive_names(tmp_path / "out")
    assert "run/train_step/gpu_train_step.json" in names
    assert "run/bench_grouped_gemm_cpu.json" not in names  # killed before it wrote: not a stale file


def test_unknown_step_is_refused_before_anything_runs(tmp_path):
    p = subprocess.run(["bash", str(SCRIPT)], env=env_for(tmp_path, GPU_CHECK_STEPS="train_step,bench"),
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert "unknown step 'bench'" in p.stderr and "accepted: bench_grouped_gemm," in p.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv", [[], ["a", "b", "c"], ["dir", "nosuchstep"]])
def test_summary_usage(argv):
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check_summary.py"), *argv],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "usage: gpu_check_summary.py RESULTS_DIR [STEP]" in p.stderr
