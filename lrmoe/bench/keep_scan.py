"""Kept-pair landscape: around the exact kept-pair search's answer, which kept-pair counts give a
plan that fits the budget (issue 29, item 2: is a faster search than the bisection possible that is
equal or better in 99 % of cases?).

For every (cell, step) of the planner benchmark where the kept-pair search runs (the same models, EP sizes, budgets,
routings and drifting traces as ``lrmoe bench planners``; LRMoE with drop 0.2 and the exact
searches), the live planner plans the step; where its kept-pair count ``k_b`` (of the microbatch piece
it plans, when it splits) is below the requested count, it is the bisection's answer: the count
fits and ``k_b + 1`` does not. Then
:func:`lrmoe.planning.lrmoe_plan.kept_pairs_fit` decides, as the search's probe does, whether the
plan keeping ``k_b + j * stride`` pairs fits, for every j with ``|j * stride| <= window`` (up to
the requested count).

A row per (cell, step): the highest fitting offset (a plan that fits and keeps that many more pairs
than the exact search's: better under the objective "fits, then more kept pairs, then the lower
slowest rank"), the lowest non-fitting offset, the share of the grid above ``k_b`` that fits and
below it that does not, and whether the fit is monotone on the grid. Deterministic (no timing).

    lrmoe bench keep-scan                          # results/bench/keep_scan.json and .md
    lrmoe bench keep-scan --only 'qwen3.*EP8' --window 500 --stride 5
"""
from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from ..planning.lrmoe_plan import kept_pairs_fit
from ..planning.memory import GIB
from ..planning.plan import split_piece
from ..planning.policies import plan_placement
from ..planning.quota import retained_total
from .common import markdown_table, require_positive
from .planners import EP_SIZES, MODELS, ROUTINGS, cluster_of, dims_of, drifting_trace, trace_seed

POLICY_OPTIONS = {"waterfill": {"drop_ratio": 0.2, "quota_policy": "waterfill"},
                  "proportional": {"drop_ratio": 0.2, "quota_policy": "proportional"}}
PRESSURED_BUDGETS_GIB = (12.0, 6.0)


def scan_step(demand_GE, cluster, dims, budget_bytes, options: dict, window: int, stride: int) -> dict | None:
    """One step's row (module docstring), or None when the plan (of its piece, when it splits) keeps every
    requested pair: the kept-pair search did not run. The grid stops at the requested count."""
    plan = plan_placement("lrmoe", demand_GE, cluster, dims, budget_bytes, **options)
    piece = split_piece(demand_GE, plan.num_splits) if plan.num_splits > 1 else demand_GE
    P = int(piece.sum())
    hi_keep = retained_total(P, options["drop_ratio"])  # the requested count: never more
    k_b = int(plan.backward_quota_GN.sum())  # the planned piece's kept pairs
    if k_b >= hi_keep:
        return None
    offsets = np.arange(-(window // stride), window // stride + 1, dtype=np.int64) * stride
    offsets = offsets[(k_b + offsets >= 1) & (k_b + offsets <= hi_keep)]
    fit = kept_pairs_fit(piece, cluster, dims, budget_bytes, k_b + offsets, **options)
    if not fit[offsets == 0].all():
        raise RuntimeError(f"the planner's kept-pair count {k_b} does not fit in its own probe: a planner bug")
    above, below = offsets > 0, offsets < 0
    fit_above = offsets[above & fit]
    nofit_below = offsets[below & ~fit]
    highest = int(fit_above.max()) if fit_above.size else 0
    return {"pairs": P, "splits": plan.num_splits, "fallback": plan.fallback, "kept": k_b,
            "kept_fraction": k_b / P,
            "highest_fit_offset": highest, "highest_fit_pct": 100.0 * highest / P,
            "lowest_nofit_offset": int(nofit_below.min()) if nofit_below.size else None,
            "fit_above_share": float(fit[above].mean()) if above.any() else None,
            "nofit_below_share": float((~fit[below]).mean()) if below.any() else None,
            "monotone": not fit_above.size and not nofit_below.size,
            "grid": "".join("1" if f else "0" for f in fit)}


def summary_rows(rows: list[dict]) -> list[dict]:
    """Per (model, EP): cases, monotone on the grid, cases with a fitting count above k_b, the
    median and largest highest fitting offset."""
    out = []
    for key in sorted({(r["model"], r["ep"]) for r in rows}):
        rs = [r for r in rows if (r["model"], r["ep"]) == key]
        out.append({"model": key[0], "ep": key[1], "cases": len(rs), "monotone": sum(r["monotone"] for r in rs),
                    "better_above": sum(r["highest_fit_offset"] > 0 for r in rs),
                    "median_offset": statistics.median(r["highest_fit_offset"] for r in rs),
                    "max_offset": max(r["highest_fit_offset"] for r in rs),
                    "median_pct": statistics.median(r["highest_fit_pct"] for r in rs),
                    "max_pct": max(r["highest_fit_pct"] for r in rs)})
    return out


SUMMARY_COLUMNS = [("model", "model", ""), ("ep", "EP", ""), ("cases", "pressured (cell, step)", "d"),
                   ("monotone", "fit monotone on the grid", "d"), ("better_above", "a fitting count above k_b", "d"),
                   ("median_offset", "highest fitting offset, median (pairs)", ".0f"),
                   ("max_offset", "largest (pairs)", "d"), ("median_pct", "median, % of pairs", ".3f"),
                   ("max_pct", "largest, % of pairs", ".3f")]
ROW_COLUMNS = [("cell", "cell", ""), ("step", "step", "d"), ("splits", "splits", "d"), ("kept", "k_b", "d"),
               ("highest_fit_offset", "highest fitting offset", "d"),
               ("lowest_nofit_offset", "lowest non-fitting offset", ""),
               ("fit_above_share", "fits above k_b", ".2f"), ("nofit_below_share", "fails below k_b", ".2f")]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="lrmoe bench keep-scan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--window", type=int, default=5000, help="pairs either side of k_b (default 5000)")
    ap.add_argument("--stride", type=int, default=25, help="grid step in pairs (default 25)")
    ap.add_argument("--steps", type=int, default=5, help="steps of each drifting trace (default 5, as the benchmark)")
    ap.add_argument("--policy", choices=sorted(POLICY_OPTIONS), default="waterfill", help="LRMoE's quota policy")
    ap.add_argument("--only", default=None, metavar="REGEX",
                    help="cells whose 'model/EP/budgetGiB/routing' name matches (re.search)")
    ap.add_argument("--tokens", type=int, default=32768, help="tokens per rank (default 32768; top-k pairs each)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("results/bench"), help="output folder for keep_scan.json")
    args = ap.parse_args(argv)
    require_positive(ap, args, "window", "stride", "steps", "tokens")
    try:
        only = re.compile(args.only) if args.only else None
    except re.error as e:
        ap.error(f"--only is not a valid regular expression ({e}): {args.only!r}")
    cells = [(m, ep, b, rt) for m in MODELS for ep in EP_SIZES for b in PRESSURED_BUDGETS_GIB for rt in ROUTINGS
             if only is None or only.search(f"{m}/{ep}/{b:g}GiB/{rt}")]
    if not cells:
        ap.error(f"--only {args.only!r} matches no cell (names look like 'qwen3-30b-a3b/EP8/6GiB/lognormal')")
    options = POLICY_OPTIONS[args.policy]
    rows, t0 = [], time.perf_counter()
    for i, (m, ep, b, rt) in enumerate(cells):
        dims, cluster = dims_of(m), cluster_of(ep, MODELS[m][2])
        name = f"{m}/{ep}/{b:g}GiB/{rt}"
        print(f"[{i + 1}/{len(cells)}] {name} ...", end=" ", flush=True, file=sys.stderr)
        trace = drifting_trace(rt, dims.num_experts, cluster.num_ranks, args.tokens * dims.top_k, args.steps,
                               trace_seed(args.seed, m, ep, rt))
        found = 0
        for step, d in enumerate(trace):
            row = scan_step(d, cluster, dims, b * GIB, options, args.window, args.stride)
            if row is not None:
                rows.append({"cell": name, "model": m, "ep": ep, "budget_gib": b, "routing": rt, "step": step, **row})
                found += 1
        print(f"{found} pressured steps", file=sys.stderr, flush=True)
    elapsed = time.perf_counter() - t0

    from ..environment import environment
    from ..files import write_json, write_text

    summary = summary_rows(rows)
    n = len(rows)
    headline = (f"{n} pressured (cell, step) pairs, grid +-{args.window} pairs by {args.stride}: the fit is monotone "
                f"on the grid in {sum(r['monotone'] for r in rows)}; a count above the exact search's answer fits in "
                f"{sum(r['highest_fit_offset'] > 0 for r in rows)} ({elapsed:.0f} s)")
    payload = {"benchmark": "keep-scan",
               "options": {"window": args.window, "stride": args.stride, "steps": args.steps, "policy": args.policy,
                           "only": args.only, "tokens_per_rank": args.tokens, "seed": args.seed,
                           "budgets_gib": list(PRESSURED_BUDGETS_GIB), "planner_options": options},
               "environment": environment(), "elapsed_s": elapsed, "summary": summary, "headline": headline,
               "rows": rows}
    path = write_json(args.out / "keep_scan.json", payload)
    table = markdown_table(summary, SUMMARY_COLUMNS)
    write_text(args.out / "keep_scan.md",
               f"# `lrmoe bench keep-scan {' '.join(argv if argv is not None else sys.argv[1:])}` (revision "
               f"{payload['environment']['git']}; see docs/benchmarks.md)\n\n{headline}\n\n{table}\n\n"
               + markdown_table(rows, ROW_COLUMNS) + "\n")
    print(table)
    print(headline)
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
