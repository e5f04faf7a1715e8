"""The `lrmoe ablate` command line: ``lrmoe ablate GRID [--jobs N] [--only REGEX] [--dry-run]
[--out DIR] [--data SRC]``, and ``lrmoe ablate probe ...`` (the gradient-fidelity probe,
:mod:`lrmoe.ablate.probe`)."""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

DESCRIPTION = ("`lrmoe ablate GRID`: train the runs of an ablation grid (ablations/*.toml; docs/ablations.md), "
               "then its tables (Markdown + LaTeX, paired differences with 95 % intervals) and figures. "
               "`lrmoe ablate probe --out DIR`: the gradient-fidelity probe.")


def _options(p) -> None:
    p.add_argument("--out", default=None, help="results folder (default: results/ablations-local/<grid name>, git-ignored; the committed reference is results/ablations/<grid name>)")
    p.add_argument("--only", default=None, metavar="REGEX", help="only runs whose name matches (e.g. 'C90')")
    p.add_argument("--dry-run", action="store_true", help="list the runs, their baselines and status; run nothing")
    p.add_argument("--data", default=None, help="Alpaca source for every run (default: the preset's)")
    p.add_argument("--jobs", type=int, default=None, help="runs in parallel (default: the grid's)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--no-figures", action="store_true", help="tables and ablation.json only")
    p.add_argument("--tables-from", default=None, metavar="DIR",
                   help="train nothing: the tables and figures from finished runs of the same configs in DIR "
                        "(e.g. results/cpu for ablations/scorers.toml), written to --out")


def register_cli(sub) -> None:
    p = sub.add_parser("ablate", help="run an ablation grid (ablations/*.toml), or the gradient-fidelity probe",
                       description=DESCRIPTION)
    _options(p)
    p.add_argument("grid", metavar="GRID", help="a grid file, a grid name (ablations/NAME.toml), or 'probe'")
    p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    p.set_defaults(func=_cli)


def _cli(args) -> int:
    from lrmoe.runs import UsageError

    if args.grid == "probe":
        return _probe(args.rest)
    later = argparse.ArgumentParser(prog="lrmoe ablate GRID", add_help=False)
    _options(later)
    try:
        more, extra = later.parse_known_args(args.rest)
    except SystemExit:
        return 2
    if extra:
        print(f"lrmoe ablate: unexpected argument(s) {' '.join(extra)}; usage: lrmoe ablate GRID [--jobs N] "
              f"[--only REGEX] [--dry-run] [--out DIR] [--data SRC]", file=sys.stderr)
        return 2
    for k, v in vars(more).items():  # (not `v in (None, False)`: 0 == False, and --jobs 0 must be refused)
        if v is not None and v is not False:
            setattr(args, k, v)
    from .runner import ablate, tables_from

    try:
        if args.tables_from is not None:
            return tables_from(args.grid, args.tables_from, args.out, args.data, figures=not args.no_figures)
        return ablate(args.grid, args.out, args.only, args.dry_run, args.data, args.jobs,
                      progress=not args.no_progress, figures=not args.no_figures)
    except UsageError as e:  # a bad grid or argument: one line, no traceback
        print(f"lrmoe ablate: {e}", file=sys.stderr)
        return 2


def _probe(argv: list[str]) -> int:
    try:
        found = importlib.util.find_spec("lrmoe.ablate.probe") is not None
    except ImportError:
        found = False
    if not found:
        print("lrmoe ablate probe: the gradient-fidelity probe (lrmoe/ablate/probe.py) is not installed in this "
              "checkout", file=sys.stderr)
        return 2
    return int(importlib.import_module("lrmoe.ablate.probe").main(list(argv)) or 0)
