"""``python -m lrmoe.reproduce [options]``: the same as ``lrmoe reproduce [options]``."""
import argparse
import sys

from .cli import register_cli

ap = argparse.ArgumentParser(prog="python -m lrmoe.reproduce")
register_cli(ap.add_subparsers(dest="command", required=True))
a = ap.parse_args(["reproduce", *sys.argv[1:]])
sys.exit(a.func(a))
