"""Aggregation against a hand computation: paired differences per seed, the t interval, the
resolved flag, orderings (Holm-corrected), damaged runs named; the t interval at every n."""
import json
import math
import random

import pytest

from lrmoe.ablate.aggregate import analyse, write_all
from lrmoe.ablate.grid import parse_grid
from lrmoe.stats import estimate

T_975_2 = 4.302652729911275  # Student t, 0.975 quantile, 2 degrees of freedom (tables)
STEPS = 10

BASE_PPL = {0: 1.0, 1: 1.1, 2: 1.2}
DELTA = {"lrm": {0: 0.1, 1: 0.2, 2: 0.3}, "random": {0: 1.0, 1: 1.3, 2: 1.1}}


@pytest.fixture
def folder(tmp_path):
    """Finished run folders of a 3-seed grid whose final-window PPLs are known: the final 10 % of
    10 steps is step 10 alone; the loss of every step is 0.5 + the run's PPL offset."""
    g = parse_grid({"grid": {"question": "q?", "preset": "smoke", "metrics": ["dppl_final", "dloss_all"]},
                    "set": {"steps": STEPS}, "axes": {"seed": [0, 1, 2], "drop_ratio": [0.5],
                                                      "scorer": ["lrm", "random"]}}, "t.toml")
    for c in g.cells:
        seed = c.coords["seed"]
        off = 0.0 if c.is_baseline else DELTA[c.coords["scorer"]][seed]
        d = tmp_path / c.name
        d.mkdir()
        rows = [{"step": s, "loss": 0.5 + off, "ppl": BASE_PPL[seed] + off} for s in range(1, STEPS + 1)]
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        cfg = next(r.config for r in g.runs() if r.name == c.name)
        (d / "summary.json").write_text(json.dumps({"status": "done", "config": cfg, "steps_done": STEPS,
                                                    "final": {"kept_fraction_mean": 0.5}, "environment": {}}))
    return g, tmp_path


def _effect(a, scorer):
    return next(e for e in a["effects"] if e["variant"]["scorer"] == scorer)


def test_paired_differences_intervals_and_orderings_by_hand(folder):
    g, out = folder
    a = analyse(g, out)
    for scorer, deltas in DELTA.items():
        e = _effect(a, scorer)["metrics"]["dppl_final"]
        xs = [deltas[s] for s in (0, 1, 2)]
        m = sum(xs) / 3
        s = math.sqrt(sum((x - m) ** 2 for x in xs) / 2)
        half = T_975_2 * s / math.sqrt(3)
        assert e["n"] == 3 and e["values"] == pytest.approx(xs)
        assert (e["mean"], e["lo"], e["hi"]) == pytest.approx((m, m - half, m + half))
        assert _effect(a, scorer)["metrics"]["dloss_all"]["mean"] == pytest.approx(m)  # loss offset = PPL offset
    assert not _effect(a, "lrm")["metrics"]["dppl_final"]["resolved"]  # [-0.048, 0.448] holds 0
    assert _effect(a, "random")["metrics"]["dppl_final"]["resolved"]  # [0.64, 1.62]
    (c,) = a["comparisons"]  # one pair differing in one option: the scorer
    assert (c["axis"], c["a"], c["b"], c["context"]) == ("scorer", "lrm", "random", {"family": "qwen3",
                                                                                   "drop_ratio": 0.5})
    diff = [DELTA["lrm"][s] - DELTA["random"][s] for s in (0, 1, 2)]  # -0.9, -1.1, -0.8
    m = sum(diff) / 3
    half = T_975_2 * math.sqrt(sum((x - m) ** 2 for x in diff) / 2) / math.sqrt(3)
    e = c["metrics"]["dppl_final"]
    assert (e["mean"], e["lo"], e["hi"]) == pytest.approx((m, m - half, m + half))
    assert e["resolved"] and e["ordering"] == "lrm < random" and e["seeds"] == [0, 1, 2]
    assert a["baseline_ppl_final"]["qwen3"]["mean"] == pytest.approx(1.1)
    # the effects against the baseline are one family of tests per metric: Holm over the two variants
    from scipy.stats import ttest_1samp

    ps = {sc: ttest_1samp([DELTA[sc][s] for s in (0, 1, 2)], 0).pvalue for sc in DELTA}
    lo, hi = sorted(ps, key=ps.get)
    holm = {lo: min(1.0, 2 * ps[lo])}
    holm[hi] = max(holm[lo], min(1.0, ps[hi]))
    for sc in DELTA:
        got = _effect(a, sc)["metrics"]["dppl_final"]
        assert got["p"] == pytest.approx(ps[sc]) and got["p_holm"] == pytest.approx(holm[sc])
        assert got["holm_family"] == 2


def test_files_and_a_damaged_run_is_named_not_dropped(folder):
    g, out = folder
    (out / "qwen3-C50-random-s2" / "summary.json").write_text("{not json")
    a = analyse(g, out)
    assert "qwen3-C50-random-s2" in a["damaged"] and "summary.json" in a["damaged"]["qwen3-C50-random-s2"]
    assert _effect(a, "random")["metrics"]["dppl_final"]["n"] == 2
    assert a["comparisons"][0]["metrics"]["dppl_final"]["seeds"] == [0, 1]
    warned = []
    files = write_all(g, out, warn=warned.append)
    assert warned and "qwen3-C50-random-s2" in warned[0]
    md = (out / "tables" / "t.md").read_text()
    assert "*Left out*" in md and "`qwen3-C50-random-s2`" in md
    assert "+0.200000 [−0.048414, +0.448414] (n=3)" in md  # the lrm row, by hand above
    assert r"\begin{tabular}" in (out / "tables" / "t.tex").read_text()
    for stem in ("t_dppl_final", "t_dloss_all"):
        for ext in ("png", "pdf"):
            assert (out / "figures" / f"{stem}.{ext}").stat().st_size > 0
    assert json.loads((out / "ablation.json").read_text())["damaged"] == a["damaged"]
    assert len(files) == 7


def test_estimates_small_n_and_t_interval_at_every_n():
    assert estimate([]).n == 0 and estimate([]).mean is None
    one = estimate([0.3])
    assert one.mean == 0.3 and one.lo is None and not one.resolved
    flat = estimate([0.2, 0.2, 0.2])
    assert flat.lo == flat.hi == flat.mean == pytest.approx(0.2) and flat.resolved
    rng = random.Random(1)
    xs = [rng.gauss(0.5, 1.0) for _ in range(12)]
    for n in (3, 9, 12):  # one convention: Student's t interval whatever the number of seeds
        assert estimate(xs[:n]).method.startswith("t interval")


def test_orderings_are_holm_corrected(folder):
    g, out = folder
    (c,) = analyse(g, out)["comparisons"]
    e = c["metrics"]["dppl_final"]
    assert e["p_holm"] == pytest.approx(e["p"])  # one comparison in the table: nothing to correct
    assert e["p"] < 0.05 and e["resolved_holm"]
    md = (out / "tables").exists() or write_all(g, out, figures=False)
    md = (out / "tables" / "t.md").read_text()
    assert "Holm" in md and "lrm < random" in md


def test_paper_t2_only_on_rows_at_the_kits_t2_level(folder):
    """The paper's T2 ΔPPL (its drop level not stated; the kit compares it at C20) stands beside C20
    rows only: a C10, C30 or C50 row of the same scorer gets none."""
    import copy

    from lrmoe.ablate.aggregate import paper_t2, tables

    assert paper_t2("qwen3", "lrm") == pytest.approx(0.012474) and paper_t2("qwen3", "lrm", 0.2) == pytest.approx(0.012474)
    assert paper_t2("qwen3", "lrm", 0.1) is None and paper_t2("qwen3", "lrm", 0.3) is None
    g, out = folder
    a = analyse(g, out)  # every row at C50
    a2 = copy.deepcopy(a)
    a2["effects"].append(copy.deepcopy(_effect(a, "lrm")))
    a2["effects"][-1]["variant"]["drop_ratio"] = 0.2
    lines = "\n".join(tables(a2, g)[0]).splitlines()
    head = next(x for x in lines if x.startswith("| family"))
    assert head.rstrip(" |").endswith("paper T2 ΔPPL (C20 rows; its drop level not stated)")
    rows = [x for x in lines if x.startswith("| Qwen3-MoE | C")]
    assert [r.rsplit("|", 2)[-2].strip() for r in rows] == ["—", "—", "0.012474"]
