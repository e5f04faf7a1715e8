"""Planner benchmark: how long every placement policy takes to plan one step of one MoE layer,
beside the frozen reference (:mod:`lrmoe.planning.reference`, the planners as of 2cf58af).

Scenarios: the paper's two models (Qwen3-30B-A3B: hidden 2048, expert FFN 768; GLM-4.5-Air:
hidden 4096, expert FFN 1408; both 128 experts, top-8), EP8 (one fast domain) and EP64 (eight
8-GPU domains), ``--tokens`` tokens per rank (32,768), slots E/G + 4, bf16 weights, fp32 grads, no
optimizer state, per-GPU layer budgets ``--budgets`` (80 / 12 / 6 GiB) and four routings:
balanced, log-normal popularity (sigma 1), one hot expert (a tenth of all pairs), a hot rank
(the experts of rank 0 four times as popular). Popularity drifts over the steps (AR(1) on log
popularity, phi 0.9, innovation 0.1; seeded) and every rank draws its pairs from it (multinomial).

Policies: fixed, symi, ultraep, ultraep_greedy, lrmoe (drop 0.2) with waterfill and with
proportional quotas, all with their default options, and lrmoe (waterfill) with approximate
searches (``search_tolerance=1e-3``). The reference of an approximate policy is the live exact
planner (the same options without the tolerance; its plans are the frozen reference's, which every
exact row checks), interleaved with it in the same way, so the ratio and the quality columns say
what the tolerance buys and costs. For each cell (model, EP, budget, routing,
policy) the live planner (:func:`lrmoe.planning.policies.plan_placement`) and the reference plan
the same drifting trace of ``--steps`` steps, interleaved (live, ref, ref, live on even steps, the
reverse on odd ones: two timed calls each per step; symi carries each one's own state). The table
gives the median and p95 wall time of both, the ratio reference / live (the speed-up), and the
plan quality of both: slowest rank's cost (forward rows + 2 x kept rows, mean over steps), peak
memory (max), kept pairs (mean), replicas (mean), steps over budget, the fallbacks used and how
many steps gave identical plans.

Targets (issue 29, medians, EP8 and EP64 alike): LRMoE <= 0.1 ms per plan without pressure and
<= 1 ms under pressure (a cell is pressured when a fallback was used), every baseline <= 0.05 and
<= 0.5 ms; at EP8 the plan and its layout together (``plan + layout``: the live plan's host layout,
:func:`lrmoe.sim.simulate.host_layout_seconds`, slowest rank) <= 0.15 ms per MoE layer and rank.

    lrmoe bench planners                       # everything, results/bench/bench_planners_cpu.json
    lrmoe bench planners --only 'qwen3.*EP8' --steps 5
    lrmoe bench planners --quick               # Qwen3, EP8, 80 and 6 GiB, balanced and log-normal
    lrmoe bench planners --steps 5 --rounds 3  # every cell measured in 3 passes spread over the run
"""
from __future__ import annotations

import argparse
import math
import re
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from ..planning.memory import GIB
from .common import markdown_table, require_positive
from ..planning.plan import Cluster, ModelDims
from ..planning.policies import plan_placement
from ..planning.reference import reference_plan
from ..sim.simulate import host_layout_seconds

MODELS = {  # name: (hidden, expert FFN, experts, top-k)
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "glm-4.5-air": (4096, 1408, 128, 8),
}
EP_SIZES = {"EP8": (8, 8), "EP64": (64, 8)}  # name: (ranks, ranks per fast domain)
ROUTINGS = ("balanced", "lognormal", "hot_expert", "hot_rank")
POLICIES = {  # label: (policy, options)
    "fixed": ("fixed", {}),
    "symi": ("symi", {}),
    "ultraep": ("ultraep", {}),
    "ultraep_greedy": ("ultraep_greedy", {}),
    "lrmoe_waterfill": ("lrmoe", {"drop_ratio": 0.2, "quota_policy": "waterfill"}),
    "lrmoe_proportional": ("lrmoe", {"drop_ratio": 0.2, "quota_policy": "proportional"}),
    # the approximate searches (lrmoe.planning.lrmoe_plan, search_tolerance), against the exact live planner
    "lrmoe_waterfill_tol1e-3": ("lrmoe", {"drop_ratio": 0.2, "quota_policy": "waterfill", "search_tolerance": 1e-3}),
}
REFERENCE_IGNORES = ("search_tolerance",)  # options the reference does not have: it plans exactly
BUDGETS_GIB = (80.0, 12.0, 6.0)
QUICK = {"models": ["qwen3-30b-a3b"], "ep": ["EP8"], "budgets": [80.0, 6.0], "routings": ["balanced", "lognormal"]}
PHI, INNOVATION = 0.9, 0.1


def reference_options(options: dict) -> dict:
    """A policy's options as the reference takes them (it has no approximate searches)."""
    return {k: v for k, v in options.items() if k not in REFERENCE_IGNORES}


def dims_of(model: str) -> ModelDims:
    H, I, E, K = MODELS[model]
    return ModelDims(hidden=H, intermediate=I, num_experts=E, top_k=K, dtype_bytes=2, grad_bytes=4,
                     optimizer_bytes_per_param=0)


def cluster_of(ep: str, num_experts: int) -> Cluster:
    G, per = EP_SIZES[ep]
    return Cluster(num_ranks=G, slots_per_rank=num_experts // G + 4,
                   fast_domains=tuple(tuple(range(d, d + per)) for d in range(0, G, per)))


def base_log_popularity(routing: str, E: int, G: int, rng) -> np.ndarray:
    if routing == "balanced":
        return np.zeros(E)
    if routing == "lognormal":
        return rng.normal(0.0, 1.0, E)
    if routing == "hot_expert":  # expert 0 carries a tenth of all pairs (at most 1/top_k can)
        logp = np.zeros(E)
        logp[0] = math.log(0.1 * (E - 1) / 0.9)
        return logp
    if routing == "hot_rank":  # rank 0's experts four times as popular
        logp = np.zeros(E)
        logp[: E // G] = math.log(4.0)
        return logp
    raise ValueError(f"unknown routing {routing!r}")


def drifting_trace(routing: str, E: int, G: int, pairs_per_rank: int, steps: int, seed: int) -> list[np.ndarray]:
    """``steps`` demands [G, E]: log popularity = base + z_t, z_t = PHI z_{t-1} + INNOVATION eps_t;
    each rank draws its pairs from the popularity (multinomial)."""
    rng = np.random.default_rng(seed)
    base = base_log_popularity(routing, E, G, rng)
    z = np.zeros(E)
    out = []
    for _ in range(steps):
        z = PHI * z + INNOVATION * rng.normal(size=E)
        p = np.exp(base + z)
        out.append(rng.multinomial(pairs_per_rank, p / p.sum(), size=G).astype(np.int64))
    return out


def trace_seed(seed: int, model: str, ep: str, routing: str) -> int:
    """The seed of a cell's drifting trace: one per (model, EP, routing), the same for every budget and policy."""
    return seed * 1000 + 100 * list(MODELS).index(model) + 10 * list(EP_SIZES).index(ep) + ROUTINGS.index(routing)


def quality(plan) -> dict:
    return {"cost": float(plan.cost_G(2.0).max(initial=0.0)), "peak": int(plan.memory.peak),
            "kept": int(plan.backward_quota_GN.sum()) * plan.num_splits, "replicas": int(plan.num_replicas_G.sum()),
            "over": bool(plan.over_budget), "fallback": plan.fallback}


def same_plan(a, b) -> bool:
    return (a.fallback == b.fallback and a.num_splits == b.num_splits and a.instances == b.instances
            and np.array_equal(a.send_GN, b.send_GN) and np.array_equal(a.backward_quota_GN, b.backward_quota_GN))


def summarise(times: list[float], quals: list[dict], prefix: str) -> dict:
    ms = np.array(times) * 1e3
    fallbacks = sorted({q["fallback"] for q in quals})
    return {f"{prefix}_median_ms": float(np.median(ms)), f"{prefix}_p95_ms": float(np.percentile(ms, 95)),
            f"{prefix}_cost": statistics.fmean(q["cost"] for q in quals),
            f"{prefix}_peak_gib": max(q["peak"] for q in quals) / GIB,
            f"{prefix}_kept": statistics.fmean(q["kept"] for q in quals),
            f"{prefix}_replicas": statistics.fmean(q["replicas"] for q in quals),
            f"{prefix}_over_budget_steps": sum(q["over"] for q in quals),
            f"{prefix}_fallback": ",".join(fallbacks), f"{prefix}_samples_ms": [float(x) for x in ms]}


def time_cell(label, trace, cluster, dims, budget_bytes, reference: bool) -> dict:
    """One pass over the cell's trace: the raw timings (s) and plan qualities of both planners and
    how many steps gave identical plans."""
    name, options = POLICIES[label]
    ref_options = reference_options(options)
    # an approximate policy is timed against the exact live planner (whose plans are the frozen reference's)
    ref_planner = plan_placement if approximate(label) else reference_plan
    t_live, t_ref, q_live, q_ref, t_layout = [], [], [], [], []
    state_live = state_ref = None
    same = 0
    for step, d in enumerate(trace):
        def live():
            return plan_placement(name, d, cluster, dims, budget_bytes, state=state_live, **options)

        def ref():
            return ref_planner(name, d, cluster, dims, budget_bytes, state=state_ref, **ref_options)

        # ABBA (BAAB on odd steps): whichever runs first on a new demand is not always the same one
        order = [("live", live), ("ref", ref)] if reference else [("live", live)]
        if step % 2:
            order.reverse()
        plans = {}
        for who, fn in order + order[::-1]:
            t0 = time.perf_counter()
            plan = fn()
            (t_live if who == "live" else t_ref).append(time.perf_counter() - t0)
            plans.setdefault(who, plan)
        state_live = plans["live"].state
        q_live.append(quality(plans["live"]))
        # the runtime's host layout of the live plan (slowest rank), as the simulator charges it
        t_layout.append(host_layout_seconds(plans["live"], selects=True))
        if reference:
            state_ref = plans["ref"].state
            q_ref.append(quality(plans["ref"]))
            same += same_plan(plans["live"], plans["ref"])
    return {"t_live": t_live, "t_ref": t_ref, "q_live": q_live, "q_ref": q_ref, "same": same, "t_layout": t_layout}


def cell_row(passes: list[dict], reference: bool) -> dict:
    """A cell's row from its passes (one per round): the timings of every pass pooled, the plan
    quality and identical-plan count of the first (the plans are deterministic: every pass plans
    the same trace from the same state)."""
    first = passes[0]
    row = summarise([t for p in passes for t in p["t_live"]], first["q_live"], "live")
    row["layout_median_ms"] = float(np.median([t for p in passes for t in p["t_layout"]])) * 1e3
    row["host_median_ms"] = row["live_median_ms"] + row["layout_median_ms"]
    if reference:
        row.update(summarise([t for p in passes for t in p["t_ref"]], first["q_ref"], "ref"))
        row["speedup"] = row["ref_median_ms"] / row["live_median_ms"]
        row["same_plans"] = first["same"]
    return row


def approximate(label: str) -> bool:
    """Whether the policy runs options the reference does not have (its plans may differ by design)."""
    return any(k in POLICIES[label][1] for k in REFERENCE_IGNORES)


def plan_comparison(rows, steps: int) -> str:
    """How the live plans compare with the reference's: the exact policies' identical (cell, step)
    pairs, and for the approximate ones (whose reference is the exact live planner) the range of
    their mean kept pairs and slowest-rank cost relative to the exact plans' (the quality rule's
    two numbers)."""
    exact = [r for r in rows if not approximate(r["policy"])]
    out = (f"; exact policies: live plans identical to the reference in {sum(r['same_plans'] for r in exact)} of "
           f"{len(exact) * steps} (cell, step) pairs")
    approx = [r for r in rows if approximate(r["policy"])]

    def span(key):
        rel = [r[f"live_{key}"] / r[f"ref_{key}"] - 1 for r in approx if r[f"ref_{key}"]]
        return f"{min(rel):+.2%} to {max(rel):+.2%}" if rel else "n/a (the reference's is 0)"

    if approx:
        out += (f"; approximate searches ({', '.join(sorted({r['policy'] for r in approx}))}; their reference "
                f"is the exact live planner): identical in {sum(r['same_plans'] for r in approx)} of "
                f"{len(approx) * steps}, mean kept pairs {span('kept')} and slowest-rank cost {span('cost')} of "
                f"the exact plans' per cell")
    return out


def target_ms(row) -> float:
    """Issue 29's targets per plan: LRMoE 0.1 ms unpressured and 1 ms under pressure, every baseline
    0.05 and 0.5 ms, at EP8 and EP64 alike."""
    lrmoe = POLICIES[row["policy"]][0] == "lrmoe"
    if row["pressured"]:
        return 1.0 if lrmoe else 0.5
    return 0.1 if lrmoe else 0.05


#: Issue 29's target for the plan and its layout together, per MoE layer and rank, at EP8.
HOST_TARGET_MS = 0.15


def markdown(rows, reference: bool) -> str:
    cols = [("cell", "model/EP/budget/routing", ""), ("policy", "policy", ""),
            ("live_median_ms", "live ms (median)", ".2f"), ("live_p95_ms", "p95", ".2f")]
    if reference:
        cols += [("ref_median_ms", "ref ms (median)", ".2f"), ("ref_p95_ms", "p95", ".2f"),
                 ("speedup", "ref/live", ".2f")]
    cols += [("target", "target", ""), ("layout_median_ms", "layout ms", ".3f"),
             ("host_median_ms", "plan + layout ms", ".3f"), ("live_cost", "slowest cost", ".0f")]
    if reference:
        cols += [("ref_cost", "ref cost", ".0f")]
    cols += [("live_peak_gib", "peak GiB", ".2f"), ("live_kept", "kept pairs", ".0f")]
    if reference:
        cols += [("ref_kept", "ref kept", ".0f")]
    cols += [("live_replicas", "replicas", ".1f"), ("live_over_budget_steps", "over-budget steps", "d"),
             ("live_fallback", "fallback", "")]
    if reference:
        cols += [("ref_fallback", "ref fallback", ""), ("same_plans", "same plans", "d")]
    return markdown_table(rows, cols)


def short_fallbacks(names) -> str:
    short = {"none": "none", "shrink_quota": "shrink"}
    out = sorted({short.get(n, "split" if n.startswith("split") else n) for f in names for n in f.split(",")})
    return "/".join(out)


def summary_tables(rows, reference: bool) -> str:
    """Per model and EP size, a policy x budget grid: the live planner's median ms over the
    routings (the reference's in brackets), in how many routings the live median meets its target
    (bold when all), and the fallbacks the live plans used. docs/benchmarks.md shows these."""
    out = []
    for m in dict.fromkeys(r["model"] for r in rows):
        for ep in dict.fromkeys(r["ep"] for r in rows if r["model"] == m):
            sub = [r for r in rows if r["model"] == m and r["ep"] == ep]
            budgets = list(dict.fromkeys(r["budget_gib"] for r in sub))
            lines = [f"**{m}, {ep}**", "", "| policy | " + " | ".join(f"{b:g} GiB" for b in budgets) + " |",
                     "|---|" + "---|" * len(budgets)]
            for pol in dict.fromkeys(r["policy"] for r in sub):
                cells = []
                for b in budgets:
                    c = [r for r in sub if r["policy"] == pol and r["budget_gib"] == b]
                    if not c:
                        cells.append("")
                        continue
                    live = statistics.median(r["live_median_ms"] for r in c)
                    text = f"{live:.2f}"
                    if reference:
                        text += f" ({statistics.median(r['ref_median_ms'] for r in c):.2f})"
                    met = sum(r["target_met"] for r in c)
                    text += f" {met}/{len(c)} {short_fallbacks(r['live_fallback'] for r in c)}"
                    cells.append(f"**{text}**" if met == len(c) else text)
                lines.append(f"| {pol} | " + " | ".join(cells) + " |")
            out.append("\n".join(lines))
    return "\n\n".join(out) + "\n"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="lrmoe bench planners", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2,
                    help="steps of the drifting trace per cell (default 2, two timed calls each; --steps 3 took 184 s "
                         "of planning on 2 shared cores, docs/benchmarks.md)")
    ap.add_argument("--quick", action="store_true", help="Qwen3, EP8, 80 and 6 GiB, balanced and log-normal only")
    ap.add_argument("--only", default=None, metavar="REGEX",
                    help="cells whose 'model/EP/budgetGiB/routing/policy' name matches (re.search)")
    ap.add_argument("--tokens", type=int, default=32768, help="tokens per rank (default 32768; top-k pairs each)")
    ap.add_argument("--budgets", default=",".join(f"{b:g}" for b in BUDGETS_GIB),
                    help="per-GPU layer budgets in GiB, comma-separated (default 80,12,6)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="passes over all cells (default 1); a cell's samples are pooled over the rounds, which are "
                         "spread over the whole run, so a slow spell of the machine touches every cell a little "
                         "instead of a few cells much")
    ap.add_argument("--no-reference", dest="reference", action="store_false", help="time the live planners only")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("results/bench"), help="output folder for bench_planners_cpu.json")
    args = ap.parse_args(argv)
    require_positive(ap, args, "steps", "rounds", "tokens")
    try:
        budgets = [float(b) for b in args.budgets.split(",")]
        if not budgets or any(not b > 0 for b in budgets):
            raise ValueError
    except ValueError:
        ap.error(f"--budgets must be numbers > 0 (GiB), comma-separated, got {args.budgets!r}")
    try:
        only = re.compile(args.only) if args.only else None
    except re.error as e:
        ap.error(f"--only is not a valid regular expression ({e}): {args.only!r}")
    models, eps, routings = list(MODELS), list(EP_SIZES), list(ROUTINGS)
    if args.quick:
        models, eps, routings = QUICK["models"], QUICK["ep"], QUICK["routings"]
        if args.budgets == ap.get_default("budgets"):
            budgets = QUICK["budgets"]

    cells = [(m, ep, b, rt, pol) for m in models for ep in eps for b in budgets for rt in routings for pol in POLICIES
             if only is None or only.search(f"{m}/{ep}/{b:g}GiB/{rt}/{pol}")]
    if not cells:
        ap.error(f"--only {args.only!r} matches no cell (names look like 'qwen3-30b-a3b/EP8/6GiB/lognormal/symi')")
    # warm-up: imports and first-call costs (scipy's max flow) outside the timings
    small = Cluster(num_ranks=2, slots_per_rank=3)
    for label, (name, options) in POLICIES.items():
        d = np.full((2, 4), 10, dtype=np.int64)
        plan_placement(name, d, small, ModelDims(8, 8, 4, 2), 1e12, **options)
        reference_plan(name, d, small, ModelDims(8, 8, 4, 2), 1e12, **reference_options(options))

    rows, traces, passes = [], {}, {c: [] for c in cells}
    t_start = time.perf_counter()
    for rnd in range(args.rounds):
        for m, ep, b, rt, pol in cells:
            dims = dims_of(m)
            cluster = cluster_of(ep, dims.num_experts)
            key = (m, ep, rt)
            if key not in traces:
                traces[key] = drifting_trace(rt, dims.num_experts, cluster.num_ranks, args.tokens * dims.top_k,
                                             args.steps, trace_seed(args.seed, m, ep, rt))
            name = f"{m}/{ep}/{b:g}GiB/{rt}/{pol}" + (f" (round {rnd + 1}/{args.rounds})" if args.rounds > 1 else "")
            print(f"{name} ...", end=" ", flush=True, file=sys.stderr)
            p = time_cell(pol, traces[key], cluster, dims, b * GIB, args.reference)
            passes[(m, ep, b, rt, pol)].append(p)
            print(f"{statistics.median(p['t_live']) * 1e3:.2f} ms"
                  + (f" (ref {statistics.median(p['t_ref']) * 1e3:.2f} ms)" if args.reference else ""),
                  file=sys.stderr, flush=True)
    for (m, ep, b, rt, pol), ps in passes.items():
        row = {"cell": f"{m}/{ep}/{b:g}GiB/{rt}", "model": m, "ep": ep, "ranks": EP_SIZES[ep][0], "budget_gib": b,
               "routing": rt, "policy": pol, **cell_row(ps, args.reference)}
        row["pressured"] = row["live_fallback"] != "none" or (args.reference and row["ref_fallback"] != "none")
        row["target_ms"] = target_ms(row)
        row["target_met"] = row["live_median_ms"] <= row["target_ms"]
        row["target"] = f"{'met' if row['target_met'] else 'MISSED'} (<= {row['target_ms']:g})"
        row["host_target_met"] = row["host_median_ms"] <= HOST_TARGET_MS if row["ranks"] == 8 else None
        rows.append(row)
    elapsed = time.perf_counter() - t_start

    from ..environment import environment
    from ..files import write_json, write_text

    pressured_budget = min(budgets)
    unpressured_at_min = sorted({r["policy"] for r in rows if r["budget_gib"] == pressured_budget
                                 and not r["pressured"]})
    notes = []
    if unpressured_at_min:
        notes.append(f"the smallest budget ({pressured_budget:g} GiB) triggered no fallback for: "
                     + ", ".join(unpressured_at_min) + " (in some cells)")
    met = sum(r["target_met"] for r in rows)
    ep8 = [r for r in rows if r["host_target_met"] is not None]
    summary = (f"targets met in {met} of {len(rows)} cells; plan + layout <= {HOST_TARGET_MS * 1e3:.0f} us in "
               f"{sum(r['host_target_met'] for r in ep8)} of {len(ep8)} EP8 cells ({elapsed:.0f} s of planning)")
    payload = {"benchmark": "planners",
               "options": {"steps": args.steps, "rounds": args.rounds, "quick": args.quick, "only": args.only,
                           "tokens_per_rank": args.tokens,
                           "budgets_gib": budgets, "reference": args.reference, "seed": args.seed},
               "scenarios": {"models": {m: dict(zip(("hidden", "intermediate", "num_experts", "top_k"), MODELS[m]))
                                        for m in models},
                             "ep": {e: dict(zip(("ranks", "ranks_per_domain"), EP_SIZES[e])) for e in eps},
                             "slots_per_rank": "E/G + 4", "dtype_bytes": 2, "grad_bytes": 4,
                             "optimizer_bytes_per_param": 0, "routings": routings,
                             "drift": {"phi": PHI, "innovation": INNOVATION},
                             "policies": {k: {"policy": n, "options": o} for k, (n, o) in POLICIES.items()}},
               "environment": environment(), "elapsed_s": elapsed, "rows": rows, "summary": summary, "notes": notes}
    path = write_json(args.out / "bench_planners_cpu.json", payload)
    table = markdown(rows, args.reference)
    header = (f"# `lrmoe bench planners {' '.join(argv if argv is not None else sys.argv[1:])}` "
              f"(revision {payload['environment']['git']}, {payload['environment']['cpu_model']}; see docs/benchmarks.md)\n\n"
              f"{summary}" + (plan_comparison(rows, args.steps) if args.reference else "") + "\n\n")
    write_text(args.out / "bench_planners_cpu.md", header + summary_tables(rows, args.reference) + "\n" + table + "\n")
    print(table)
    print(summary)
    for n in notes:
        print("note:", n)
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
