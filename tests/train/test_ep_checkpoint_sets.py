"""EP checkpoints (lrmoe.train.ep + lrmoe.train.checkpoint): a run killed at any point of the
checkpoint commit sequence, twice in a row, resumes from a consistent set, the last one committed.

The W ranks run as threads of this process with a thread barrier in place of the host barrier, so
the real save and load paths of DistributedRunner run without torch.distributed. A kill is an
exception raised when the k-th file operation of the save (a write or a deletion) starts: every
later one fails too, and the barrier breaks, as the other ranks die with the job."""
import pathlib
import threading
import types

import pytest
import torch

import lrmoe.train.ep as train_ep
from lrmoe.train import checkpoint
from lrmoe.train.ep import DistributedRunner

W = 2
# DCP folder files, rank files, main file, deletions (at most 2 rank files per rank, the old folder's
# file per rank and the folder), no kill
KILL_POINTS = range(W + W + 1 + 2 * W + W + 1 + 1)


class Killed(Exception):
    pass


class FakeOptimizer:
    def __init__(self, step=0, rank=0):
        self.state = {"step": step, "rank": rank}

    def state_dict(self):
        return dict(self.state)

    def load_state_dict(self, state):
        self.state = dict(state)


def _runner(rank: int) -> DistributedRunner:
    r = DistributedRunner.__new__(DistributedRunner)  # no process group: only the checkpoint methods run
    r.rank, r.world, r.is_main = rank, W, rank == 0
    r.env = types.SimpleNamespace(ep_size=W)
    r.eps = []
    # the DCP folder's part of the sequence, as files of this rank (torch.save: a kill point each)
    r.save_sharded_state = lambda folder, model, opt: (
        folder.mkdir(exist_ok=True),
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, folder / f"rank{rank}.pt"))
    r.load_sharded_state = lambda folder, model, opt: _load_fake_dcp(folder, rank, model, opt)
    return r


def _load_fake_dcp(folder, rank, model, opt):
    state = torch.load(folder / f"rank{rank}.pt")
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])


def _model(step: int) -> torch.nn.Module:
    m = torch.nn.Linear(1, 1)
    with torch.no_grad():
        m.weight.fill_(step)
        m.bias.fill_(step)
    return m


def _save(path, step: int, kill_at: int | None, monkeypatch) -> bool:
    """Every rank saves the checkpoint of ``step``; the job dies when file operation number
    ``kill_at`` (0-based) starts. Returns whether the main file of ``step`` was written."""
    barrier = threading.Barrier(W, timeout=60)
    lock, ops, committed = threading.Lock(), [0], [False]
    real_save, real_unlink = torch.save, pathlib.Path.unlink

    def operation():
        with lock:
            if kill_at is not None and ops[0] >= kill_at:
                barrier.abort()
                raise Killed
            ops[0] += 1

    def save(obj, f, *a, **k):
        operation()
        real_save(obj, f, *a, **k)
        if "rank_files" in obj:
            committed[0] = True

    def unlink(self, *a, **k):
        operation()
        return real_unlink(self, *a, **k)

    monkeypatch.setattr(torch, "save", save)
    monkeypatch.setattr(pathlib.Path, "unlink", unlink)
    monkeypatch.setattr(train_ep, "host_barrier", barrier.wait)
    done = [False] * W

    def rank_main(rank):
        try:
            common = {"config": {}, "step": step, "scheduler": {}, "data_position": step, "timings": {}}
            _runner(rank).save_checkpoint(path, common, _model(step), FakeOptimizer(step, rank), {"step": step})
            done[rank] = True
        except (Killed, threading.BrokenBarrierError):
            pass

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(W)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    monkeypatch.setattr(torch, "save", real_save)
    monkeypatch.setattr(pathlib.Path, "unlink", real_unlink)
    assert all(done) or kill_at is not None
    return committed[0]


def _resume(path) -> int:
    """Every rank loads the committed set; returns its step after checking each rank's state is of it."""
    steps = set()
    for rank in range(W):
        r = _runner(rank)
        ck = r.load_checkpoint(path)
        model, opt, rng = _model(-1), FakeOptimizer(), {}
        r.load_state(path, ck, model, opt, rng.update)
        assert model.weight.item() == ck["step"] == opt.state["step"] == rng["step"] == ck["data_position"]
        assert opt.state["rank"] == rank
        steps.add(ck["step"])
    assert len(steps) == 1
    return steps.pop()


@pytest.mark.parametrize("first_kill", KILL_POINTS)
@pytest.mark.parametrize("second_kill", KILL_POINTS)
def test_killed_twice_inside_the_commit_window_resumes_from_the_last_complete_set(tmp_path, monkeypatch,
                                                                                  first_kill, second_kill):
    path = tmp_path / "checkpoint.pt"
    assert _save(path, 2, None, monkeypatch)
    committed = 2
    if _save(path, 4, first_kill, monkeypatch):
        committed = 4
    if _save(path, 6, second_kill, monkeypatch):
        committed = 6
    assert _resume(path) == committed
    assert _save(path, 8, None, monkeypatch)  # and the run goes on
    assert _resume(path) == 8


@pytest.mark.parametrize("kill", KILL_POINTS)
def test_a_committed_set_replaces_every_older_file(tmp_path, monkeypatch, kill):
    path = tmp_path / "checkpoint.pt"
    assert _save(path, 2, None, monkeypatch)
    _save(path, 4, kill, monkeypatch)
    assert _save(path, 6, None, monkeypatch)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoint.pt", "checkpoint.step6.dcp", *(f"checkpoint.step6.rank{r}.pt" for r in range(W))]
    assert sorted(p.name for p in (tmp_path / "checkpoint.step6.dcp").iterdir()) == [f"rank{r}.pt" for r in range(W)]


def test_a_set_in_the_layout_before_step_named_files_still_resumes(tmp_path):
    """Older versions wrote checkpoint.rank{r}.pt (and kept the previous one as .prev.pt)."""
    path = tmp_path / "checkpoint.pt"
    torch.save({"step": 3, "rank_files": "checkpoint.rank{r}.pt", "world_size": W, "ep_size": W}, path)
    torch.save({"step": 1, "optimizer": {}}, tmp_path / "checkpoint.rank0.pt")  # a later, uncommitted one
    torch.save({"step": 3, "optimizer": {"x": 1}}, tmp_path / "checkpoint.rank0.prev.pt")
    assert checkpoint.load_rank_state(path, torch.load(path), 0)["optimizer"] == {"x": 1}
    with pytest.raises(ValueError, match=r"no per-rank file of rank 1 matches it \(none found\)"):
        checkpoint.load_rank_state(path, torch.load(path), 1)


def test_a_set_with_the_full_weights_in_the_main_file_still_resumes(tmp_path):
    """Before the DCP folder, checkpoint.pt held the full weights and each rank file its optimizer state."""
    path = tmp_path / "checkpoint.pt"
    torch.save({"step": 5, "rank_files": "checkpoint.step5.rank{r}.pt", "world_size": W, "ep_size": W,
                "model": _model(5).state_dict(), "data_position": 5}, path)
    for rank in range(W):
        torch.save({"step": 5, "rank": rank, "optimizer": {"step": 5, "rank": rank}, "rng": {"step": 5}},
                   checkpoint.rank_file(path, 5, rank))
    assert _resume(path) == 5
