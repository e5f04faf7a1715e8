"""Training loop (lrmoe.train): metrics schema, learning, exact resume, accumulation, summary, errors."""
import json
import math
import shutil

import pytest
import torch

from lrmoe.data import shared_data_dir
from lrmoe.train import METRIC_KEYS, TrainConfig, lr_factor, read_metrics, train

TINY = shared_data_dir() / "alpaca" / "alpaca_tiny.json"


@pytest.fixture(autouse=True)
def _isolated_caches(tmp_path_factory, monkeypatch):
    base = tmp_path_factory.getbasetemp()
    monkeypatch.setenv("HF_HOME", str(base / "hf"))
    monkeypatch.setenv("LRMOE_CACHE", str(base / "lrmoe_cache"))
    monkeypatch.delenv("HF_DATASETS_CACHE", raising=False)


@pytest.fixture(scope="module")
def data_path():
    if not TINY.exists():
        pytest.skip(f"offline Alpaca sample not found at {TINY} (set LRMOE_SHARED_DATA to the shared/data folder)")
    return str(TINY)


def cfg(data_path, **kw):
    base = dict(model="qwen3-moe-tiny", data=data_path, tokenizer="bpe:300", seq_len=64, micro_batch=2, steps=6,
                lr=3e-3, warmup_steps=2, threads=2, heldout_fraction=0.1, eval_batches=2)
    base.update(kw)
    return TrainConfig(**base)


def losses(out):
    return [r["loss"] for r in read_metrics(out / "metrics.jsonl")]


def test_metrics_schema_and_summary(data_path, tmp_path):
    c = cfg(data_path, drop_ratio=0.25, eval_interval=3, sample_layers=[0, -1])
    s = train(c, tmp_path, progress=False)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 7))
    for r in rows:
        assert set(METRIC_KEYS) <= set(r), set(METRIC_KEYS) - set(r)
        assert math.isclose(r["ppl"], math.exp(r["loss"]), rel_tol=1e-9)
        assert r["kept_fraction"] == pytest.approx(0.75, abs=0.01)
        assert r["moe_fwd_s"] > 0 and r["moe_bwd_s"] > 0
        assert r["moe_fwd_s"] + r["moe_bwd_s"] < r["step_time_s"]
        assert r["tokens"] > 0 and r["tokens_per_s"] > 0 and r["label_tokens"] > 0
        assert set(r["layers"]) == {"0", "1"}  # qwen3-moe-tiny has 2 MoE layers
        for st in r["layers"].values():
            assert len(st["demand"]) == len(st["quota"]) == len(st["kept"]) == 8
            assert sum(st["demand"]) == 2 * 64 * 2  # micro_batch x seq_len x top-2
            assert all(k == q <= d for d, q, k in zip(st["demand"], st["quota"], st["kept"]))
    assert [r["step"] for r in rows if "eval_loss" in r] == [3, 6]
    assert [r["lr"] for r in rows][:2] == pytest.approx([1.5e-3, 3e-3])

    assert s["status"] == "done" and s["steps_done"] == 6
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk == json.loads(json.dumps(s, default=str))
    assert s["config"] == c.to_dict() and s["seed"] == 0
    env = s["environment"]
    for key in ("torch", "transformers", "python", "git", "device", "threads", "date"):
        assert key in env
    assert s["final"]["loss"] == rows[-1]["loss"] and s["final"]["eval_ppl"] == rows[-1]["eval_ppl"]
    assert s["final"]["mean_ppl_final_10pct"] == rows[-1]["ppl"]  # ceil(0.6) = the last step
    assert s["model"]["moe_layers"] == 2 and s["model"]["experts"] == 8
    assert s["timings"]["moe_bwd_s"] == pytest.approx(sum(r["moe_bwd_s"] for r in rows))
    assert (tmp_path / "checkpoint.pt").exists()
    # a finished run is returned as is
    assert train(c, tmp_path, progress=False)["timings"] == s["timings"]


def test_loss_decreases_on_a_repeated_batch(data_path, tmp_path):
    # two records, no held-out split: every step sees the same rows
    c = cfg(data_path, max_records=1, heldout_fraction=0.0, micro_batch=8, steps=15, lr=1e-2, warmup_steps=1,
            min_lr_ratio=1.0)
    train(c, tmp_path, progress=False)
    ls = losses(tmp_path)
    assert ls[-1] < 0.5 * ls[0], ls


@pytest.mark.parametrize("scorer", ["random", "lrm"])
def test_exact_resume(data_path, tmp_path, scorer):
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
    s = train(c, part, progress=False)
    assert s["status"] == "done" and s["resumed_from"] == [4]  # lineage of the checkpoint it resumed
    a, b = read_metrics(full / "metrics.jsonl"), read_metrics(part / "metrics.jsonl")
    assert [r["step"] for r in b] == list(range(1, 9))
    for key in ("loss", "grad_norm", "lr", "epoch", "kept_fraction", "layers", "eval_loss"):
        assert [r.get(key) for r in a] == [r.get(key) for r in b], key


def test_grad_accumulation_matches_a_bigger_micro_batch(data_path, tmp_path):
    big = cfg(data_path, micro_batch=2, grad_accum=1, steps=3)
    acc = cfg(data_path, micro_batch=1, grad_accum=2, steps=3)
    assert acc.global_batch == big.global_batch == 2
    train(big, tmp_path / "big", progress=False)
    train(acc, tmp_path / "acc", progress=False)
    a, b = read_metrics(tmp_path / "big" / "metrics.jsonl"), read_metrics(tmp_path / "acc" / "metrics.jsonl")
    assert a[0]["loss"] == pytest.approx(b[0]["loss"], rel=1e-5)
    assert a[0]["grad_norm"] == pytest.approx(b[0]["grad_norm"], rel=1e-4)
    assert [r["loss"] for r in a] == pytest.approx([r["loss"] for r in b], rel=1e-4)


def test_lr_schedule():
    c = TrainConfig(steps=100, warmup_steps=10, lr=1.0, min_lr_ratio=0.1)
    f = [lr_factor(s, c) for s in range(100)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0) and f[10] == pytest.approx(1.0)
    assert f[-1] == pytest.approx(0.1, abs=1e-12) and all(a >= b for a, b in zip(f[10:], f[11:]))


@pytest.mark.parametrize("kw, match", [
    (dict(micro_batch=0), "micro_batch must be an integer >= 1"),
    (dict(micro_batch=3, global_batch=8), r"global_batch \(8\) must be a multiple of micro_batch \(3\)"),
    (dict(micro_batch=2, global_batch=8, grad_accum=2), r"must equal micro_batch \(2\) \* grad_accum \(2\)"),
    (dict(steps=0), "steps must be an integer >= 1"),
    (dict(steps=5, warmup_steps=6), r"warmup_steps \(6\) must be <= steps \(5\)"),
    (dict(lr=-1.0), "lr must be a finite number > 0"),
    (dict(drop_ratio=1.5), r"drop_ratio must be a number in \[0, 1\)"),
    (dict(scorer="nope"), "unknown scorer 'nope'"),
    (dict(quota="nope"), "unknown quota policy 'nope'"),
    (dict(mode="nope"), "unknown backward mode 'nope'"),
    (dict(model="gpt2"), "unknown model preset 'gpt2'"),
    (dict(dtype="fp8"), "unknown dtype 'fp8'"),
    (dict(device="tpu"), "device"),
    (dict(min_lr_ratio=2.0), r"min_lr_ratio must be a finite number in \[0, 1\]"),
    (dict(clip=-1.0), r"clip must be a finite number in \[0, inf\)"),
])
def test_bad_config_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**kw).validate()


def test_bad_sample_layers_and_other_run_in_dir(data_path, tmp_path):
    with pytest.raises(ValueError, match=r"sample_layers \[5\] out of range"):
        train(cfg(data_path, steps=1, warmup_steps=0, sample_layers=[5]), tmp_path / "a", progress=False)
    train(cfg(data_path, steps=1, warmup_steps=0), tmp_path / "b", progress=False)
    with pytest.raises(ValueError, match="holds a different run"):
        train(cfg(data_path, steps=1, warmup_steps=0, lr=1e-2), tmp_path / "b", progress=False)
    with pytest.raises(ValueError, match="unknown TrainConfig fields"):
        TrainConfig.from_dict({"lrr": 1})


def test_cli_train_and_resume(data_path, tmp_path, capsys):
    from lrmoe.cli import main

    args = ["train", "--out", str(tmp_path), "--data", data_path, "--tokenizer", "bpe:300", "--seq-len", "64",
            "--micro-batch", "1", "--global-batch", "2", "--steps", "3", "--warmup-steps", "1", "--no-progress",
            "--model", "glm4-moe-tiny", "--drop-ratio", "0.2", "--model-override", "num_hidden_layers=2"]
    assert main(args + ["--stop-after", "1"]) == 0
    assert main(args) == 0
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["status"] == "done" and s["config"]["grad_accum"] == 2 and s["resumed_from"] == [1]
    assert s["model"]["family"] == "glm4_moe" and s["model"]["moe_layers"] == 1
    assert main(["train", "--out", str(tmp_path / "x"), "--micro-batch", "3", "--global-batch", "4"]) == 2
    assert "must be a multiple of micro_batch" in capsys.readouterr().err


def test_init_from_a_checkpoint(data_path, tmp_path):
    from lrmoe import hf

    src = hf.build_model("qwen3-moe-tiny", vocab_size=320, seed=7)
    src.save_pretrained(tmp_path / "ckpt")
    c = cfg(data_path, steps=2, warmup_steps=1, init_from=str(tmp_path / "ckpt"), drop_ratio=0.2)
    s = train(c, tmp_path / "run", progress=False)
    assert s["status"] == "done" and s["model"]["vocab_size"] == 300
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert rows[0]["kept_fraction"] == pytest.approx(0.8, abs=0.01)
    with pytest.raises(ValueError, match="token embeddings but the tokenizer"):
        train(cfg(data_path, steps=1, warmup_steps=0, tokenizer="bpe:400", init_from=str(tmp_path / "ckpt")),
              tmp_path / "run2", progress=False)
