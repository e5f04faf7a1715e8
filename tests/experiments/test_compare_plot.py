"""The rerun-vs-reference comparison of `lrmoe reproduce` (synthetic run folders: identical,
agreeing, differing and missing cells, the seed spreads, per-run bit identity), the refusal of
tables over non-comparable runs, F2's seed band, `lrmoe plot` on tiny run folders and its bad
input, and the reproduce options around them (default folder, --reference)."""
import json
import math
import shutil

import pytest

from lrmoe.cli import main
from lrmoe.reproduce.compare import compare, judge, render_markdown, write_comparison
from lrmoe.reproduce.driver import default_out, default_reference
from lrmoe.reproduce.progress import last_step, machine, machine_line

ENV = {"device": "cpu", "cpu_model": "Test CPU", "cpu_count": 2, "threads": 1, "torch": "2.13.0", "git": "abc"}
PRESET = {"name": "fake", "families": ["qwen3"], "models": {"qwen3": "qwen3-moe-tiny"}, "e1_seeds": [0],
          "e2_seeds": [0, 1, 2], "e2_drop": 0.2, "e2_scorers": ["lrm", "random"],
          "base": {"seq_len": 16, "micro_batch": 2, "steps": 10}}


def ppl_of(drop, scorer, seed):
    """Every step's PPL of a fake run (constant, so the final-10 % mean is this value)."""
    return 1.0 + 0.01 * seed + (0.001 + 0.01 * seed if drop == 0.2 else 0.0) + drop / 100 \
        + (0.05 if scorer == "random" else 0.0)


def run_names():
    out = {f"qwen3-C00-s{s}": (0.0, "lrm", s) for s in (0, 1, 2)}
    out.update({"qwen3-C10-lrm-s0": (0.1, "lrm", 0), "qwen3-C30-lrm-s0": (0.3, "lrm", 0)})
    out.update({f"qwen3-C20-{sc}-s{s}": (0.2, sc, s) for sc in ("lrm", "random") for s in (0, 1, 2)})
    return out


def write_run(d, name, drop, scorer, seed, ppl, steps=10, env=ENV, **cfg_extra):
    cfg = dict(PRESET["base"], model="qwen3-moe-tiny", drop_ratio=drop, scorer=scorer, seed=seed, quota="waterfill",
               mode="compact", steps=steps, **cfg_extra)
    run = d / name
    run.mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps({"status": "done", "config": cfg, "environment": env,
                                                  "model": {"family": "qwen3_moe"}}))
    rows = [{"step": t, "loss": math.log(ppl), "ppl": ppl, "kept_fraction": 1 - drop, "moe_fwd_s": 0.01,
             "moe_bwd_s": 0.02, "layers": {"0": {"demand": [3, 5, 0, 4], "quota": [3, 4, 0, 4],
                                                 "kept": [3, 4, 0, 4]}}} for t in range(1, steps + 1)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def write_folder(d, change=None, skip=(), env=ENV):
    """A results folder of the fake preset; ``change``: run name -> PPL added; ``skip``: runs left out."""
    d.mkdir(parents=True)
    names = run_names()
    for name, (drop, scorer, seed) in names.items():
        if name not in skip:
            write_run(d, name, drop, scorer, seed, ppl_of(drop, scorer, seed) + (change or {}).get(name, 0.0), env=env)
    (d / "manifest.json").write_text(json.dumps({"preset": PRESET, "runs": [
        {"name": n, "family": "qwen3", "experiments": ["E1", "E2"], "config": {}} for n in names]}))
    return d


def cells_by(result):
    return {(c["table"], c["row"], c["quantity"]): c for c in result["cells"]}


def test_judge():
    assert judge(1.0, 1.0, None) == "identical"
    assert judge(1.0, 1.001, 0.002) == "agrees" and judge(1.0, 1.003, 0.002) == "differs"
    assert judge(None, 1.0, 0.1) == judge(1.0, None, 0.1) == "missing"
    assert judge(1.0, 1.1, None) == "unjudged"


def test_same_folder_is_identical_everywhere(tmp_path):
    ref = write_folder(tmp_path / "ref")
    user = tmp_path / "user"
    shutil.copytree(ref, user)
    r = compare(user, ref)
    assert {c["vs_reference"] for c in r["cells"]} == {"identical"}
    assert all(x["identical"] for x in r["runs"]) and len(r["runs"]) == len(run_names())
    assert r["environment_differences"] == {}


def test_agree_differ_missing_and_spreads(tmp_path):
    ref = write_folder(tmp_path / "ref")
    env = dict(ENV, cpu_model="Other CPU")
    user = write_folder(tmp_path / "user", change={"qwen3-C10-lrm-s0": 0.005, "qwen3-C20-random-s0": 0.5},
                        skip=("qwen3-C30-lrm-s0",), env=env)
    r = compare(user, ref)
    c = cells_by(r)
    # C0's PPL over seeds 0-2: 1.00, 1.01, 1.02 -> range 0.02; C10 (one seed) borrows it
    assert c[("T1", "C0", "PPL")]["spread"] == pytest.approx(0.02)
    assert c[("T1", "C0", "PPL")]["vs_reference"] == "identical"
    assert c[("T1", "C10", "PPL")]["spread"] == pytest.approx(0.02) and "C0's PPL" in c[("T1", "C10", "PPL")]["spread_from"]
    assert c[("T1", "C10", "PPL")]["difference"] == pytest.approx(0.005)
    assert c[("T1", "C10", "PPL")]["vs_reference"] == "agrees"
    # ΔPPL of C20 LRM per seed: 0.001 + 0.01 s + 0.002 -> range 0.02, borrowed by C10
    assert c[("T1", "C10", "ΔPPL vs C0")]["spread"] == pytest.approx(0.02)
    assert c[("T1", "C10", "ΔPPL vs C0")]["vs_reference"] == "agrees"
    assert c[("T1", "C30", "PPL")]["vs_reference"] == "missing"
    assert c[("T1", "C30", "ΔPPL vs C0")]["vs_reference"] == "missing"
    # random: seed 0 moved by 0.5 -> the mean over 3 seeds by 0.1667, beyond its spread of 0.02
    t2 = c[("T2", "random", "ΔPPL vs C0 (final 10 %)")]
    assert t2["difference"] == pytest.approx(0.5 / 3) and t2["spread"] == pytest.approx(0.02)
    assert t2["vs_reference"] == "differs"
    assert c[("T2", "LRM", "ΔPPL vs C0 (final 10 %)")]["vs_reference"] == "identical"
    # the paper's values are shown for orientation only: no cell is judged against them
    assert c[("T1", "C10", "PPL")]["paper"] == pytest.approx(1.015156)
    assert c[("T1", "C10", "ΔPPL vs C0")]["paper"] == pytest.approx(1.015156 - 1.015190)
    assert t2["paper"] == pytest.approx(0.775797)
    assert not any("vs_paper" in x for x in r["cells"]) and set(r["summary"]) == {"vs_reference"}
    runs = {x["run"]: x for x in r["runs"]}
    assert runs["qwen3-C20-random-s0"]["first_differing_step"] == 1 and runs["qwen3-C00-s0"]["identical"]
    assert "qwen3-C30-lrm-s0" not in runs
    assert r["environment_differences"] == {"cpu_model": {"user": "Other CPU", "reference": "Test CPU"}}
    assert r["summary"]["vs_reference"]["differs"] >= 1 and r["summary"]["vs_reference"]["missing"] == 2
    md = render_markdown(r)
    assert "**differs**" in md and "Cells outside the reference's seed spread:** T2 Qwen3-MoE random" in md
    assert "Why cells can differ" in md and "cpu_model: 'Other CPU' here" in md
    # a rerun check, not a test of the paper: said in the header, no agrees/differs word for the paper
    assert md.startswith("# Rerun check: this rerun vs the committed reference")
    assert "It is not a test of the paper's claims" in md and "paper_figures/verdict.py" in md
    assert "vs the paper" not in md and "| vs paper |" not in md
    assert "| paper's value (for orientation; not judged) |" in md
    header = next(line for line in md.splitlines() if line.startswith("| Table |"))
    rows = [line for line in md.splitlines() if line.startswith(("| T1 |", "| T2 |"))]
    assert rows and all(row.count(" | ") == header.count(" | ") for row in rows)
    for row in rows:  # one status word per row: the vs reference column's
        assert sum(row.count(w) for w in ("agrees", "differs", "identical", "missing", "unjudged")) == 1, row
    t1_c10 = next(row for row in rows if "| C10 | ΔPPL vs C0 |" in row)
    assert t1_c10.endswith(f"| {1.015156 - 1.015190:+.6f} |"), t1_c10
    files = write_comparison(r, user)
    assert [f.name for f in files] == ["compare.md", "compare.json"]
    written = json.loads(files[1].read_text())
    assert written["format"] == "lrmoe-compare/2" and "not a test of the paper" in written["scope"]


def test_figures_refuse_non_comparable_runs(tmp_path, capsys):
    d = tmp_path / "mine"
    write_run(d, "a", 0.0, "lrm", 0, 1.1, steps=12)
    write_run(d, "b", 0.1, "lrm", 0, 1.2, steps=2)
    assert main(["figures", "--results", str(d), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not comparable" in err
    assert "steps: 12 (a) / 2 (b)" in err and "lrmoe plot" in err
    assert not (tmp_path / "out").exists()  # nothing written


def test_f2_band_is_mean_and_range_over_seeds(tmp_path):
    from paper_figures import Results
    from paper_figures.figures import f2_bands

    bands = f2_bands(Results.load(write_folder(tmp_path / "ref")))
    c0, c10 = bands[("qwen3", "C0")], bands[("qwen3", "C10")]
    assert c0["seeds"] == [0, 1, 2] and c10["seeds"] == [0]
    assert c0["ppl_mean"][-1] == pytest.approx(1.01) and c0["ppl_min"][-1] == pytest.approx(1.0)
    assert c0["ppl_max"][-1] == pytest.approx(1.02) and len(c0["steps"]) == 10
    assert c10["ppl_min"] == c10["ppl_max"] == c10["ppl_mean"]


def test_plot_two_runs(tmp_path, capsys):
    a = write_run(tmp_path / "runs", "a", 0.0, "lrm", 0, 1.1)
    b = write_run(tmp_path / "runs", "b", 0.2, "random", 1, 1.2)
    out = tmp_path / "plots"
    assert main(["plot", str(a), str(b), "--out", str(out)]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == ["runs_curves.pdf", "runs_curves.png", "runs_experts.pdf", "runs_experts.png"]
    assert (out / "runs_curves.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "runs_experts.pdf").read_bytes()[:4] == b"%PDF"
    from paper_figures.plot import load_runs

    labels = [r.label for r in load_runs([a, b])]
    assert labels == ["drop_ratio=0.0, scorer='lrm', seed=0", "drop_ratio=0.2, scorer='random', seed=1"]


@pytest.mark.parametrize("case", ["missing", "twice", "not_a_run", "damaged", "layer", "step", "out_file"])
def test_plot_bad_input(tmp_path, capsys, case):
    a = write_run(tmp_path / "runs", "a", 0.0, "lrm", 0, 1.1)
    (tmp_path / "file").write_text("x")
    args = {"missing": [str(tmp_path / "nope")], "twice": [str(a), str(a)], "not_a_run": [str(tmp_path / "runs")],
            "damaged": [str(a)], "layer": [str(a), "--layer", "5"], "step": [str(a), "--step", "99"],
            "out_file": [str(a), "--out", str(tmp_path / "file")]}[case]
    if case == "damaged":
        (a / "metrics.jsonl").write_text('{"step": 1}\ngarbage\n{"step": 3}\n')
    out = tmp_path / "plots"
    rc = main(["plot", *args] + ([] if "--out" in args else ["--out", str(out)]))
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and err.startswith("lrmoe plot: "), err
    assert not out.exists()


def test_reproduce_writes_beside_the_reference(tmp_path, capsys):
    assert str(default_out("cpu")) == "results/cpu-local" and str(default_reference("cpu")) == "results/cpu"
    assert main(["reproduce", "--preset", "smoke", "--dry-run", "--out", str(tmp_path / "o"),
                 "--reference", str(tmp_path / "none-such")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--reference" in err and "'none'" in err


def test_step_progress_reads_the_last_complete_row(tmp_path):
    f = tmp_path / "metrics.jsonl"
    assert last_step(f) == 0
    f.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "lo')  # the last row being written
    assert last_step(f) == 2
    m = machine()
    assert m["cpu_count"] and len(m["load_average"]) == 3 and "load average" in machine_line(m)


def test_report_puts_the_simulated_tables_beside_the_measured(tmp_path):
    """T4/T5/F3/F5 come from <results>/sim/<scenario>/ (what `lrmoe simulate` writes there); without
    them the report lists them as not yet produced."""
    from paper_figures import make_all

    d = write_folder(tmp_path / "ref")
    make_all(d, only=["T1", "T4", "F5"])
    report = (d / "report.md").read_text()
    assert "## T4:" in report and "Not yet produced: needs the cluster simulator's scenarios" in report
    tables = d / "sim" / "paper-qwen3" / "tables"
    tables.mkdir(parents=True)
    (tables / "T4_paper-qwen3.md").write_text("**T4 paper-qwen3**\n\n| method | GiB |\n|---|---|\n| lrmoe | 11.08 |\n\n"
                                             "Simulated (h100-sxm; ...)\n")
    figs = d / "sim" / "sweep-skew" / "figures"
    figs.mkdir(parents=True)
    (figs / "F5_sweep-skew.png").write_bytes(b"\x89PNG")
    files = make_all(d, only=["T1", "T4", "F5"])
    assert tables / "T4_paper-qwen3.md" in files and figs / "F5_sweep-skew.png" in files
    report = (d / "report.md").read_text()
    t1, t4, f5 = (report.index(f"## {k}:") for k in ("T1", "T4", "F5"))
    assert t1 < t4 < f5 and "| lrmoe | 11.08 |" in report[t4:f5] and "Simulated (h100-sxm" in report[t4:f5]
    assert "![F5](sim/sweep-skew/figures/F5_sweep-skew.png)" in report[f5:]
    assert "Not yet produced" not in report
