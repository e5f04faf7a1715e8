"""A grid's results from its run files only: paired differences against the baseline of the same
seed and family, means with 95 % intervals (:mod:`~lrmoe.stats`), resolved orderings,
and the files a user reads and plots.

Written under the results folder:
  ``tables/<grid>.md`` and ``.tex``: the effects (every variant, every metric: mean [95 % interval]
  (n)) and the orderings (every two variants that differ in one option, paired by seed);
  ``figures/<grid>_<metric>.png`` and ``.pdf``: the metric against the drop ratio per series with
  interval bands (a point plot when the grid does not vary the drop ratio), the paper's points
  beside them for ΔPPL; ``ablation.json``: every number, the per-seed values included.

What each run folder holds is :func:`lrmoe.run_folder.run_state`'s answer (the run machinery reads
the same): a damaged run is named in the tables and the JSON and left out of every mean, never
dropped silently; a run not finished yet is listed as such."""
from __future__ import annotations

import itertools
from pathlib import Path

from lrmoe.files import write_json
from lrmoe.run_folder import DAMAGED, DONE, run_state
from paper_figures.figures import pyplot, save_figure
from paper_figures.results import FAMILY_NAMES, Run, paper_numbers
from paper_figures.tables import SCORER_NAMES, md_table, write_table

from ..stats import BOOTSTRAP_MIN, CONFIDENCE, estimate
from .grid import Grid
from .metrics import get_metric

NOT_RUN = "not run"


def collect(g: Grid, out) -> dict:
    """The state of every run of ``g`` under ``out``: ``runs`` (name -> finished
    :class:`~paper_figures.results.Run`), ``damaged`` (name -> what is wrong, the file named) and
    ``unfinished`` (name -> its state: new, interrupted, running)."""
    out = Path(out)
    runs, damaged, unfinished = {}, {}, {}
    for c in g.cells:
        st = run_state(out / c.name)
        if st.state == DONE:
            runs[c.name] = Run(c.name, out / c.name, st.summary, (), st)
        elif st.state == DAMAGED:
            damaged[c.name] = st.why
        else:
            unfinished[c.name] = st.label
    return {"runs": runs, "damaged": damaged, "unfinished": unfinished}


def _variant_key(coords: dict) -> tuple:
    return tuple((k, v) for k, v in coords.items() if k != "seed")


def per_seed(g: Grid, found: dict, metric: str) -> dict[tuple, dict[int, float]]:
    """variant key -> {seed: metric(run, its baseline)} over the runs where both are finished."""
    m, runs = get_metric(metric), found["runs"]
    out: dict[tuple, dict[int, float]] = {}
    for c in g.cells:
        if c.is_baseline:
            continue
        vals = out.setdefault(_variant_key(c.coords), {})
        if c.name in runs and c.baseline in runs:
            v = m(runs[c.name], runs[c.baseline])
            if v is not None:
                vals[c.coords["seed"]] = v
    return out


def analyse(g: Grid, out) -> dict:
    """Everything the tables and figures show (also written as ``ablation.json``)."""
    found = collect(g, out)
    variants = list(dict.fromkeys(_variant_key(c.coords) for c in g.cells if not c.is_baseline))
    seeds = {k: per_seed(g, found, k) for k in g.metrics}
    effects = []
    for key in variants:
        row = {"variant": dict(key), "metrics": {}}
        for k in g.metrics:
            vals = seeds[k][key]
            row["metrics"][k] = dict(estimate([vals[s] for s in sorted(vals)]).to_dict(), seeds=sorted(vals))
        effects.append(row)
    comparisons = []
    paired = [k for k in g.metrics if get_metric(k).paired]
    for a, b in itertools.combinations(variants, 2):
        da, db = dict(a), dict(b)
        differ = [k for k in da if da[k] != db.get(k)]
        if len(differ) != 1 or differ[0] == "family":
            continue
        axis = differ[0]
        comp = {"axis": axis, "a": da[axis], "b": db[axis],
                "context": {k: v for k, v in da.items() if k != axis}, "metrics": {}}
        for k in paired:
            sa, sb = seeds[k][a], seeds[k][b]
            common = sorted(set(sa) & set(sb))
            est = estimate([sa[s] - sb[s] for s in common])
            comp["metrics"][k] = dict(est.to_dict(), seeds=common, ordering=_ordering(est, da[axis], db[axis]))
        comparisons.append(comp)
    baselines = {}
    for fam in dict.fromkeys(c.coords["family"] for c in g.cells):
        ppl = [found["runs"][c.name].ppl_window_mean() for c in g.cells
               if c.is_baseline and c.coords["family"] == fam and c.name in found["runs"]]
        baselines[fam] = estimate([p for p in ppl if p is not None]).to_dict()
    return {"grid": g.to_dict(), "confidence": CONFIDENCE,
            "statistics": f"paired differences over seeds; Student t interval for n < {BOOTSTRAP_MIN}, "
                          f"BCa bootstrap (scipy.stats.bootstrap) from n = {BOOTSTRAP_MIN}",
            "metrics": {k: {"label": get_metric(k).label, "unit": get_metric(k).unit, "help": get_metric(k).help}
                        for k in g.metrics},
            "baseline_ppl_final": baselines, "effects": effects, "comparisons": comparisons,
            "damaged": found["damaged"], "unfinished": found["unfinished"],
            "hardware": sorted({_hardware(r) for r in found["runs"].values()})}


def _hardware(run: Run) -> str:
    from lrmoe.environment import hardware_label

    return hardware_label(run.summary.get("environment", {}), run.summary.get("distributed"))


def _ordering(est, a, b) -> str:
    if est.n == 0:
        return NOT_RUN
    if not est.resolved:
        return "unresolved"
    return f"{a} < {b}" if est.sign < 0 else f"{a} > {b}"


# ----------------------------------------------------------------------------- tables


def _num(v, digits: int, sign: bool = True) -> str:
    if v is None:
        return "—"
    return (f"{v:+.{digits}f}" if sign else f"{v:.{digits}f}").replace("-", "−")


def _cell(e: dict, digits: int, sign: bool = True) -> str:
    if e["n"] == 0:
        return NOT_RUN
    txt = _num(e["mean"], digits, sign)
    if e["lo"] is not None:
        txt += f" [{_num(e['lo'], digits, sign)}, {_num(e['hi'], digits, sign)}]"
    return txt + f" (n={e['n']})"


def _label(k, v) -> str:
    if k == "family":
        return FAMILY_NAMES.get(v, v)
    if k == "drop_ratio":
        return f"C{round(v * 100)}"
    return str(v)


def paper_t2(family: str, scorer) -> float | None:
    """The paper's T2 ΔPPL of ``scorer`` on ``family`` (its drop level is not stated), or None."""
    return paper_numbers()["T2"]["values"].get(family, {}).get(scorer)


def tables(a: dict, g: Grid) -> tuple[list[str], list[tuple[str, list, list]]]:
    """The Markdown lines of the grid's tables, and (caption, head, rows) of each for LaTeX."""
    varied = [k for k in g.varied() if k != "seed"]
    if "family" not in varied:
        varied = ["family"] + varied
    show_paper = "scorer" in varied and "dppl_final" in g.metrics
    head = [k for k in varied] + [f"{get_metric(k).label} ({get_metric(k).unit})" if get_metric(k).unit
                                  else get_metric(k).label for k in g.metrics]
    if show_paper:
        head.append("paper T2 ΔPPL (drop level not stated)")
    rows = []
    for e in a["effects"]:
        row = [_label(k, e["variant"].get(k)) for k in varied]
        row += [_cell(e["metrics"][k], get_metric(k).digits, get_metric(k).paired) for k in g.metrics]
        if show_paper:
            pv = paper_t2(e["variant"].get("family"), e["variant"].get("scorer"))
            row.append(_num(pv, 6, sign=False) if pv is not None else "—")
        rows.append(row)
    paired = [k for k in g.metrics if get_metric(k).paired]
    chead = ["context", "option", "a vs b"] + [f"{get_metric(k).label}: a − b" for k in paired] + ["ordering"]
    crow = []
    first = g.metrics[0]
    for c in a["comparisons"]:
        ctx = " ".join(_label(k, v) for k, v in c["context"].items())
        crow.append([ctx, c["axis"], f"{_label(c['axis'], c['a'])} vs {_label(c['axis'], c['b'])}"]
                    + [_cell(c["metrics"][k], get_metric(k).digits) for k in paired]
                    + [c["metrics"][first]["ordering"]])
    md = [f"**Ablation `{g.name}`** ({g.file}): {g.question}", "",
          f"*Measured* (this kit): grid preset `{g.preset.name}`, {_scale(g)}; hardware: "
          f"{'; '.join(a['hardware']) or 'no finished run'}.  ",
          f"Each value is a paired difference run − baseline of the same seed and family "
          f"(baseline: {', '.join(f'{k} = {v}' for k, v in g.baseline_options.items())}), then the mean over seeds "
          f"with its {round(CONFIDENCE * 100)} % confidence interval: {a['statistics']} (docs/ablations.md). An "
          f"ordering is resolved when the interval of the paired difference a − b excludes 0; it is judged on "
          f"the first metric ({get_metric(first).label}).", ""]
    base = "; ".join(f"{FAMILY_NAMES.get(f, f)} {_cell(e, 6, sign=False)}" for f, e in a["baseline_ppl_final"].items())
    md += [f"Baseline training PPL (final 10 % of steps; mean [interval] over its seeds): {base}.", ""]
    if a["damaged"]:
        md += ["*Left out* (damaged run folders; the variants they belong to count fewer seeds): "
               + "; ".join(f"`{n}` ({why})" for n, why in a["damaged"].items()) + ".", ""]
    if a["unfinished"]:
        md += [f"*Not finished* (left out of the means): "
               + ", ".join(f"`{n}` ({s})" for n, s in a["unfinished"].items()) + ".", ""]
    md += ["Effects (every variant against its baseline):", "", md_table(head, rows), ""]
    md += [f"Orderings (variants that differ in one option, paired by seed; n = seeds both finished):", "",
           md_table(chead, crow) if crow else "(no two variants differ in exactly one option)", ""]
    md += ["Metrics: " + "; ".join(f"{get_metric(k).label}: {get_metric(k).help}" for k in g.metrics) + "."]
    tex = [(f"Ablation {g.name}: effects against the baseline ({g.question})", head, rows),
           (f"Ablation {g.name}: orderings (paired differences a - b)", chead, crow)]
    return md, tex


def _scale(g: Grid) -> str:
    c = g.specs[0].config if g.specs else {}
    models = sorted({s.config.get("model") for s in g.specs})
    return (f"{', '.join(models)}, {c.get('steps')} steps of {c.get('micro_batch', 0) * (c.get('grad_accum') or 1)} "
            f"rows x {c.get('seq_len')} tokens, {len({s.config.get('seed') for s in g.specs})} seed(s)")


_TEX = (("\\", r"\textbackslash{}"), ("&", r"\&"), ("%", r"\%"), ("_", r"\_"), ("#", r"\#"), ("Δ", r"$\Delta$"),
        ("−", "$-$"), ("|", r"$|$"), ("<", "$<$"), (">", "$>$"))


def _tex_text(s: str) -> str:
    for a, b in _TEX:
        s = s.replace(a, b)
    return s


def _tex(parts) -> str:
    out = []
    for caption, head, rows in parts:
        out += [r"\begin{table}[t]", r"\centering", r"\scriptsize", rf"\begin{{tabular}}{{{'l' * len(head)}}}",
                r"\toprule", " & ".join(_tex_text(h) for h in head) + r" \\", r"\midrule"]
        out += [" & ".join(_tex_text(c) for c in r) + r" \\" for r in rows]
        out += [r"\bottomrule", r"\end{tabular}", rf"\caption{{{_tex_text(caption)}}}", r"\end{table}", ""]
    return "\n".join(out)


# ----------------------------------------------------------------------------- figures


def figure(a: dict, g: Grid, metric: str, out: Path) -> list[Path]:
    """``metric`` against the drop ratio, one line per series (the other varied options) with its
    interval band, one panel per family, and the paper's points in a panel beside (ΔPPL only);
    a point plot with interval bars when the grid does not vary the drop ratio."""
    plt, sns = pyplot()
    m = get_metric(metric)
    fams = list(dict.fromkeys(e["variant"]["family"] for e in a["effects"]))
    by_drop = "drop_ratio" in g.varied()
    paper = metric == "dppl_final" and "scorer" in g.varied()
    fig, axes = plt.subplots(1, len(fams) + paper, figsize=(5.2 * (len(fams) + paper), 3.8), squeeze=False)
    series_keys = [k for k in g.varied() if k not in ("seed", "family", "drop_ratio")]
    all_series = list(dict.fromkeys(tuple(e["variant"].get(k) for k in series_keys) for e in a["effects"]))
    colors = dict(zip(all_series, sns.color_palette("colorblind", max(1, len(all_series)))))
    for j, fam in enumerate(fams):
        ax = axes[0][j]
        mine = [e for e in a["effects"] if e["variant"]["family"] == fam]
        for i, s in enumerate(all_series):
            pts = [e for e in mine if tuple(e["variant"].get(k) for k in series_keys) == s and e["metrics"][metric]["n"]]
            name = " ".join(_series_label(k, v) for k, v in zip(series_keys, s)) or "variant"
            if not pts:
                continue
            if by_drop:
                pts.sort(key=lambda e: e["variant"]["drop_ratio"])
                xs = [0.0] + [e["variant"]["drop_ratio"] for e in pts]
                ys = [0.0] + [e["metrics"][metric]["mean"] for e in pts]
                lo = [0.0] + [_or(e["metrics"][metric]["lo"], e["metrics"][metric]["mean"]) for e in pts]
                hi = [0.0] + [_or(e["metrics"][metric]["hi"], e["metrics"][metric]["mean"]) for e in pts]
                if len(pts) >= 2:  # a curve only through measured drop ratios: C0 and at least two more
                    ax.plot(xs, ys, marker="o", ms=3, lw=1, color=colors[s], label=name)
                    ax.fill_between(xs, lo, hi, color=colors[s], alpha=0.15, lw=0)
                else:  # one drop ratio beside the baseline: points and interval bars, no line between them
                    dodge = 0.012 * (i - (len(all_series) - 1) / 2)  # side by side at the same ratio
                    err = [[y - a for y, a in zip(ys, lo)], [b - y for y, b in zip(ys, hi)]]
                    ax.errorbar([x + dodge * (x > 0) for x in xs], ys, yerr=err, fmt="o", ms=4, capsize=3,
                                color=colors[s], label=name)
            else:
                for e in pts:
                    est = e["metrics"][metric]
                    err = None if est["lo"] is None else [[est["mean"] - est["lo"]], [est["hi"] - est["mean"]]]
                    ax.errorbar([i], [est["mean"]], yerr=err, fmt="o", color=colors[s], capsize=3, label=name)
        if not by_drop:
            ax.set_xticks(range(len(all_series)))
            ax.set_xticklabels([" ".join(_series_label(k, v) for k, v in zip(series_keys, s)) for s in all_series],
                               fontsize=7, rotation=20)
        else:
            ax.set_xticks(sorted({0.0, *(e["variant"]["drop_ratio"] for e in mine)}))  # the measured ratios only
            ax.set_xlabel("drop ratio (0: the baseline)")
        ax.axhline(0.0, color="0.3", lw=0.6)
        spread = sorted(abs(v) for e in mine for k in ("mean", "lo", "hi") if (v := e["metrics"][metric][k]))
        if spread and spread[-1] > 100 * spread[len(spread) // 4]:  # decades apart: a symmetric log scale
            ax.set_yscale("symlog", linthresh=spread[len(spread) // 4])
        ax.set_ylabel(f"{m.label} ({m.unit})" if m.unit else m.label)
        ax.set_title(f"measured: {FAMILY_NAMES.get(fam, fam)}, mean and {round(CONFIDENCE * 100)} % interval over "
                     f"seeds", fontsize=8)
        ax.legend(fontsize=7)
    if paper:
        _paper_panel(axes[0][-1], fams, colors, series_keys)
    fig.suptitle(f"Ablation {g.name}: {m.label}", fontsize=9)
    fig.tight_layout()
    files = save_figure(fig, out, f"{g.name}_{metric}")
    plt.close(fig)
    return files


def _or(v, default):
    return default if v is None else v


def _series_label(k, v) -> str:
    return SCORER_NAMES.get(v, str(v)) if k == "scorer" else f"{k}={v}" if k not in ("quota", "mode", "selection") else str(v)


def _paper_panel(ax, fams, colors, series_keys) -> None:
    """The paper's T2 ΔPPL per scorer (its drop level is not stated: drawn at C20, the level this
    kit assumes) and T1's LRM ΔPPL at C10-C30 (Qwen3): the paper's scale, beside ours."""
    nums = paper_numbers()
    t1 = nums["T1"]["values"]
    markers = {"qwen3": "o", "glm4": "s"}
    for fam in fams:
        for sc, v in nums["T2"]["values"].get(fam, {}).items():
            key = next((s for s in colors if "scorer" in series_keys and s[series_keys.index("scorer")] == sc), None)
            ax.scatter([0.2], [v], marker=markers.get(fam, "o"), color=colors.get(key, "0.4"),
                       label=f"T2 {FAMILY_NAMES.get(fam, fam)} {SCORER_NAMES.get(sc, sc)}")
    if nums["T1"].get("model") in fams:
        xs = [0.0, 0.1, 0.2, 0.3]
        ax.plot(xs, [t1[f"C{round(x * 100)}"] - t1["C0"] for x in xs], color="0.3", lw=1, ls="--", marker=".",
                label="T1 LRM (Qwen3-30B-A3B)")
    ax.set_yscale("symlog", linthresh=1e-3)
    ax.set_xlim(-0.05, 1.0)
    ax.set_xlabel("drop ratio (T2's level is not stated; drawn at C20)")
    ax.set_ylabel("ΔPPL (paper)")
    ax.set_title("paper (8 Hopper GPUs, 10,000 steps)", fontsize=8)
    ax.legend(fontsize=6)


# ----------------------------------------------------------------------------- all


def write_all(g: Grid, out, warn=print, figures: bool = True, runs_dir=None) -> list[Path]:
    """ablation.json, the tables and (``figures``) the figures of ``g`` into ``out``, from the run
    files under ``runs_dir`` (default: ``out`` itself)."""
    out = Path(out)
    a = analyse(g, out if runs_dir is None else runs_dir)
    a["runs_dir"] = str(out if runs_dir is None else runs_dir)
    if a["damaged"]:
        warn(f"{len(a['damaged'])} damaged run folder(s) left out of the tables: "
             + "; ".join(f"{n}: {why}" for n, why in a["damaged"].items()))
    files = [write_json(out / "ablation.json", a)]
    md, tex = tables(a, g)
    files += write_table(out, g.name, md, _tex(tex))
    for k in g.metrics if figures else ():
        if any(e["metrics"][k]["n"] for e in a["effects"]):
            files += figure(a, g, k, out)
    return files
