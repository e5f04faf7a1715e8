"""A grid's results from its run files only: paired differences against the baseline of the same
seed and family, means with 95 % intervals (:mod:`~lrmoe.stats`), resolved orderings,
and the files a user reads and plots.

Written under the results folder:
  ``tables/<grid>.md`` and ``.tex``: the effects (every variant, every metric: mean [95 % interval]
  (n)) and the orderings (every two variants that differ in one option, paired by seed);
  ``figures/<grid>_<metric>.png`` and ``.pdf`` (:func:`figure`): for a paired metric a dot plot, one
  panel per family and drop level, each variant's mean and 95 % t interval with a line at 0 for the
  baseline, and for ΔPPL of a scorer grid the paper's T2 values in a log-axis panel beside; for the
  kept fraction a line against the drop level (two or more levels only); none for a grid with a
  single variant (the table says it all); ``ablation.json``: every number, the per-seed values included.

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

from ..stats import CONFIDENCE, CONVENTION, estimate, fmt_p, with_holm
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
    paired = [k for k in g.metrics if get_metric(k).paired]
    ests = {k: [estimate([seeds[k][key][s] for s in sorted(seeds[k][key])]) for key in variants] for k in g.metrics}
    for k in paired:  # every effect against its baseline: one family of tests per metric, Holm-corrected
        ests[k] = list(with_holm(ests[k]))
    for i, key in enumerate(variants):
        row = {"variant": dict(key), "metrics": {}}
        for k in g.metrics:
            extra = {"holm_family": len(variants)} if k in paired else {}
            row["metrics"][k] = dict(ests[k][i].to_dict(), seeds=sorted(seeds[k][key]), **extra)
        effects.append(row)
    comparisons = []
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
            comp["metrics"][k] = (estimate([sa[s] - sb[s] for s in common]), common)
        comparisons.append(comp)
    # Holm's correction across the table's comparisons: one family of tests per metric and option
    # (the scorer orderings are one family, the drop-ratio orderings another)
    for k in paired:
        for axis in dict.fromkeys(c["axis"] for c in comparisons):
            fam = [c for c in comparisons if c["axis"] == axis]
            for c, est in zip(fam, with_holm(c["metrics"][k][0] for c in fam)):
                common = c["metrics"][k][1]
                c["metrics"][k] = dict(est.to_dict(), seeds=common, holm_family=len(fam),
                                       ordering=_ordering(est, c["a"], c["b"]))
    baselines = {}
    for fam in dict.fromkeys(c.coords["family"] for c in g.cells):
        ppl = [found["runs"][c.name].ppl_window_mean() for c in g.cells
               if c.is_baseline and c.coords["family"] == fam and c.name in found["runs"]]
        baselines[fam] = estimate([p for p in ppl if p is not None]).to_dict()
    return {"grid": g.to_dict(), "confidence": CONFIDENCE,
            "statistics": CONVENTION,
            "metrics": {k: {"label": get_metric(k).label, "unit": get_metric(k).unit, "help": get_metric(k).help}
                        for k in g.metrics},
            "baseline_ppl_final": baselines, "effects": effects, "comparisons": comparisons,
            "damaged": found["damaged"], "unfinished": found["unfinished"],
            "hardware": sorted({_hardware(r) for r in found["runs"].values()})}


def _hardware(run: Run) -> str:
    from lrmoe.environment import hardware_label

    return hardware_label(run.summary.get("environment", {}), run.summary.get("distributed"))


def _ordering(est, a, b) -> str:
    """The ordering after Holm's correction across the table's comparisons; one that only the
    uncorrected interval resolves says so."""
    if est.n == 0:
        return NOT_RUN
    if not est.resolved:
        return "unresolved"
    order = f"{a} < {b}" if est.sign < 0 else f"{a} > {b}"
    return order if est.resolved_holm else f"unresolved after Holm (uncorrected: {order})"


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


#: the drop ratio the kit compares the paper's T2 at (the paper does not state its level; docs/reproduce.md)
T2_LEVEL = 0.2


def paper_t2(family: str, scorer, drop_ratio=T2_LEVEL) -> float | None:
    """The paper's T2 ΔPPL of ``scorer`` on ``family`` for a row at ``drop_ratio``: only at
    :data:`T2_LEVEL` (its own level is not stated; a C10 or C30 row has no paper value), else None."""
    if drop_ratio is None or abs(float(drop_ratio) - T2_LEVEL) > 1e-9:
        return None
    return paper_numbers()["T2"]["values"].get(family, {}).get(scorer)


def tables(a: dict, g: Grid) -> tuple[list[str], list[tuple[str, list, list]]]:
    """The Markdown lines of the grid's tables, and (caption, head, rows) of each for LaTeX."""
    varied = [k for k in g.varied() if k != "seed"]
    if "family" not in varied:
        varied = ["family"] + varied
    show_paper = "scorer" in varied and "dppl_final" in g.metrics
    head = [k for k in varied] + [f"{get_metric(k).label} ({get_metric(k).unit})" if get_metric(k).unit
                                  else get_metric(k).label for k in g.metrics]
    first = g.metrics[0]
    effect_p = get_metric(first).paired
    if effect_p:
        head.append(f"p (t test) / Holm, {get_metric(first).label} vs baseline")
    if show_paper:
        head.append(f"paper T2 ΔPPL (C{round(100 * T2_LEVEL)} rows; its drop level not stated)")
    rows = []
    for e in a["effects"]:
        row = [_label(k, e["variant"].get(k)) for k in varied]
        row += [_cell(e["metrics"][k], get_metric(k).digits, get_metric(k).paired) for k in g.metrics]
        if effect_p:
            m = e["metrics"][first]
            row.append(f"{fmt_p(m.get('p'))} / {fmt_p(m.get('p_holm'))}")
        if show_paper:
            pv = paper_t2(e["variant"].get("family"), e["variant"].get("scorer"),
                          e["variant"].get("drop_ratio", g.set.get("drop_ratio")))
            row.append(_num(pv, 6, sign=False) if pv is not None else "—")
        rows.append(row)
    paired = [k for k in g.metrics if get_metric(k).paired]
    chead = (["context", "option", "a vs b"] + [f"{get_metric(k).label}: a − b" for k in paired]
             + [f"p (t test) / Holm, {get_metric(paired[0]).label}" if paired else "p", "ordering (Holm)"])
    crow = []
    for c in a["comparisons"]:
        ctx = " ".join(_label(k, v) for k, v in c["context"].items())
        crow.append([ctx, c["axis"], f"{_label(c['axis'], c['a'])} vs {_label(c['axis'], c['b'])}"]
                    + [_cell(c["metrics"][k], get_metric(k).digits) for k in paired]
                    + [f"{fmt_p(c['metrics'][first]['p'])} / {fmt_p(c['metrics'][first]['p_holm'])}",
                       c["metrics"][first]["ordering"]])
    md = [f"**Ablation `{g.name}`** ({g.file}): {g.question}", "",
          f"*Measured* (this kit): grid preset `{g.preset.name}`, {_scale(g)}; hardware: "
          f"{'; '.join(a['hardware']) or 'no finished run'}.  ",
          f"Each value is a paired difference run − baseline of the same seed and family "
          f"(baseline: {', '.join(f'{k} = {v}' for k, v in g.baseline_options.items())}), then the mean over seeds "
          f"with its {round(CONFIDENCE * 100)} % Student t interval (uncorrected). An ordering is resolved when "
          f"the two-sided t test of the paired difference a − b gives p < 0.05 after Holm's correction across "
          f"this table's comparisons of the same option ({_families(a)}); it is judged on the first metric "
          f"({get_metric(first).label}). Convention: {a['statistics']} (docs/statistics.md).", ""]
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


def _families(a: dict) -> str:
    counts = {}
    for c in a["comparisons"]:
        counts[c["axis"]] = counts.get(c["axis"], 0) + 1
    return ", ".join(f"{n} {axis} comparisons" for axis, n in counts.items()) or "none"


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
    """One figure of ``metric``; [] when a table says it all (fewer than two values to compare).

    A paired metric (a difference to the baseline of the same seed) is a dot plot: one panel per
    family and drop ratio, the variants side by side with their mean and 95 % t interval on a
    linear axis of the panel's own scale (values decades apart across drop ratios get their own
    panels, never a symmetric-log axis), a line at 0 (the baseline), and for ΔPPL of a scorer grid
    the paper's T2 values in a panel beside on a log axis. A per-run metric (the kept fraction) is a
    line against the drop ratio with the target 1 − drop ratio; series that coincide are drawn once."""
    m = get_metric(metric)
    fams = list(dict.fromkeys(e["variant"]["family"] for e in a["effects"]))
    series_keys = [k for k in g.varied() if k not in ("seed", "family", "drop_ratio")]
    all_series = list(dict.fromkeys(tuple(e["variant"].get(k) for k in series_keys) for e in a["effects"]))
    drops = sorted({e["variant"]["drop_ratio"] for e in a["effects"] if "drop_ratio" in e["variant"]})
    if not m.paired:
        return _line_figure(a, g, metric, out, fams, series_keys, all_series, drops)
    filled = [e for e in a["effects"] if e["metrics"][metric]["n"]]
    if len(filled) < 2:  # one variant: its row of the table is the whole story
        return []
    plt, sns = pyplot()
    paper = metric == "dppl_final" and "scorer" in g.varied()
    cols = [*(drops or [None])]
    ncol = len(cols) + paper

    def estimate_of(fam, d, s):
        e = next((e for e in a["effects"] if e["variant"]["family"] == fam and e["variant"].get("drop_ratio") == d
                  and tuple(e["variant"].get(k) for k in series_keys) == s), None)
        est = e["metrics"][metric] if e else None
        return est if est and est["n"] else None

    # each panel shows the variants it has (a grid with LRM alone at C10 and C30 left empty slots);
    # its width follows their number, the most any family has at that level
    shown = {(fam, d): [s for s in all_series if estimate_of(fam, d, s)] for fam in fams for d in cols}
    widths = [max(1, *(len(shown[fam, d]) for fam in fams)) for d in cols] + ([len(all_series)] if paper else [])
    fig, axes = plt.subplots(len(fams), ncol, squeeze=False, gridspec_kw={"width_ratios": [0.6 + w for w in widths]},
                             figsize=(1.2 + sum(1.1 + 0.55 * w for w in widths), 3.4 * len(fams)))
    colors = dict(zip(all_series, sns.color_palette("colorblind", max(1, len(all_series)))))
    name_of = {s: " ".join(_series_label(k, v) for k, v in zip(series_keys, s)) or "variant" for s in all_series}
    names = [name_of[s] for s in all_series]
    for j, fam in enumerate(fams):
        for c, d in enumerate(cols):
            ax = axes[j][c]
            here = shown[fam, d]
            for i, s in enumerate(here):
                est = estimate_of(fam, d, s)
                err = None if est["lo"] is None else [[est["mean"] - est["lo"]], [est["hi"] - est["mean"]]]
                ax.errorbar([i], [est["mean"]], yerr=err, fmt="o", ms=5, capsize=4, color=colors[s])
            ax.axhline(0.0, color="0.3", lw=0.8)
            ax.set_xticks(range(len(here)))
            ax.set_xticklabels([name_of[s] for s in here], fontsize=7, rotation=30, ha="right")
            ax.set_xlim(-0.6, max(1, len(here)) - 0.4)
            ax.tick_params(axis="y", labelsize=7)
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 4), useMathText=True)
            ax.set_title(f"{FAMILY_NAMES.get(fam, fam)}" + (f", C{round(d * 100)}" if d is not None else ""), fontsize=8)
            if c == 0:
                ax.set_ylabel(f"{m.label}, run − baseline" + (f" ({m.unit})" if m.unit else ""), fontsize=8)
        if paper:
            _paper_panel(axes[j][-1], fam, all_series, series_keys, colors, names)
    base = ", ".join(f"{k} = {_label(k, v) if k == 'drop_ratio' else v}" for k, v in g.baseline_options.items())
    fig.suptitle(f"Ablation {g.name}: {m.label} against the baseline of the same seed ({base}); measured, "
                 f"{_scale(g)}\nmean and 95 % Student t interval over seeds (uncorrected; the tables give the "
                 f"Holm-corrected orderings); 0 = the baseline", fontsize=8)
    fig.tight_layout()
    files = save_figure(fig, out, f"{g.name}_{metric}")
    plt.close(fig)
    return files


def _line_figure(a, g, metric, out, fams, series_keys, all_series, drops) -> list[Path]:
    """A per-run metric against the drop ratio (the kept fraction): measured points only (no
    baseline point drawn as 0), the target 1 − drop ratio dashed, coinciding series drawn once."""
    if len(drops) < 2:
        return []
    plt, sns = pyplot()
    m = get_metric(metric)
    fig, axes = plt.subplots(1, len(fams), figsize=(5.2 * len(fams), 3.6), squeeze=False)
    colors = dict(zip(all_series, sns.color_palette("colorblind", max(1, len(all_series)))))
    for j, fam in enumerate(fams):
        ax = axes[0][j]
        curves = {}
        for s in all_series:
            pts = sorted((e["variant"]["drop_ratio"], e["metrics"][metric]) for e in a["effects"]
                         if e["variant"]["family"] == fam and tuple(e["variant"].get(k) for k in series_keys) == s
                         and e["metrics"][metric]["n"])
            if pts:
                curves[s] = pts
        groups: list[tuple[list, list]] = []  # (series, points): series whose means coincide are one line
        for s, pts in curves.items():
            same = next((grp for grp in groups if len(grp[1]) == len(pts) and all(
                p[0] == q[0] and abs(p[1]["mean"] - q[1]["mean"]) <= 1e-6 for p, q in zip(pts, grp[1]))), None)
            if same:
                same[0].append(s)
            else:
                groups.append(([s], pts))
        for ss, pts in groups:
            label = ", ".join(" ".join(_series_label(k, v) for k, v in zip(series_keys, s)) for s in ss) or "variant"
            if len(ss) > 1:
                label = f"{label} (identical)"
            xs = [x for x, _ in pts]
            ax.plot(xs, [e["mean"] for _, e in pts], marker="o", ms=4, lw=1.2, color=colors[ss[0]], label=label)
        ax.plot(drops, [1 - d for d in drops], ls="--", color="0.4", lw=1, label="target: 1 − drop ratio")
        ax.set_xticks(drops)
        ax.set_xticklabels([f"C{round(d * 100)}" for d in drops])
        ax.set_xlabel("backward drop level")
        ax.set_ylabel(f"{m.label}" + (f" ({m.unit})" if m.unit else ""))
        ax.set_ylim(0, 1.05)
        ax.set_title(f"{FAMILY_NAMES.get(fam, fam)}", fontsize=8)
        ax.legend(fontsize=7, loc="upper right")
    fig.suptitle(f"Ablation {g.name}: {m.label} (mean over seeds); measured, {_scale(g)}", fontsize=8)
    fig.tight_layout()
    files = save_figure(fig, out, f"{g.name}_{metric}")
    plt.close(fig)
    return files


def _series_label(k, v) -> str:
    return SCORER_NAMES.get(v, str(v)) if k == "scorer" else f"{k}={v}" if k not in ("quota", "mode", "selection") else str(v)


def _paper_panel(ax, fam, all_series, series_keys, colors, names) -> None:
    """The paper's T2 ΔPPL per scorer of ``fam`` (its drop level is not stated) on a log axis: the
    paper's scale, beside ours; the same x positions and colours as the measured panels."""
    vals = paper_numbers()["T2"]["values"].get(fam, {})
    for i, s in enumerate(all_series):
        sc = s[series_keys.index("scorer")] if "scorer" in series_keys else None
        if sc in vals:
            ax.scatter([i], [vals[sc]], marker="D", s=28, color=colors[s])
            ax.annotate(f"{vals[sc]:.3g}", (i, vals[sc]), textcoords="offset points", xytext=(6, 0), fontsize=6.5,
                        va="center")
    ax.set_yscale("log")
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    # labels at 1, 2 and 5 times each power of ten, as plain numbers: a range of one or two
    # decades gets several (a single 10^-1 label said nothing)
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xticks(range(len(all_series)))
    ax.set_xticklabels(names, fontsize=7, rotation=30, ha="right")
    ax.set_xlim(-0.6, len(all_series) - 0.4)
    ax.tick_params(axis="y", labelsize=7)
    ax.set_ylabel("ΔPPL, paper (log scale)", fontsize=8)
    ax.set_title(f"paper T2 ({'Qwen3-30B-A3B' if fam == 'qwen3' else 'GLM4.5-106B-A12B' if fam == 'glm4' else fam}; "
                 f"8 GPUs; level not stated)", fontsize=7)


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
