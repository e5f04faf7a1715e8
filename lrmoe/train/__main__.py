"""``python -m lrmoe.train [options]``: the same as ``lrmoe train [options]``."""
import argparse
import sys

from .cli import register_cli

ap = argparse.ArgumentParser(prog="python -m lrmoe.train")
register_cli(ap.add_subparsers(dest="command", required=True))
a = ap.parse_args(["train", *sys.argv[1:]])
sys.exit(a.func(a))
