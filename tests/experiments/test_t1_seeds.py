"""T1 with several E1 seeds (the cpu preset has one): the PPL column is lrmoe.stats' estimate,
mean [95 % t interval] (n), the convention every table uses, never mean ± sd. Hand-made run
files with known PPLs, no training."""
import json
import math

from scipy.stats import t as student_t

import paper_figures
from paper_figures import Results
from paper_figures.tables import make_t1, t1_data

ENV = {"device": "cpu", "cpu_model": "Test CPU", "cpu_count": 2, "threads": 1}
SEEDS = (0, 1, 2)
PRESET = {"name": "fake3", "families": ["qwen3"], "models": {"qwen3": "qwen3-moe-tiny"}, "e1_seeds": list(SEEDS),
          "e2_seeds": list(SEEDS), "e2_drop": 0.2, "e2_scorers": ["lrm"],
          "base": {"max_records": 8, "seq_len": 16, "micro_batch": 2, "grad_accum": 2, "steps": 10}}
# the final PPL of each run: level + a seed offset that differs by level, so the spread is not 0
OFFSET = {0: 0.000, 1: 0.004, 2: 0.011}


def final_ppl(drop: float, seed: int) -> float:
    return 1.0 + drop + OFFSET[seed] * (1 + drop)


def write_results(d):
    d.mkdir(parents=True)
    runs = []
    for drop in (0.0, 0.1, 0.2, 0.3):
        for s in SEEDS:
            name = f"qwen3-C{round(drop * 100):02d}" + ("-lrm" if drop else "") + f"-s{s}"
            cfg = dict(PRESET["base"], model="qwen3-moe-tiny", drop_ratio=drop, scorer="lrm", seed=s,
                       quota="waterfill", mode="compact")
            runs.append({"name": name, "family": "qwen3", "experiments": ["E1", "E2"], "config": cfg})
            (d / name).mkdir()
            (d / name / "summary.json").write_text(json.dumps({
                "status": "done", "config": cfg, "environment": ENV, "model": {"family": "qwen3_moe"},
                "data": {"train_records": 7}}))
            rows = [{"step": k, "loss": math.log(final_ppl(drop, s) + 0.1 * (10 - k)),
                     "ppl": final_ppl(drop, s) + 0.1 * (10 - k)} for k in range(1, 11)]
            (d / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "manifest.json").write_text(json.dumps({"preset": PRESET, "runs": runs}))
    return d


def by_hand(values):
    """mean and 95 % Student t interval, computed here without lrmoe.stats."""
    n = len(values)
    m = sum(values) / n
    sd = math.sqrt(sum((v - m) ** 2 for v in values) / (n - 1))
    half = student_t.ppf(0.975, n - 1) * sd / math.sqrt(n)
    return m, m - half, m + half


def test_t1_ppl_over_several_seeds_is_mean_and_t_interval(tmp_path):
    res = Results.load(write_results(tmp_path / "fake3"))
    rows = {r["level"]: r for r in t1_data(res)}
    md, tex = make_t1(res, paper_figures.paper_numbers(), tmp_path / "out")
    text = md.read_text()
    assert "±" not in text and "±" not in tex.read_text()
    for level, drop in (("C0", 0.0), ("C10", 0.1), ("C20", 0.2), ("C30", 0.3)):
        m, lo, hi = by_hand([final_ppl(drop, s) for s in SEEDS])
        est = rows[level]["ppl_est"]
        assert est["n"] == 3 and math.isclose(est["mean"], m) and math.isclose(rows[level]["ppl"], m)
        assert math.isclose(est["lo"], lo) and math.isclose(est["hi"], hi)
        assert f"| {level} | {m:.6f} [{lo:.6f}, {hi:.6f}] (n=3) |" in text, level
    assert "PPL measured with several E1 seeds: their mean [95 % Student t interval] (n)" in text


def test_t1_ppl_of_one_seed_is_the_value_alone(tmp_path):
    d = write_results(tmp_path / "fake1")
    manifest = json.loads((d / "manifest.json").read_text())
    manifest["preset"]["e1_seeds"] = [0]
    (d / "manifest.json").write_text(json.dumps(manifest))
    md, _ = make_t1(Results.load(d), paper_figures.paper_numbers(), tmp_path / "out")
    text = md.read_text()
    for level, drop in (("C0", 0.0), ("C30", 0.3)):
        delta = final_ppl(drop, 0) - final_ppl(0.0, 0)
        assert f"| {level} | {final_ppl(drop, 0):.6f} | {delta:+.6f} |" in text, level
    assert "PPL measured with several E1 seeds" not in text
