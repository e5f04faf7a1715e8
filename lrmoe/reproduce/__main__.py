"""``python -m lrmoe.reproduce [options]``: the same as ``lrmoe reproduce [options]``."""
import argparse
import sys

from lrmoe.interrupts import run_command

from .cli import AFTER_CTRL_C, register_cli

ap = argparse.ArgumentParser(prog="python -m lrmoe.reproduce")
register_cli(ap.add_subparsers(dest="command", required=True))
a = ap.parse_args(["reproduce", *sys.argv[1:]])
sys.exit(run_command(lambda: a.func(a), "lrmoe reproduce", AFTER_CTRL_C))
