"""The gradient-fidelity probe's outputs (`lrmoe ablate probe`, :mod:`lrmoe.ablate.probe`):
probe.json, the tables (probe.md, probe.tex) and Figure A1 (relative error of the expert weight
gradients against the drop ratio, per scorer, phi and selection rule; PNG + PDF), all from the
records only (:func:`write_outputs`; :func:`from_json` redraws them from a probe.json)."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from lrmoe.files import read_json, write_json, write_text

from .figures import pyplot, save_figure


def variant_name(r: dict) -> str:
    """``lrm[h]/top``-style label of a record's policy."""
    phi = f"[{r['phi']}]" if r["scorer"] == "lrm" else ""
    return f"{r['scorer']}{phi}/{r['selection']}"


def layer_means(records: list[dict], key: str, params=("gate_up", "down")) -> dict:
    """{(checkpoint, variant, drop_ratio): mean of ``key`` over layers and the given params}."""
    acc = defaultdict(list)
    for r in records:
        if r["param"] in params and r.get(key) is not None:
            acc[(r["checkpoint"], variant_name(r), r["drop_ratio"])].append(r[key])
    return {k: sum(v) / len(v) for k, v in acc.items()}


def _order(records):
    seen = []
    for r in records:
        if variant_name(r) not in seen:
            seen.append(variant_name(r))
    return seen


def _grid(records, key, checkpoint, params=("gate_up", "down"), digits=4):
    m = layer_means(records, key, params)
    drops = sorted({r["drop_ratio"] for r in records})
    rows = []
    for v in _order(records):
        if any((checkpoint, v, d) in m for d in drops):
            rows.append([v] + [f"{m[(checkpoint, v, d)]:.{digits}f}" if (checkpoint, v, d) in m else "-"
                               for d in drops])
    return ["variant"] + [f"C{round(100 * d):02d}" for d in drops], rows


def _md(head, rows) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]


def _tex(caption, label, head, rows) -> str:
    esc = lambda s: s.replace("_", r"\_").replace("[", "{[}").replace("]", "{]}")  # noqa: E731
    lines = [r"\begin{table}[t]", r"\centering", rf"\caption{{{esc(caption)}}}", rf"\label{{{label}}}",
             r"\begin{tabular}{l" + "r" * (len(head) - 1) + "}", r"\toprule", " & ".join(map(esc, head)) + r" \\",
             r"\midrule"] + [" & ".join(map(esc, r)) + r" \\" for r in rows] + [r"\bottomrule", r"\end{tabular}",
                                                                              r"\end{table}"]
    return "\n".join(lines) + "\n"


def tables(records: list[dict], meta: dict) -> tuple[str, str]:
    """(Markdown, LaTeX) of the probe: per checkpoint, the end-to-end and layer-local relative
    errors, the dropped score share, and for the sampled rule its bias and variance."""
    checkpoints = [c for c in meta.get("checkpoints", []) if any(r["checkpoint"] == c for r in records)]
    md = [f"# Gradient-fidelity probe (`{meta.get('command', 'lrmoe ablate probe')}`)", "",
          f"Measured on {meta.get('machine', '?')}, {meta.get('dtype', 'float64')}: model {meta.get('model')} "
          f"({meta.get('steps')} training steps; run {meta.get('run')}), {meta.get('batches')} fixed micro-batches "
          f"of {meta.get('rows')} rows x {meta.get('seq_len')} tokens, {meta.get('draws')} draws per sampled "
          f"selection, seed {meta.get('seed')}; {meta.get('seconds')} s. Each cell is the mean over the MoE "
          f"layers and both expert weights (gate_up, down); probe.json has every layer and weight.", ""]
    tex = []
    sections = [("rel_err", "relative error ||G - G_full|| / ||G_full|| (end to end: the policy at every layer)"),
                ("rel_err_local", "relative error, layer-local (this layer's selection on the full backward's "
                                  "incoming gradient)"),
                ("cosine", "cosine with the full gradient (end to end)"),
                ("dropped_score_share", "dropped share of sum R_u (R with the paper's phi = h; layer-local)"),
                ("bias_local", "sampled rule: bias ||mean G - G_full|| / ||G_full|| (layer-local)"),
                ("bias_floor_local", "sampled rule: the bias an unbiased estimator shows from the finite draws "
                                     "alone, sqrt(variance / draws) (layer-local)"),
                ("variance_local", "sampled rule: variance / ||G_full||^2 (layer-local)")]
    for c in checkpoints:
        for key, title in sections:
            head, rows = _grid(records, key, c)
            if not rows:
                continue
            md += [f"## {c}: {title}", ""] + _md(head, rows) + [""]
            if key in ("rel_err", "dropped_score_share"):
                tex.append(_tex(f"Gradient-fidelity probe, {c} model: {title}.", f"tab:probe-{key}-{c}", head, rows))
    return "\n".join(md), "\n".join(tex)


def figure_a1(records: list[dict], out: Path) -> list[Path]:
    """End-to-end relative error against drop ratio, faceted so that no panel holds more than six
    lines: one column per checkpoint x selection rule (top-quota: solid; sampled: dashed), one row
    per expert weight, one colour per scorer (LRM per φ) in every panel. The layer-local error is in
    probe.md, not drawn."""
    plt, sns = pyplot()
    from matplotlib.lines import Line2D

    checkpoints = list(dict.fromkeys(r["checkpoint"] for r in records))
    params = ["gate_up", "down"]
    order = _order(records)
    colour_keys = list(dict.fromkeys(v.split("/")[0] for v in order))
    colours = dict(zip(colour_keys, sns.color_palette("tab10", len(colour_keys))))
    last = max(1, len(colour_keys) - 1)
    width = {k: 1.0 + 4.0 * (last - n) / last for n, k in enumerate(colour_keys)}  # the first drawn widest
    selections = [sel for sel in ("top", "sample") if any(v.endswith("/" + sel) for v in order)]
    cols = [(c, sel) for c in checkpoints for sel in selections]
    fig, axes = plt.subplots(len(params), len(cols), figsize=(4.1 * len(cols), 6.6), squeeze=False)
    drops = sorted({r["drop_ratio"] for r in records})
    sel_name = {"top": "top-quota selection", "sample": "sampled selection (unbiased, 1/π scaled)"}
    for j, (c, sel) in enumerate(cols):
        for i, p in enumerate(params):
            ax = axes[i][j]
            m = layer_means(records, "rel_err", (p,))
            for v in order:
                base, vs = v.split("/")
                xs = [d for d in drops if (c, v, d) in m]
                if vs != sel or not xs:
                    continue
                # the first colours drawn widest: a series that coincides with an earlier one (here the two
                # gradient-only scorers under top-quota, on the trained model) shows as a line in a band
                ax.plot(xs, [m[(c, v, d)] for d in xs], marker="o" if sel == "top" else "x", markersize=3.5,
                        linestyle="-" if sel == "top" else "--", color=colours[base], linewidth=width[base])
            ax.set_title(f"{c} model, {p}_proj\n{sel_name.get(sel, sel)}", fontsize=9)
            ax.set_xlabel("drop ratio")
            ax.set_xticks([d for d in drops if d in (0.0, 0.2, 0.5, 0.7, 0.9)] or drops)
            ax.set_ylim(bottom=0)
            if j == 0:
                ax.set_ylabel("relative error of the expert\nweight gradient ‖G − G_full‖ / ‖G_full‖", fontsize=8)
    handles = [Line2D([], [], color=colours[k], lw=width[k]) for k in colour_keys]
    labels = list(colour_keys)
    handles += [Line2D([], [], color="0.3", ls="-", marker="o", ms=3.5), Line2D([], [], color="0.3", ls="--", marker="x",
                                                                                 ms=3.5)]
    labels += ["solid: top-quota", "dashed: sampled"]
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8, frameon=False,
               bbox_to_anchor=(0.5, -0.01))
    fig.suptitle("Figure A1 (measured, float32, cpu scale; not in the paper): expert weight gradient error against "
                 "the full backward, end to end, mean over MoE layers\ncolour: scorer (LRM per φ); wider lines "
                 "drawn first, so coinciding series show as a thin line inside a band", fontsize=9)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    paths = save_figure(fig, out, "figure_a1")
    plt.close(fig)
    return paths


def write_outputs(out: Path, records: list[dict], meta: dict) -> list[Path]:
    """probe.json, probe.md, probe.tex and figures/figure_a1.png/.pdf in ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    md, tex = tables(records, meta)
    files = [write_json(out / "probe.json", {"meta": meta, "records": records}), write_text(out / "probe.md", md),
             write_text(out / "probe.tex", tex)]
    return files + figure_a1(records, out)


def from_json(path: Path, out: Path | None = None) -> list[Path]:
    """Redraw the tables and the figure of a probe.json (in its folder unless ``out``)."""
    d = read_json(path)
    return write_outputs(Path(out) if out else Path(path).parent, d["records"], d["meta"])
