"""The `lrmoe` command.

Each subcommand lives in its own module, which defines ``register_cli(subparsers)``: it adds its
parser and sets ``func`` (called with the parsed arguments, returning an exit code). Modules are
imported lazily, so a heavy dependency of one command does not slow down the others.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

# subcommand -> module defining register_cli(subparsers)
COMMANDS = {
    "bench": "lrmoe.bench.cli",
    "train": "lrmoe.train.cli",
    "estimate-memory": "lrmoe.reproduce.estimate_cli",
    "export-hf": "lrmoe.train.export",
    "reproduce": "lrmoe.reproduce",
    "ablate": "lrmoe.ablate.cli",
    "figures": "paper_figures.cli",
    "plot": "paper_figures.plot",
    "simulate": "lrmoe.sim.cli",
}


def _available(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # the parent package is not part of this checkout
        return False


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="lrmoe", description="LRMoE reproduction kit")
    commands = {name: module for name, module in COMMANDS.items() if _available(module)}
    sub = ap.add_subparsers(dest="command", required=True, metavar="{" + ",".join(commands) + "}")
    wanted = [a for a in argv if not a.startswith("-")][:1]
    for name, module in commands.items():
        if wanted and wanted[0] != name and wanted[0] in commands:
            sub.add_parser(name)  # listed in --help; loaded only when chosen
            continue
        importlib.import_module(module).register_cli(sub)
    return ap


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    if not hasattr(args, "func"):
        raise SystemExit(f"lrmoe {args.command}: not available in this checkout")
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
