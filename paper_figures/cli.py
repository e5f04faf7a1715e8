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
    from pathlib import Path

    from . import MAKERS, make_all

    if not Path(args.results).is_dir():
        print(f"lrmoe figures: no results folder {args.results!r}", file=sys.stderr)
        return 2
    only = [k.strip() for k in args.only.split(",")] if args.only else None
    files = make_all(args.results, args.out, only)
    for f in files:
        print(f)
    missing = [k for k, m in sorted(MAKERS.items()) if m.fn is None and (not only or k in only)]
    if missing:
        print(f"not yet produced: {', '.join(missing)} (see report.md)", file=sys.stderr)
    return 0
