"""Checkpoints and resume (lrmoe.train.checkpoint): exact resume, the checks that refuse a resume
(other config, other data, other thread count), RNG and policy-generator state."""
import json
import shutil

import pytest
import torch

from lrmoe import BackwardPolicy, data
from lrmoe.train import read_metrics, train

from .helpers import cfg


@pytest.mark.parametrize("scorer", ["random", "lrm"])
def test_exact_resume(data_path, tmp_path, scorer, capsys):
    c = cfg(data_path, steps=8, drop_ratio=0.3, scorer=scorer, eval_interval=4, checkpoint_interval=2)
    full, part = tmp_path / "full", tmp_path / "part"
    train(c, full, progress=False)
    s = train(c, part, progress=False, stop_after=4)
    assert s["status"] == "running" and s["steps_done"] == 4
    assert len(read_metrics(part / "metrics.jsonl")) == 4
    # simulate a kill after step 6 whose last checkpoint is the one of step 4
    shutil.copy(part / "checkpoint.pt", tmp_path / "ck4.pt")
    train(c, part, progress=False, stop_after=6)
    assert len(read_metrics(part / "metrics.jsonl")) == 6
    shutil.copy(tmp_path / "ck4.pt", part / "checkpoint.pt")
    capsys.readouterr()
    s = train(c, part, progress=False)
    assert s["status"] == "done" and s["resumed_from"] == [4]  # lineage of the checkpoint it resumed
    assert "part: resuming from step 4 of 8 (checkpoint.pt)" in capsys.readouterr().err  # said, not silent
    a, b = read_metrics(full / "metrics.jsonl"), read_metrics(part / "metrics.jsonl")
    assert [r["step"] for r in b] == list(range(1, 9))
    for key in ("loss", "grad_norm", "lr", "epoch", "kept_fraction", "layers", "eval_loss"):
        assert [r.get(key) for r in a] == [r.get(key) for r in b], key


def test_resume_refuses_other_data(data_path, tmp_path, monkeypatch):
    """Resuming with $LRMOE_ALPACA pointing at other records (config.data None both times) used to
    continue silently on the new data."""
    records = json.loads(open(data_path).read())
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(records))
    b.write_text(json.dumps(records[50:] + records[:50]))
    c = cfg(None, steps=4, warmup_steps=1)
    monkeypatch.setenv("LRMOE_ALPACA", str(a))
    s = train(c, tmp_path / "run", progress=False, stop_after=2)
    assert s["status"] == "running" and s["data"]["source"] == str(a)
    monkeypatch.setenv("LRMOE_ALPACA", str(b))
    with pytest.raises(ValueError, match="trained on other data"):
        train(c, tmp_path / "run", progress=False)
    monkeypatch.setenv("LRMOE_ALPACA", str(a))
    assert train(c, tmp_path / "run", progress=False)["status"] == "done"


def test_checkpoint_mismatch_names_the_difference(data_path, tmp_path):
    train(cfg(data_path, steps=4, warmup_steps=1), tmp_path, progress=False, stop_after=2)
    (tmp_path / "summary.json").unlink()
    with pytest.raises(ValueError, match=r"different config \(lr: 0.003 != 0.005\)"):
        train(cfg(data_path, steps=4, warmup_steps=1, lr=5e-3), tmp_path, progress=False)


def test_resume_check_covers_files_prepared_without_a_fingerprint(data_path, tmp_path):
    """Prepared files from before fingerprints were stored: the check computed nothing and never fired."""
    records = json.loads(open(data_path).read())
    src = tmp_path / "a.json"
    src.write_text(json.dumps(records))
    c = cfg(str(src), steps=4, warmup_steps=1)
    path = data.prepare(c.data, c.tokenizer, c.seq_len, c.heldout_fraction, c.data_seed, c.max_records)
    blob = torch.load(path, weights_only=True)
    del blob["stats"]["source_fingerprint"]  # as an old cache file
    torch.save(blob, path)
    train(c, tmp_path / "run", progress=False, stop_after=2)
    assert torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)["data_fingerprint"]
    src.write_text(json.dumps(records[1:]))  # edited in place
    with pytest.raises(ValueError, match="trained on other data"):
        train(c, tmp_path / "run", progress=False)


def test_generator_key_normalises_the_cuda_index(monkeypatch):
    """train() saves policy.generator(runner.device) while the experts draw from
    policy.generator(tensor.device): "cuda" and "cuda:0" must be one generator. (CPU machine: the
    CUDA generator and current device are stood in for.)"""
    real = torch.Generator

    class FakeGen:
        def __init__(self, device=None):
            self.device, self.g = device, real()

        def manual_seed(self, s):
            self.g.manual_seed(s)
            return self

    monkeypatch.setattr(torch, "Generator", FakeGen)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    policy = BackwardPolicy(0.2, scorer="random", seed=5)
    assert policy.generator(torch.device("cuda")) is policy.generator(torch.device("cuda", 0))
    assert policy.generator("cpu") is not policy.generator(torch.device("cuda", 0))


def test_changing_the_seed_starts_the_new_seed_stream():
    policy = BackwardPolicy(0.2, scorer="random", seed=1)
    first = torch.rand(4, generator=policy.generator("cpu"))
    policy.seed = 2
    assert torch.equal(torch.rand(4, generator=policy.generator("cpu")),
                       torch.rand(4, generator=torch.Generator().manual_seed(2)))
    policy.seed = 1  # back to seed 1: its stream continues where it was
    assert not torch.equal(torch.rand(4, generator=policy.generator("cpu")), first)


def test_resume_with_another_thread_count_is_refused(data_path, tmp_path):
    """CPU results depend on the thread count (reduction order): a resumed run would not equal the
    uninterrupted one, so it is refused, naming both counts and how to resume."""
    before = torch.get_num_threads()
    try:
        train(cfg(data_path, steps=4, warmup_steps=1, threads=2), tmp_path, progress=False, stop_after=2)
        with pytest.raises(ValueError, match=r"trained with 2 CPU thread\(s\), this process has 1.*--threads 2"):
            train(cfg(data_path, steps=4, warmup_steps=1, threads=1), tmp_path, progress=False)
        assert train(cfg(data_path, steps=4, warmup_steps=1, threads=2), tmp_path, progress=False)["status"] == "done"
    finally:
        torch.set_num_threads(before)
