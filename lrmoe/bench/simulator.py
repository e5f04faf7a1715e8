"""Simulator validation: calibrate ``cpu-local`` on this machine, run the real expert-parallel
runtime (gloo, one thread per process) on routing of several skews, and compare the simulator's
plans, bytes and times with what the runtime did.

    lrmoe bench simulator                    # 2 processes, results/bench/sim_validation_cpu.json
    lrmoe bench simulator --steps 2 --quick  # a small version (what the test runs)

1. Calibration (``results/sim/cpu-local.json``, the ``cpu-local`` hardware preset): grouped GEMMs
   (``lrmoe.kernels.grouped_gemm.grouped_mm``, the runtime's kernel) at the validation's shapes
   over several group sizes and counts -> FLOP rate and per-call cost by least squares; a large
   copy -> memory bandwidth; gloo ``all_to_all_single`` over message sizes -> latency and bandwidth;
   the runtime's layer at 1 token per rank -> the fixed per-call forward and backward cost.
2. Runs: each method (fixed, symi, ultraep, lrmoe) at C0 and C20 on each routing (balanced,
   log-normal sigma 1, one hot expert), ``--steps`` timed steps after one warm-up, the methods
   taking turns within each step (same inputs, one after another); per step the
   demand the runtime gathered, its plan, its all-to-all bytes, forward and backward wall time
   (barrier to barrier).
3. The simulator replays the recorded demands with ``cpu-local`` and reports, per (method,
   routing): plans identical to the runtime's (send, backward quotas, instances), token-row bytes
   identical, and predicted against measured forward, backward and total time (medians), with the
   error. Times are judged here, never asserted in tests.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROUTINGS = ("balanced", "lognormal", "hot_expert")
METHODS = (("fixed", 0.0), ("symi", 0.0), ("ultraep", 0.0), ("lrmoe", 0.0),
           ("fixed", 0.2), ("symi", 0.2), ("ultraep", 0.2), ("lrmoe", 0.2))


def parse(argv=None):
    ap = argparse.ArgumentParser(prog="lrmoe bench simulator", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2, help="gloo processes (2; one thread each)")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per rank (2048)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=256)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12, help="timed steps per (method, routing) (12)")
    ap.add_argument("--quick", action="store_true", help="two routings; fixed and lrmoe at C0 and C20, symi (a stateful planner) at C0")
    ap.add_argument("--calibrate-only", action="store_true",
                    help="write the cpu-local calibration and stop (what `lrmoe simulate calibrate` runs)")
    ap.add_argument("--out", type=Path, default=Path("results/bench/sim_validation_cpu.json"))
    ap.add_argument("--calibration", type=Path, default=Path("results/sim/cpu-local.json"),
                    help="where the cpu-local preset is written (results/sim/cpu-local.json)")
    args = ap.parse_args(argv)
    from .common import require_positive  # lazily, as this module imports torch only where it runs it

    require_positive(ap, args, "world", "tokens", "hidden", "intermediate", "experts", "top_k", "steps")
    if args.experts % args.world:
        ap.error(f"--experts ({args.experts}) must be divisible by --world ({args.world})")
    return args


def popularity(routing: str, E: int, rng) -> np.ndarray:
    if routing == "balanced":
        p = np.ones(E)
    elif routing == "lognormal":
        p = rng.lognormal(0.0, 1.0, E)
    elif routing == "hot_expert":
        p = np.ones(E)
        p[0] = E / 3
    else:
        raise ValueError(f"unknown routing {routing!r}; accepted: {ROUTINGS}")
    return p / p.sum()


def routing_counts(routing: str, E: int, K: int, T: int, G: int, steps: int, seed: int) -> np.ndarray:
    """[steps, G, E] counts, each expert at most T per rank (a token picks K distinct experts)."""
    rng = np.random.default_rng(seed)
    p = popularity(routing, E, rng)
    p = np.minimum(p, 1.0 / K)
    p = p / p.sum()
    out = np.zeros((steps, G, E), dtype=np.int64)
    for s in range(steps):
        for r in range(G):
            c = rng.multinomial(T * K, p)
            while c.max() > T:  # rare: move the excess of an expert over T to the least loaded
                e = int(c.argmax())
                c[e] -= 1
                c[int(c.argmin())] += 1
            out[s, r] = c
    return out


def indices_from_counts(c_E: np.ndarray, K: int, seed: int):
    """top-k indices [T, K] whose expert counts are exactly c_E (each count <= T): the experts in
    sorted order, token t taking positions t, t + T, ...; tokens shuffled."""
    import torch

    T = int(c_E.sum()) // K
    flat = np.repeat(np.arange(c_E.size), c_E)
    idx = flat.reshape(K, T).T
    idx = idx[np.random.default_rng(seed).permutation(T)]
    return torch.as_tensor(np.ascontiguousarray(idx), dtype=torch.int64)


def _fit(x_NF: np.ndarray, t_N: np.ndarray) -> np.ndarray:
    """Non-negative least squares t ~ x @ coef (scipy.optimize.nnls)."""
    from scipy.optimize import nnls

    return nnls(x_NF, t_N)[0]


def _time(fn, reps: int = 5) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _mean_over_ranks(t: float) -> float:
    """The mean over ranks of one sample each rank timed at the same moment."""
    import torch
    import torch.distributed as dist

    v = torch.tensor([t], dtype=torch.float64)
    dist.all_reduce(v)
    return float(v) / dist.get_world_size()


def calibrate_local(H: int, I: int) -> dict:
    """GEMM rate and per-call cost, memory bandwidth: every rank times the same samples at the same
    moment (one thread each), as they run in the layer, so shared caches and memory bandwidth are
    contended as in the runs; each sample is the mean over ranks."""
    import torch
    import torch.distributed as dist

    from ..kernels.grouped_gemm import grouped_mm

    def timed(fn) -> float:
        dist.barrier()
        return _mean_over_ranks(_time(fn))

    rows, feats = [], []
    for m in (16, 64, 256, 512):
        for g in (1, 4, 8):
            for n_out, k_in in ((2 * I, H), (H, I)):
                a = torch.randn(m * g, k_in)
                b = torch.randn(g, k_in, n_out)
                offs = torch.arange(1, g + 1, dtype=torch.int32) * m
                rows.append(timed(lambda a=a, b=b, offs=offs: grouped_mm(a, b, offs)))
                feats.append([2.0 * m * g * k_in * n_out, 1.0])
    inv_rate, call_s = _fit(np.array(feats), np.array(rows))
    x = torch.randn(16 * 2**20 // 4)
    copy_s = timed(lambda: x.clone())
    # indexed row copies as the layer does them: a gather of [P, H] rows by a random index and the
    # index add of P rows into [T, H] (each reads and writes P rows)
    T, P = 2048, 2048 * 4
    src, idx = torch.randn(T, H), torch.randint(0, T, (P,))
    rows_out, acc = torch.randn(P, H), torch.zeros(T, H)
    row_s = timed(lambda: (src.index_select(0, idx), acc.index_add_(0, idx, rows_out)))
    return {"gemm_tflops": 1.0 / inv_rate / 1e12 if inv_rate > 0 else 1e-3, "gemm_call_s": float(call_s),
            "hbm_bytes_per_s": 2 * x.numel() * 4 / copy_s, "row_bytes_per_s": 2 * 2 * P * H * 4 / row_s,
            "gemm_samples": {"seconds": rows, "flops_and_calls": feats}}


def calibrate_a2a(G: int) -> dict:
    """gloo all_to_all_single over message sizes: latency and bandwidth (bytes a rank sends)."""
    import torch
    import torch.distributed as dist

    sizes, ts = [], []
    for n in (256, 4096, 65536, 262144, 1048576):
        buf = torch.randn(n * G)
        out = torch.empty_like(buf)

        def a2a():
            dist.barrier()
            dist.all_to_all_single(out, buf)

        ts.append(_time(a2a))
        sizes.append(n * (G - 1) * 4)
    lat, inv_bw = _fit(np.c_[np.ones(len(sizes)), sizes], np.array(ts))
    return {"a2a_latency_s": float(lat), "fast_bytes_per_s": 1.0 / inv_bw if inv_bw > 0 else 1e12,
            "a2a_samples": {"bytes": sizes, "seconds": ts}}


def run_layer(module, x, idx, w, dy):
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    y = module(x, idx, w)
    dist.barrier()
    t1 = time.perf_counter()
    y.backward(dy)
    dist.barrier()
    t2 = time.perf_counter()
    module.gate_up_proj.grad = module.down_proj.grad = None
    return t1 - t0, t2 - t1


def worker(args):
    import torch
    import torch.distributed as dist

    from ..parallel.launch import init_distributed, shutdown
    from ..parallel.runtime import ExpertParallel, ExpertParallelExperts
    from ..policy import BackwardPolicy

    env = init_distributed(backend="gloo", timeout_s=600)
    torch.set_num_threads(1)
    G, r = env.world_size, env.rank
    E, H, I, K, T = args.experts, args.hidden, args.intermediate, args.top_k, args.tokens
    gen = torch.Generator().manual_seed(0)
    gu = torch.randn(E, 2 * I, H, generator=gen) / H**0.5
    dn = torch.randn(E, H, I, generator=gen) / I**0.5
    slots = E // G + 2
    calib = calibrate_a2a(G)
    calib.update(calibrate_local(H, I))
    # fixed per-call cost: the layer at one token per rank (fixed ownership, C0)
    ep = ExpertParallel(E, env.ep_group, "fixed", slots_per_rank=slots)
    mod = ExpertParallelExperts.from_full(gu, dn, ep, BackwardPolicy())
    tiny = indices_from_counts(np.r_[np.ones(K, dtype=np.int64), np.zeros(E - K, dtype=np.int64)], K, 0)
    f_b = [run_layer(mod, torch.randn(1, H), tiny, torch.ones(1, K) / K, torch.randn(1, H)) for _ in range(7)]
    calib["forward_overhead_s"] = statistics.median(a for a, _ in f_b[1:])
    calib["backward_overhead_s"] = statistics.median(b for _, b in f_b[1:])

    if args.calibrate_only:
        if r == 0:
            write_calibration(args, calib)
            print(f"wrote {args.calibration}")
        dist.barrier()
        shutdown()
        return
    routings = ROUTINGS[:2] if args.quick else ROUTINGS
    methods = [m for m in METHODS if m[0] in ("fixed", "lrmoe") or m == ("symi", 0.0)] if args.quick else list(METHODS)
    runs = []
    for ri, routing in enumerate(routings):
        counts = routing_counts(routing, E, K, T, G, args.steps + 1, seed=100 + ri)
        recs, mods = [], []
        for placement, drop in methods:
            opts = {"min_tokens": 64} if placement == "ultraep" else {}
            ep = ExpertParallel(E, env.ep_group, placement, slots_per_rank=slots, **opts)
            mods.append((ep, ExpertParallelExperts.from_full(gu, dn, ep, BackwardPolicy(drop_ratio=drop))))
            recs.append({"routing": routing, "placement": placement, "drop_ratio": drop, "options": opts,
                         "fwd_s": [], "bwd_s": [], "plans": [], "comm": [], "quota": [], "kept": []})
        # round-robin: each step runs every method once, so a load change on the machine falls on
        # all methods alike instead of on whichever ran then
        for s in range(args.steps + 1):
            g = torch.Generator().manual_seed(1000 * s + r)
            idx = indices_from_counts(counts[s, r], K, seed=1000 * s + r)
            x, w = torch.randn(T, H, generator=g), torch.softmax(torch.randn(T, K, generator=g), -1)
            dy = torch.randn(T, H, generator=g)
            for (ep, mod), rec in zip(mods, recs):
                f, b = run_layer(mod, x, idx, w, dy)
                rec["plans"].append(ep.last_plan)  # the warm-up's too: stateful planners (SYMI) start from it
                if s == 0:
                    continue  # warm-up: not timed
                rec["fwd_s"].append(f)
                rec["bwd_s"].append(b)
                rec["comm"].append(dict(mod.last_backward.comm_bytes))
                rec["quota"].append([int(v) for v in mod.last_backward.quota.tolist()])  # this rank's pairs, per expert
                rec["kept"].append([int(v) for v in mod.last_backward.kept.tolist()])
        runs.extend(recs)
    gathered = [None] * G
    dist.all_gather_object(gathered, {"calib": calib, "runs": [{k: v for k, v in x.items() if k != "plans"}
                                                                for x in runs]})
    if r == 0:
        report(args, gathered, runs, env)
    dist.barrier()
    shutdown()


def compare_step(plan, dims, m, comm_G: list[dict], quota_G: list, kept_G: list) -> dict:
    """One executed step, the runtime's counts (per rank: ``comm_bytes`` by kind, backward quota
    and kept pairs per expert) against the simulator's for the same plan: ``{"kinds": {kind:
    equal on every rank}, "quota": bool, "kept": bool, "mismatch": [...]}``."""
    from ..planning.plan import expert_sum_kernel
    from ..sim.cost import COMM_KINDS, comm_bytes_G

    G, E = plan.demand_GE.shape
    sim = comm_bytes_G(plan, dims, selects=m.selects)
    kinds, mismatch = {}, []
    for kind in COMM_KINDS:
        got = [int(c.get(kind, 0)) for c in comm_G]
        want = [int(round(x)) for x in sim[kind]]
        kinds[kind] = got == want
        if got != want:
            mismatch.append(f"{kind}: runtime {got}, simulator {want}")
    # the backward quota of each rank's own pairs per expert, and the pairs it kept (top-quota
    # selection keeps exactly the quota)
    q_GE = expert_sum_kernel(np.ascontiguousarray(plan.backward_quota_GN), np.ascontiguousarray(plan.expert_N), E)
    quota_ok = np.array_equal(np.asarray(quota_G, dtype=np.int64), q_GE)
    kept_ok = np.array_equal(np.asarray(kept_G, dtype=np.int64), q_GE)
    if not quota_ok:
        mismatch.append(f"quota: runtime {np.asarray(quota_G).tolist()}, simulator {q_GE.tolist()}")
    if not kept_ok:
        mismatch.append(f"kept: runtime {np.asarray(kept_G).tolist()}, simulator {q_GE.tolist()}")
    return {"kinds": kinds, "quota": quota_ok, "kept": kept_ok, "mismatch": mismatch}


def write_calibration(args, c0: dict):
    """The ``cpu-local`` Hardware from one rank's calibration, written to ``args.calibration``."""
    from ..environment import environment
    from ..files import write_json
    from ..sim.hardware import Hardware

    hw_fields = {k: c0[k] for k in ("gemm_tflops", "gemm_call_s", "hbm_bytes_per_s", "row_bytes_per_s", "a2a_latency_s",
                                    "fast_bytes_per_s", "forward_overhead_s", "backward_overhead_s")}
    hw = Hardware(name="cpu-local", tile_rows=1, net_bytes_per_s=hw_fields["fast_bytes_per_s"], memory_bytes=0.0,
                  fuse_gather=False, source=f"lrmoe bench simulator on {environment()['cpu_model']}", **hw_fields)
    write_json(args.calibration, {"hardware": {k: getattr(hw, k) for k in hw.__dataclass_fields__},
                                  "samples": {k: v for k, v in c0.items() if k.endswith("_samples")},
                                  "shapes": {"world": args.world, "hidden": args.hidden,
                                             "intermediate": args.intermediate},
                                  "load_average": list(os.getloadavg()), "environment": environment()})
    return hw


def report(args, gathered, runs, env) -> None:
    from ..environment import environment
    from ..files import write_json
    from ..planning import Cluster, ModelDims
    from ..sim.simulate import Method, run_method

    G, E, H, I, K = args.world, args.experts, args.hidden, args.intermediate, args.top_k
    hw = write_calibration(args, gathered[0]["calib"])
    dims = ModelDims(hidden=H, intermediate=I, num_experts=E, top_k=K, dtype_bytes=4)
    cluster = Cluster(G, E // G + 2)
    rows, same_total, same_memory_total, plans_total = [], 0, 0, 0
    for i, rec in enumerate(runs):
        plans = rec["plans"]  # plans[0] is the untimed warm-up step's
        timed = len(plans) - 1
        demand = np.stack([p.demand_GE for p in plans])[:, None]
        m = Method(f"{rec['placement']}", rec["placement"], rec["options"], drop_ratio=rec["drop_ratio"])
        sim = run_method(m, demand, cluster, dims, hw, math.inf)
        # the simulator's own plans on the same demands (plan_layer, as run_method makes them)
        from ..planning.step import plan_layer
        state, same, same_memory = None, 0, 0
        for p in plans:
            q = plan_layer(m.placement, p.demand_GE, cluster, dims, math.inf, options=m.options, selects=m.selects,
                           drop_ratio=m.drop_ratio, state=state)
            state = q.state
            same += bool(np.array_equal(p.send_GN, q.send_GN) and np.array_equal(p.backward_quota_GN, q.backward_quota_GN)
                         and p.instances == q.instances)
            # the per-rank memory the runtime's plan reports (its own ModelDims) against the simulator's
            same_memory += all(np.array_equal(getattr(p.memory, f.name), getattr(q.memory, f.name))
                               for f in dataclasses.fields(p.memory))
        steps = [compare_step(p, dims, m, [g["runs"][i]["comm"][s] for g in gathered],
                              [g["runs"][i]["quota"][s] for g in gathered], [g["runs"][i]["kept"][s] for g in gathered])
                 for s, p in enumerate(plans[1:])]
        bytes_ok = sum(all(c["kinds"].values()) for c in steps)
        kept_ok = sum(c["quota"] and c["kept"] for c in steps)
        mismatches = [f"step {s + 1}: {x}" for s, c in enumerate(steps) for x in c["mismatch"]]
        # per step the slowest rank (the barrier-to-barrier time is the straggler's)
        fwd_s = [max(g["runs"][i]["fwd_s"][s] for g in gathered) for s in range(timed)]
        bwd_s = [max(g["runs"][i]["bwd_s"][s] for g in gathered) for s in range(timed)]
        tot_s = [a + b for a, b in zip(fwd_s, bwd_s)]
        fwd, bwd = statistics.median(fwd_s), statistics.median(bwd_s)
        q1, _, q3 = statistics.quantiles(tot_s, n=4) if timed >= 2 else (tot_s[0],) * 3
        pf, pb = sim["forward_ms_per_layer"] / 1e3, sim["backward_ms_per_layer"] / 1e3
        rows.append({"routing": rec["routing"], "method": f"{rec['placement']} C{round(100 * rec['drop_ratio'])}",
                     "measured_fwd_ms": 1e3 * fwd, "predicted_fwd_ms": 1e3 * pf,
                     "measured_bwd_ms": 1e3 * bwd, "predicted_bwd_ms": 1e3 * pb,
                     "measured_total_ms": 1e3 * statistics.median(tot_s), "predicted_total_ms": 1e3 * (pf + pb),
                     "measured_total_iqr_ms": [1e3 * q1, 1e3 * q3],
                     "error_fwd": pf / fwd - 1, "error_bwd": pb / bwd - 1,
                     "error_total": (pf + pb) / statistics.median(tot_s) - 1,
                     "same_plans": same, "same_memory": same_memory, "plans": len(plans), "steps": timed,
                     "bytes_equal": bytes_ok, "kept_and_quota_equal": kept_ok, "mismatches": mismatches,
                     "bytes_by_kind_equal": {k: sum(c["kinds"][k] for c in steps) for k in steps[0]["kinds"]} if steps else {}})
        for x in mismatches:
            print(f"MISMATCH {rec['routing']} {rows[-1]['method']} {x}")
        same_total += same
        same_memory_total += same_memory
        plans_total += len(plans)
    errs = [abs(r["error_total"]) for r in rows]
    order_ok, resolved_pairs, resolved_agree = [], 0, 0
    for routing in dict.fromkeys(r["routing"] for r in rows):
        sub = [r for r in rows if r["routing"] == routing]
        order_ok.append([r["method"] for r in sorted(sub, key=lambda r: r["measured_total_ms"])]
                        == [r["method"] for r in sorted(sub, key=lambda r: r["predicted_total_ms"])])
        # pairs the measurement itself orders: interquartile ranges of the per-step totals disjoint
        for a in range(len(sub)):
            for b in range(a + 1, len(sub)):
                x, y = sub[a], sub[b]
                if x["measured_total_iqr_ms"][1] < y["measured_total_iqr_ms"][0] or \
                        y["measured_total_iqr_ms"][1] < x["measured_total_iqr_ms"][0]:
                    resolved_pairs += 1
                    resolved_agree += (x["measured_total_ms"] < y["measured_total_ms"]) == \
                        (x["predicted_total_ms"] < y["predicted_total_ms"])
    steps_total = sum(r["steps"] for r in rows)
    summary = {"plans_identical": f"{same_total} of {plans_total}",
               "bytes_identical": f"{sum(r['bytes_equal'] for r in rows)} of {steps_total} steps (every all-to-all kind, "
                                  f"every rank)",
               "kept_and_quota_identical": f"{sum(r['kept_and_quota_equal'] for r in rows)} of {steps_total} steps",
               "plan_memory_identical": f"{same_memory_total} of {plans_total}",
               "median_abs_error_total": statistics.median(errs), "max_abs_error_total": max(errs),
               "same_order": f"{sum(order_ok)} of {len(order_ok)} routings",
               "resolved_pairs_same_order": f"{resolved_agree} of {resolved_pairs}",
               "targets": "median |error| <= 15 %, none over 30 %, same order (issue 13)"}
    lines = ["| routing | method | fwd ms (pred) | bwd ms (pred) | total ms (pred) | error | same plans | bytes equal "
             "| kept, quotas equal |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['routing']} | {r['method']} | {r['measured_fwd_ms']:.2f} ({r['predicted_fwd_ms']:.2f}) | "
                     f"{r['measured_bwd_ms']:.2f} ({r['predicted_bwd_ms']:.2f}) | {r['measured_total_ms']:.2f} "
                     f"({r['predicted_total_ms']:.2f}) | {100 * r['error_total']:+.1f} % | {r['same_plans']}/{r['plans']} "
                     f"| {r['bytes_equal']}/{r['steps']} | {r['kept_and_quota_equal']}/{r['steps']} |")
    print("\n".join(lines))
    print(f"plans identical {summary['plans_identical']} (their memory, every rank and component: "
          f"{summary['plan_memory_identical']}); bytes {summary['bytes_identical']}; kept pairs and quotas "
          f"{summary['kept_and_quota_identical']}; |error| of the total: median "
          f"{100 * summary['median_abs_error_total']:.1f} %, max {100 * summary['max_abs_error_total']:.1f} %; "
          f"methods in the same order in {summary['same_order']}; method pairs the measurement orders "
          f"(interquartile ranges apart) predicted in the same order: {summary['resolved_pairs_same_order']}")
    write_json(args.out, {"benchmark": "simulator_validation", "options": {k: str(v) if isinstance(v, Path) else v
                                                                          for k, v in vars(args).items()},
                          "hardware": {k: getattr(hw, k) for k in hw.__dataclass_fields__}, "rows": rows,
                          "summary": summary, "table": lines, "load_average": list(os.getloadavg()),
                          "environment": environment()})
    print(f"load average at the end (1, 5, 15 min): {', '.join(f'{x:.2f}' for x in os.getloadavg())} "
          f"on {os.cpu_count()} CPUs")
    print(f"wrote {args.out} and {args.calibration}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned(rank, args, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(args.world), OMP_NUM_THREADS="1")
    worker(args)


def main(argv=None):
    args = parse(argv)
    if "RANK" in os.environ:  # under torchrun
        worker(args)
        return
    import torch.multiprocessing as mp

    print(f"[bench simulator] {args.world} gloo processes, {args.tokens} tokens per rank", file=sys.stderr)
    mp.start_processes(_spawned, args=(args, _free_port()), nprocs=args.world, start_method="spawn")


if __name__ == "__main__":
    main()
