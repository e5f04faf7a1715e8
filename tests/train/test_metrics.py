"""metrics.jsonl on resume and restart (lrmoe.train.metrics): rows are never dropped silently; only a
torn last line may be dropped, any other undecodable line stops the resume naming the line."""
import json

from lrmoe.cli import main
from lrmoe.train import read_metrics, train

from .helpers import cfg

FLAGS = ["--tokenizer", "bpe:300", "--seq-len", "64", "--micro-batch", "2", "--steps", "6", "--warmup-steps", "2",
         "--threads", "2", "--heldout-fraction", "0.1", "--eval-batches", "2", "--no-progress"]


def _lines(path) -> list[str]:
    return path.read_text().splitlines()


def test_a_restart_without_a_checkpoint_keeps_the_earlier_rows_aside(data_path, tmp_path, capsys):
    """A run killed before its first checkpoint (SIGKILL, power loss) restarts at step 1: the rows of
    the earlier attempt move to metrics.jsonl.discarded, and the count is printed."""
    c = cfg(data_path, steps=4, warmup_steps=1)
    train(c, tmp_path, progress=False, stop_after=3)
    before = _lines(tmp_path / "metrics.jsonl")
    (tmp_path / "checkpoint.pt").unlink()  # as if killed before the first checkpoint
    capsys.readouterr()
    train(c, tmp_path, progress=False, stop_after=1)
    assert "3 row(s) of an earlier attempt" in capsys.readouterr().err
    assert _lines(tmp_path / "metrics.jsonl.discarded") == before
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1]


def test_rows_past_the_checkpoint_are_kept_aside_and_counted(data_path, tmp_path, capsys):
    c = cfg(data_path, steps=6, warmup_steps=1)
    train(c, tmp_path, progress=False, stop_after=2)
    saved = (tmp_path / "checkpoint.pt").read_bytes()
    train(c, tmp_path, progress=False, stop_after=4)
    (tmp_path / "checkpoint.pt").write_bytes(saved)  # killed after step 4 with the checkpoint of step 2
    capsys.readouterr()
    train(c, tmp_path, progress=False, stop_after=3)
    assert "2 row(s) after the checkpoint's step 2" in capsys.readouterr().err
    assert [json.loads(x)["step"] for x in _lines(tmp_path / "metrics.jsonl.discarded")] == [3, 4]
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]


def test_an_undecodable_line_inside_the_file_stops_the_resume_naming_it(data_path, tmp_path, capsys):
    """One bad line in the middle used to make the resume cut every later row (a run then finished
    "done" with its summary means over the rows before it)."""
    out = tmp_path / "run"
    args = ["train", "--out", str(out), "--data", data_path, *FLAGS]
    assert main(args + ["--stop-after", "4"]) == 0
    lines = _lines(out / "metrics.jsonl")
    lines[1] = lines[1][: len(lines[1]) // 2]  # line 2 of 4 torn in place
    (out / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "metrics.jsonl: line 2 of 4 is not valid JSON" in err and "Traceback" not in err
    assert _lines(out / "metrics.jsonl")[2:] == lines[2:]  # nothing was cut


def test_a_torn_last_line_is_dropped_on_resume(data_path, tmp_path):
    c = cfg(data_path, steps=4, warmup_steps=1)
    train(c, tmp_path, progress=False, stop_after=2)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "loss": 1.')  # a process killed in the middle of an append
    s = train(c, tmp_path, progress=False)
    assert s["status"] == "done"
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]
