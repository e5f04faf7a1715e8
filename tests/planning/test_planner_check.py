"""``lrmoe bench planner-check``: fresh random cases, live planners against the frozen reference. It
counts what it compares, finds a planted worse planner, refuses bad options before planning."""
import json

import pytest

from lrmoe.bench import planner_check as C
from lrmoe.planning.policies import plan_placement


def run(tmp_path, *argv):
    return C.main([*argv, "--out", str(tmp_path)])


def test_counts_add_up_and_the_files_say_so(tmp_path):
    payload = run(tmp_path, "--cases", "6", "--seed", "11")
    summary = payload["summary"]
    assert sum(s["cases"] for s in summary) == 6
    assert sum(s["plans"] for s in summary) == 6 * 4 * C.STEPS  # four budgets, three steps
    for s in summary:
        assert s["identical"] + s["better"] + s["as_good"] + s["worse"] == s["plans"]
        assert s["worse"] == 0
    assert len(payload["rows"]) == sum(s["better"] + s["as_good"] + s["worse"] for s in summary)
    written = json.loads((tmp_path / "planner_check.json").read_text())
    assert written["summary"] == summary and written["headline"] == payload["headline"]
    assert "identical to the frozen reference's" in (tmp_path / "planner_check.md").read_text()


def test_a_planted_worse_planner_is_found(tmp_path, monkeypatch):
    """UltraEP's live plans replaced by fixed ownership's (no replicas: a slower slowest rank; under
    pressure other criteria may decide first)."""
    def planted(name, *args, **kwargs):
        if name == "ultraep":
            kwargs.pop("min_tokens", None)
            name = "fixed"
        return plan_placement(name, *args, **kwargs)

    monkeypatch.setattr(C, "plan_placement", planted)
    payload = run(tmp_path, "--cases", "4", "--seed", "3", "--policies", "ultraep")
    worse = [r for r in payload["rows"] if r["verdict"] == "worse"]
    assert worse and {r["criterion"] for r in worse} <= {name for name, _ in C.ORDER}
    assert any(r["criterion"] == "slowest rank's cost" for r in worse)  # unpressured: no replica to balance
    assert all("policy" in r["fields"] for r in payload["rows"])
    with pytest.raises(SystemExit, match="worse than the reference"):
        run(tmp_path, "--cases", "4", "--seed", "3", "--policies", "ultraep", "--strict")


def test_the_decided_order():
    base = {"fits": True, "dropped": 0, "kept": 100, "cost": 50.0}
    assert C.verdict(base, dict(base)) == ("as good", None)
    assert C.verdict({**base, "kept": 101, "cost": 60.0}, base) == ("better", "kept pairs")
    assert C.verdict({**base, "cost": 49.0}, base) == ("better", "slowest rank's cost")
    assert C.verdict({**base, "dropped": 1, "kept": 200}, base) == ("worse", "forward drops")
    assert C.verdict({**base, "fits": False, "cost": 1.0}, base) == ("worse", "over budget where the other fits")


@pytest.mark.parametrize("argv, message", [(["--cases", "0"], "--cases must be >= 1"),
                                           (["--seed", "-1"], "--seed must be >= 0"),
                                           (["--policies", "lrmoe,nope"], "--policies must name cases among")])
def test_bad_options_are_refused_before_planning(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        run(tmp_path, *argv)
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "planner_check.json").exists()
