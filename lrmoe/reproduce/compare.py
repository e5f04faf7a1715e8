"""A rerun check: this machine's tables beside the committed reference's, cell by cell
(``compare.md`` and ``compare.json``; `lrmoe reproduce` prints the Markdown last).

It answers one question: does this rerun reproduce the reference within the reference's seed
spread? It is **not** a test of the paper's claims: those are judged only by the README's verdict
(:mod:`paper_figures.verdict`), under the statistics convention of docs/statistics.md. The paper's
numbers are shown beside each cell for orientation only, with no agrees/differs status.

The reference is a results folder of the same preset, by default the committed
``results/<preset>/``. Every T1 cell (PPL and ΔPPL vs C0 per model family and drop level) and T2
cell (ΔPPL over the final 10 % and Δloss over all steps, per family and scorer) of the rerun is
judged against the reference's:

* ``identical``: the same float (same machine type, threads, revision and library versions);
* ``agrees``: differs by no more than the reference's **seed spread** of that quantity;
* ``differs``: by more than that;
* ``unjudged``: the reference has no seed spread for it (a preset with one seed);
* ``missing``: the cell is "not run" in the rerun or in the reference.

The seed spread of a quantity is the range (max − min) of its per-seed values over the seeds the
reference has run: T2 cells over their own seeds; a T1 level with one seed borrows the spread of
the nearest quantity with several seeds (PPL: C0's PPL over its seeds; ΔPPL: the ΔPPL of the E2
level, C20 with the LRM scorer), and says so (``spread_from``). This is a reproducibility
tolerance (is a moved cell within what changing the seed moves it?), not a statistical test.

Besides the cells: per run present in both folders, whether the loss curves are bit-identical or
the first step where they differ, and the environment fields in which the two folders' runs differ
(CPU, threads, torch, revision, ...), which says why cells may move (:data:`WHY`)."""
from __future__ import annotations

from pathlib import Path

from lrmoe.files import write_json, write_text
from paper_figures import FAMILY_NAMES, Results, level_name, paper_numbers
from paper_figures.tables import LEVELS, SCORER_NAMES, check_comparable, t1_data, t2_data

FORMAT = "lrmoe-compare/2"  # 2: no "vs_paper" status; the paper's value is shown only
STATUSES = ("identical", "agrees", "differs", "unjudged", "missing")
ENV_KEYS = ("cpu_model", "cpu_count", "threads", "torch", "git", "python", "transformers", "numpy", "platform",
            "device", "gpu")
SCOPE = ("This is a **rerun check**: does this machine reproduce the committed reference within the reference's "
         "seed spread? It is not a test of the paper's claims; those are judged only by the README's verdict "
         "(paper_figures/verdict.py) under docs/statistics.md. The paper's values are shown beside the cells for "
         "orientation, with no agrees/differs status.")
SPREAD_RULE = ("a cell agrees when it differs from the reference by no more than the reference's seed spread of "
               "that quantity: the range (max - min) of its per-seed values over the seeds the reference ran (a T1 "
               "level with one seed borrows the spread of C0's PPL, or of the C20 LRM ΔPPL, over their seeds)")
WHY = ("Runs are deterministic for a fixed machine type, thread count per run, kit revision and library versions "
       "(torch, transformers): a rerun there gives bit-identical metrics and tables. On another CPU (e.g. AMD EPYC "
       "instead of Intel Xeon) the BLAS and oneDNN kernels take other code paths (vector widths, blocking) and add "
       "floating-point numbers in another order; the loss then differs in its last bits after a few steps, "
       "training amplifies the difference, and final cells move by amounts of the order of the seed spread. The "
       "same happens with another thread count, torch version or revision. A cell that differs by much more than "
       "the seed spread points to something else: compare the environment differences listed above and the "
       "configs in manifest.json.")


def _spread(values: list[float]) -> float | None:
    return (max(values) - min(values)) if len(values) >= 2 else None


def _all_seeds(res: Results) -> list[int]:
    return sorted({*res.seeds("e1_seeds"), *res.seeds("e2_seeds", default=())})


def _per_seed(res: Results, family: str, drop: float, delta: bool) -> list[float]:
    """PPL (or ΔPPL vs the C0 run of the same seed) of the LRM run at ``drop``, one per seed run."""
    out = []
    for s in _all_seeds(res):
        r = res.find(family, drop, "lrm", s)
        v = r.ppl_window_mean() if r is not None else None
        if v is not None and delta:
            c0 = res.find(family, 0.0, None, s)
            b = c0.ppl_window_mean() if c0 is not None else None
            v = None if b is None else v - b
        if v is not None:
            out.append(v)
    return out


def _t1_spreads(ref: Results, family: str, drop: float) -> dict:
    """{"PPL": (spread, from), "ΔPPL vs C0": (spread, from)} of one T1 row, from the reference."""
    e2 = float(ref.preset.get("e2_drop", 0.2))
    out = {}
    for qty, delta, fallback in (("PPL", False, 0.0), ("ΔPPL vs C0", True, e2)):
        vals = _per_seed(ref, family, drop, delta)
        if len(vals) >= 2:
            out[qty] = (_spread(vals), f"{len(vals)} seeds")
        else:
            fb = _per_seed(ref, family, fallback, delta)
            what = "C0's PPL" if not delta else f"{level_name(fallback)} LRM ΔPPL"
            out[qty] = (_spread(fb), f"{what}, {len(fb)} seeds; {level_name(drop)} has {len(vals)}")
    return out


def judge(value, other, spread) -> str:
    """The status of ``value`` against ``other`` (None: missing) given the seed ``spread``."""
    if value is None or other is None:
        return "missing"
    if value == other:
        return "identical"
    if spread is None:
        return "unjudged"
    return "agrees" if abs(value - other) <= spread else "differs"


def _cell(table, family, row, qty, user, refv, spread, spread_from, paper=None, note=""):
    """One cell: judged against the reference only; ``paper`` is the paper's value, shown for
    orientation and never judged (the paper's claims are judged by :mod:`paper_figures.verdict`)."""
    c = {"table": table, "family": family, "row": row, "quantity": qty, "user": user, "reference": refv,
         "difference": (user - refv) if user is not None and refv is not None else None,
         "spread": spread, "spread_from": spread_from, "vs_reference": judge(user, refv, spread), "paper": paper}
    if note:
        c["note"] = note
    return c


def _t1_cells(user: Results, ref: Results, paper: dict) -> list[dict]:
    pt = paper["T1"]
    pv = pt["values"]
    mine = {(r["family"], r["level"]): r for r in t1_data(user)}
    theirs = {(r["family"], r["level"]): r for r in t1_data(ref)}
    cells = []
    for fam in dict.fromkeys([*ref.families(), *user.families()]):
        for d in LEVELS:
            lv = level_name(d)
            u, r = mine.get((fam, lv), {}), theirs.get((fam, lv), {})
            sp = _t1_spreads(ref, fam, d)
            cells.append(_cell("T1", fam, lv, "PPL", u.get("ppl"), r.get("ppl"), *sp["PPL"],
                               paper=pv.get(lv) if fam == pt["model"] else None,
                               note="absolute PPL: other models, tokenizer and data than the paper's"
                               if fam == pt["model"] else ""))
            if d == 0.0:
                continue  # ΔPPL of C0 is 0 by definition
            p_delta = pv[lv] - pv["C0"] if fam == pt["model"] else None
            cells.append(_cell("T1", fam, lv, "ΔPPL vs C0", u.get("delta"), r.get("delta"), *sp["ΔPPL vs C0"],
                               paper=p_delta))
    return cells


def _t2_cells(user: Results, ref: Results, paper: dict) -> list[dict]:
    pv = paper["T2"]["values"]
    mine = {(r["family"], r["scorer"]): r for r in t2_data(user)}
    theirs = {(r["family"], r["scorer"]): r for r in t2_data(ref)}
    cells = []
    for key in dict.fromkeys([*theirs, *mine]):
        fam, sc = key
        u, r = mine.get(key, {}), theirs.get(key, {})
        n = len(r.get("values", []))
        cells.append(_cell("T2", fam, SCORER_NAMES.get(sc, sc), "ΔPPL vs C0 (final 10 %)", u.get("delta"),
                           r.get("delta"), _spread(r.get("values", [])), f"{n} seeds",
                           paper=pv.get(fam, {}).get(sc),
                           note="the paper's averaging window for T2 is not stated"))
        n = len(r.get("values_all", []))
        cells.append(_cell("T2", fam, SCORER_NAMES.get(sc, sc), "Δloss vs C0 (all steps, nats)",
                           u.get("loss_gap_all"), r.get("loss_gap_all"), _spread(r.get("values_all", [])),
                           f"{n} seeds"))
    return cells


def _runs(user: Results, ref: Results) -> list[dict]:
    """Per run finished in both folders: bit-identical loss curves, or the first step they differ."""
    out = []
    for name in sorted(set(user.runs) & set(ref.runs)):
        a, b = user.runs[name], ref.runs[name]
        if not (a.done and b.done):
            continue
        la = {r["step"]: r.get("loss") for r in a.rows}
        lb = {r["step"]: r.get("loss") for r in b.rows}
        first = next((s for s in sorted(set(la) | set(lb)) if la.get(s) != lb.get(s)), None)
        entry = {"run": name, "identical": first is None}
        if first is not None:
            entry.update(first_differing_step=first, loss=la.get(first), reference_loss=lb.get(first),
                         ppl_final_10pct=a.ppl_window_mean(), reference_ppl_final_10pct=b.ppl_window_mean())
        out.append(entry)
    return out


def _environment(res: Results) -> dict:
    env = next((r.summary.get("environment", {}) for r in sorted(res.runs.values(), key=lambda r: r.name)
                if r.done), {})
    return {k: env.get(k) for k in ENV_KEYS if k in env}


def compare(user_dir, reference_dir) -> dict:
    """Every T1/T2 cell of ``user_dir`` judged against ``reference_dir`` (the paper's value beside,
    not judged; module docstring); a JSON-ready dict. Raises what
    :meth:`paper_figures.Results.load` raises (a corrupt manifest)
    and :class:`paper_figures.AmbiguousRuns` (or its :class:`~paper_figures.IncomparableRuns`)."""
    user, ref = Results.load(user_dir), Results.load(reference_dir)
    for res in (user, ref):
        check_comparable(res)
    paper = paper_numbers()
    cells = _t1_cells(user, ref, paper) + _t2_cells(user, ref, paper)
    eu, er = _environment(user), _environment(ref)
    env_diff = {k: {"user": eu.get(k), "reference": er.get(k)} for k in dict.fromkeys([*er, *eu])
                if eu.get(k) != er.get(k)}
    summary = {"vs_reference": {s: sum(c["vs_reference"] == s for c in cells) for s in STATUSES
                                if any(c["vs_reference"] == s for c in cells)}}
    return {"format": FORMAT, "user": {"dir": str(user.dir), "preset": user.preset_name, "hardware": user.hardware(),
                                       "machine": (user.manifest or {}).get("machine"), "environment": eu},
            "reference": {"dir": str(ref.dir), "preset": ref.preset_name, "hardware": ref.hardware(),
                          "machine": (ref.manifest or {}).get("machine"), "environment": er},
            "environment_differences": env_diff, "scope": SCOPE, "rule": SPREAD_RULE, "why": WHY, "summary": summary,
            "cells": cells, "runs": _runs(user, ref),
            "damaged": {"user": dict(user.damaged), "reference": dict(ref.damaged)}}


# ----------------------------------------------------------------------------- Markdown
def _num(v, sign=False) -> str:
    if v is None:
        return "—"
    if v != 0 and abs(v) < 1e-5:
        return f"{v:+.1e}" if sign else f"{v:.1e}"
    return f"{v:+.6f}" if sign else f"{v:.6f}"


def _paper(c: dict, sign: bool) -> str:
    """The paper's value of a cell, for orientation only (no status)."""
    if c.get("paper") is None:
        return "—"
    return _num(c["paper"], sign) + (" (absolute PPL: other models and data)" if c["quantity"] == "PPL" else "")


def render_markdown(result: dict) -> str:
    u, r = result["user"], result["reference"]
    lines = [f"# Rerun check: this rerun vs the committed reference (preset `{u['preset']}`)", "",
             SCOPE, "",
             f"- this rerun: `{u['dir']}/`, {u['hardware']}" + (f", revision {u['environment']['git']}"
                                                                 if u["environment"].get("git") else ""),
             f"- reference: `{r['dir']}/`, {r['hardware']}" + (f", revision {r['environment']['git']}"
                                                                if r["environment"].get("git") else "")]
    if result["environment_differences"]:
        lines.append("- environment differences (first finished run of each folder): " + "; ".join(
            f"{k}: {v['user']!r} here, {v['reference']!r} in the reference"
            for k, v in result["environment_differences"].items()))
    else:
        lines.append("- environment: the same CPU, threads, library versions and revision")
    runs = result["runs"]
    same = [x for x in runs if x["identical"]]
    lines.append(f"- loss curves: {len(same)} of {len(runs)} runs present in both folders are bit-identical to the "
                 f"reference")
    diff = [x for x in runs if not x["identical"]]
    if diff:
        first = min(diff, key=lambda x: x["first_differing_step"])
        lines.append(f"  (the others first differ at steps {min(x['first_differing_step'] for x in diff)}-"
                     f"{max(x['first_differing_step'] for x in diff)}; e.g. `{first['run']}` at step "
                     f"{first['first_differing_step']}: loss {first['loss']!r} here, {first['reference_loss']!r} "
                     f"in the reference)")
    for side, what in (("user", "this rerun"), ("reference", "the reference")):
        if result["damaged"][side]:
            lines.append(f"- damaged run folders in {what} (their cells are missing): "
                         + ", ".join(f"`{n}`" for n in result["damaged"][side]))
    s = result["summary"]
    lines += ["", "**Summary.** vs the reference: " + ", ".join(f"{n} {k}" for k, n in s["vs_reference"].items())
              + ".", "",
              "| Table | Model | Row | Quantity | this rerun | reference | difference | seed spread (reference) | "
              "vs reference | paper's value (for orientation; not judged) |", "|---" * 10 + "|"]
    for c in result["cells"]:
        sign = c["quantity"] != "PPL"
        lines.append(f"| {c['table']} | {FAMILY_NAMES.get(c['family'], c['family'])} | {c['row']} | {c['quantity']} | "
                     f"{_num(c['user'], sign)} | {_num(c['reference'], sign)} | {_num(c['difference'], True)} | "
                     f"{_num(c['spread'])} ({c['spread_from']}) | **{c['vs_reference']}** | "
                     f"{_paper(c, sign)} |")
    off = [c for c in result["cells"] if c["vs_reference"] == "differs"]
    lines += [""]
    if off:
        lines += ["**Cells outside the reference's seed spread:** " + "; ".join(
            f"{c['table']} {FAMILY_NAMES.get(c['family'], c['family'])} {c['row']} {c['quantity']} "
            f"({_num(c['difference'], True)}, spread {_num(c['spread'])})" for c in off) + ".", ""]
    lines += [f"**How cells are judged.** Against the reference only: {SPREAD_RULE}. This is a reproducibility "
              f"tolerance, not a statistical test. The paper's column is printed for orientation and judged by "
              f"nothing here: its values come from 10⁴× larger models trained 50× longer (absolute PPL from other "
              f"models, tokenizer and data; the T2 values' averaging window is not stated). Whether the paper's "
              f"claims hold is decided only by the README's verdict (paper_figures/verdict.py), over seeds with "
              f"the paired t intervals and Holm's correction of docs/statistics.md.", "",
              f"**Why cells can differ.** {WHY}", ""]
    return "\n".join(lines)


def write_comparison(result: dict, out) -> list[Path]:
    """``<out>/compare.md`` and ``<out>/compare.json`` (atomic writes); returns both paths."""
    out = Path(out)
    return [write_text(out / "compare.md", render_markdown(result)), write_json(out / "compare.json", result)]


__all__ = ["FORMAT", "SCOPE", "SPREAD_RULE", "STATUSES", "WHY", "compare", "judge", "render_markdown",
           "write_comparison"]
