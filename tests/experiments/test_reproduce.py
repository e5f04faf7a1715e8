"""`lrmoe reproduce`: presets as data, the smoke preset end to end, resume/skip, tables and figures."""
import json
import re
import shutil

import pytest

from lrmoe.data import shared_data_dir
from lrmoe.reproduce import PRESETS, plan, reproduce

TINY = shared_data_dir() / "alpaca" / "alpaca_tiny.json"
TABLES = ["tables/T1_convergence.md", "tables/T1_convergence.tex", "tables/T2_scorer_ablation.md",
          "tables/T2_scorer_ablation.tex"]
FIGURES = ["figures/F1_expert_loads.png", "figures/F1_expert_loads.pdf", "figures/F2_loss_curves.png",
           "figures/F2_loss_curves.pdf"]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    if not TINY.exists():
        pytest.skip(f"offline Alpaca sample not found at {TINY} (set LRMOE_SHARED_DATA to the shared/data folder)")
    base = tmp_path_factory.mktemp("smoke")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HOME", str(base / "hf"))
        mp.setenv("LRMOE_CACHE", str(base / "cache"))
        mp.delenv("HF_DATASETS_CACHE", raising=False)
        mp.delenv("LRMOE_ALPACA", raising=False)
        out = base / "results"
        assert reproduce("smoke", out, progress=False, simulate=False) == 0  # the simulator: tests/sim
        yield out


def test_presets_are_data():
    cpu = PRESETS["cpu"].runs()
    names = [r.name for r in cpu]
    assert len(names) == len(set(names)) == 70  # E1 + E2: 34; E3: 6 methods x 2 families x 3 seeds
    e3 = [r for r in cpu if "E3" in r.experiments]
    assert len(e3) == 36 and all(r.experiments == ("E3",) and r.config["virtual_ep"] == 8 for r in e3)
    assert {r.config["seed"] for r in e3} == {0, 1, 2}
    assert sorted(r.config["placement"] for r in e3 if r.family == "qwen3" and r.config["seed"] == 0) == [
        "fixed", "lrmoe", "symi", "symi", "symi", "ultraep"]
    # SYMI at its own capacity factor 1.0 (no option), at 1.25 and dropless (issue 30: a fair T3)
    symi = {r.name: r.config.get("ep_options", {}) for r in e3 if r.family == "qwen3" and r.config["seed"] == 0
            and r.config["placement"] == "symi"}
    assert symi == {"qwen3-E3-symi-s0": {}, "qwen3-E3-symi-cf125-s0": {"capacity_factor": 1.25},
                    "qwen3-E3-symi-dropless-s0": {"capacity_factor": None}}
    from paper_figures.time_to_target import method_of

    assert {method_of(r.config) for r in e3} == {"fixed", "symi", "symi-cf125", "symi-dropless", "ultraep", "lrmoe"}
    for fam in ("qwen3", "glm4"):
        e1 = [r for r in cpu if r.family == fam and "E1" in r.experiments]
        assert sorted(r.config["drop_ratio"] for r in e1) == [0.0, 0.1, 0.2, 0.3]
        e2 = [r for r in cpu if r.family == fam and "E2" in r.experiments and r.config["drop_ratio"] == 0.2]
        assert {r.config["scorer"] for r in e2} == {"lrm", "grad_norm", "abs_grad", "random"}
        assert {r.config["seed"] for r in e2} == {0, 1, 2}
        assert {r.config["seed"] for r in cpu if r.family == fam and r.config["drop_ratio"] == 0} == {0, 1, 2}
    assert "E1" in next(r for r in cpu if r.name == "qwen3-C20-lrm-s0").experiments
    assert "E2" in next(r for r in cpu if r.name == "qwen3-C20-lrm-s0").experiments
    for p in PRESETS.values():
        for r in p.runs():
            r.train_config().validate() if p.base.get("device") == "cpu" else r.train_config()
    gpu = PRESETS["gpu1"].runs()[0].config
    assert gpu["model"] == "qwen3-30b-a3b" and gpu["seq_len"] == 8192 and gpu["model_overrides"]


def test_paper_preset_has_e3_torchrun_runs_that_record_their_routing(tmp_path, capsys):
    """The paper preset's E3 (issue 14): fixed, SYMI and UltraEP at EP8 per model, each recording its
    routing trace; LRMoE is E1's C20 run, tagged E3 and recording too; --dry-run prints each one's
    torchrun command with --record-trace into its run folder."""
    from lrmoe.cli import main

    runs = PRESETS["paper"].runs()
    assert len(runs) == len({r.name for r in runs}) == 44  # 34 E1/E2 + 10 E3
    e3 = [r for r in runs if "E3" in r.experiments]
    from paper_figures.time_to_target import method_of

    for fam in ("qwen3", "glm4"):
        mine = {method_of(r.config): r for r in e3 if r.family == fam}
        assert sorted(mine) == ["fixed", "lrmoe", "symi", "symi-cf125", "symi-dropless", "ultraep"], fam
        assert all(r.record_trace and r.config["ep"] == 8 for r in mine.values())
        lrmoe = mine["lrmoe"]
        assert lrmoe.name == f"{fam}-C20-lrm-s0" and {"E1", "E2", "E3"} <= set(lrmoe.experiments)
        assert lrmoe.config["drop_ratio"] == 0.2
        assert all(r.config["drop_ratio"] == 0.0 for p, r in mine.items() if p != "lrmoe")
    assert not [r for r in runs if "E3" not in r.experiments and r.record_trace]
    out = tmp_path / "paper"
    assert main(["reproduce", "--preset", "paper", "--dry-run", "--out", str(out), "--only", "E3|C20-lrm-s0"]) == 0
    lines = capsys.readouterr().out.splitlines()
    listed = [ln.split()[0] for ln in lines if not ln.startswith("    ")]
    assert sorted(listed) == sorted(r.name for r in e3)
    commands = [ln.strip() for ln in lines if ln.startswith("    torchrun")]
    assert len(commands) == len(e3)
    for r in e3:
        cmd = next(c for c in commands if f"{out / r.name}" in c)
        assert "--nproc-per-node 8" in cmd and f"--record-trace {out / r.name}/" in cmd, cmd
        assert f"--placement {r.config['placement']}" in cmd and "--ep 8" in cmd, cmd
    assert not out.exists()


def test_smoke_end_to_end(smoke):
    for f in TABLES + FIGURES + ["report.md", "manifest.json", "reproduce.json"]:
        assert (smoke / f).is_file() and (smoke / f).stat().st_size > 0, f
    runs = json.loads((smoke / "manifest.json").read_text())["runs"]
    for r in runs:
        s = json.loads((smoke / r["name"] / "summary.json").read_text())
        assert s["status"] == "done" and (smoke / r["name"] / "metrics.jsonl").exists()
    t1 = (smoke / "tables/T1_convergence.md").read_text()
    assert "1.015190" in t1 and "1.016270" in t1  # paper
    assert "not run" not in t1 and "preset `smoke`" in t1 and "measured" in t1.lower()
    measured = [line for line in t1.splitlines() if line.startswith("| Qwen3-MoE") and "| C20 |" in line]
    assert measured and re.search(r"\| \d+\.\d{6} \|", measured[0])
    t2 = (smoke / "tables/T2_scorer_ablation.md").read_text()
    for v in ("0.012474", "0.775797", "0.003464", "0.079282"):
        assert v in t2
    assert "not run" not in t2 and "(n=2;" in t2
    assert r"\begin{tabular}" in (smoke / "tables/T2_scorer_ablation.tex").read_text()
    report = (smoke / "report.md").read_text()
    for key in ("T3", "T4", "T5", "F3", "F4"):
        assert re.search(rf"## {key}:.*\n\nNot yet produced", report), key
    # the gradient-fidelity probe of the preset's Qwen3 C0 run, shown in the report as A1
    probe = json.loads((smoke / "probe/probe.json").read_text())
    assert probe["meta"]["run"] == str(smoke / "qwen3-C00-s0") and probe["meta"]["drops"] == [0.0, 0.5]
    assert {r["checkpoint"] for r in probe["records"]} == {"trained", "init"}
    a1 = report[report.index("## A1:"):].split("\n## ")[0]
    assert "Not yet produced" not in a1 and "figure_a1.png" in a1
    assert (smoke / "figures/F1_expert_loads.png").read_bytes()[:4] == b"\x89PNG"
    assert (smoke / "figures/F2_loss_curves.pdf").read_bytes()[:4] == b"%PDF"


def test_second_call_skips_finished_runs(smoke, capsys):
    before = {p: p.stat().st_mtime_ns for p in smoke.glob("*/metrics.jsonl")}
    probed = (smoke / "probe/probe.json").stat().st_mtime_ns
    assert reproduce("smoke", smoke, figures=False, progress=False) == 0
    assert json.loads((smoke / "reproduce.json").read_text())["ran_now"] == 0
    assert {p: p.stat().st_mtime_ns for p in smoke.glob("*/metrics.jsonl")} == before
    assert "0 to run" in capsys.readouterr().err
    # with the figures, the probe is not repeated either: its probe.json is of the run as it is (the
    # same final metrics, the same arguments), with the checkpoint or without it (a committed reference)
    ck = smoke / "qwen3-C00-s0" / "checkpoint.pt"
    for kept in (True, False):
        if not kept:
            ck.rename(ck.with_suffix(".aside"))
        try:
            assert reproduce("smoke", smoke, progress=False, simulate=False, reference="none") == 0
        finally:
            if not kept:
                ck.with_suffix(".aside").rename(ck)
        assert "probe.json is up to date" in capsys.readouterr().err
        assert (smoke / "probe/probe.json").stat().st_mtime_ns == probed


def test_finished_runs_of_another_config_are_refused(smoke, tmp_path, capsys):
    """A finished run whose config differs from the preset's (an older kit, another --data) is
    neither reused silently nor overwritten: reproduce lists the differences and exits with 2.
    The same data at another path (a moved data folder) is still the same run."""
    copy = tmp_path / "copy"
    shutil.copytree(smoke, copy, ignore=shutil.ignore_patterns("checkpoint.pt"))
    moved = tmp_path / "moved.json"
    shutil.copy(TINY, moved)
    assert reproduce("smoke", copy, data=str(moved), figures=False, progress=False) == 0  # same content
    assert "0 to run" in capsys.readouterr().err
    run = next(p for p in sorted(copy.iterdir()) if (p / "summary.json").exists())
    summary = json.loads((run / "summary.json").read_text())
    summary["config"]["lr"] = summary["config"]["lr"] * 2
    (run / "summary.json").write_text(json.dumps(summary))
    before = (run / "metrics.jsonl").read_text()
    assert reproduce("smoke", copy, figures=False, progress=False) == 2
    err = capsys.readouterr().err
    assert f"{run.name}: lr:" in err and "move or delete them" in err
    assert (run / "metrics.jsonl").read_text() == before


def test_missing_runs_say_not_run(smoke, tmp_path):
    from paper_figures import make_all

    partial = tmp_path / "partial"
    shutil.copytree(smoke, partial, ignore=shutil.ignore_patterns("checkpoint.pt", "tables", "figures"))
    shutil.rmtree(partial / "glm4-C30-lrm-s0")
    shutil.rmtree(partial / "qwen3-C20-random-s0")
    shutil.rmtree(partial / "qwen3-C20-random-s1")
    make_all(partial, partial)
    t1 = (partial / "tables/T1_convergence.md").read_text()
    glm_c30 = next(line for line in t1.splitlines() if "glm4" in line and "| C30 |" in line)
    assert glm_c30.count("not run") == 4  # PPL, ΔPPL, Δ% and the paired column
    t2 = (partial / "tables/T2_scorer_ablation.md").read_text()
    random_row = next(line for line in t2.splitlines() if line.startswith("| random"))
    assert random_row.split(" | ")[2] == "not run" and "(n=2;" in random_row


def test_cli_dry_run_only_and_paper(smoke, capsys, monkeypatch):
    from lrmoe.cli import main

    assert main(["reproduce", "--preset", "cpu", "--dry-run", "--out", str(smoke / "cpu"),
                 "--only", "qwen3-C[0-9]+-lrm-s0"]) == 0
    out = capsys.readouterr().out
    assert [line.split()[0] for line in out.strip().splitlines()] == ["qwen3-C10-lrm-s0", "qwen3-C20-lrm-s0",
                                                                     "qwen3-C30-lrm-s0"]
    # never a real launch, whatever GPUs the machine running the tests has
    monkeypatch.setattr("lrmoe.runs.torchrun.missing_hardware", lambda runs, nproc: "the test stands in for missing GPUs")
    assert main(["reproduce", "--preset", "paper", "--out", str(smoke / "paper")]) == 2
    assert "expert-parallel" in capsys.readouterr().err
    assert not (smoke / "paper").exists()
    assert main(["figures", "--results", str(smoke), "--out", str(smoke / "again"), "--only", "T1"]) == 0
    assert (smoke / "again/tables/T1_convergence.md").exists()
    assert not (smoke / "again/figures").exists()


def test_dry_run_shows_a_stale_run(smoke, tmp_path, capsys):
    """--dry-run used to list a run folder of another config as done; a real call stops with 2."""
    from lrmoe.cli import main

    out = tmp_path / "smoke"
    shutil.copytree(smoke, out)
    name = next(p.name for p in out.iterdir() if (p / "summary.json").exists())
    s = json.loads((out / name / "summary.json").read_text())
    s["config"]["lr"] *= 2
    (out / name / "summary.json").write_text(json.dumps(s))
    assert main(["reproduce", "--preset", "smoke", "--out", str(out), "--dry-run", "--only", f"^{name}$"]) == 0
    cap = capsys.readouterr()
    assert cap.out.split()[:3][2] == "stale" and "a real call stops with status 2" in cap.err
    assert main(["reproduce", "--preset", "smoke", "--out", str(out), "--only", f"^{name}$"]) == 2


def test_missing_shared_data_is_status_2_and_runs_nothing(tmp_path, monkeypatch, capsys):
    """Without data nothing can run: said with where the data was looked for and what is accepted,
    status 2 (it was 0, so `make ablate` in a clone without the shared folder "succeeded" having run
    nothing), no folder written; --dry-run still lists the runs."""
    monkeypatch.setenv("LRMOE_SHARED_DATA", str(tmp_path / "nowhere"))
    monkeypatch.delenv("LRMOE_ALPACA", raising=False)
    assert plan("smoke", tmp_path)["skip"]
    assert reproduce("smoke", tmp_path / "out", progress=False) == 2
    err = capsys.readouterr().err
    assert "nothing was run" in err and str(tmp_path / "nowhere") in err and "--data PATH" in err
    assert not (tmp_path / "out").exists()
    assert reproduce("smoke", tmp_path / "out", progress=False, dry_run=True) == 0


def test_a_run_folder_with_an_unreadable_summary_is_refused(smoke, tmp_path, capsys):
    """A summary.json that cannot be decoded used to count as "no run yet": the run was trained
    again into that folder. Whether it holds this preset's run is unknown, so reproduce stops with
    status 2 and names the folder; nothing in it is touched."""
    copy = tmp_path / "copy"
    shutil.copytree(smoke, copy, ignore=shutil.ignore_patterns("checkpoint.pt", "tables", "figures"))
    run = copy / "qwen3-C10-lrm-s0"
    (run / "summary.json").write_text('{"status": "done", "config": {"lr": 0.0')
    before = (run / "metrics.jsonl").read_bytes()
    assert reproduce("smoke", copy, figures=False, progress=False) == 2
    err = capsys.readouterr().err
    assert "qwen3-C10-lrm-s0: " in err and "summary.json" in err and "cannot be read" in err
    assert (run / "metrics.jsonl").read_bytes() == before
    assert (run / "summary.json").read_text() == '{"status": "done", "config": {"lr": 0.0'


def test_a_corrupt_reproduce_json_is_kept_aside_not_reset(smoke, tmp_path, capsys):
    """A reproduce.json that cannot be decoded used to be replaced silently, its wall-time total
    reset to this call's: now it is moved to reproduce.json.corrupt and the call says so."""
    copy = tmp_path / "copy"
    shutil.copytree(smoke, copy, ignore=shutil.ignore_patterns("checkpoint.pt", "tables", "figures"))
    (copy / "reproduce.json").write_text('{"wall_s_total": 1234.5, "ru')
    assert reproduce("smoke", copy, figures=False, progress=False) == 0
    err = capsys.readouterr().err
    assert "reproduce.json" in err and "reproduce.json.corrupt" in err
    assert (copy / "reproduce.json.corrupt").read_text() == '{"wall_s_total": 1234.5, "ru'
    rec = json.loads((copy / "reproduce.json").read_text())
    assert rec["ran_now"] == 0 and "reproduce.json.corrupt" in rec["wall_s_total_note"]
