"""The `lrmoe reproduce` command line."""
from __future__ import annotations

from .driver import reproduce
from .presets import PRESETS

# said after a Ctrl-C that the driver did not see (while the command starts)
AFTER_CTRL_C = "finished runs are kept, started ones resume from their checkpoints; rerun the same command"
DESCRIPTION = "`lrmoe reproduce --preset smoke|cpu|gpu1|paper`: run every experiment of a preset, then the figures."


def register_cli(sub) -> None:
    p = sub.add_parser("reproduce", help="run every experiment of a preset, then `lrmoe figures`",
                       description=DESCRIPTION)
    p.add_argument("--preset", default="cpu", choices=list(PRESETS), help="smoke (CI), cpu (default), gpu1, paper")
    p.add_argument("--out", default=None, help="results folder of this call (default: results/<preset>-local, "
                                               "git-ignored; results/<preset> is the committed reference)")
    p.add_argument("--reference", default=None, metavar="DIR|none",
                   help="results folder the tables are compared with, cell by cell, at the end (compare.md / "
                        ".json in --out); default: the committed results/<preset> when it exists; 'none': no comparison")
    p.add_argument("--only", default=None, metavar="REGEX", help="only runs whose name matches (e.g. 'qwen3-C[0-9]+-lrm')")
    p.add_argument("--dry-run", action="store_true", help="list the runs and their status; run nothing")
    p.add_argument("--data", default=None, help="Alpaca source for every run (file, directory or hub id); "
                                                "default: the preset's shared sample, $LRMOE_ALPACA, or the hub")
    p.add_argument("--jobs", type=int, default=None, help="runs in parallel (default: the preset's)")
    p.add_argument("--no-figures", action="store_true", help="skip the figures/tables step (and the simulation)")
    p.add_argument("--no-simulation", action="store_true",
                   help="skip the cluster simulator's scenarios (T4, T5, F3, F5 in report.md; ~1 CPU-minute)")
    p.set_defaults(func=_cli)


def _cli(args) -> int:
    import sys

    from lrmoe.runs import UsageError

    try:
        return reproduce(args.preset, args.out, args.only, args.dry_run, args.data, args.jobs,
                         figures=not args.no_figures, reference=args.reference,
                         simulate=not args.no_simulation)
    except UsageError as e:  # a bad argument: one line, no traceback
        print(f"lrmoe reproduce: {e}", file=sys.stderr)
        return 2
