"""TraceRecorder (``--record-trace``): the run folder's own trace is rewritten by a restart from
step 0, a file elsewhere never is; a resume extends the trace its checkpoint covers and refuses
one that is too short or missing."""
from __future__ import annotations

import types

import numpy as np
import pytest

from lrmoe.run_folder import TRACE
from lrmoe.sim.trace import load_trace
from lrmoe.train.trace_record import TraceRecorder

CFG = types.SimpleNamespace(model="qwen3-moe-tiny", placement="lrmoe", ep=2, virtual_ep=1, drop_ratio=0.2, seed=0,
                            grad_accum=1)


def _record(path, run_dir, steps_done=0, micro_batches=3):
    rec = TraceRecorder(path, CFG, run_dir=run_dir, main=True, steps_done=steps_done, tokens_per_rank=16)
    for i in range(micro_batches):
        rec.add(np.full((1, 2, 4), steps_done + i + 1), top_k=2)
    rec.save()
    return rec


def test_the_run_folders_own_trace_is_rewritten_by_a_restart(tmp_path):
    for path in (None, tmp_path / TRACE):  # the default, and the same file named explicitly (a preset's E3 run)
        _record(path, tmp_path)
        _record(path, tmp_path, micro_batches=2)  # a restart from step 0
        tr = load_trace(tmp_path / TRACE)
        assert tr.counts.shape == (2, 1, 2, 4) and tr.meta["ep"] == 2 and tr.meta["placement"] == "lrmoe"


def test_a_file_elsewhere_is_never_overwritten(tmp_path):
    other = tmp_path / "mine.npz"
    _record(other, tmp_path / "run")
    with pytest.raises(ValueError, match="exists and this run starts at step 0"):
        _record(other, tmp_path / "run")
    assert load_trace(other).steps == 3


def test_a_resume_extends_the_trace_its_checkpoint_covers(tmp_path):
    _record(None, tmp_path, micro_batches=3)
    _record(None, tmp_path, steps_done=2, micro_batches=2)  # checkpoint after 2: the third is recorded again
    assert load_trace(tmp_path / TRACE).counts[:, 0, 0, 0].tolist() == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="holds 4 micro-batches but the run resumes after 5"):
        _record(None, tmp_path, steps_done=5)
    with pytest.raises(ValueError, match="does not exist but the run resumes at step 2"):
        _record(tmp_path / "absent.npz", tmp_path, steps_done=2)
