"""Fresh-seed check of the compiled planners against the frozen reference (issue 29, item 1).

The test suite compares the live planners (:mod:`lrmoe.planning.policies`) with the frozen reference
(:mod:`lrmoe.planning.reference`) on fixed seeds; this draws new cases from ``--seed``, as many as
asked, so a change to a planner can be checked on inputs nobody chose. Every case draws a cluster
(2-16 ranks, 1-4 experts per rank, 1-3 replica slots, one or several fast domains), a model's
sizes, a demand of one of five kinds (uniform, one hot expert, one hot rank, log-normal with empty
experts, a single routed pair) and one of the built-in policies with its options; it is planned
unpressured, at two tight budgets and at a hopeless one (fractions of the reference's unpressured
peak), three steps each (SYMI plans from the previous step's popularity).

Each live plan is compared with the reference's field by field. A plan that differs is judged in
the decided order of plan quality: it fits the budget where the other does not, then fewer forward
drops, then more kept backward pairs, then the lower slowest rank (forward rows + 2 x kept rows);
the first criterion on which the two differ decides (:func:`verdict`). Where they differ in none,
they are "as good". LRMoE's unpressured threshold is searched from the domain floor and its plan is
kept when it fits (docs/placement.md): those plans may differ, and the check counts them.

    lrmoe bench planner-check                       # 2,000 cases from seed 0: results/bench/planner_check.json
    lrmoe bench planner-check --cases 500 --seed 7 --policies lrmoe,lrmoe_prop --strict
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

from ..planning import Cluster, ModelDims
from ..planning.plan import replace_plan
from ..planning.policies import plan_placement
from ..planning.reference import reference_plan
from .common import markdown_table, require_positive

# name -> (policy, options): every built-in policy, LRMoE's quota policies and options
CASES = {"fixed": ("fixed", {}), "fixed_cf": ("fixed", {"capacity_factor": 1.0}),
         "symi": ("symi", {}), "symi_dropless": ("symi", {"capacity_factor": None}),
         "ultraep": ("ultraep", {"min_tokens": 4}), "ultraep_greedy": ("ultraep_greedy", {}),
         "lrmoe": ("lrmoe", {"drop_ratio": 0.2}),
         "lrmoe_prop": ("lrmoe", {"drop_ratio": 0.2, "quota_policy": "proportional"}),
         "lrmoe_d0": ("lrmoe", {"drop_ratio": 0.0}),
         "lrmoe_min_keep": ("lrmoe", {"drop_ratio": 0.5, "quota_options": {"min_keep": 3}}),
         "lrmoe_r1": ("lrmoe", {"drop_ratio": 0.3, "replica_slots": 1, "min_rows": 5})}
KINDS = ("uniform", "hot_expert", "hot_rank", "lognormal_empty", "one_pair")
STEPS = 3
# info the live LRMoE planner adds and the reference (exact searches only) lacks, at its exact value
LIVE_ONLY_INFO = {"search_tolerance": 0.0}
# the decided order of plan quality: (criterion, key; larger is better)
ORDER = (("over budget where the other fits", lambda q: q["fits"]),
         ("forward drops", lambda q: -q["dropped"]),
         ("kept pairs", lambda q: q["kept"]),
         ("slowest rank's cost", lambda q: -q["cost"]))


def quality(plan) -> dict:
    """What the order compares (and what a report shows) of a plan."""
    return {"cost": float(plan.cost_G(2.0).max(initial=0.0)), "peak": int(plan.memory.peak), "fits": bool(plan.fits),
            "kept": int(plan.backward_quota_GN.sum() * plan.num_splits),
            "dropped": int(plan.dropped_GE.sum() * plan.num_splits), "replicas": int(plan.num_replicas_G.sum()),
            "fallback": plan.fallback}


def differences(live, ref) -> list[str]:
    """Names of the plan fields that differ (arrays compared exactly, info and state by value); the
    live plan's :data:`LIVE_ONLY_INFO` entries count as equal where the reference has no such key."""
    extra = {k for k, v in LIVE_ONLY_INFO.items() if k in live.info and live.info[k] == v and k not in ref.info}
    if extra:
        live = replace_plan(live, info={k: v for k, v in live.info.items() if k not in extra})

    def same(a, b):
        if dataclasses.is_dataclass(a) and dataclasses.is_dataclass(b):
            return all(same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
        if isinstance(a, dict) and isinstance(b, dict):
            return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
            return np.shape(a) == np.shape(b) and np.array_equal(a, b)
        return a == b
    return [f.name for f in dataclasses.fields(live) if not same(getattr(live, f.name), getattr(ref, f.name))]


def verdict(q_live: dict, q_ref: dict) -> tuple[str, str | None]:
    """("better" | "worse" | "as good", the deciding criterion or None) of the live plan's
    :func:`quality` against the reference's, in :data:`ORDER`."""
    for name, key in ORDER:
        if key(q_live) != key(q_ref):
            return ("better" if key(q_live) > key(q_ref) else "worse"), name
    return "as good", None


def random_case(rng: np.random.Generator) -> dict:
    """One case (module docstring): cluster, dims, demand [G, E] int64, its kind and its case name."""
    G = int(rng.choice([2, 4, 8, 16]))
    per_rank = int(rng.choice([1, 2, 4]))
    E = G * per_rank
    slots = per_rank + int(rng.integers(1, 4))
    domains = None
    if G >= 4 and rng.random() < 0.5:
        size = int(rng.choice([2, G // 2]))
        domains = tuple(tuple(range(i, i + size)) for i in range(0, G, size))
    cluster = Cluster(num_ranks=G, slots_per_rank=slots, fast_domains=domains)
    dims = ModelDims(hidden=int(rng.choice([32, 64, 128])), intermediate=int(rng.choice([16, 32, 96])),
                     num_experts=E, top_k=2)
    kind = KINDS[int(rng.integers(len(KINDS)))]
    scale = int(rng.choice([20, 60, 300, 2000]))
    d = rng.integers(0, scale, (G, E))
    if kind == "hot_expert":
        d[:, int(rng.integers(E))] += rng.integers(scale, 5 * scale, G)
    elif kind == "hot_rank":
        d[int(rng.integers(G))] *= 4
    elif kind == "lognormal_empty":
        d = rng.poisson(np.exp(rng.normal(0, 1.5, E)) * scale / 3, (G, E))
        d[:, rng.permutation(E)[:max(1, E // 4)]] = 0
    elif kind == "one_pair":
        d = np.zeros((G, E), dtype=np.int64)
        d[int(rng.integers(G)), int(rng.integers(E))] = int(rng.integers(1, scale))
    return {"cluster": cluster, "dims": dims, "demand": np.asarray(d, dtype=np.int64), "kind": kind}


def check_case(index: int, case: dict, name: str, rng: np.random.Generator) -> tuple[int, list[dict]]:
    """Plan one case with both planners at four budgets and three steps: (plans compared, a row per
    plan that differs)."""
    policy, options = CASES[name]
    cluster, dims, d = case["cluster"], case["dims"], case["demand"]
    free = reference_plan(policy, d, cluster, dims, math.inf, **options)
    scales = (None, float(rng.uniform(0.9, 1.0)), float(rng.uniform(0.5, 0.9)), float(rng.uniform(0.02, 0.5)))
    compared, rows = 0, []
    for scale in scales:
        budget = math.inf if scale is None else scale * free.memory.peak
        live_state = ref_state = None
        for step in range(STEPS):
            d_step = d if step == 0 else np.roll(d, step, axis=1) + rng.integers(0, 3, d.shape)
            ref = reference_plan(policy, d_step, cluster, dims, budget, state=ref_state, **options)
            live = plan_placement(policy, d_step, cluster, dims, budget, state=live_state, **options)
            compared += 1
            diff = differences(live, ref)
            if diff:
                q_live, q_ref = quality(live), quality(ref)
                judged, criterion = verdict(q_live, q_ref)
                rows.append({"case": index, "policy": name, "kind": case["kind"], "ranks": cluster.num_ranks,
                             "experts": dims.num_experts, "domains": len(set(cluster.domain_G)),
                             "budget_scale": scale, "step": step, "fields": diff, "verdict": judged,
                             "criterion": criterion, "live": q_live, "reference": q_ref})
            live_state, ref_state = live.state, ref.state
    return compared, rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="lrmoe bench planner-check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=2000, help="random cases (default 2000; 12 plans each)")
    ap.add_argument("--seed", type=int, default=0, help="first case's seed (case i draws from seed + i)")
    ap.add_argument("--policies", default=",".join(CASES),
                    help=f"comma-separated case names, drawn from uniformly (default all: {','.join(CASES)})")
    ap.add_argument("--strict", action="store_true", help="exit with status 1 when a live plan is worse")
    ap.add_argument("--out", type=Path, default=Path("results/bench"), help="output folder for planner_check.json")
    args = ap.parse_args(argv)
    require_positive(ap, args, "cases")
    if args.seed < 0:
        ap.error(f"--seed must be >= 0, got {args.seed}")
    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    unknown = [n for n in names if n not in CASES]
    if not names or unknown:
        ap.error(f"--policies must name cases among {', '.join(CASES)}; got {args.policies!r}")

    counts = {n: Counter() for n in names}
    rows, t0 = [], time.perf_counter()
    for i in range(args.cases):
        rng = np.random.default_rng(args.seed + i)
        case = random_case(rng)
        name = names[int(rng.integers(len(names)))]
        compared, diverged = check_case(args.seed + i, case, name, rng)
        counts[name]["plans"] += compared
        counts[name]["cases"] += 1
        for row in diverged:
            counts[name][row["verdict"]] += 1
        rows += diverged
        if (i + 1) % 100 == 0 or i + 1 == args.cases:
            print(f"[{i + 1}/{args.cases}] {sum(c['plans'] for c in counts.values())} plans, {len(rows)} differ, "
                  f"{sum(r['verdict'] == 'worse' for r in rows)} worse ({time.perf_counter() - t0:.0f} s)",
                  file=sys.stderr, flush=True)
    elapsed = time.perf_counter() - t0

    from ..environment import environment
    from ..files import write_json, write_text

    summary = [{"policy": n, "cases": c["cases"], "plans": c["plans"],
                "identical": c["plans"] - c["better"] - c["as good"] - c["worse"],
                "better": c["better"], "as_good": c["as good"], "worse": c["worse"]} for n, c in counts.items()]
    plans = sum(s["plans"] for s in summary)
    worse = sum(s["worse"] for s in summary)
    headline = (f"{args.cases} random cases from seed {args.seed}, {plans} plans: identical to the frozen reference's "
                f"in {sum(s['identical'] for s in summary)}, better in {sum(s['better'] for s in summary)}, as good in "
                f"{sum(s['as_good'] for s in summary)}, worse in {worse} ({elapsed:.0f} s)")
    payload = {"benchmark": "planner-check",
               "options": {"cases": args.cases, "seed": args.seed, "policies": {n: CASES[n] for n in names},
                           "steps": STEPS, "budget_scales": "inf, U(0.9, 1), U(0.5, 0.9), U(0.02, 0.5) x peak"},
               "environment": environment(), "elapsed_s": elapsed, "summary": summary, "headline": headline,
               "rows": rows}
    path = write_json(args.out / "planner_check.json", payload)
    columns = [(k, k.replace("_", " "), "") for k in ("policy", "cases", "plans", "identical", "better", "as_good",
                                                      "worse")]
    table = markdown_table(summary, columns)
    write_text(args.out / "planner_check.md",
               f"# `lrmoe bench planner-check {' '.join(argv if argv is not None else sys.argv[1:])}` (revision "
               f"{payload['environment']['git']}; see docs/benchmarks.md)\n\n{headline}\n\n{table}\n")
    print(table)
    print(headline)
    print(f"wrote {path}")
    if args.strict and worse:
        raise SystemExit(f"{worse} live plan(s) worse than the reference's: see {path}")
    return payload


if __name__ == "__main__":
    main()
