"""The GPU check's plumbing on CPU (scripts/gpu_check.sh, no-gpu branch): every step's output appears
under a fake $OUT as the step ends, also when the whole command is killed (SIGKILL, as the lent
machine does at its limit: no trap runs), and the summary reads what the steps wrote."""
import json
import os
import re
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
    env = {k: v for k, v in os.environ.items()
           if k not in ("OUT", "GPU_CHECK_STEPS", "GPU_CHECK_DIR", "GPU_CHECK_LIMITS", "LRMOE_WARM_PLANNERS")}
    env.update({"OUT": str(tmp_path / "out"), "GPU_CHECK_DIR": str(tmp_path / "res" / "run"), "PYTHON": sys.executable,
                "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "2", "LRMOE_CACHE": str(tmp_path / "cache"),
                "TRITON_CACHE_DIR": str(tmp_path / "triton"), **extra})
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
    assert {"run/bench_grouped_gemm_cpu.json", "run/train_step/gpu_train_step.json", "run/train_step.log",
            "run/compile_cuda.xml", "run/warm_planners.log"} <= names
    assert "run/synthetic_alpaca.json" not in names
    steps = (out / "steps.txt").read_text().splitlines()
    # every step is accounted for: ran (with its rc) or skipped with a reason; then the planners' warm-up,
    # which no step of the dry run waits for (stopped at the end if still compiling)
    ran = ["train_step", "bench_grouped_gemm", "compile_cuda"]
    assert [s.split()[0] for s in steps] == ran + ["sim_preset", "bench_layer", "train_step_fsdp",
                                                   "bench_gemm_scaling", "pytest_cuda", "warm_planners"]
    assert all(f"{name} rc=0" in line for name, line in zip(ran, steps))
    assert all("skipped: " in s for s in steps[len(ran):-1])
    assert "no step waited" in steps[-1]
    assert p.stdout.index("plan (limits, s): train_step 70 bench_grouped_gemm 100 compile_cuda 85; worst case ") \
        < p.stdout.index("== train_step")
    # the pytest plumbing: pytest-timeout's flags, the junit XML, the counted summary line
    log = (tmp_path / "res" / "run" / "compile_cuda.log").read_text()
    assert "session timeout: " in log and "timeout: 20.0s" in log  # --session-timeout and the per-test --timeout
    assert log.splitlines()[-1] == ("[gpu_check] pytest: 0 passed, 0 failed (0 timed out), 0 errors, 1 skipped of 1 "
                                    "selected (junit compile_cuda.xml, 0 s in tests)")
    # the dirty tree beside the revision, as git sees it
    env_lines = (out / "env.txt").read_text().splitlines()
    rev = next(i for i, line in enumerate(env_lines) if line.startswith("revision "))
    tree = re.fullmatch(r"tree (clean|dirty: (\d+) paths) \(git status --porcelain against the copy's HEAD \w+\)",
                        env_lines[rev + 1])
    assert tree, env_lines[rev + 1]
    listed = min(int(tree[2] or 0), 100)
    assert all(re.fullmatch(r"    [ MADRCU?!]{2} \S.*", line) for line in env_lines[rev + 2:rev + 2 + listed])
    assert env_lines[rev + 2 + listed].startswith("steps ")
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


def test_killed_run_keeps_the_finished_steps_and_the_running_steps_log(tmp_path):
    """SIGKILL to the whole process group while the second step runs: the first step's results are in $OUT,
    and the second step's log so far (the periodic pack, every second here)."""
    env = env_for(tmp_path, GPU_CHECK_STEPS="train_step,bench_grouped_gemm", GPU_CHECK_PACK_EVERY="1",
                  LRMOE_WARM_PLANNERS="0")  # no warm-up: it would outlive the kill (timeout's own process group)
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
        # the second step (the grouped GEMM under the interpreter, ~15 s) runs; a periodic pack takes its log
        while time.monotonic() < deadline and proc.poll() is None:
            if "run/bench_grouped_gemm.log" in archive_names(tmp_path / "out"):
                break
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    names = archive_names(tmp_path / "out")
    assert "run/train_step/gpu_train_step.json" in names
    assert "run/bench_grouped_gemm.log" in names  # the running step's log so far
    assert "run/bench_grouped_gemm_cpu.json" not in names  # killed before it wrote: not a stale file
    assert "bench_grouped_gemm rc=" not in steps.read_text()


def test_gpu_that_torch_cannot_use_fails_loudly(tmp_path):
    """nvidia-smi lists a GPU but torch cannot initialise CUDA (a bogus CUDA_VISIBLE_DEVICES here; on this
    machine a CPU-only torch): torch's error and exit 3, not a silent dry run. CUDA_VISIBLE_DEVICES=''
    (the tests above) asks for the dry run."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-00000000-0000-0000-0000-000000000000)'\n")
    fake.chmod(0o755)
    env = env_for(tmp_path, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
                  CUDA_VISIBLE_DEVICES="GPU-00000000-0000-0000-0000-000000000000")
    p = subprocess.run(["bash", str(SCRIPT)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 3, p.stdout[-2000:] + p.stderr[-2000:]
    assert "nvidia-smi lists a GPU, but torch cannot initialise CUDA" in p.stderr
    assert "GPU 0: NVIDIA H200" in p.stderr
    torch_said = p.stderr.split("torch said:", 1)[1]
    assert "Error" in torch_said  # torch's exception (type and message), whatever its wording
    assert not (tmp_path / "out").exists() and not (tmp_path / "res").exists()


def test_unknown_step_is_refused_before_anything_runs(tmp_path):
    p = subprocess.run(["bash", str(SCRIPT)], env=env_for(tmp_path, GPU_CHECK_STEPS="train_step,bench"),
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert "unknown step 'bench'" in p.stderr and "accepted: bench_grouped_gemm," in p.stderr
    assert not (tmp_path / "out").exists()
    for limits, why in (("pytest=10", "unknown step 'pytest' in GPU_CHECK_LIMITS"),
                        ("pytest_cuda=10s", "'pytest_cuda=10s' is not STEP=SECONDS")):
        p = subprocess.run(["bash", str(SCRIPT)], env=env_for(tmp_path, GPU_CHECK_LIMITS=limits), cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 2 and why in p.stderr


@pytest.mark.parametrize("argv", [[], ["a", "b", "c"], ["dir", "nosuchstep"]])
def test_summary_usage(argv):
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check_summary.py"), *argv],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "usage: gpu_check_summary.py RESULTS_DIR [STEP]" in p.stderr
