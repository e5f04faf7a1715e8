"""The training loop (lrmoe.train.loop): metrics schema and summary, learning, accumulation,
init_from, steps without response tokens, bf16 autocast, one process per run folder."""
import json
import math

import pytest

import lrmoe.hf as hf
from lrmoe.train import METRIC_KEYS, TrainConfig, read_metrics, train

from .helpers import cfg, losses


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
    # the event, not a rate: every later step is below the first, and training is still descending
    # at the end (how fast it falls depends on the machine's floating-point details)
    assert all(x < ls[0] for x in ls[1:]), ls
    assert ls[-1] < ls[len(ls) // 2], ls


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


def test_bad_sample_layers_and_other_run_in_dir(data_path, tmp_path):
    with pytest.raises(ValueError, match=r"sample_layers \[5\] out of range"):
        train(cfg(data_path, steps=1, warmup_steps=0, sample_layers=[5]), tmp_path / "a", progress=False)
    train(cfg(data_path, steps=1, warmup_steps=0), tmp_path / "b", progress=False)
    with pytest.raises(ValueError, match="holds a different run"):
        train(cfg(data_path, steps=1, warmup_steps=0, lr=1e-2), tmp_path / "b", progress=False)
    with pytest.raises(ValueError, match="unknown TrainConfig fields"):
        TrainConfig.from_dict({"lrr": 1})


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


def test_init_from_a_glm_checkpoint_reports_the_glm_family(data_path, tmp_path):
    """summary.json's model.family (used by paper_figures to group runs into tables) comes from the
    cfg.model preset even when the weights come from init_from: a GLM checkpoint trained with the
    default model preset is reported (and tabulated) as qwen3_moe."""
    src = hf.build_model("glm4-moe-tiny", vocab_size=320, seed=7)
    src.save_pretrained(tmp_path / "ckpt")
    c = cfg(data_path, steps=1, warmup_steps=0, init_from=str(tmp_path / "ckpt"), eval_batches=1)
    s = train(c, tmp_path / "run", progress=False)
    assert s["model"]["moe_layers"] == 1  # the GLM checkpoint's layers were indeed used
    assert s["model"]["family"] == "glm4_moe"


def test_a_step_without_response_tokens_has_no_loss(data_path, tmp_path):
    """Rows of 64 tokens, one row per step: steps 7 and 8 hold only prompt tokens. They used to log
    loss 0 and PPL 1, which entered the final-10 % PPL mean that T1/T2 are built on."""
    c = cfg(data_path, micro_batch=1, steps=8, warmup_steps=1, heldout_fraction=0.05, eval_batches=1)
    s = train(c, tmp_path, progress=False)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    empty = [r for r in rows if r["label_tokens"] == 0]
    assert empty, "the case no longer has a step without response tokens"
    assert all(r["loss"] is None and r["ppl"] is None for r in empty)
    assert all(r["loss"] > 0 and r["ppl"] > 1 for r in rows if r["label_tokens"])
    fin = s["final"]
    assert fin["steps_without_loss"] == len(empty)
    with_loss = [r["ppl"] for r in rows if r["ppl"] is not None]
    assert fin["mean_ppl_all_steps"] == pytest.approx(sum(with_loss) / len(with_loss))
    # the final-10 % window is the last step here: no PPL exactly when that step has none
    assert (fin["mean_ppl_final_10pct"] is None) == (rows[-1]["ppl"] is None)
    if rows[-1]["ppl"] is not None:
        assert fin["mean_ppl_final_10pct"] == pytest.approx(rows[-1]["ppl"])


def test_vocab_override_smaller_than_the_tokenizer(data_path, tmp_path):
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        train(cfg(data_path, model_overrides={"vocab_size": 100}, steps=1, warmup_steps=0), tmp_path, progress=False)


def test_bf16_autocast_on_cpu_tracks_fp32(data_path, tmp_path):
    a = cfg(data_path, steps=2, warmup_steps=1, eval_batches=None)
    b = cfg(data_path, steps=2, warmup_steps=1, eval_batches=None, dtype="bf16")
    train(a, tmp_path / "a", progress=False)
    train(b, tmp_path / "b", progress=False)
    ra, rb = read_metrics(tmp_path / "a" / "metrics.jsonl"), read_metrics(tmp_path / "b" / "metrics.jsonl")
    assert rb[0]["loss"] == pytest.approx(ra[0]["loss"], rel=2e-2)
    assert math.isfinite(rb[-1]["eval_loss"])


@pytest.mark.parametrize("content", [b'{"status": "running", "conf', b"\xff\xfe", b"[1, 2]"])
def test_an_unreadable_summary_is_refused_naming_the_file(data_path, tmp_path, content):
    """It used to read as "no previous run", which skipped the different-run guard."""
    from lrmoe.cli import main

    c = cfg(data_path, steps=2, warmup_steps=1)
    train(c, tmp_path, progress=False, stop_after=1)
    (tmp_path / "summary.json").write_bytes(content)
    with pytest.raises(ValueError, match=r"summary\.json"):
        train(cfg(data_path, steps=2, warmup_steps=1, lr=1e-2), tmp_path, progress=False)
    assert (tmp_path / "summary.json").read_bytes() == content  # left as it was
    assert main(["train", "--out", str(tmp_path), "--no-progress"]) == 2
