"""One status per run folder (lrmoe.run_folder.run_state), shared by `lrmoe reproduce` (its dry
run too) and every table maker: damaged results are named with what is wrong, never silently
dropped; an interrupted run is not shown as running; leftovers of failed runs are cleaned (issue 17).
No training: the run folders are written by the test."""
import contextlib
import json
import os
import threading

import pytest

from lrmoe import run_folder
from lrmoe.run_folder import run_folder_lock, run_state

STEPS = 4


def _write(d, status="done", steps=STEPS, config=None, rows=None, family="qwen3_moe"):
    d.mkdir(parents=True, exist_ok=True)
    cfg = dict(config or {"model": "qwen3-moe-tiny", "drop_ratio": 0.0, "scorer": "lrm", "seed": 0}, steps=steps)
    (d / "summary.json").write_text(json.dumps({"status": status, "config": cfg, "steps_done": steps,
                                                "model": {"family": family}}))
    rows = [{"step": s, "loss": 1.0, "ppl": 2.0} for s in range(1, steps + 1)] if rows is None else rows
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


# ----------------------------------------------------------------------------- run_state


def test_a_complete_finished_run_is_done(tmp_path):
    st = run_state(_write(tmp_path / "r"))
    assert (st.state, st.label, st.why) == ("done", "done", "")
    assert [r["step"] for r in st.rows] == [1, 2, 3, 4] and st.summary["status"] == "done"


def test_a_missing_or_empty_folder_is_new(tmp_path):
    assert run_state(tmp_path / "nothing").state == "new"
    (tmp_path / "empty").mkdir()
    st = run_state(tmp_path / "empty")
    assert (st.state, st.leftovers) == ("new", ())


@pytest.mark.parametrize("damage,why", [
    (lambda d: (d / "metrics.jsonl").write_text('{"step": 1}\ngarbage\n{"step": 3}\n{"step": 4}\n'),
     "metrics.jsonl: line 2 of 4 is not valid JSON"),
    (lambda d: (d / "metrics.jsonl").write_text(""), "metrics.jsonl: empty, but summary.json says the run is done"),
    (lambda d: (d / "metrics.jsonl").unlink(), "metrics.jsonl: missing, but summary.json says the run is done"),
    (lambda d: (d / "metrics.jsonl").write_bytes((d / "metrics.jsonl").read_bytes()[:-5]),
     "3 row(s) for a run of 4 steps, step(s) 4 missing (its last line is torn)"),
    (lambda d: (d / "metrics.jsonl").write_text('{"step": 1}\n{"step": 4}\n'), "step(s) 2-3 missing"),
    (lambda d: open(d / "metrics.jsonl", "a").write("garbage\n"),  # every row there, then a bad line
     "metrics.jsonl: line 5 (the last) is not valid JSON, but summary.json says the run is done"),
    (lambda d: (d / "summary.json").write_bytes((d / "summary.json").read_bytes()[:40]), "summary.json: not valid JSON"),
    (lambda d: (d / "summary.json").write_text("[]"), "summary.json: expected a JSON object"),
    (lambda d: (d / "summary.json").write_text('{"status": "exploded"}'), "unknown status 'exploded'"),
])
def test_damaged_files_are_named_with_what_is_wrong(tmp_path, damage, why):
    d = _write(tmp_path / "r")
    damage(d)
    st = run_state(d)
    assert st.state == "damaged" and why in st.why, st.why
    assert str(d) in st.why and st.leftovers == ()  # nothing of a damaged folder is ever removed


def test_running_in_the_summary_but_no_live_lock_is_interrupted(tmp_path):
    d = _write(tmp_path / "r", status="running", rows=[{"step": 1}, {"step": 2}])
    json.dump(dict(json.loads((d / "summary.json").read_text()), steps_done=2), open(d / "summary.json", "w"))
    (d / ".lrmoe.lock").write_text("999999")  # a lock file whose owner is gone
    st = run_state(d)
    assert (st.state, st.label) == ("interrupted", "interrupted (restarts)")
    assert "stopped at step 2 of 4; no checkpoint.pt: restarts at step 1" == st.why
    (d / "checkpoint.pt").write_bytes(b"x")
    st = run_state(d)
    assert (st.label, st.why) == ("interrupted (resumable)", "stopped at step 2 of 4; resumes from its checkpoint")


@contextlib.contextmanager
def _trained_by_a_thread(run_dir):
    """The run folder's lock held (as training holds it) by another thread while the block runs."""
    held, release = threading.Event(), threading.Event()

    def trainer():
        with run_folder_lock(run_dir):
            held.set()
            release.wait(30)

    t = threading.Thread(target=trainer)
    t.start()
    try:
        assert held.wait(30)
        yield
    finally:
        release.set()
        t.join()


def test_a_held_lock_is_running(tmp_path):
    d = _write(tmp_path / "r", status="running")
    with _trained_by_a_thread(d):
        st = run_state(d)
        assert (st.state, st.why) == ("running", f"pid {os.getpid()}")
        assert run_folder.lock_holder(d)
    assert run_state(d).state == "interrupted" and run_folder.lock_holder(d) is None


def test_a_folder_with_only_a_lock_file_is_new_and_its_leftovers_are_listed(tmp_path):
    d = tmp_path / "r"
    d.mkdir()
    (d / ".lrmoe.lock").write_text("12345")
    (d / ".summary.json.abc123.tmp").write_text("{")
    st = run_state(d)
    assert st.state == "new" and "left its lock file" in st.why
    assert sorted(p.name for p in st.leftovers) == [".lrmoe.lock", ".summary.json.abc123.tmp"]


def test_the_checkpoint_name_is_trainings():
    from lrmoe.train import checkpoint

    assert run_folder.CHECKPOINT == checkpoint.MAIN


# ----------------------------------------------------------------------------- reproduce and figures agree


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """A smoke-preset results folder whose runs all look finished, then damaged/interrupted/failed in
    known ways. Data preparation and training are replaced by a recorder."""
    from lrmoe.reproduce import plan
    import lrmoe.reproduce.driver as driver
    import lrmoe.runs.pool as pool
    from lrmoe.runs import Outcome

    out = tmp_path / "smoke"
    monkeypatch.setenv("LRMOE_ALPACA", str(tmp_path / "alpaca.json"))  # a data source, never read here
    pl = plan("smoke", out)
    for r in pl["runs"]:
        _write(out / r.name, steps=r.config["steps"], config=r.config, family=f"{r.family}_moe")
    (out / "manifest.json").write_text(json.dumps({"preset": pl["preset"].to_dict(),
                                                   "runs": [{"name": r.name, "experiments": list(r.experiments)}
                                                            for r in pl["all_runs"]]}))
    # damaged: a garbage line, a truncated summary, an empty metrics file
    m = out / "qwen3-C10-lrm-s0" / "metrics.jsonl"
    lines = m.read_text().splitlines()
    lines[3] = "garbage"
    m.write_text("\n".join(lines) + "\n")
    s = out / "glm4-C20-lrm-s1" / "summary.json"
    s.write_bytes(s.read_bytes()[:60])
    (out / "qwen3-C20-random-s1" / "metrics.jsonl").write_text("")
    # interrupted (resumable), and a run that failed before its first step (only its lock file)
    inter = out / "glm4-C30-lrm-s0"
    sm = json.loads((inter / "summary.json").read_text())
    (inter / "summary.json").write_text(json.dumps(dict(sm, status="running", steps_done=12)))
    (inter / "checkpoint.pt").write_bytes(b"x")
    (inter / ".checkpoint.pt.xyz.tmp").write_bytes(b"half a checkpoint")
    failed = out / "qwen3-C30-lrm-s0"
    for f in failed.iterdir():
        f.unlink()
    (failed / ".lrmoe.lock").write_text("4242")
    trained = []

    def fake_run_all(runs, out_dir, jobs=1, **kw):
        trained.extend(r.name for r in runs)
        return Outcome()

    monkeypatch.setattr(driver, "run_all", fake_run_all)
    monkeypatch.setattr(pool, "prepare_data", lambda runs, progress=True: None)
    return out, trained


DAMAGED = {"qwen3-C10-lrm-s0": "metrics.jsonl: line 4 of 30 is not valid JSON",
           "glm4-C20-lrm-s1": "summary.json: not valid JSON",
           "qwen3-C20-random-s1": "metrics.jsonl: empty, but summary.json says the run is done"}


def _dry_run_labels(out, capsys) -> tuple[dict, str]:
    from lrmoe.cli import main

    assert main(["reproduce", "--preset", "smoke", "--out", str(out), "--dry-run"]) == 0
    cap = capsys.readouterr()
    labels = {}
    for line in cap.out.splitlines():
        name, _exp, rest = line.split(maxsplit=2)
        labels[name] = rest.split(" model=")[0].strip()
    return labels, cap.err


def test_the_dry_run_and_the_tables_agree_on_every_run(folder, capsys):
    from paper_figures import Results

    out, _ = folder
    labels, err = _dry_run_labels(out, capsys)
    assert {n for n, lab in labels.items() if lab == "damaged"} == set(DAMAGED)
    assert labels["glm4-C30-lrm-s0"] == "interrupted (resumable)" and labels["qwen3-C30-lrm-s0"] == "new"
    assert "running" not in labels.values()
    for name, why in DAMAGED.items():
        assert f"{out / name}/{why.split(':')[0]}: {why.split(': ', 1)[1]}" in err, (name, err)
    assert "stopped at step 12 of 30; resumes from its checkpoint: a real call reruns it" in err
    assert "left its lock file: a real call removes .lrmoe.lock" in err

    res = Results.load(out)
    assert set(res.damaged) == set(DAMAGED)
    for name, why in DAMAGED.items():
        assert why in res.damaged[name]
    done_in_tables = {n for n, r in res.runs.items() if r.done}
    assert done_in_tables == {n for n, lab in labels.items() if lab == "done"}


def test_figures_name_every_damaged_run_in_every_table_and_exit_2(folder, capsys):
    from lrmoe.cli import main

    out, _ = folder
    assert main(["figures", "--results", str(out), "--only", "T1,T2"]) == 2
    err = capsys.readouterr().err
    for name, why in DAMAGED.items():
        assert f"damaged run {name} is left out of the tables and figures: " in err and why in err
    assert err.strip().splitlines()[-1].startswith("lrmoe figures: 3 damaged run folder(s) left out (")
    for table in ("T1_convergence.md", "T2_scorer_ablation.md"):
        text = (out / "tables" / table).read_text()
        assert "*Left out* (damaged run folders" in text and all(f"`{n}`" in text for n in DAMAGED), table
    assert "*Unfinished*" in (out / "tables" / "T1_convergence.md").read_text()
    assert "`glm4-C30-lrm-s0` (interrupted (resumable))" in (out / "tables" / "T1_convergence.md").read_text()
    report = (out / "report.md").read_text()
    assert "3 damaged run folder(s)" in report and all(f"`{n}`: " in report for n in DAMAGED)


def test_reproduce_refuses_damaged_runs_naming_them_and_trains_nothing(folder, capsys):
    """A truncated summary.json used to make reproduce retrain the run without a word; a garbage
    metrics line or an empty metrics file let it count as done."""
    from lrmoe.cli import main

    out, trained = folder
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert main(["reproduce", "--preset", "smoke", "--out", str(out), "--jobs", "1"]) == 2
    err = capsys.readouterr().err
    assert "3 run folder(s) under" in err and "are damaged" in err
    for name, why in DAMAGED.items():
        assert f"  {name}: {out / name}/" in err and why.split(": ", 1)[1] in err
    assert trained == []
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before  # nothing touched


def test_reproduce_reruns_an_interrupted_run_saying_why_and_cleans_leftovers(folder, capsys):
    import shutil

    out, trained = folder
    for name in DAMAGED:  # the user moves the damaged runs away
        shutil.move(str(out / name), str(out.parent / name))
    from lrmoe.cli import main

    assert main(["reproduce", "--preset", "smoke", "--out", str(out), "--jobs", "1", "--no-figures"]) == 0
    err = capsys.readouterr().err
    assert "started runs that run again:" in err
    assert "  glm4-C30-lrm-s0: interrupted (resumable): stopped at step 12 of 30; resumes from its checkpoint" in err
    assert sorted(trained) == sorted([*DAMAGED, "glm4-C30-lrm-s0", "qwen3-C30-lrm-s0"])
    assert "removed 3 leftover(s)" in err
    assert not (out / "qwen3-C30-lrm-s0").exists()  # the failed run's folder held only its lock file
    assert not (out / "glm4-C30-lrm-s0" / ".checkpoint.pt.xyz.tmp").exists()
    assert (out / "glm4-C30-lrm-s0" / "checkpoint.pt").exists()


def test_a_run_that_fails_before_its_first_step_leaves_no_folder(tmp_path, monkeypatch, capsys):
    """The run machinery itself: a failed run whose folder holds only its lock file is cleaned."""
    import lrmoe.runs.pool as pool
    from lrmoe.reproduce import reproduce

    monkeypatch.setenv("LRMOE_ALPACA", str(tmp_path / "alpaca.json"))
    monkeypatch.setattr(pool, "prepare_data", lambda runs, progress=True: None)

    def failing(spec, out_dir, progress):
        from pathlib import Path

        Path(out_dir).mkdir(parents=True, exist_ok=True)
        with run_folder_lock(out_dir):
            raise ValueError("no such tokenizer")

    monkeypatch.setattr(pool, "train_one", failing)
    out = tmp_path / "r"
    assert reproduce("smoke", out, only="qwen3-C00-s0", jobs=1, figures=False, progress=False) == 1
    cap = capsys.readouterr()
    assert "qwen3-C00-s0: FAILED: ValueError('no such tokenizer')" in cap.out + cap.err
    assert "removed 2 leftover(s)" in cap.err
    assert not (out / "qwen3-C00-s0").exists() and (out / "manifest.json").exists()


def test_a_run_trained_by_another_process_is_not_started_twice(folder, capsys):
    from lrmoe.cli import main

    out, trained = folder
    with _trained_by_a_thread(out / "glm4-C30-lrm-s0"):
        labels, err = _dry_run_labels(out, capsys)
        assert labels["glm4-C30-lrm-s0"] == "running"
        assert main(["reproduce", "--preset", "smoke", "--out", str(out), "--only", "glm4-C30"]) == 2
        err = capsys.readouterr().err
        assert "being trained by another process" in err and "glm4-C30-lrm-s0: pid " in err
    assert trained == []
