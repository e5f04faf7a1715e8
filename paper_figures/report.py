"""``make_all``: every table and figure of a results folder, and ``report.md`` that gathers them
beside the paper's numbers (and says which are not produced yet, and which run folders are
damaged and left out)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

from lrmoe.files import write_text

from .makers import MAKERS, ordered
from .results import Results, paper_numbers
from .tables import check_comparable


def make_all(results_dir, out_dir=None, only: list[str] | None = None,
             warn: Callable[[str], None] | None = None) -> list[Path]:
    """Write every registered table/figure (or those in ``only``) and ``report.md`` of
    ``results_dir`` (a folder, or its :class:`~paper_figures.results.Results`); returns the files. ``warn`` is told of each damaged run folder, left out of the tables and figures (the
    report and every table name them too). Two runs of one table cell raise
    :class:`~paper_figures.results.AmbiguousRuns`, table runs that differ in more than the
    tables' axes :class:`~paper_figures.results.IncomparableRuns` (both before anything is written)."""
    res = results_dir if isinstance(results_dir, Results) else Results.load(results_dir)
    check_comparable(res)
    out = Path(out_dir) if out_dir is not None else res.dir
    for name, why in res.damaged.items():
        if warn is not None:
            warn(f"damaged run {name} is left out of the tables and figures: {why}")
    paper = paper_numbers()
    written, status = [], {}
    for m in ordered(only):
        if m.fn is None:
            status[m.key] = ("not yet produced", [])
            continue
        files = m.fn(res, paper, out)
        if files is None:  # e.g. a simulated table whose simulation has not been run into the folder
            status[m.key] = ("not yet produced", [])
            continue
        written += files
        status[m.key] = ("written", files)
    path = write_text(out / "report.md", _report(res, out, paper, status))
    return written + [path]


def _report(res: Results, out: Path, paper: dict, status: dict) -> str:
    e3 = res.e3_scale()
    lines = [f"# Reproduced tables and figures: preset `{res.preset_name}`", "",
             f"- scale: {res.scale()}" + (" (E1, E2)" if e3 else ""),
             *([f"- scale of E3 (T3, F4): {e3}"] if e3 else []),
             f"- hardware: {res.hardware()}",
             f"- runs: {sum(r.done for r in res.runs.values())} finished of {len(res.runs)} found"
             + (f" ({len((res.manifest or {}).get('runs', []))} in the preset)" if res.manifest else "")]
    if res.damaged:
        lines.append(f"- **left out**: {len(res.damaged)} damaged run folder(s) (repair the file, or move the "
                     f"folder away and rerun the run; until then its cells say \"not run\"):")
        lines += [f"  - `{name}`: {why}" for name, why in res.damaged.items()]
    lines += ["- every value below is **measured** by this kit from the run files unless labelled **paper**", ""]
    for key in status:
        m = MAKERS[key]
        state, files = status[key]
        lines += [f"## {key}: {m.title}", ""]
        if state == "written":
            for f in files:
                rel = Path(os.path.relpath(Path(f).resolve(), Path(out).resolve()))  # resolves from report.md
                if f.suffix == ".md":
                    lines += [_nested(f.read_text().strip()), ""]
                elif f.suffix == ".png":
                    lines += [f"![{key}]({rel.as_posix()})", ""]
        else:
            lines += [f"Not yet produced: needs {m.needs}.", "", f"Paper's numbers for this {m.kind}:", "",
                      *_paper_table(key, paper), ""]
    return "\n".join(lines).rstrip() + "\n"


def _nested(md: str) -> str:
    """A maker's Markdown under its ``## KEY`` section: its own headings two levels deeper (``#`` ->
    ``###``), so that they do not open sections of the report; fenced code is left alone."""
    out, fenced = [], False
    for line in md.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        out.append("##" + line if not fenced and line.startswith("#") else line)
    return "\n".join(out)


def _paper_table(key: str, paper: dict) -> list[str]:
    """The paper's numbers that belong to a table/figure (entries whose ``belongs_to`` lists it) as
    a Markdown table: one row per number, named by its path in ``paper_numbers.json``."""
    rows = []
    for name, entry in paper.items():
        if not (isinstance(entry, dict) and key in entry.get("belongs_to", ())):
            continue
        if entry.get("unit"):
            rows.append([name, "unit", entry["unit"]])
        for path, value in _flatten({k: v for k, v in entry.items() if k not in ("title", "belongs_to", "unit")}):
            rows.append([name, " / ".join(path), value])
    if not rows:
        return ["(none in paper_numbers.json)"]
    out = ["| paper entry | quantity | value |", "|---|---|---|"]
    return out + [f"| {a} | {b} | {c} |" for a, b, c in rows]


def _flatten(d: dict, path: tuple = ()):
    """(key path, value text) of every leaf; lists of numbers are written on one line."""
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _flatten(v, (*path, str(k)))
        elif isinstance(v, list):
            yield (*path, str(k)), ", ".join(json.dumps(x) if not isinstance(x, str) else x for x in v)
        else:
            yield (*path, str(k)), v if isinstance(v, str) else json.dumps(v)
