"""Training-loop cases from a review pass (each failed before its fix): a step without response
tokens, resuming on other data, a prepared file named by the caller, config checks (overrides,
ignored flags, tokenizer spec, vocabulary), the CLI's error exits, the end of a short cosine."""
import json
from types import SimpleNamespace

import pytest
import torch

from lrmoe import data
from lrmoe.train.loop import TrainConfig, _cli, lr_factor, read_metrics, train

from test_train import _isolated_caches, cfg, data_path  # noqa: F401 (fixtures)


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
    assert fin["mean_ppl_final_10pct"] is None or fin["mean_ppl_final_10pct"] > 1


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


def test_prepare_refuses_a_named_file_built_otherwise(data_path, tmp_path):
    out = tmp_path / "x.pt"
    data.prepare(data_path, "bpe:300", 64, out=out)
    assert data.load_prepared(out)[2]["config"]["seq_len"] == 64
    assert data.prepare(data_path, "bpe:300", 64, out=out) == out  # same arguments: reused
    with pytest.raises(ValueError, match="seq_len differ"):
        data.prepare(data_path, "bpe:300", 128, out=out)
    data.prepare(data_path, "bpe:300", 128, out=out, overwrite=True)
    assert data.load_prepared(out)[2]["config"]["seq_len"] == 128


@pytest.mark.parametrize("kw,match", [
    (dict(model_overrides={"output_router_logits": True}), "auxiliary loss"),
    (dict(mode="full", drop_ratio=0.2), "mode 'full' keeps every pair"),
    (dict(placement="symi"), "placement applies only to expert parallelism"),
    (dict(ep_budget_mib=1, ep_options={"min_tokens": 2}), "ep_budget_mib, ep_options apply only"),
    (dict(tokenizer="bpe:abc"), "'bpe:N' with N a positive integer"),
    (dict(tokenizer="bpe:0"), "'bpe:N' with N a positive integer"),
])
def test_config_checks(kw, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**kw).validate()


def test_rope_overrides_are_accepted():
    """rope_theta lives under rope_parameters in transformers 5; the presets set it themselves."""
    TrainConfig(model="qwen3-moe-tiny", model_overrides={"rope_theta": 1e4}).validate()


def test_vocab_override_smaller_than_the_tokenizer(data_path, tmp_path):
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        train(cfg(data_path, model_overrides={"vocab_size": 100}, steps=1, warmup_steps=0), tmp_path, progress=False)


def _args(**kw):
    base = dict(config=None, out=None, no_progress=True, stop_after=None)
    base.update(kw)
    return SimpleNamespace(**base)


def test_cli_reports_bad_data_without_a_traceback(tmp_path, capsys):
    rc = _cli(_args(out=str(tmp_path / "run"), data=str(tmp_path / "nope.json"), steps=1, warmup_steps=0,
                    tokenizer="bpe:300"))
    err = capsys.readouterr().err
    assert rc == 2 and "lrmoe train: FileNotFoundError" in err and "nope.json" in err
    assert _cli(_args(out=str(tmp_path / "r2"), config=str(tmp_path / "none.json"))) == 2


def test_checkpoint_mismatch_names_the_difference(data_path, tmp_path):
    train(cfg(data_path, steps=4, warmup_steps=1), tmp_path, progress=False, stop_after=2)
    (tmp_path / "summary.json").unlink()
    with pytest.raises(ValueError, match=r"different config \(lr: 0.003 != 0.005\)"):
        train(cfg(data_path, steps=4, warmup_steps=1, lr=5e-3), tmp_path, progress=False)


@pytest.mark.parametrize("steps,warmup", [(2, 1), (5, 4), (3, 0)])
def test_cosine_ends_at_min_lr_right_after_warmup(steps, warmup):
    c = TrainConfig(steps=steps, warmup_steps=warmup, lr=1.0, min_lr_ratio=0.1)
    assert lr_factor(steps - 1, c) == pytest.approx(0.1)


def test_one_training_process_per_run_folder(tmp_path):
    """A second process (e.g. a second `lrmoe reproduce` while orphaned workers still train) is refused."""
    from lrmoe.run_folder import run_folder_lock as _run_folder_lock

    with _run_folder_lock(tmp_path, True):
        with pytest.raises(ValueError, match="being trained by another process"):
            with _run_folder_lock(tmp_path, True):
                pass
        with _run_folder_lock(tmp_path, False):  # only the main rank locks
            pass
    with _run_folder_lock(tmp_path, True):  # released on exit
        pass


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
