"""paper_figures on a tiny fake results folder (run files written by the test, no training): the
results model, T1/T2 with known numbers, F1/F2 and the report, the maker registry, and a run
whose summary cannot be read (named in the report and on stderr, not silently dropped)."""
import json
import math
import shutil

import pytest

import paper_figures
from paper_figures import MAKERS, Results, level_name, make_all, mean_std, register, rows_per_step, unregister
from paper_figures.tables import make_t1, make_t2

ENV = {"device": "cpu", "cpu_model": "Test CPU", "cpu_count": 2, "threads": 1}
PRESET = {"name": "fake", "families": ["qwen3"], "models": {"qwen3": "qwen3-moe-tiny"}, "e1_seeds": [0],
          "e2_seeds": [0, 1], "e2_drop": 0.2, "e2_scorers": ["lrm", "random"],
          "base": {"max_records": 8, "seq_len": 16, "micro_batch": 2, "grad_accum": 2, "steps": 10}}
# name: (drop, scorer, seed, experiments)
RUNS = {"qwen3-C00-s0": (0.0, "lrm", 0, ("E1", "E2")), "qwen3-C10-lrm-s0": (0.1, "lrm", 0, ("E1",)),
        "qwen3-C20-lrm-s0": (0.2, "lrm", 0, ("E1", "E2")), "qwen3-C30-lrm-s0": (0.3, "lrm", 0, ("E1",)),
        "qwen3-C00-s1": (0.0, "lrm", 1, ("E2",)), "qwen3-C20-lrm-s1": (0.2, "lrm", 1, ("E2",)),
        "qwen3-C20-random-s0": (0.2, "random", 0, ("E2",)), "qwen3-C20-random-s1": (0.2, "random", 1, ("E2",))}


def final_ppl(drop, scorer, seed):
    """The fake runs' PPL at their last step (the T1/T2 window of a 10-step run is that step)."""
    return 1.0 + drop + 0.01 * seed + (0.05 if scorer == "random" else 0.0)


def write_results(d, status="done"):
    d.mkdir(parents=True, exist_ok=True)
    manifest_runs = []
    for name, (drop, scorer, seed, exps) in RUNS.items():
        cfg = dict(PRESET["base"], model="qwen3-moe-tiny", drop_ratio=drop, scorer=scorer, seed=seed,
                   quota="waterfill", mode="compact")
        manifest_runs.append({"name": name, "family": "qwen3", "experiments": list(exps), "config": cfg})
        run = d / name
        run.mkdir()
        (run / "summary.json").write_text(json.dumps({
            "status": status, "config": cfg, "environment": ENV, "model": {"family": "qwen3_moe"},
            "data": {"train_records": 7}}))
        rows = []
        for step in range(1, 11):
            ppl = final_ppl(drop, scorer, seed) + 0.1 * (10 - step)
            rows.append({"step": step, "loss": math.log(ppl), "ppl": ppl})
        rows[-1]["layers"] = {"0": {"demand": [3, 5, 0, 4], "quota": [3, 4, 0, 4], "kept": [3, 4, 0, 4]}}
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "manifest.json").write_text(json.dumps({"preset": PRESET, "runs": manifest_runs}))
    return d


@pytest.fixture
def fake(tmp_path):
    return write_results(tmp_path / "fake")


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """make_all over the fake folder, once (the figures take a few seconds)."""
    d = write_results(tmp_path_factory.mktemp("made") / "fake")
    return d, make_all(d, d)


# ----------------------------------------------------------------------------- results model


def test_results_model_reads_the_run_folders(fake):
    res = Results.load(fake)
    assert sorted(res.runs) == sorted(RUNS) and res.damaged == {}
    assert res.preset_name == "fake" and res.families() == ["qwen3"] and res.model_of("qwen3") == "qwen3-moe-tiny"
    c20 = res.runs["qwen3-C20-lrm-s0"]
    assert (c20.family, c20.drop, c20.scorer, c20.seed, c20.experiments) == ("qwen3", 0.2, "lrm", 0, ("E1", "E2"))
    assert res.runs["qwen3-C00-s0"].scorer == "none"
    assert c20.ppl_window_mean() == pytest.approx(final_ppl(0.2, "lrm", 0))
    assert sorted(c20.ppl_by_step()) == list(range(1, 11))
    assert res.find("qwen3", 0.2, "random", 1).name == "qwen3-C20-random-s1"
    assert res.find("qwen3", 0.3, "lrm", 1) is None
    assert [r["name"] for r in res.expected("E1")] == [n for n, v in RUNS.items() if "E1" in v[3]]
    assert res.scale() == "qwen3-moe-tiny; 7 training records of Alpaca, seq 16, 4 rows/step, 10 steps"
    assert res.hardware() == "CPU (Test CPU), 2 cores, 1 thread(s) per run"


def test_unfinished_runs_have_no_window_mean(tmp_path):
    res = Results.load(write_results(tmp_path / "running", status="running"))
    assert res.runs["qwen3-C20-lrm-s0"].ppl_window_mean() is None
    assert res.hardware() == "no finished runs"


def test_two_runs_of_one_cell_without_a_manifest_raise(fake):
    (fake / "manifest.json").unlink()
    shutil.copytree(fake / "qwen3-C20-lrm-s0", fake / "qwen3-C20-lrm-again-s0")
    with pytest.raises(ValueError, match="2 runs match the cell qwen3 C20.*qwen3-C20-lrm-again-s0"):
        Results.load(fake).find("qwen3", 0.2, "lrm", 0)


def test_helpers():
    assert [level_name(d) for d in (0.0, 0.1, 0.2, 0.3)] == ["C0", "C10", "C20", "C30"]
    assert mean_std([]) == (None, None) and mean_std([2.0]) == (2.0, None)
    assert mean_std([1.0, 3.0]) == (2.0, pytest.approx(math.sqrt(2.0)))


@pytest.mark.parametrize("config,rows", [({"micro_batch": 1, "grad_accum": 4}, 4), ({"micro_batch": 8}, 8),
                                         ({"micro_batch": 2, "global_batch": 16, "grad_accum": 8}, 16), ({}, "?")])
def test_caption_rows_per_step_count_accumulation(config, rows):
    assert rows_per_step(config) == rows


# ----------------------------------------------------------------------------- tables


def test_t1_from_known_numbers(fake, tmp_path):
    md, tex = make_t1(Results.load(fake), paper_figures.paper_numbers(), tmp_path)
    text = md.read_text()
    for level, drop in (("C0", 0.0), ("C10", 0.1), ("C20", 0.2), ("C30", 0.3)):
        d = final_ppl(drop, "lrm", 0) - final_ppl(0.0, "lrm", 0)
        assert (f"| Qwen3-MoE (qwen3-moe-tiny) | {level} | {final_ppl(drop, 'lrm', 0):.6f} | {d:+.6f} | "
                f"{100 * d:+.3f} |") in text, level
    assert "preset `fake`" in text and "not run" not in text
    assert r"\begin{tabular}" in tex.read_text() and r"\label{tab:t1}" in tex.read_text()


def test_t2_pairs_each_seed_with_its_own_c0(fake, tmp_path):
    md, _ = make_t2(Results.load(fake), paper_figures.paper_numbers(), tmp_path)
    rows = {line.split(" | ")[0].lstrip("| "): line for line in md.read_text().splitlines() if line.startswith("| ")}
    for name, scorer, delta in (("LRM", "lrm", 0.2), ("random", "random", 0.25)):
        # the all-steps column: mean over steps of loss(C20) - loss(C0), seed by seed
        gaps = [sum(math.log(final_ppl(0.2, scorer, s) + 0.1 * (10 - k)) - math.log(final_ppl(0.0, "lrm", s)
                                                                                 + 0.1 * (10 - k))
                    for k in range(1, 11)) / 10 for s in (0, 1)]
        m, sd = mean_std(gaps)
        half = 12.706204736174698 * sd / math.sqrt(2)  # t(0.975, 1) · s / √n, by hand
        f = lambda v, d: f"{v:+.{d}f}".replace("-", "−")  # noqa: E731
        # every seed has the same ΔPPL: no spread, the interval is the value and p = 0
        assert f"| {f(delta, 6)} [{f(delta, 6)}, {f(delta, 6)}] (n=2; p <0.001, Holm <0.001) |" in rows[name], rows[name]
        assert f"| {f(m, 4)} [{f(m - half, 4)}, {f(m + half, 4)}] (n=2; p " in rows[name], rows[name]
    assert "Δloss measured (mean over all steps, nats)" in md.read_text()
    assert "Holm's correction" in md.read_text() and "95 % Student t interval" in md.read_text()


def test_a_missing_run_says_not_run(fake, tmp_path):
    shutil.rmtree(fake / "qwen3-C30-lrm-s0")
    md, _ = make_t1(Results.load(fake), paper_figures.paper_numbers(), tmp_path)
    c30 = next(line for line in md.read_text().splitlines() if "| C30 |" in line)
    assert c30.count("not run") == 4  # PPL, ΔPPL, Δ% and the paired column


# ----------------------------------------------------------------------------- figures and report


def test_make_all_writes_tables_figures_and_the_report(made):
    d, files = made
    names = sorted(f.relative_to(d).as_posix() for f in files)
    assert names == ["figures/F1_expert_loads.pdf", "figures/F1_expert_loads.png", "figures/F2_loss_curves.pdf",
                     "figures/F2_loss_curves.png", "report.md", "tables/T1_convergence.md",
                     "tables/T1_convergence.tex", "tables/T2_scorer_ablation.md", "tables/T2_scorer_ablation.tex"]
    for stem in ("F1_expert_loads", "F2_loss_curves"):
        assert (d / "figures" / f"{stem}.png").read_bytes()[:4] == b"\x89PNG"
        assert (d / "figures" / f"{stem}.pdf").read_bytes()[:4] == b"%PDF"
    assert sorted(p.name for p in (d / "figures").iterdir()) == sorted(  # no temporary file left behind
        f"{s}.{e}" for s in ("F1_expert_loads", "F2_loss_curves") for e in ("png", "pdf"))
    report = (d / "report.md").read_text()
    assert report.startswith("# Reproduced tables and figures: preset `fake`")
    assert "![F1](figures/F1_expert_loads.png)" in report and "**T1. Convergence" in report
    for key in ("T3", "T4", "T5", "F3", "F4", "A1"):
        assert f"## {key}: {MAKERS[key].title}\n\nNot yet produced: needs {MAKERS[key].needs}." in report
    assert "left out" not in report
    # the paper's numbers of the tables not produced yet: a table, not raw JSON
    t4 = report[report.index("## T4:"):report.index("## T5:")]
    assert "| paper entry | quantity | value |" in t4 and "| T4 | unit | GiB per GPU |" in t4
    assert "| T4 | subtotal / LRMoE | 5.44 |" in t4 and "{" not in t4
    assert "| T3 | reduction_vs_symi_pct / qwen3 | 42.5, 43.2 |" in report


def test_a_corrupt_summary_is_named_in_the_report_and_on_stderr(fake, capsys):
    """A summary.json that cannot be decoded used to remove its run from the tables without a word:
    the tables are still written, without it, and the command names it and exits with 2."""
    from lrmoe.cli import main

    (fake / "qwen3-C20-lrm-s0" / "summary.json").write_text('{"status": "done", "conf')
    assert main(["figures", "--results", str(fake), "--only", "T1"]) == 2
    err = capsys.readouterr().err
    assert "qwen3-C20-lrm-s0" in err and "summary.json" in err and "not valid JSON" in err
    report = (fake / "report.md").read_text()
    left_out = report[report.index("left out"):].split("\n- every value")[0]
    assert "`qwen3-C20-lrm-s0`" in left_out and "not valid JSON" in left_out
    c20 = next(line for line in (fake / "tables/T1_convergence.md").read_text().splitlines() if "| C20 |" in line)
    assert "not run" in c20


# ----------------------------------------------------------------------------- makers


def test_makers_are_listed_explicitly_and_a_duplicate_key_raises(fake, tmp_path):
    assert set(MAKERS) == {"T1", "T2", "T3", "T4", "T5", "F1", "F2", "F3", "F4", "F5", "A1"}
    assert MAKERS["T1"].fn is make_t1 and MAKERS["T3"].fn is not None and MAKERS["T3"].needs  # T3: E3's runs
    with pytest.raises(ValueError, match="'T1' is already registered"):
        register("T1", "table", "another T1", fn=lambda res, paper, out: [])
    with pytest.raises(ValueError, match="kind must be one of"):
        register("X1", "plot", "a plot", fn=lambda res, paper, out: [])
    seen = []

    def extra(res, paper, out):
        seen.append(sorted(res.runs))
        return []

    def with_headings(res, paper, out):
        f = out / "x2.md"
        f.write_text("# Title\n\ntext\n\n## Part\n\n```\n# a comment in code\n```\n")
        return [f]

    register("X1", "table", "an extra table", fn=extra)
    register("X2", "table", "a maker whose Markdown has headings", fn=with_headings)
    try:
        make_all(fake, tmp_path, only=["X1", "X2"])
        report = (tmp_path / "report.md").read_text()
        assert seen == [sorted(RUNS)] and "## X1: an extra table" in report
        # its headings sit under its own section, not beside it; code is left as it is
        x2 = report[report.index("## X2:"):]
        assert "\n### Title\n" in x2 and "\n#### Part\n" in x2 and "\n# a comment in code\n" in x2
        assert [ln for ln in report.splitlines() if ln.startswith("## ")][-2:] == [
            "## X1: an extra table", "## X2: a maker whose Markdown has headings"]
        register("X1", "table", "replaced", fn=extra, override=True)
        assert MAKERS["X1"].title == "replaced"
    finally:
        unregister("X1")
        unregister("X2")
    assert "X1" not in MAKERS and "X2" not in MAKERS


def test_figures_cli_rejects_an_unknown_key_and_a_missing_folder(fake, tmp_path, capsys):
    from lrmoe.cli import main

    assert main(["figures", "--results", str(fake), "--only", "T1,T9"]) == 2
    assert "unknown key(s) T9" in capsys.readouterr().err and not (fake / "report.md").exists()
    assert main(["figures", "--results", str(tmp_path / "nowhere")]) == 2
    assert "no results folder" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["figures", "--results", str(empty)]) == 2  # nothing to tabulate: no empty tables written
    assert "no run folders in" in capsys.readouterr().err and list(empty.iterdir()) == []


def test_figures_cli_names_a_file_it_cannot_read(fake, capsys):
    """A corrupt manifest, or a bad line inside a finished run's metrics, stops `lrmoe figures` with
    status 2 and the file (and line) named, not a traceback and not a silently shorter curve."""
    from lrmoe.cli import main

    rows = (fake / "qwen3-C10-lrm-s0" / "metrics.jsonl").read_text().splitlines()
    rows[4] = rows[4][:10]
    (fake / "qwen3-C10-lrm-s0" / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    assert main(["figures", "--results", str(fake), "--only", "T1"]) == 2
    assert "qwen3-C10-lrm-s0/metrics.jsonl: line 5 of 10" in capsys.readouterr().err
    (fake / "manifest.json").write_text("{")
    assert main(["figures", "--results", str(fake)]) == 2
    assert "manifest.json: not valid JSON" in capsys.readouterr().err


def test_report_links_resolve_from_another_out_folder(tmp_path):
    """`lrmoe figures --results R --out DIR`: the simulated figures (F3, F5) and the probe's A1 stay
    under R; report.md in DIR used to link them by R's path as given, which resolves from nowhere."""
    import re
    from pathlib import Path

    from lrmoe.cli import main

    cpu = Path(__file__).resolve().parents[2] / "results" / "cpu"
    out = tmp_path / "elsewhere" / "report"
    assert main(["figures", "--results", str(cpu), "--out", str(out), "--only", "F3,F5,A1"]) == 0
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", (out / "report.md").read_text())
    assert len(links) >= 3 and all(not Path(link).is_absolute() for link in links)
    for link in links:
        assert (out / link).resolve().is_file(), link
