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

from lrmoe.interrupts import run_command

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


# After Ctrl-C anywhere in a command (its import included): what is kept and how to go on, said in
# one line, exit status 130 (lrmoe.interrupts.run_command). Commands that know more say it
# themselves first: `reproduce` and `ablate` the step and the runs kept, `train` the run folder.
AFTER_CTRL_C = {
    "train": "the run folder keeps its last checkpoint; rerun the same command to resume from it",
    "reproduce": "finished runs are kept, started ones resume from their checkpoints; rerun the same command",
    "ablate": "finished runs are kept, started ones resume from their checkpoints; rerun the same command",
    "simulate": "the scenarios it finished are written; rerun the same command to simulate again",
    "figures": "rerun the same command to make the tables and figures again",
    "bench": "the benchmark's results are written when it ends; rerun the same command to measure again",
}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    name = next((a for a in argv if not a.startswith("-")), None)
    name = name if name in COMMANDS else None

    def run() -> int:
        args = build_parser(argv).parse_args(argv)
        if not hasattr(args, "func"):
            raise SystemExit(f"lrmoe {args.command}: not available in this checkout")
        return int(args.func(args) or 0)

    return run_command(run, f"lrmoe {name}" if name else "lrmoe",
                       AFTER_CTRL_C.get(name, "rerun the same command to start again"))


if __name__ == "__main__":
    sys.exit(main())
