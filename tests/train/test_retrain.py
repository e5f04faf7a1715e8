"""restore_checkpoint: a finished run folder kept without its checkpoint (as the committed
references are) gets the checkpoint of the same run back, trained again; a retrained run that
differs replaces the folder's files and keeps the previous ones; other folders are refused."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from lrmoe.run_folder import CHECKPOINT, METRICS, SUMMARY
from lrmoe.train import train
from lrmoe.train.retrain import PREVIOUS, RETRAIN, restore_checkpoint

from .helpers import cfg


@pytest.fixture(scope="module")
def finished(tmp_path_factory, data_path):
    """(config, a finished run folder with its checkpoint): trained once for the module."""
    c = cfg(data_path, steps=4, eval_interval=4, checkpoint_interval=4)
    run = tmp_path_factory.mktemp("run") / "r"
    train(c, run, progress=False)
    return c, run


def _committed_copy(run, dest):
    """The run folder as a committed reference keeps it: metrics and summary, no checkpoint."""
    dest.mkdir()
    for name in (SUMMARY, METRICS):
        shutil.copy(run / name, dest / name)
    return dest


def _model(path):
    return torch.load(path / CHECKPOINT, map_location="cpu", weights_only=False)["model"]


def test_the_same_run_is_trained_again_for_its_checkpoint(finished, tmp_path):
    c, run = finished
    ref = _committed_copy(run, tmp_path / "ref")
    before = {n: (ref / n).read_bytes() for n in (SUMMARY, METRICS)}
    r = restore_checkpoint(c, ref)
    assert r == {"restored": True, "same": True, "differences": []}
    assert not (ref / RETRAIN).exists() and (ref / CHECKPOINT).is_file()
    assert {n: (ref / n).read_bytes() for n in (SUMMARY, METRICS)} == before  # the folder's files untouched
    a, b = _model(run), _model(ref)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # the run's own weights
    assert restore_checkpoint(c, ref) == {"restored": False, "same": None, "differences": []}  # nothing to do


def test_a_run_that_comes_out_different_replaces_the_files_and_keeps_the_old(finished, tmp_path):
    c, run = finished
    ref = _committed_copy(run, tmp_path / "ref")
    s = json.loads((ref / SUMMARY).read_text())
    true_loss, s["final"]["loss"] = s["final"]["loss"], 123.0  # as if trained elsewhere
    (ref / SUMMARY).write_text(json.dumps(s))
    r = restore_checkpoint(c, ref)
    assert r["restored"] and r["same"] is False
    assert r["differences"] == [f"loss: 123.0 -> {true_loss!r}"]
    assert json.loads((ref / SUMMARY).read_text())["final"]["loss"] == true_loss  # describes the checkpoint
    assert json.loads((ref / (SUMMARY + PREVIOUS)).read_text())["final"]["loss"] == 123.0
    assert (ref / (METRICS + PREVIOUS)).read_bytes() == (run / METRICS).read_bytes()
    assert not (ref / RETRAIN).exists()


def test_other_folders_are_refused(finished, tmp_path):
    c, run = finished
    with pytest.raises(ValueError, match="not a finished run"):
        restore_checkpoint(c, tmp_path)  # empty
    ref = _committed_copy(run, tmp_path / "ref")
    with pytest.raises(ValueError, match="holds another run.*lr"):
        restore_checkpoint(cfg(c.data, steps=4, eval_interval=4, checkpoint_interval=4, lr=1e-3), ref)
    assert not (ref / CHECKPOINT).exists() and not (ref / RETRAIN).exists()
