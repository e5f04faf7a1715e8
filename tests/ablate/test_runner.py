"""`lrmoe ablate GRID` end to end on a tiny grid of smoke-sized runs (6 steps): --dry-run writes
nothing, an interrupted run resumes, --only trains a subset, a rerun trains nothing, a changed
grid is refused, the tables count what finished; the command line's bad input is one line, status 2."""
import json

import pytest

from lrmoe.ablate.runner import ablate, tables_from
from lrmoe.cli import main as lrmoe_main
from lrmoe.data import shared_data_dir

TINY = shared_data_dir() / "alpaca" / "alpaca_tiny.json"
GRID = """
[grid]
question = "tiny"
preset = "smoke"
metrics = ["dppl_final", "kept_fraction"]
jobs = 1
[set]
steps = {steps}
eval_interval = 0
checkpoint_interval = 0
[axes]
drop_ratio = [0.5]
scorer = ["lrm", "random"]
"""
RUNS = ["qwen3-C00-s0", "qwen3-C50-lrm-s0", "qwen3-C50-random-s0"]

pytestmark = pytest.mark.skipif(not TINY.exists(), reason=f"offline Alpaca sample not found at {TINY}")


@pytest.fixture
def env(tmp_path, tmp_path_factory, monkeypatch):
    cache = tmp_path_factory.getbasetemp() / "ablate-cache"  # the tokenizer is trained once
    monkeypatch.setenv("HF_HOME", str(cache / "hf"))
    monkeypatch.setenv("LRMOE_CACHE", str(cache / "lrmoe"))
    monkeypatch.delenv("LRMOE_ALPACA", raising=False)
    grid = tmp_path / "tiny.toml"
    grid.write_text(GRID.format(steps=6))
    return grid, tmp_path / "out"


def _summary(out, name):
    return json.loads((out / name / "summary.json").read_text())


def test_dry_run_resume_only_rerun_and_stale(env, capsys):
    grid, out = env
    assert ablate(grid, out, dry_run=True, progress=False, figures=False) == 0
    listed = capsys.readouterr().out
    assert not out.exists()
    for name in RUNS:
        assert name in listed
    assert "(baseline)" in listed and "vs qwen3-C00-s0" in listed

    from lrmoe.ablate.grid import load_grid
    from lrmoe.reproduce.presets import resolve_data
    from lrmoe.train import train
    from lrmoe.train import TrainConfig

    g = load_grid(grid)
    base = next(r for r in g.runs() if r.name == RUNS[0])
    data, _ = resolve_data(g, None)
    train(TrainConfig.from_dict(dict(base.config, data=data)), out / RUNS[0], progress=False, stop_after=3)
    assert _summary(out, RUNS[0])["status"] == "running"  # interrupted at step 3

    assert ablate(grid, out, only="C00|random", progress=False, figures=False) == 0
    err = capsys.readouterr().err
    assert "qwen3-C00-s0: interrupted" in err and "resumes from its checkpoint" in err
    s = _summary(out, RUNS[0])
    assert s["status"] == "done" and s["steps_done"] == 6 and s["resumed_from"]
    assert not (out / RUNS[1]).exists() and _summary(out, RUNS[2])["status"] == "done"
    md = (out / "tables" / "tiny.md").read_text()
    assert "`qwen3-C50-lrm-s0` (new)" in md and "not run" in md  # the lrm run is not trained yet

    before = {n: (out / n / "metrics.jsonl").read_bytes() for n in (RUNS[0], RUNS[2])}
    assert ablate(grid, out, progress=False, figures=False) == 0  # trains the lrm run only
    assert {n: (out / n / "metrics.jsonl").read_bytes() for n in before} == before
    a = json.loads((out / "ablation.json").read_text())
    assert [e["metrics"]["dppl_final"]["n"] for e in a["effects"]] == [1, 1]
    assert all(e["metrics"]["kept_fraction"]["mean"] == pytest.approx(0.5, abs=0.01) for e in a["effects"])
    assert not a["unfinished"] and not a["damaged"]
    assert json.loads((out / "ablate.json").read_text())["ran_now"] == 1
    assert json.loads((out / "manifest.json").read_text())["preset"]["kind"] == "ablation grid"

    other = out.with_name("other")  # --tables-from: the same tables from the runs of another folder
    assert tables_from(grid, out, other, figures=False) == 0
    assert json.loads((other / "ablation.json").read_text())["effects"] == a["effects"]
    assert sorted(q.name for q in other.iterdir()) == ["ablation.json", "tables"]

    grid.write_text(GRID.format(steps=7))  # the grid changed: its finished runs are of another config
    assert ablate(grid, out, progress=False, figures=False) == 2
    err = capsys.readouterr().err
    assert "hold runs of another config" in err and "steps: 6 != 7" in err
    assert tables_from(grid, out, other, figures=False) == 2
    assert "steps: 6 != 7" in capsys.readouterr().err


def test_command_line(env, capsys):
    grid, out = env
    assert lrmoe_main(["ablate", str(grid), "--dry-run", "--out", str(out)]) == 0
    assert "qwen3-C50-random-s0" in capsys.readouterr().out
    bad = grid.with_name("bad.toml")
    bad.write_text(GRID.format(steps=6).replace('scorer = ["lrm", "random"]', 'scorer = ["lrm", "nope"]'))
    for argv, message in ((["ablate", str(bad)], "bad.toml: [axes] scorer = 'nope': unknown scorer 'nope'"),
                          (["ablate", str(grid), "--jobs", "0"], "--jobs 0: give a number"),
                          (["ablate", str(grid), "--only", "("], "--only '(' is not a regular expression"),
                          (["ablate", "no_such_grid"], "grid 'no_such_grid': no such file"),
                          (["ablate", str(grid), "--colour"], "unexpected argument(s) --colour")):
        assert lrmoe_main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, (argv, err)
    assert not out.exists()


def test_probe_dispatch(monkeypatch, capsys):
    import importlib.util

    if importlib.util.find_spec("lrmoe.ablate.probe") is None:
        assert lrmoe_main(["ablate", "probe", "--out", "x"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "probe" in err and "not installed" in err
    else:  # H2's probe: the arguments after 'probe' reach its main
        import lrmoe.ablate.probe as probe

        seen = []
        monkeypatch.setattr(probe, "main", lambda argv: seen.append(argv) or 0)
        assert lrmoe_main(["ablate", "probe", "--out", "x"]) == 0 and seen == [["--out", "x"]]
