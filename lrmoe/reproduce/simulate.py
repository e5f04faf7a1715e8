"""The simulated half of `lrmoe reproduce`: the cluster simulator's paper-scale scenarios (T4, T5,
F3, F5) into ``<out>/sim/<scenario>/``, through the `lrmoe simulate` command itself (its
``simulation.json``, tables and figures; every number labelled simulated, with its hardware model
and trace). The report (:mod:`paper_figures.makers`) then puts them beside the measured tables."""
from __future__ import annotations

import argparse
import contextlib
import io
import time
from pathlib import Path

SCENARIOS = "all"  # the paper set (T4/T5 of both models, F3 pressure) and the F5 sweeps
SUBDIR = "sim"


def simulate_into(out) -> tuple[int, str, float]:
    """Run ``lrmoe simulate --scenario all --out <out>/sim``; returns (exit status, its stderr and
    stdout, seconds). The command prints every table on stdout; that goes to ``sim/simulate.log``
    with its stderr, so `reproduce` keeps its own output short."""
    from lrmoe.sim.cli import register_cli

    ap = argparse.ArgumentParser(prog="lrmoe")
    register_cli(ap.add_subparsers(dest="command", required=True))
    d = Path(out) / SUBDIR
    args = ap.parse_args(["simulate", "--scenario", SCENARIOS, "--out", str(d)])
    buf, t0 = io.StringIO(), time.perf_counter()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        rc = int(args.func(args) or 0)
    d.mkdir(parents=True, exist_ok=True)
    from lrmoe.files import write_text

    write_text(d / "simulate.log", buf.getvalue())
    return rc, buf.getvalue(), time.perf_counter() - t0
