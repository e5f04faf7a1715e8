"""The `lrmoe` command.

Each subcommand lives in its own module, which defines ``register_cli(subparsers)``: it adds its
parser and sets ``func`` (called with the parsed arguments, returning an exit code). Modules are
imported lazily, so a heavy dependency of one command does not slow down the others.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module defining register_cli(subparsers)
COMMANDS = {
    "bench": "lrmoe.bench.cli",
    "train": "lrmoe.train",
    "reproduce": "lrmoe.reproduce",
    "figures": "paper_figures.cli",
    "ablate": "ablations.cli",
    "simulate": "lrmoe.sim.cli",
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="lrmoe", description="LRMoE reproduction kit")
    sub = ap.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")
    wanted = [a for a in argv if not a.startswith("-")][:1]
    for name, module in COMMANDS.items():
        if wanted and wanted[0] != name and wanted[0] in COMMANDS:
            sub.add_parser(name)  # listed in --help; loaded only when chosen
            continue
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name and (module == e.name or module.startswith(e.name + ".")):
                continue  # not part of this checkout yet
            raise
        mod.register_cli(sub)
    return ap


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    if not hasattr(args, "func"):
        raise SystemExit(f"lrmoe {args.command}: not available in this checkout")
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
