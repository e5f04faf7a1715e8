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

    from lrmoe.files import CorruptFileError

    from .makers import MAKERS, ordered
    from .report import make_all

    if not Path(args.results).is_dir():
        print(f"lrmoe figures: no results folder {args.results!r}", file=sys.stderr)
        return 2
    only = [k.strip() for k in args.only.split(",")] if args.only else None
    unknown = sorted(set(only or ()) - set(MAKERS))
    if unknown:
        print(f"lrmoe figures: unknown key(s) {', '.join(unknown)} in --only; accepted: {', '.join(sorted(MAKERS))}",
              file=sys.stderr)
        return 2
    try:
        files = make_all(args.results, args.out, only, warn=lambda msg: print(f"lrmoe figures: {msg}", file=sys.stderr))
    except CorruptFileError as e:  # a manifest, or a finished run's metrics, that cannot be read
        print(f"lrmoe figures: {e}", file=sys.stderr)
        return 2
    for f in files:
        print(f)
    missing = [m.key for m in sorted(ordered(only), key=lambda m: m.key) if m.fn is None]
    if missing:
        print(f"not yet produced: {', '.join(missing)} (see report.md)", file=sys.stderr)
    return 0
