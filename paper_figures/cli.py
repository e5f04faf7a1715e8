"""`lrmoe figures --results DIR --out DIR`: tables (Markdown + LaTeX) and figures (PNG + PDF) from results files."""
from __future__ import annotations

import sys


def register_cli(sub) -> None:
    p = sub.add_parser("figures", help="tables and figures from a results folder (measured beside the paper)",
                       description=__doc__)
    p.add_argument("--results", default="results/cpu", help="results folder of a preset (default: results/cpu)")
    p.add_argument("--out", default=None, help="output folder (default: the results folder); writes tables/, "
                                               "figures/ and report.md")
    p.add_argument("--only", default=None, help="comma-separated keys, e.g. T1,F2")
    p.set_defaults(func=_cli)


def _cli(args) -> int:
    """Exit status 0; 2 for a bad argument, a results folder that cannot be read (a corrupt
    manifest, two runs of one table cell) or damaged run folders (the tables and report are still
    written, without them, and each is named)."""
    from pathlib import Path

    from lrmoe.files import CorruptFileError

    from .makers import MAKERS, ordered
    from .report import make_all
    from .results import AmbiguousRuns, Results

    if not Path(args.results).is_dir():
        what = "is not a folder" if Path(args.results).exists() else "does not exist"
        print(f"lrmoe figures: no results folder {args.results!r} (it {what}); give --results a folder of run "
              f"folders, e.g. results/cpu", file=sys.stderr)
        return 2
    only = [k.strip() for k in args.only.split(",") if k.strip()] if args.only is not None else None
    unknown = sorted(set(only or ()) - set(MAKERS))
    if unknown or only == []:
        print(f"lrmoe figures: unknown key(s) {', '.join(unknown) or repr(args.only)} in --only; accepted: "
              f"{', '.join(sorted(MAKERS))}", file=sys.stderr)
        return 2
    try:
        res = Results.load(args.results)
        if not res.runs and not res.damaged and not any((Path(args.results) / d).is_dir() for d in ("sim", "probe")):
            print(f"lrmoe figures: no run folders in {args.results!r} (a run folder holds a summary.json; nor sim/ or "
                  f"probe/ results); nothing to tabulate. Give --results the folder `lrmoe reproduce` wrote, e.g. "
                  f"results/cpu (the reference) or results/cpu-local (your rerun)", file=sys.stderr)
            return 2
        files = make_all(res, args.out, only, warn=lambda msg: print(f"lrmoe figures: {msg}", file=sys.stderr))
    except (CorruptFileError, AmbiguousRuns) as e:  # a manifest that cannot be read; two runs of one cell
        print(f"lrmoe figures: {e}", file=sys.stderr)
        return 2
    for f in files:
        print(f)
    missing = [m.key for m in sorted(ordered(only), key=lambda m: m.key) if m.fn is None]
    if missing:
        print(f"not yet produced: {', '.join(missing)} (see report.md)", file=sys.stderr)
    if res.damaged:
        print(f"lrmoe figures: {len(res.damaged)} damaged run folder(s) left out ({', '.join(res.damaged)}; why: above and in "
              f"report.md); repair them, or move them away and rerun those runs", file=sys.stderr)
        return 2
    return 0
