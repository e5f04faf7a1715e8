"""The `lrmoe train` command (lrmoe.train.cli): train and resume, error exits without a traceback."""
import json
from types import SimpleNamespace

from lrmoe.train.cli import _cli


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
