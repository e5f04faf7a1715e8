"""T1 (convergence by drop level) and T2 (scorer ablation): Markdown + LaTeX, measured beside paper.

Definitions (docs/reproduce.md):
* PPL of a step = exp(mean response-token cross-entropy of that optimizer step) on the training
  stream; a run's PPL = the mean of the per-step PPL over its final 10 % of steps (the paper: the
  mean over the final 1,000 of 10,000 steps).
* T1 PPL over the E1 seeds: lrmoe.stats' estimate, mean [95 % t interval] (n) (one seed: the value
  alone); the same interval as every other table, never mean +- sd.
* T1 dPPL = PPL(Cxx) - PPL(C0), same family and seed, over the E1 seeds; a second column pairs
  every seed that has both runs (the E2 LRM runs give C20 three seeds) under the kit's statistics
  convention (lrmoe.stats: mean, 95 % t interval, Holm's correction across the table's comparisons).
* T2 dPPL = PPL(C20, scorer) - PPL(C0) of the same seed, then the mean and 95 % Student t interval
  over seeds, with the t test's p after Holm's correction across the table's ΔPPL comparisons.
  A second column measures the whole run: the mean over all steps of the per-step training-loss
  difference loss(C20, scorer) - loss(C0), same seed (nats; the area between the two loss
  curves divided by the steps; steps without a loss in either run left out), summarised the same
  way (its own Holm family). Loss, not PPL: the PPL of the first steps is in the hundreds and would
  outweigh the rest.
"""
from __future__ import annotations

from pathlib import Path

from lrmoe.files import write_text
from lrmoe.stats import CONVENTION, estimate, fmt_p, holm

from .results import FAMILY_NAMES, NOT_RUN, IncomparableRuns, Results, grouped_differences, level_name, mean_std

LEVELS = (0.0, 0.1, 0.2, 0.3)
SCORER_NAMES = {"lrm": "LRM", "grad_norm": "squared gradient norm", "abs_grad": "absolute gradient magnitude",
                "random": "random"}


def _fmt(v, digits=6, sign=False):
    if v is None:
        return NOT_RUN
    return f"{v:+.{digits}f}" if sign else f"{v:.{digits}f}"


def _fmt_est(e: dict | None, digits=6) -> str:
    """A paired estimate as the tables print it: ``mean [lo, hi] (n=3; p 0.41, Holm 1.00)``."""
    if e is None or not e["n"]:
        return NOT_RUN

    def f(v):
        return f"{v:+.{digits}f}".replace("-", "−")

    txt = f(e["mean"]) + (f" [{f(e['lo'])}, {f(e['hi'])}]" if e["lo"] is not None else "")
    if e.get("p") is None:
        return txt + f" (n={e['n']}" + ("; one seed: no interval)" if e["n"] == 1 else ")")
    return txt + f" (n={e['n']}; p {fmt_p(e['p'])}, Holm {fmt_p(e.get('p_holm'))})"


def _fmt_level(e: dict | None, digits=6) -> str:
    """A quantity's own level over seeds (T1's PPL, not a difference): ``mean [lo, hi] (n=3)`` by
    :func:`lrmoe.stats.estimate`; one seed: the value alone (no interval); none: "not run"."""
    if e is None or not e["n"]:
        return NOT_RUN
    txt = _fmt(e["mean"], digits)
    if e["n"] == 1 or e["lo"] is None:
        return txt
    return txt + f" [{_fmt(e['lo'], digits)}, {_fmt(e['hi'], digits)}] (n={e['n']})"


def apply_holm(estimates: list[dict]) -> None:
    """Set ``p_holm`` (and ``resolved_holm``) on estimate dicts: Holm's correction across them."""
    for e, q in zip(estimates, holm(e.get("p") for e in estimates)):
        e["p_holm"] = q
        e["resolved_holm"] = q is not None and q < 0.05 and bool(e.get("resolved"))


def _header(res: Results, key: str, title: str, paper_scale: str) -> list[str]:
    lines = [f"**{key}. {title}**", "",
             f"*Measured* (this kit): preset `{res.preset_name}`; {res.scale()}; hardware: {res.hardware()}.  ",
             f"*Paper*: {paper_scale}.", ""]
    if res.damaged:  # never a silently shorter mean: say which runs are missing from the cells, and why
        lines += [f"*Left out* (damaged run folders; their cells say \"{NOT_RUN}\" or count fewer seeds): "
                  + "; ".join(f"`{name}` ({why})" for name, why in res.damaged.items()) + ".", ""]
    unfinished = [r for r in res.runs.values() if not r.done and r.name not in res.damaged]
    if unfinished:
        lines += [f"*Unfinished* (their cells say \"{NOT_RUN}\"): "
                  + ", ".join(f"`{r.name}` ({r.status.label})" for r in unfinished) + ".", ""]
    return lines


def md_table(head: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def _tex_escape(s: str) -> str:
    for a, b in (("\\", r"\textbackslash{}"), ("&", r"\&"), ("%", r"\%"), ("_", r"\_"), ("#", r"\#"),
                 ("±", r"$\pm$"), ("Δ", r"$\Delta$"), ("→", r"$\to$"), ("×", r"$\times$"), ("≈", r"$\approx$"), ("—", "--")):
        s = s.replace(a, b)
    return s.replace("*", "")


def tex_table(caption: str, label: str, head: list[str], rows: list[list[str]]) -> str:
    cols = "l" * 2 + "r" * (len(head) - 2)
    lines = [r"\begin{table}[t]", r"\centering", r"\small", rf"\begin{{tabular}}{{{cols}}}", r"\toprule",
             " & ".join(_tex_escape(h) for h in head) + r" \\", r"\midrule"]
    lines += [" & ".join(_tex_escape(c) for c in r) + r" \\" for r in rows]
    lines += [r"\bottomrule", r"\end{tabular}", rf"\caption{{{_tex_escape(caption)}}}", rf"\label{{{label}}}",
              r"\end{table}", ""]
    return "\n".join(lines)


def write_table(out: Path, stem: str, md_lines: list[str], tex: str) -> list[Path]:
    d = out / "tables"
    d.mkdir(parents=True, exist_ok=True)
    md, tx = d / f"{stem}.md", d / f"{stem}.tex"
    write_text(md, "\n".join(md_lines).rstrip() + "\n")
    write_text(tx, tex)
    return [md, tx]


# ----------------------------------------------------------------------------- comparability
TABLE_AXES = ("drop_ratio", "scorer", "seed", "policy_seed")  # what T1, T2 and F2 vary between their runs
FAMILY_FIELDS = ("model", "model_overrides", "init_from", "tokenizer")  # what may differ between the families


def table_runs(res: Results) -> list:
    """The finished runs that fill a T1/T2/F2 cell (every seed of the preset)."""
    seeds = sorted({*res.seeds("e1_seeds"), *res.seeds("e2_seeds", default=(0, 1, 2))})
    drop = float(res.preset.get("e2_drop", 0.2))
    scorers = list(res.preset.get("e2_scorers", SCORER_NAMES))
    found = {}
    for fam in res.families():
        for s in seeds:
            cells = [(d, "lrm") for d in LEVELS] + [(drop, sc) for sc in scorers]
            for d, sc in cells:
                r = res.find(fam, d, sc if d > 0 else None, s)
                if r is not None and r.done:
                    found[r.name] = r
    return list(found.values())


def check_comparable(res: Results) -> None:
    """Raise :class:`IncomparableRuns` when the runs of the tables differ in more than the tables'
    axes (drop ratio, scorer, seed) within a family, or, between families, in more than those and
    the model (a T1 built from 12-step and 2-step runs would be meaningless)."""
    runs = table_runs(res)
    lines = []
    for fam in res.families():
        mine = [r for r in runs if r.family == fam]
        lines += [f"{fam}: {d}" for d in grouped_differences(mine, TABLE_AXES)]
    if not lines and len(res.families()) > 1:
        lines += [f"between families: {d}" for d in grouped_differences(runs, TABLE_AXES + FAMILY_FIELDS)]
    if lines:
        raise IncomparableRuns(
            f"{res.dir}: the runs of T1/T2/F2 are not comparable: they differ in more than drop_ratio, scorer and "
            f"seed (and the model between families): " + "; ".join(lines) + ". Keep one setting per folder (move the "
            f"other runs elsewhere), or plot one's own runs side by side with `lrmoe plot RUN...`")


# ----------------------------------------------------------------------------- T1


def t1_data(res: Results) -> list[dict]:
    """Rows of T1: family, level, measured PPL over the E1 seeds (``ppl``: the mean; ``ppl_est``: the
    :func:`lrmoe.stats.estimate`, mean and 95 % t interval), dPPL vs C0, the paired dPPL estimate."""
    seeds = res.seeds("e1_seeds")
    every = sorted({*seeds, *res.seeds("e2_seeds", default=(0, 1, 2))})
    out = []
    for fam in res.families():
        ppl, allp = {}, {}
        for d in LEVELS:
            vals = {}
            for s in every:
                r = res.find(fam, d, "lrm" if d > 0 else None, s)
                v = r.ppl_window_mean() if r else None
                if v is not None:
                    vals[s] = v
            allp[d] = vals
            ppl[d] = {s: v for s, v in vals.items() if s in seeds}
        for d in LEVELS:
            ppl_est = estimate([ppl[d][s] for s in sorted(ppl[d])]).to_dict()
            deltas = [ppl[d][s] - ppl[0.0][s] for s in ppl[d] if s in ppl[0.0]]
            dm, dsd = mean_std(deltas)
            c0m = mean_std(list(ppl[0.0].values()))[0]
            paired = None if d == 0.0 else estimate(
                [allp[d][s] - allp[0.0][s] for s in sorted(allp[d]) if s in allp[0.0]]).to_dict()
            out.append({"family": fam, "level": level_name(d), "ppl": ppl_est["mean"], "ppl_est": ppl_est,
                        "n": len(ppl[d]),
                        "delta": dm, "delta_std": dsd,
                        "delta_pct": (100 * dm / c0m) if (dm is not None and c0m) else None,
                        "delta_paired": paired})
    apply_holm([r["delta_paired"] for r in out if r["delta_paired"] is not None])
    return out


def make_t1(res: Results, paper: dict, out: Path) -> list[Path]:
    p = paper["T1"]
    pv = p["values"]
    head = ["Model family", "Level", "PPL measured", "ΔPPL vs C0 measured", "Δ% measured",
            "ΔPPL vs C0, every seed with both runs: mean [95 % t] (n; p, Holm)", "PPL paper", "Δ% paper"]
    rows = []
    for r in t1_data(res):
        is_paper = r["family"] == p["model"]
        ppl = _fmt_level(r["ppl_est"])
        paper_ppl = f"{pv[r['level']]:.6f}" if is_paper else "—"
        paper_pct = (f"{100 * (pv[r['level']] - pv['C0']) / pv['C0']:+.3f}" if is_paper else "—")
        rows.append([f"{FAMILY_NAMES.get(r['family'], r['family'])} ({res.model_of(r['family'])})", r["level"], ppl,
                     _fmt(r["delta"], sign=True), _fmt(r["delta_pct"], 3, sign=True),
                     "—" if r["delta_paired"] is None else _fmt_est(r["delta_paired"]), paper_ppl, paper_pct])
    scale = (f"Qwen3-30B-A3B, 8× Hopper, {p['run_steps']:,} steps, mean over the final {p['window_steps']:,} steps "
             f"(the paper reports Qwen3 only; its Δ% column is computed from its PPL values, it states +0.106 % for C30)")
    md = _header(res, "T1", "Convergence by backward drop level (LRM scorer, waterfill quotas): mean per-token "
                             "training perplexity over the final 10 % of steps", scale)
    seeds = ", ".join(map(str, res.seeds("e1_seeds")))
    stats_line = (f"PPL, ΔPPL and Δ% measured: the E1 seed(s) {seeds}. The paired column pairs every seed that has "
                  f"both the level's LRM run and C0 (the E2 runs give C20 more seeds); statistics: {CONVENTION} "
                  f"(docs/statistics.md). One seed: no interval and no test."
                  + (" PPL measured with several E1 seeds: their mean [95 % Student t interval] (n), "
                     "lrmoe.stats' estimate, no test (a level, not a difference)."
                     if len(res.seeds("e1_seeds")) > 1 else ""))
    md += [md_table(head, rows), "", stats_line, ""]
    cap = (f"T1: convergence by drop level. Measured: preset {res.preset_name}, {res.scale()}, {res.hardware()}. "
           f"{stats_line} Paper: {scale}.")
    return write_table(out, "T1_convergence", md, tex_table(cap, "tab:t1", head, rows))


# ----------------------------------------------------------------------------- T2


def loss_gap_all_steps(run, c0) -> float | None:
    """Mean over the steps both runs logged a loss of loss(run) - loss(c0), in nats (the area
    between the two training-loss curves divided by the number of steps)."""
    a, b = ({r["step"]: r["loss"] for r in x.rows if r.get("loss") is not None} for x in (run, c0))
    common = sorted(set(a) & set(b))
    if not common:
        return None
    return sum(a[s] - b[s] for s in common) / len(common)


def t2_data(res: Results) -> list[dict]:
    seeds = res.seeds("e2_seeds", default=(0, 1, 2))
    drop = float(res.preset.get("e2_drop", 0.2))
    scorers = list(res.preset.get("e2_scorers", SCORER_NAMES))
    out = []
    for fam in res.families():
        for sc in scorers:
            final, whole = [], []
            for s in seeds:
                r, c0 = res.find(fam, drop, sc, s), res.find(fam, 0.0, None, s)
                if not (r and c0 and r.done and c0.done):
                    continue
                a, b = r.ppl_window_mean(), c0.ppl_window_mean()
                if a is not None and b is not None:
                    final.append(a - b)
                w = loss_gap_all_steps(r, c0)
                if w is not None:
                    whole.append(w)
            fm, fs = mean_std(final)
            wm, ws = mean_std(whole)
            out.append({"family": fam, "scorer": sc, "level": level_name(drop), "delta": fm, "delta_std": fs,
                        "n": len(final), "loss_gap_all": wm, "loss_gap_all_std": ws, "n_all": len(whole),
                        "values": final, "values_all": whole, "delta_est": estimate(final).to_dict(),
                        "loss_gap_all_est": estimate(whole).to_dict()})
    for key in ("delta_est", "loss_gap_all_est"):  # one Holm family per column kind, across the table
        apply_holm([d[key] for d in out])
    return out


def make_t2(res: Results, paper: dict, out: Path) -> list[Path]:
    p = paper["T2"]
    data = t2_data(res)
    fams = [f for f in res.families()]
    head = ["Scorer", "Level"]
    for f in fams:
        name = FAMILY_NAMES.get(f, f)
        head += [f"{name} ΔPPL measured (final 10 %)", f"{name} Δloss measured (mean over all steps, nats)",
                 f"{name} ΔPPL paper"]
    rows = []
    by = {(d["family"], d["scorer"]): d for d in data}
    scorers = list(dict.fromkeys(d["scorer"] for d in data))
    for sc in scorers:
        row = [SCORER_NAMES.get(sc, sc), by[(fams[0], sc)]["level"] if fams else ""]
        for f in fams:
            d = by.get((f, sc))
            row.append(_fmt_est(d["delta_est"]) if d else NOT_RUN)
            row.append(_fmt_est(d["loss_gap_all_est"], 4) if d else NOT_RUN)
            pv = p["values"].get(f, {}).get(sc)
            row.append(f"{pv:.6f}" if pv is not None else "—")
        rows.append(row)
    order_lines = []
    for f in fams:
        meas = [(by[(f, sc)]["delta"], sc) for sc in scorers if by.get((f, sc)) and by[(f, sc)]["delta"] is not None]
        pap = [(v, sc) for sc, v in p["values"].get(f, {}).items()]
        if meas:
            order_lines.append(f"- {FAMILY_NAMES.get(f, f)}: measured order (best first) "
                               + " < ".join(SCORER_NAMES.get(sc, sc) for _, sc in sorted(meas))
                               + "; paper " + " < ".join(SCORER_NAMES.get(sc, sc) for _, sc in sorted(pap)))
    scale = ("Qwen3-30B-A3B and GLM4.5-106B-A12B, 8× Hopper, 10,000-step runs; the paper's averaging window and "
             "drop level for this ablation are not stated in our sources")
    stats_line = (f"Statistics (docs/statistics.md): {CONVENTION}. Holm's families: the {len(data)} ΔPPL cells "
                  f"of this table, and separately its {len(data)} Δloss cells.")
    md = _header(res, "T2", "Scorer ablation: ΔPPL vs C0 of the same seed (mean [95 % t interval] over seeds; "
                            "n = seeds; p: t test against 0, Holm: after Holm's correction)",
                 scale)
    md += [md_table(head, rows), "", stats_line, "",
           "Δloss (mean over all steps): the training-loss difference to the C0 run of the same seed, averaged "
           "over every step (the area between the two loss curves divided by the steps, in nats), then the same "
           "statistics; it weighs the whole run, where the ΔPPL columns weigh its final 10 %.", ""]
    md += order_lines + [""]
    cap = (f"T2: scorer ablation, mean [95 % t interval] over seeds of the paired PPL difference to C0 of the "
           f"same seed. {stats_line} Tables use booktabs. Measured: preset "
           f"{res.preset_name}, {res.scale()}, {res.hardware()}. Paper: {scale}.")
    return write_table(out, "T2_scorer_ablation", md, tex_table(cap, "tab:t2", head, rows))

