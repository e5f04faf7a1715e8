"""`lrmoe bench <target> [options]`: benchmarks that print a table and write JSON."""
from __future__ import annotations

TARGETS = {"layer": "lrmoe.bench.layer", "planners": "lrmoe.bench.planners", "simulator": "lrmoe.bench.simulator",
           "keep-scan": "lrmoe.bench.keep_scan", "planner-check": "lrmoe.bench.planner_check"}


def register_cli(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks (print a table, write JSON)", add_help=False,
                       description="Benchmarks that print a table and write JSON. `lrmoe bench <target> --help` "
                                   "lists a target's options; other benchmarks are scripts in scripts/ "
                                   "(docs/benchmarks.md).")
    p.add_argument("-h", "--help", action="help", help="show this help message and exit")
    p.add_argument("target", choices=sorted(TARGETS),
                   help="what to benchmark; `lrmoe bench <target> --help` for options")
    p.add_argument("rest", nargs="...", help="options of the benchmark")
    p.set_defaults(func=run)


def run(args) -> int:
    import importlib

    importlib.import_module(TARGETS[args.target]).main(args.rest)
    return 0
