"""Stopping a run (lrmoe.train.loop): Ctrl-C and SIGTERM at and inside a step, an ignored SIGINT;
the run resumes as if uninterrupted."""
import os
import signal
import time

import pytest
import torch

import lrmoe.hf as hf
from lrmoe.train import read_metrics, train

from .helpers import cfg


def _on_call(monkeypatch, target, name, n, action):
    """Run ``action()`` on the n-th call (1-based) of target.name, before the call."""
    orig = getattr(target, name)
    calls = {"n": 0}

    def wrapper(*a, **k):
        calls["n"] += 1
        if calls["n"] == n:
            action()
        return orig(*a, **k)

    monkeypatch.setattr(target, name, wrapper)


def _raise():
    raise KeyboardInterrupt


def _sigint():
    os.kill(os.getpid(), signal.SIGINT)


@pytest.fixture
def sigint_handler(request):
    """SIGINT set to ``request.param`` (default: Python's own handler, whatever this process
    inherited: a background job starts with SIGINT ignored) for the test, restored after."""
    handler = getattr(request, "param", signal.default_int_handler)
    before = signal.signal(signal.SIGINT, handler)
    yield handler
    signal.signal(signal.SIGINT, before)


@pytest.mark.parametrize("how", ["signal", "exception"])
def test_ctrl_c_inside_a_step_resumes_exactly(data_path, tmp_path, monkeypatch, how, sigint_handler):
    """Ctrl-C while step 3's second micro-batch runs (grad_accum 2, random scorer). A real SIGINT
    lets step 3 finish and checkpoints at its end; a KeyboardInterrupt raised inside the step
    (no consistent state) writes no checkpoint. Either way the resumed run equals an
    uninterrupted one: same rows, epochs and losses."""
    c = cfg(data_path, steps=5, grad_accum=2, drop_ratio=0.3, scorer="random")
    full, part = tmp_path / "full", tmp_path / "part"
    train(c, full, progress=False)
    with monkeypatch.context() as mp:  # backward_records: once per micro-batch; call 6 = step 3, micro-batch 2
        _on_call(mp, hf, "backward_records", 6, _sigint if how == "signal" else _raise)
        with pytest.raises(KeyboardInterrupt):
            train(c, part, progress=False)
    rows = read_metrics(part / "metrics.jsonl")
    assert [r["step"] for r in rows] == ([1, 2, 3] if how == "signal" else [1, 2])
    assert (part / "checkpoint.pt").exists() == (how == "signal")
    assert signal.getsignal(signal.SIGINT) is sigint_handler  # the handler was restored
    train(c, part, progress=False)
    a, b = read_metrics(full / "metrics.jsonl"), read_metrics(part / "metrics.jsonl")
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5]
    assert [r["epoch"] for r in b] == [r["epoch"] for r in a]
    assert [r["loss"] for r in b] == [r["loss"] for r in a]


@pytest.mark.parametrize("sigint_handler", [signal.SIG_IGN], indirect=True)
def test_an_ignored_sigint_stays_ignored(data_path, tmp_path, monkeypatch, sigint_handler):
    """A process started with SIGINT ignored (a background job, nohup) keeps ignoring it: training
    installs no Ctrl-C handler, and a SIGINT in the middle of a step changes nothing."""
    c = cfg(data_path, steps=3, warmup_steps=1, eval_batches=None)
    seen = []
    with monkeypatch.context() as mp:
        _on_call(mp, hf, "backward_records", 2, lambda: (seen.append(signal.getsignal(signal.SIGINT)), _sigint()))
        try:
            train(c, tmp_path / "run", progress=False)
        except KeyboardInterrupt:  # not let through to pytest, which would end the whole session
            pytest.fail("training stopped on a SIGINT that the process ignores")
    assert seen == [signal.SIG_IGN]
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3]
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN


@pytest.mark.parametrize("sigint_handler", [signal.SIG_IGN], indirect=True)
def test_a_callers_sigterm_handler_passes_the_stop_on(data_path, tmp_path, monkeypatch, sigint_handler):
    """A SIGTERM handler of the caller's (the run pool's) stays in place; through request_stop the
    signal stops the run at its step with a checkpoint, SIGINT being ignored. With no run training
    request_stop does nothing (False: the caller stops at once)."""
    from lrmoe.train.loop import Interrupted, request_stop

    asked = []

    def on_term(signum, frame):
        asked.append(request_stop(signum))
        if not asked[-1]:
            raise Interrupted(signum)

    c = cfg(data_path, steps=5, warmup_steps=1, eval_batches=None)
    prev = signal.signal(signal.SIGTERM, on_term)
    try:
        assert request_stop(signal.SIGTERM) is False
        with monkeypatch.context() as mp:  # backward_records: once per step here; call 2 = step 2
            _on_call(mp, hf, "backward_records", 2, lambda: os.kill(os.getpid(), signal.SIGTERM))
            with pytest.raises(Interrupted) as e:
                train(c, tmp_path / "run", progress=False)
        assert signal.getsignal(signal.SIGTERM) is on_term and request_stop(signal.SIGTERM) is False
    finally:
        signal.signal(signal.SIGTERM, prev)
    assert e.value.signum == signal.SIGTERM and e.value.exit_code == 143 and asked == [True]
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1, 2]
    assert torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)["step"] == 2
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def test_ctrl_c_during_evaluation_keeps_every_metrics_row(data_path, tmp_path, monkeypatch, sigint_handler):
    """Ctrl-C during the evaluation of step 2: the step (with its eval) completes, its row is
    written, the checkpoint is at step 2, and the resumed file has one row per step."""
    import lrmoe.train.loop as T

    c = cfg(data_path, steps=4, eval_interval=2)
    with monkeypatch.context() as mp:
        _on_call(mp, T, "evaluate", 1, _sigint)
        with pytest.raises(KeyboardInterrupt):
            train(c, tmp_path, progress=False)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and "eval_loss" in rows[-1]
    train(c, tmp_path, progress=False)
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]


# ----------------------------------------------------------------------------- SIGTERM, a real process


def _metrics_lines(path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


# With SIGINT ignored (a background job of a non-interactive shell, some schedulers) the SIGTERM path
# is the same: test_an_ignored_sigint_stays_ignored and test_a_callers_sigterm_handler_passes_the_stop_on
# cover that disposition in process.
def test_sigterm_checkpoints_at_the_step_and_the_rerun_keeps_every_row(data_path, tmp_path):
    """SIGTERM (what SLURM and Kubernetes send) to `lrmoe train`: the step in flight finishes, a
    checkpoint of it is written, the exit status is 143 with a resume hint; the rerun continues from
    that step with every row of the first attempt kept."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    import lrmoe

    root = Path(lrmoe.__file__).resolve().parents[1]
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "lrmoe.cli", "train", "--out", str(out), "--data", data_path, "--tokenizer",
           "bpe:300", "--seq-len", "64", "--micro-batch", "2", "--steps", "500", "--warmup-steps", "1",
           "--threads", "1", "--eval-batches", "1", "--no-progress"]
    env = dict(os.environ, PYTHONPATH=str(root))
    p = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # not as pytest inherited it

    def wait_rows(n):
        for _ in range(3000):  # (a guard against a hang, not a timed assert)
            if _metrics_lines(out / "metrics.jsonl") >= n or p.poll() is not None:
                break
            time.sleep(0.1)
        assert p.poll() is None, p.communicate()[1][-3000:]

    try:
        wait_rows(2)
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 143, err[-3000:]
    assert "rerun the same command to resume" in err
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    n = len(rows)
    assert n >= 2 and [r["step"] for r in rows] == list(range(1, n + 1))
    assert torch.load(out / "checkpoint.pt", weights_only=False)["step"] == n
    assert json.loads((out / "summary.json").read_text())["status"] == "running"
    r = subprocess.run(cmd + ["--stop-after", str(n + 1)], cwd=root, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    again = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in again] == list(range(1, n + 2))
    assert [x["loss"] for x in again[:n]] == [x["loss"] for x in rows]


def test_interrupted_survives_a_process_boundary():
    """A worker of a process pool raises Interrupted; the parent unpickles it with its signal."""
    import pickle
    import signal

    from lrmoe.train import Interrupted

    for sig in (signal.SIGINT, signal.SIGTERM):
        e = pickle.loads(pickle.dumps(Interrupted(sig)))
        assert isinstance(e, KeyboardInterrupt) and e.signum == sig and e.exit_code == 128 + sig
        assert str(e) == signal.Signals(sig).name
