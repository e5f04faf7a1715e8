"""The run machinery (lrmoe.runs) on its own, without training: selecting runs, what a results
folder holds (finished, stale, unreadable), the per-call record, and the serial pool's handling of
a failed and of an interrupted run."""
import json

import pytest

from lrmoe.runs import RunSpec, UsageError, folders, pool, record_call, run_all, select, survey
from lrmoe.train import TrainConfig

BASE = TrainConfig(model="qwen3-moe-tiny", steps=3, warmup_steps=1).to_dict()


def _spec(name, **changes):
    return RunSpec(name, "qwen3", ("E1",), dict(BASE, **changes))


def _summary(run_dir, config, status="done"):
    run_dir.mkdir(parents=True)
    (run_dir / "summary.json").write_text(json.dumps({"status": status, "config": config}))
    if status == "done":  # a finished run has one metrics row per step
        (run_dir / "metrics.jsonl").write_text("".join(f'{{"step": {i}}}\n' for i in range(1, config["steps"] + 1)))


def test_select_matches_names_by_regex():
    runs = [_spec("qwen3-C00-s0"), _spec("qwen3-C20-lrm-s0"), _spec("glm4-C20-lrm-s1")]
    assert [r.name for r in select(runs, "C20-lrm")] == ["qwen3-C20-lrm-s0", "glm4-C20-lrm-s1"]
    assert select(runs, None) == runs
    with pytest.raises(UsageError, match=r"--only '\^nothing\$' matches none of the 3 runs; they are: qwen3-C00-s0, "):
        select(runs, "^nothing$")
    with pytest.raises(UsageError, match=r"--only '\(\[' is not a regular expression"):
        select(runs, "([")


def test_survey_tells_done_running_stale_and_unreadable_folders(tmp_path):
    runs = [_spec("new"), _spec("done"), _spec("running"), _spec("stale", lr=0.5), _spec("torn")]
    _summary(tmp_path / "done", BASE)
    _summary(tmp_path / "running", BASE, status="running")
    _summary(tmp_path / "stale", BASE)  # finished with the default lr, the spec asks for 0.5
    (tmp_path / "torn").mkdir()
    (tmp_path / "torn" / "summary.json").write_text('{"status": "do')
    sv = survey(tmp_path, runs)
    assert {n: st.state for n, st in sv.states.items()} == {
        "new": "new", "done": "done", "running": "interrupted", "stale": "done", "torn": "damaged"}
    assert list(sv.stale) == ["stale"] and sv.stale["stale"][0].startswith("lr: ")
    assert list(sv.damaged) == ["torn"] and "torn/summary.json" in sv.damaged["torn"]
    # "running" in a summary with no live process holding the lock: interrupted (no checkpoint: restarts)
    assert [sv.label(r.name) for r in runs] == ["new", "done", "interrupted (restarts)", "stale", "damaged"]
    assert [r.name for r in sv.pending(runs)] == ["new", "running", "torn"]


def test_record_call_adds_up_wall_time(tmp_path):
    path = tmp_path / "reproduce.json"
    assert record_call(path, {"preset": "p"}, 2.0)["wall_s_total"] == 2.0
    rec = record_call(path, {"preset": "p"}, 3.0)
    assert (rec["wall_s_last_call"], rec["wall_s_total"]) == (3.0, 5.0)
    assert json.loads(path.read_text()) == rec and "wall_s_total_note" not in rec


@pytest.mark.parametrize("bad", ['{"wall_s_total": 12', '[1, 2]', '{"wall_s_total": "many"}'])
def test_a_corrupt_record_is_kept_aside_not_silently_reset(tmp_path, bad):
    path = tmp_path / "reproduce.json"
    path.write_text(bad)
    said = []
    rec = record_call(path, {"preset": "p"}, 4.0, warn=said.append)
    assert (tmp_path / "reproduce.json.corrupt").read_text() == bad
    assert len(said) == 1 and "reproduce.json" in said[0] and "reproduce.json.corrupt" in said[0]
    assert rec["wall_s_total"] == 4.0 and "reproduce.json.corrupt" in rec["wall_s_total_note"]
    later = record_call(path, {"preset": "p"}, 1.0, warn=said.append)
    assert later["wall_s_total"] == 5.0 and later["wall_s_total_note"] == rec["wall_s_total_note"]
    path.write_text("again not JSON")
    record_call(path, {"preset": "p"}, 1.0, warn=said.append)
    assert (tmp_path / "reproduce.json.corrupt.1").read_text() == "again not JSON"  # the first copy is kept


def test_serial_pool_reports_a_failed_run_and_goes_on(tmp_path, monkeypatch):
    trained = []

    def fake_train_one(spec, out_dir, progress):
        trained.append(spec["name"])
        if spec["name"] == "bad":
            raise ValueError("the data cannot be read")
        return {"name": spec["name"], "status": "done", "final": {"loss": 0.5}, "wall_s": 0.0}

    monkeypatch.setattr(pool, "train_one", fake_train_one)
    monkeypatch.setattr(pool, "prepare_data", lambda runs, progress=True: None)
    res = run_all([_spec("bad"), _spec("good")], tmp_path, jobs=1, progress=False)
    assert trained == ["bad", "good"] and not res.interrupted
    assert res.failures == [("bad", "ValueError('the data cannot be read')")]


def test_serial_pool_stops_at_an_interrupt_and_starts_no_other_run(tmp_path, monkeypatch):
    trained = []

    def fake_train_one(spec, out_dir, progress):
        trained.append(spec["name"])
        if spec["name"] == "second":
            raise KeyboardInterrupt  # what train raises after checkpointing at Ctrl-C / SIGTERM
        return {"name": spec["name"], "status": "done", "final": {}, "wall_s": 0.0}

    monkeypatch.setattr(pool, "train_one", fake_train_one)
    monkeypatch.setattr(pool, "prepare_data", lambda runs, progress=True: None)
    res = run_all([_spec("first"), _spec("second"), _spec("third")], tmp_path, jobs=1, progress=False)
    assert res.interrupted and res.failures == [] and trained == ["first", "second"]


def test_no_runs_is_a_no_op(tmp_path, monkeypatch):
    monkeypatch.setattr(pool, "prepare_data", lambda runs, progress=True: pytest.fail("nothing to prepare"))
    res = run_all([], tmp_path, jobs=2, progress=False)
    assert (res.failures, res.interrupted) == ([], False)
    assert not any(tmp_path.iterdir())


def test_manifest_is_written_atomically_as_json(tmp_path):
    path = folders.write_manifest(tmp_path / "out", {"preset": {"name": "p"}, "runs": []})
    assert json.loads(path.read_text()) == {"preset": {"name": "p"}, "runs": []}
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["manifest.json"]  # no temporary file left


def test_refusal_names_each_stale_and_unreadable_folder(tmp_path):
    runs = [_spec("ok"), _spec("stale", lr=0.5), _spec("torn")]
    _summary(tmp_path / "ok", BASE)
    _summary(tmp_path / "stale", BASE)
    (tmp_path / "torn").mkdir()
    (tmp_path / "torn" / "summary.json").write_bytes(b"\xff\xfe")
    lines = survey(tmp_path, runs).refusal(tmp_path, "lrmoe ablate")
    assert lines[0].startswith("lrmoe ablate: 1 run folder(s) under") and "another config" in lines[0]
    assert lines[1].startswith("  stale: lr: ")
    assert "damaged" in lines[2] and lines[3].startswith("  torn: ") and len(lines) == 4
    assert survey(tmp_path, runs[:1]).refusal(tmp_path, "lrmoe ablate") == []
