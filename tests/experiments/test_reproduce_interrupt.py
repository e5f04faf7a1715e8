"""Stopping `lrmoe reproduce` (a job scheduler's SIGTERM to the parent): every run in training
finishes its step, writes a checkpoint and exits; none keeps training orphaned, queued runs do
not start, and the parent exits 130 with a resume hint. Asserted on the events (exit status,
checkpoint step, processes left), with only an outer timeout against hangs."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from lrmoe.data import shared_data_dir

TINY = shared_data_dir() / "alpaca" / "alpaca_tiny.json"

DRIVER = textwrap.dedent("""
    import dataclasses, sys
    from lrmoe.reproduce import PRESETS, reproduce

    smoke = PRESETS["smoke"]
    base = dict(smoke.base, steps=100_000, checkpoint_interval=100_000, eval_interval=0)
    jobs = int(sys.argv[2])
    p = dataclasses.replace(smoke, name="interrupt", base=base, families=("qwen3",), e1_drops=(0.0, 0.1),
                            e2_scorers=(), e2_seeds=(), jobs=jobs)
    sys.exit(reproduce(p, sys.argv[1], jobs=jobs, figures=False, progress=False))
""")
RUNS = ("qwen3-C00-s0", "qwen3-C10-lrm-s0")

pytestmark = [pytest.mark.skipif(not TINY.exists(), reason=f"offline Alpaca sample not found at {TINY}"),
              pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals and process groups"),
              pytest.mark.timeout(600)]  # against hangs only; nothing below is timed


def _rows(path):
    try:
        return sum(1 for line in open(path) if line.strip())
    except OSError:
        return 0


def _sigterm_once_training(tmp_path, jobs: int, training: list[str]):
    """Start the driver in its own process group, wait until every run of ``training`` has logged 3
    steps, SIGTERM the parent only (as a scheduler would); returns (exit status, log, processes of
    the group still running other than multiprocessing's resource tracker, results folder)."""
    out = tmp_path / "out"
    env = dict(os.environ, LRMOE_CACHE=str(tmp_path / "cache"), HF_HOME=str(tmp_path / "hf"))
    env.pop("LRMOE_ALPACA", None)

    def child_setup():  # its own process group, SIGINT not inherited as ignored (pytest may run in the background)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.setsid()

    log_path = tmp_path / "reproduce.log"
    with open(log_path, "w") as log_fh:  # a file, not a pipe: orphaned workers must not block the read
        proc = subprocess.Popen([sys.executable, "-c", DRIVER, str(out), str(jobs)], env=env,
                                preexec_fn=child_setup, stdout=log_fh, stderr=subprocess.STDOUT)
    try:
        while not all(_rows(out / r / "metrics.jsonl") >= 3 for r in training):
            assert proc.poll() is None, log_path.read_text()
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGTERM)
        rc = proc.wait()
        ps = subprocess.run(["ps", "-o", "pid=,args=", "-g", str(proc.pid)], capture_output=True, text=True).stdout
        # A process whose command line ps shows in brackets ("[python]", "[python] <defunct>") has
        # already released its memory on its way out: it runs no more Python code.
        left = [line for line in ps.splitlines()
                if line.split(None, 1)[1:] and not line.split(None, 1)[1].startswith("[")
                and "resource_tracker" not in line]
    finally:
        try:  # whatever happened, nothing of this test keeps running
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return rc, log_path.read_text(), left, out


def _assert_checkpointed_at_its_step(run_dir):
    ck = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    assert ck["step"] == _rows(run_dir / "metrics.jsonl") >= 3  # checkpointed at the interrupted step
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "running"


def test_sigterm_lets_parallel_workers_checkpoint_and_exit(tmp_path):
    rc, log, left, out = _sigterm_once_training(tmp_path, jobs=2, training=list(RUNS))
    assert rc == 130, log
    assert "interrupted; rerun the same command to resume" in log
    assert not left, "processes left in the group:\n" + "\n".join(left)
    for r in RUNS:
        _assert_checkpointed_at_its_step(out / r)


def test_sigterm_to_one_job_checkpoints_the_run_and_starts_no_other(tmp_path):
    """With --jobs 1 the run trains in the parent itself: SIGTERM used to kill it at once (status
    -15, no checkpoint, its steps since the last periodic checkpoint lost)."""
    rc, log, left, out = _sigterm_once_training(tmp_path, jobs=1, training=[RUNS[0]])
    assert rc == 130, log
    assert "interrupted; rerun the same command to resume" in log
    assert not left, "processes left in the group:\n" + "\n".join(left)
    _assert_checkpointed_at_its_step(out / RUNS[0])
    assert not (out / RUNS[1] / "metrics.jsonl").exists()  # the queued run never started
