"""Stopping `lrmoe reproduce --jobs N` (a job scheduler's SIGTERM to the parent): the parallel
workers finish their step, write a checkpoint and exit; none keeps training orphaned, and the
parent exits 130. Before, the workers kept training after the parent was gone."""
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
    p = dataclasses.replace(smoke, name="interrupt", base=base, families=("qwen3",), e1_drops=(0.0, 0.1),
                            e2_scorers=(), e2_seeds=(), jobs=2)
    sys.exit(reproduce(p, sys.argv[1], jobs=2, figures=False, progress=False))
""")


def _rows(path):
    try:
        return sum(1 for line in open(path) if line.strip())
    except OSError:
        return 0


@pytest.mark.skipif(not TINY.exists(), reason=f"offline Alpaca sample not found at {TINY}")
@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals and process groups")
def test_sigterm_lets_parallel_workers_checkpoint_and_exit(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, LRMOE_CACHE=str(tmp_path / "cache"), HF_HOME=str(tmp_path / "hf"))
    env.pop("LRMOE_ALPACA", None)

    def child_setup():  # its own process group, SIGINT not inherited as ignored (pytest may run in the background)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.setsid()

    log_path = tmp_path / "reproduce.log"
    with open(log_path, "w") as log_fh:  # a file, not a pipe: orphaned workers must not block the read
        proc = subprocess.Popen([sys.executable, "-c", DRIVER, str(out)], env=env, preexec_fn=child_setup,
                                stdout=log_fh, stderr=subprocess.STDOUT)
    runs = [out / "qwen3-C00-s0", out / "qwen3-C10-lrm-s0"]
    rc, left = None, ""
    try:
        deadline = time.monotonic() + 120
        while not all(_rows(r / "metrics.jsonl") >= 3 for r in runs):
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, "the workers did not start training"
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGTERM)  # the parent only, as a scheduler would
        rc = proc.wait(timeout=150)
        deadline = time.monotonic() + 10  # (multiprocessing's resource tracker exits just after its parent)
        while (left := subprocess.run(["ps", "-o", "pid=,args=", "-g", str(proc.pid)], capture_output=True,
                                      text=True).stdout.strip()) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        try:  # whatever happened, nothing of this test keeps running
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    log = log_path.read_text()
    assert rc == 130, log
    assert "interrupted; rerun the same command to resume" in log
    assert not left, f"processes left in the group:\n{left}"
    for r in runs:
        ck = torch.load(r / "checkpoint.pt", weights_only=False)
        assert ck["step"] == _rows(r / "metrics.jsonl") >= 3  # checkpointed at the interrupted step
        assert json.loads((r / "summary.json").read_text())["status"] == "running"
