"""The `lrmoe` command. Subcommands: bench (layer; more as the kit grows)."""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="lrmoe", description="LRMoE reproduction kit")
    sub = ap.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="benchmarks (print a table, write JSON)", add_help=False)
    bench.add_argument("target", choices=["layer"], help="what to benchmark")
    args, rest = ap.parse_known_args(argv)
    if args.command == "bench":
        if args.target == "layer":
            from .bench.layer import main as bench_layer

            bench_layer(rest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
