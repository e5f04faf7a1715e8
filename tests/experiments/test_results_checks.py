"""Checks of the results the tables are made from: T1/T2 recomputed from the committed run files
of the cpu preset, the paper's numbers against paper.md, the tables using the preset's runs only,
and caption hardware of torchrun runs. The checks of committed results skip (saying why) when the
files are absent."""

import json
import math
import re
import shutil
import statistics

from scipy.stats import t as scipy_t
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CPU_RESULTS = REPO / "results" / "cpu"


pytestmark = pytest.mark.usefixtures("isolated_caches")


def _need(*paths):
    for p in paths:
        if not Path(p).exists():
            pytest.skip(f"{p} not found")


# ------------------------------------------------------------------------- tables (real runs)


def _window_ppl(run_dir: Path) -> float:
    s = json.loads((run_dir / "summary.json").read_text())
    steps = s["config"]["steps"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    n = math.ceil(0.1 * steps)
    tail = [r["ppl"] for r in rows if r["step"] > steps - n]
    assert len(tail) == n
    return sum(tail) / len(tail)


def test_t1_t2_arithmetic_recomputed_from_run_files():
    """Passed: T1 and T2 (md) numbers recomputed independently from metrics.jsonl."""
    _need(CPU_RESULTS / "tables" / "T1_convergence.md")
    t1 = (CPU_RESULTS / "tables" / "T1_convergence.md").read_text()
    t2 = (CPU_RESULTS / "tables" / "T2_scorer_ablation.md").read_text()
    for fam, label in (("qwen3", "Qwen3-MoE"), ("glm4", "GLM-4.5-MoE")):
        c0 = {s: _window_ppl(CPU_RESULTS / f"{fam}-C00-s{s}") for s in range(3)}
        for lvl, name in (("C0", f"{fam}-C00-s0"), ("C10", f"{fam}-C10-lrm-s0"), ("C20", f"{fam}-C20-lrm-s0"),
                          ("C30", f"{fam}-C30-lrm-s0")):
            v = _window_ppl(CPU_RESULTS / name)
            d = v - c0[0]
            row = f"| {label} ({fam}-moe-small) | {lvl} | {v:.6f} | {d:+.6f} | {100 * d / c0[0]:+.3f} |"
            assert row in t1, row
        for sc in ("lrm", "grad_norm", "abs_grad", "random"):
            ds = [_window_ppl(CPU_RESULTS / f"{fam}-C20-{sc}-s{s}") - c0[s] for s in range(3)]
            m, h = statistics.mean(ds), scipy_t.ppf(0.975, 2) * statistics.stdev(ds) / 3 ** 0.5
            cell = f"{m:+.6f} [{m - h:+.6f}, {m + h:+.6f}] (n=3;".replace("-", "\u2212")  # mean [95 % t]
            assert cell in t2, (fam, sc, cell)


def test_paper_numbers_match_paper_md():
    """Every number in paper_numbers.json (T1-T5, F3) is in shared/paper.md's results, as written there."""
    paper_md = (REPO.parent / "shared" / "paper.md")
    _need(paper_md)
    text = paper_md.read_text()
    pn = json.loads((REPO / "paper_figures" / "paper_numbers.json").read_text())
    conv = re.search(r"\| C0 \| C10 \| C20 \| C30 \|\n\|[-|]+\|\n\| (.*) \|", text).group(1)
    vals = [float(x.split()[0]) for x in conv.split(" | ")]
    assert [pn["T1"]["values"][k] for k in ("C0", "C10", "C20", "C30")] == vals
    abl = re.search(r"\| LRM \| squared.*\n\|[-|]+\|\n\| (.*) \|", text).group(1)
    pairs = [tuple(float(v) for v in cell.split(" / ")) for cell in abl.split(" | ")]
    for (q, g), sc in zip(pairs, ("lrm", "grad_norm", "abs_grad", "random")):
        assert pn["T2"]["values"]["qwen3"][sc] == q and pn["T2"]["values"]["glm4"][sc] == g
    # T3-T5 and F3: the paper's sentences and table, as written there (line breaks and bold aside)
    mem = re.search(r"\| Megatron-LM \| UltraEP \| SYMI \| LRMoE \|\n\|[-|]+\|\n\| (.*) \|", text).group(1)
    text = re.sub(r"\s+", " ", text).replace("**", "")
    t3 = pn["T3"]
    lo, hi = t3["reduction_vs_symi_pct_range"]
    assert f"{lo}–{hi} % less than SYMI" in text
    assert f"Qwen3-30B-A3B {t3['reduction_vs_symi_pct']['qwen3'][0]} % and {t3['reduction_vs_symi_pct']['qwen3'][1]} %" \
        in text and f"the {t3['reduction_vs_symi_pct']['glm4']} % low end is GLM4.5-106B-A12B" in text
    q = t3["qwen3_to_loss_0.02"]
    assert (f"SYMI {q['SYMI']['minutes']} min / {q['SYMI']['steps']:,} steps" in text
            and f"LRMoE {q['LRMoE']['minutes']} min / {q['LRMoE']['steps']:,} steps" in text)
    assert mem.split(" | ")[:3] == [f"{pn['T4']['subtotal'][k]}" for k in ("Megatron-LM", "UltraEP", "SYMI")]
    assert mem.split(" | ")[3].startswith(f"{pn['T4']['subtotal']['LRMoE']} ({pn['T4']['lrmoe_vs_fixed_ownership_pct']}".replace("-", "−"))
    tb = pn["T4"]["token_buffers"]
    assert f"{tb['Megatron-LM']} GiB (fixed ownership) → {tb['LRMoE']} GiB (LRMoE)" in text
    assert f"{pn['T5']['values']['baseline']} ms → {pn['T5']['values']['LRMoE']} ms" in text
    f3 = pn["F3"]["values"]
    assert (f"LRMoE {f3['LRMoE']:g} %, UltraEP {f3['UltraEP']} %, SYMI {f3['SYMI']} %, Megatron-LM "
            f"{f3['Megatron-LM']} %") in text and f"under {pn['F3']['pressure']}× batch-size pressure" in text


# ------------------------------------------------------------------- tables (synthetic folders)


def _copy_run(src: Path, dst: Path):
    dst.mkdir(parents=True)
    shutil.copy(src / "summary.json", dst / "summary.json")
    shutil.copy(src / "metrics.jsonl", dst / "metrics.jsonl")


def test_tables_use_the_preset_runs_not_other_runs_in_the_folder(tmp_path):
    """T1/F1/F2 are documented as 'LRM scorer, waterfill quotas' on the preset's runs, but
    Results.find matches only (family, drop, scorer, seed): a documented option run
    (--quota proportional, e.g. an ablation written into the same results folder) whose name sorts
    first silently replaces the preset's qwen3-C20-lrm-s0 in T1, F1 and F2."""
    _need(CPU_RESULTS / "manifest.json")
    from paper_figures import Results
    from paper_figures.figures import f1_source
    from paper_figures.tables import t1_data

    res_dir = tmp_path / "cpu"
    res_dir.mkdir()
    shutil.copy(CPU_RESULTS / "manifest.json", res_dir / "manifest.json")
    for name in ("qwen3-C00-s0", "qwen3-C10-lrm-s0", "qwen3-C20-lrm-s0", "qwen3-C30-lrm-s0"):
        _copy_run(CPU_RESULTS / name, res_dir / name)
    want = Results.load(res_dir)
    want_c20 = next(r for r in t1_data(want) if r["family"] == "qwen3" and r["level"] == "C20")["ppl"]

    extra = res_dir / "qwen3-C20-lrm-proportional-s0"  # not in the manifest; sorts before "...-lrm-s0"
    _copy_run(CPU_RESULTS / "qwen3-C20-lrm-s0", extra)
    s = json.loads((extra / "summary.json").read_text())
    s["config"]["quota"] = "proportional"
    (extra / "summary.json").write_text(json.dumps(s))
    rows = [json.loads(line) for line in (extra / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        r["ppl"] += 1.0
    (extra / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    res = Results.load(res_dir)
    got_c20 = next(r for r in t1_data(res) if r["family"] == "qwen3" and r["level"] == "C20")["ppl"]
    f1_run = f1_source(res)[0]
    assert (got_c20, f1_run.name) == (pytest.approx(want_c20), "qwen3-C20-lrm-s0"), (
        f"T1 C20 PPL {got_c20:.6f} (preset run: {want_c20:.6f}); F1 plots {f1_run.name} "
        f"(quota={f1_run.config['quota']})")


def _fake_run(d: Path, family: str, drop: float, scorer: str, seed: int, env: dict, extra: dict | None = None):
    d.mkdir(parents=True)
    cfg = {"model": "qwen3-30b-a3b", "drop_ratio": drop, "scorer": scorer, "seed": seed, "steps": 10,
           "quota": "waterfill", "mode": "compact", "micro_batch": 32, "grad_accum": 1, "global_batch": 32,
           "seq_len": 8192}
    summary = {"config": cfg, "status": "done", "environment": env,
               "model": {"family": family}, "data": {"train_records": 51482}, **(extra or {})}
    (d / "summary.json").write_text(json.dumps(summary))
    (d / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "ppl": 1.5, "loss": 0.4}) + "\n"
                                             for i in range(1, 11)))


def test_caption_hardware_counts_the_gpus_of_a_torchrun_run(tmp_path):
    """Every table/figure caption states the hardware via Results.hardware() ->
    lrmoe.train.hardware_label, which prints '1x <gpu>' for any CUDA run. A `paper` preset run
    (torchrun, 8 GPUs, EP8: summary 'distributed.world_size' = 8, environment gpu_count = 8) is
    captioned as measured on ONE GPU."""
    from paper_figures import Results

    env = {"device": "cuda:0", "gpu": "NVIDIA H100 80GB HBM3", "gpu_count": 8, "threads": 1}
    _fake_run(tmp_path / "qwen3-C00-s0", "qwen3_moe", 0.0, "lrm", 0, env,
              {"distributed": {"world_size": 8, "ep": 8, "dp": 1}})
    hw = Results.load(tmp_path).hardware()
    assert not hw.startswith("1x") and "8" in hw.split("NVIDIA")[0], hw
