"""Bad input to the `lrmoe` commands exits with status 2 and one line that says what was wrong and
what is accepted, never a traceback (issue 17); the defaults in --help are stated once, and the
default warm-up works for any step count."""
import json
import re
import subprocess
import sys

import pytest

from lrmoe.cli import main


def _one_line(err: str, prog: str) -> str:
    """The error line of ``prog`` (the last line of stderr), checked to be one line without a traceback."""
    assert "Traceback" not in err, err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"lrmoe {prog}: "), err
    return line


def _only_line(err: str, prog: str) -> str:
    """As :func:`_one_line`, and nothing else was printed."""
    assert len(err.strip().splitlines()) == 1, err
    return _one_line(err, prog)


# ----------------------------------------------------------------------------- reproduce


def test_reproduce_out_that_is_a_file(tmp_path, capsys):
    f = tmp_path / "FILE"
    f.write_text("not a folder")
    for out in (f, f / "sub"):
        for extra in ([], ["--dry-run"]):
            assert main(["reproduce", "--preset", "smoke", "--out", str(out), *extra]) == 2
            line = _only_line(capsys.readouterr().err, "reproduce")
            assert f"--out '{out}'" in line and "not a folder; give a folder" in line
    assert f.read_text() == "not a folder"


def test_reproduce_only_that_is_not_a_regex(tmp_path, capsys):
    assert main(["reproduce", "--preset", "smoke", "--out", str(tmp_path / "r"), "--only", "(["]) == 2
    line = _only_line(capsys.readouterr().err, "reproduce")
    assert "--only '([' is not a regular expression (unterminated character set" in line and "e.g." in line
    assert not (tmp_path / "r").exists()


def test_reproduce_only_that_matches_no_run_lists_the_runs(tmp_path, capsys):
    out = tmp_path / "r"
    assert main(["reproduce", "--preset", "smoke", "--out", str(out), "--only", "zzz"]) == 2
    line = _only_line(capsys.readouterr().err, "reproduce")
    assert "--only 'zzz' matches none of the 24 runs; they are: qwen3-C00-s0, " in line and "glm4-C20-random-s1" in line
    assert not out.exists()  # no manifest, no figures regenerated


@pytest.mark.parametrize("jobs", ["0", "-1"])
def test_reproduce_jobs_below_one(jobs, tmp_path, capsys):
    for extra in ([], ["--dry-run"]):
        assert main(["reproduce", "--preset", "smoke", "--out", str(tmp_path / "r"), "--jobs", jobs, *extra]) == 2
        line = _only_line(capsys.readouterr().err, "reproduce")
        assert f"--jobs {jobs}: give a number of runs in parallel >= 1" in line
    assert not (tmp_path / "r").exists()


def test_reproduce_a_gpu_preset_on_a_cpu_only_machine_checks_the_hardware_first(tmp_path, capsys, monkeypatch):
    """gpu1 used to fetch the data from the hub (retrying ~25 s offline), then fail with a traceback
    and a manifest.json left behind. Now the hardware is checked before anything is written or fetched."""
    import torch

    import lrmoe.reproduce.driver as driver
    import lrmoe.runs.pool as pool

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)

    def must_not_run(*a, **k):
        raise AssertionError("reached data preparation or training")

    monkeypatch.setattr(pool, "prepare_data", must_not_run)
    monkeypatch.setattr(driver, "run_all", must_not_run)
    out = tmp_path / "gpu1"
    assert main(["reproduce", "--preset", "gpu1", "--out", str(out)]) == 2
    line = _one_line(capsys.readouterr().err, "reproduce")
    assert "preset 'gpu1' needs" in line and "this machine has 0 CUDA GPU(s)" in line and "--preset cpu" in line
    assert not out.exists()
    assert main(["reproduce", "--preset", "gpu1", "--out", str(out), "--dry-run", "--only", "qwen3-C00-s0"]) == 0
    assert "a real call stops with status 2" in capsys.readouterr().err and not out.exists()


def test_reproduce_bad_arguments_from_a_fresh_process_have_no_traceback(tmp_path):
    r = subprocess.run([sys.executable, "-m", "lrmoe.cli", "reproduce", "--preset", "smoke", "--out",
                        str(tmp_path), "--only", "(["], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().count("\n") == 0, r.stderr


# ----------------------------------------------------------------------------- figures


def _run(d, name, steps, lr=1e-3):
    d.mkdir(parents=True)
    cfg = {"model": "qwen3-moe-tiny", "drop_ratio": 0.2, "scorer": "lrm", "seed": 0, "steps": steps, "lr": lr,
           "quota": "waterfill", "mode": "compact"}
    (d / "summary.json").write_text(json.dumps({"status": "done", "config": cfg, "model": {"family": "qwen3_moe"}}))
    (d / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0, "ppl": 2.7}) + "\n"
                                             for s in range(1, steps + 1)))


def test_figures_several_runs_of_one_cell_say_which_and_what_differs(tmp_path, capsys):
    _run(tmp_path / "mine-a", "mine-a", steps=12)
    _run(tmp_path / "mine-b", "mine-b", steps=2, lr=3e-3)
    assert main(["figures", "--results", str(tmp_path), "--only", "T1"]) == 2
    line = _only_line(capsys.readouterr().err, "figures")
    assert "2 runs match the cell qwen3 C20 scorer=lrm seed=0: mine-a, mine-b" in line
    assert "they differ in lr: 0.001 / 0.003; steps: 12 / 2" in line and "manifest.json" in line


@pytest.mark.parametrize("only", ["T9", "T1,T9", ","])
def test_figures_unknown_key_lists_the_accepted_keys(only, tmp_path, capsys):
    _run(tmp_path / "one", "one", steps=2)
    assert main(["figures", "--results", str(tmp_path), "--only", only]) == 2
    line = _only_line(capsys.readouterr().err, "figures")
    assert "in --only; accepted: A1, F1, F2, F3, F4, F5, T1, T2, T3, T4, T5" in line
    assert not (tmp_path / "report.md").exists()


def test_figures_results_that_is_not_a_folder(tmp_path, capsys):
    for path, what in ((tmp_path / "nowhere", "does not exist"), (tmp_path / "f.txt", "is not a folder")):
        if what == "is not a folder":
            path.write_text("x")
        assert main(["figures", "--results", str(path)]) == 2
        assert what in _only_line(capsys.readouterr().err, "figures")


# ----------------------------------------------------------------------------- train


@pytest.mark.parametrize("content,message", [
    ('{"steps": 5,', "not valid JSON"),
    ("[1, 2]", "expected a JSON object of TrainConfig fields, got a JSON list"),
    (None, "no such file"),
])
def test_train_bad_config_file_is_named(content, message, tmp_path, capsys):
    bad = tmp_path / "BAD.json"
    if content is not None:
        bad.write_text(content)
    assert main(["train", "--out", str(tmp_path / "run"), "--config", str(bad)]) == 2
    line = _only_line(capsys.readouterr().err, "train")
    assert f"--config {bad}" in line and message in line
    assert not (tmp_path / "run").exists()


def test_train_default_warmup_works_for_any_step_count():
    """`lrmoe train --steps 5` used to fail: the default warm-up was 10 steps whatever the run's length."""
    from lrmoe.train import TrainConfig
    from lrmoe.train.cli import config_from_args, register_cli

    import argparse

    ap = argparse.ArgumentParser()
    register_cli(ap.add_subparsers())
    for steps, warmup in ((1, 0), (5, 0), (10, 1), (55, 5), (100, 10), (10_000, 10)):
        args = ap.parse_args(["train", "--out", "x", "--steps", str(steps)])
        assert config_from_args(args).warmup_steps == warmup, steps
        assert TrainConfig(steps=steps).warmup_steps == warmup
    # a warm-up that is given is kept, and checked
    assert TrainConfig(steps=5, warmup_steps=2).warmup_steps == 2
    with pytest.raises(ValueError, match=r"warmup_steps \(6\) must be <= steps \(5\)"):
        TrainConfig(steps=5, warmup_steps=6)
    # configs written before (the old default, 10, at 100+ steps) are the same run
    assert TrainConfig.from_dict(TrainConfig(steps=200).to_dict()).warmup_steps == 10


def test_torchrun_commands_always_carry_the_warmup():
    """A run with steps=50 and warm-up 10 must not lose its warm-up on the command line (the default
    for 50 steps is 5)."""
    from lrmoe.runs import train_flags
    from lrmoe.train import TrainConfig

    flags = train_flags(TrainConfig(steps=50, warmup_steps=10).to_dict())
    assert flags[flags.index("--warmup-steps") + 1] == "10"


# ----------------------------------------------------------------------------- --help


def _help(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main([*argv, "--help"])
    assert e.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines: compare words


@pytest.mark.parametrize("argv", [["train"], ["reproduce"], ["figures"]])
def test_help_states_each_default_once(argv, capsys):
    text = _help(argv, capsys)
    twice = re.findall(r"\(default[^()]*(?:\([^()]*\)[^()]*)*\) \(default: [^)]*\)", text)
    assert not twice, twice
    assert "(default: None) (default" not in text


def test_train_help_states_the_warmup_default(capsys):
    text = _help(["train"], capsys)
    assert "--warmup-steps WARMUP_STEPS linear warm-up steps" in text and "default: steps // 10, at most 10" in text
    assert "(default: $LRMOE_ALPACA, else tatsu-lab/alpaca)" in text
    assert "(default: $LRMOE_ALPACA, else tatsu-lab/alpaca) (default: None)" not in text


def test_reproduce_data_that_cannot_be_read_is_said_before_anything_is_written(tmp_path, capsys):
    out = tmp_path / "r"
    missing = tmp_path / "nowhere.json"
    assert main(["reproduce", "--preset", "smoke", "--out", str(out), "--data", str(missing), "--only",
                 "qwen3-C00-s0"]) == 2
    line = _one_line(capsys.readouterr().err, "reproduce")
    assert "the runs' data cannot be prepared, so nothing was run" in line and str(missing) in line
    assert "accepted: a .json/.jsonl file" in line
    assert not out.exists()
