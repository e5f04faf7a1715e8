#!/usr/bin/env python
"""Expert-parallel layer benchmark: every placement policy on the same skewed routing.

    python scripts/bench_ep.py                      # spawns 4 gloo processes on CPU (or NCCL, one GPU each)
    torchrun --nproc-per-node 4 scripts/bench_ep.py # the same under torchrun

Per configuration (placement policy x backward drop ratio) and step: bytes sent by the backward
all-to-alls of token rows (alpha*g rows, their positions, dX rows; summed over ranks, only bytes
that leave a rank) and, separately, by the replicas' weight-gradient returns to their owners
(which do not shrink with the drop level), forward/backward wall time (barrier to barrier), max/mean rank load (forward
rows, kept backward rows, cost F + 2K) and the memory model's three components per rank (base
expert placement, replicas, token buffers) of the executed plan. For LRMoE at C20 it also
measures how far the EP kept set is from the single-process per-expert top-quota set. Prints a
table and writes ``results/bench/ep_<backend>.json``. Check: LRMoE at C20 sends <= 0.82x the
backward token-row bytes of LRMoE at C0; ratios of all backward bytes (replica gradients
included) are reported beside it.
"""
from __future__ import annotations

import argparse
import math
import os
import socket
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from lrmoe import BackwardPolicy  # noqa: E402
from lrmoe.environment import environment  # noqa: E402
from lrmoe.files import write_json  # noqa: E402
from lrmoe.bench.common import median  # noqa: E402
from lrmoe.kernels.routing import select_top_quota  # noqa: E402
from lrmoe.parallel.launch import init_distributed, shutdown  # noqa: E402
from lrmoe.parallel.function import BACKWARD_ROW_KEYS  # noqa: E402
from lrmoe.parallel.runtime import ExpertParallel, ExpertParallelExperts  # noqa: E402
from lrmoe.quota import quota_for, retained_total  # noqa: E402

MIB = 2**20
RATIO_TARGET = 0.82


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=4, help="processes to spawn when not under torchrun (4)")
    ap.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto")
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per rank (1024)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=128)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--hot", type=float, default=0.5, help="fraction of all pairs routed to expert 0 (0.5)")
    ap.add_argument("--drop-ratio", type=float, default=0.2, help="the C20 drop ratio (0.2)")
    ap.add_argument("--extra-slots", type=int, default=2, help="slots per rank beyond E/G (2)")
    ap.add_argument("--min-tokens", type=int, default=64, help="UltraEP's smallest replica (64 at this scale)")
    ap.add_argument("--budget-mib", type=float, default=math.inf, help="per-rank layer budget (inf)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--configs", default="fixed:0,symi:0,ultraep:0,ultraep_greedy:0,lrmoe:0,lrmoe:C,"
                                         "lrmoe:C:proportional,fixed:C",
                    help="placement:drop[:quota policy] list; C stands for --drop-ratio; quota default waterfill")
    ap.add_argument("--out", default=None, help="JSON path (default results/bench/ep_<backend>.json)")
    return ap.parse_args(argv)


def routing(args, rank, step):
    """Identical for every policy: expert 0 takes the fraction ``hot`` of the pairs, the rest uniform."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    T, K, E = args.tokens, args.top_k, args.experts
    scores = torch.rand(T, E, generator=g)
    scores[:, 0] = -1.0
    idx = torch.topk(scores, K, dim=1).indices  # K distinct non-hot experts
    hot = torch.rand(T, generator=g) < min(1.0, args.hot * K)
    idx[hot, 0] = 0
    w = torch.softmax(torch.randn(T, K, generator=g), -1)
    x = torch.randn(T, args.hidden, generator=g)
    dy = torch.randn(T, args.hidden, generator=g)
    return x, idx, w, dy


def configs(args):
    out = []
    for item in args.configs.split(","):
        name, drop, *quota = item.split(":")
        out.append((name, args.drop_ratio if drop == "C" else float(drop), quota[0] if quota else "waterfill"))
    return out


def options_for(name, args):
    return {"ultraep": {"min_tokens": args.min_tokens}}.get(name, {})


def kept_distance(recs_all, idx_all, drop, E, quota):
    """Overlap of the EP kept set with the single-process per-expert top-quota set over the same
    scores, and the ratio of their score masses (sum of R_u over kept pairs)."""
    scores = torch.cat([r[0] for r in recs_all]).reshape(-1)
    kept = torch.cat([r[1] for r in recs_all]).reshape(-1)
    idx = torch.cat(idx_all).reshape(-1)
    d_E = torch.bincount(idx, minlength=E)
    q_E = quota_for(d_E, retained_total(int(d_E.sum()), drop), quota)
    sp = select_top_quota(scores, idx, q_E)
    n = int(q_E.sum())
    return {"overlap": int((sp & kept).sum()) / n, "score_mass_ratio": float(scores[kept].sum() / scores[sp].sum()),
            "kept_ep": int(kept.sum()), "kept_sp": n}


def run_rank(args):
    env = init_distributed(backend=None if args.backend == "auto" else args.backend, timeout_s=300)
    if env.device.type == "cpu":
        torch.set_num_threads(1)
    G, r = env.world_size, env.rank
    dtype = getattr(torch, args.dtype)
    E, H, I = args.experts, args.hidden, args.intermediate
    gen = torch.Generator().manual_seed(0)
    gu_full = (torch.randn(E, 2 * I, H, generator=gen) / H**0.5).to(dtype)
    dn_full = (torch.randn(E, H, I, generator=gen) / I**0.5).to(dtype)
    budget = args.budget_mib * MIB
    results = []
    for name, drop, quota in configs(args):
        ep = ExpertParallel(E, env.ep_group, name, budget_bytes=budget, slots_per_rank=E // G + args.extra_slots,
                            **options_for(name, args))
        module = ExpertParallelExperts.from_full(gu_full, dn_full, ep, BackwardPolicy(drop_ratio=drop, quota=quota)).to(env.device)
        fwd, bwd, plan_s, comm_steps, plans, dist_steps = [], [], [], [], [], []
        for step in range(args.warmup + args.steps):
            x, idx, w, dy = (t.to(env.device) for t in routing(args, r, step))
            x = x.to(dtype)
            dist.barrier()
            t0 = time.perf_counter()
            y = module(x, idx, w)
            if env.device.type == "cuda":
                torch.cuda.synchronize()
            dist.barrier()
            t1 = time.perf_counter()
            y.backward(dy.to(y.dtype))
            if env.device.type == "cuda":
                torch.cuda.synchronize()
            dist.barrier()
            t2 = time.perf_counter()
            module.gate_up_proj.grad = module.down_proj.grad = None
            if step < args.warmup:
                continue
            rec = module.last_backward
            fwd.append(t1 - t0)
            plan_s.append(ep.plan_seconds)
            bwd.append(t2 - t1)
            comm_steps.append(dict(rec.comm_bytes))
            plans.append(ep.last_plan)
            if drop > 0:
                dist_steps.append((rec.scores.cpu(), rec.kept_mask.cpu(), idx.cpu()))
        gathered = [None] * G
        dist.all_gather_object(gathered, {"comm": comm_steps, "dist": dist_steps})
        if r != 0:
            results.append(None)
            continue
        keys = sorted({k for g in gathered for s in g["comm"] for k in s})  # plans may differ per step and rank
        comm = {k: sum(sum(s.get(k, 0) for s in g["comm"]) for g in gathered) / args.steps for k in keys}
        plan = plans[-1]
        if isinstance(plan, list):
            plan = max(plan, key=lambda p: p.memory.peak)
        mem = plan.memory
        row = {"placement": name, "drop_ratio": drop, "quota": quota if drop > 0 else None,
               "options": options_for(name, args),
               "mode": plan.info.get("mode", "dropless"), "fallback": plan.fallback,
               "fwd_ms": 1e3 * median(fwd), "bwd_ms": 1e3 * median(bwd), "plan_ms": 1e3 * median(plan_s),
               "bwd_row_bytes": sum(comm.get(k, 0) for k in BACKWARD_ROW_KEYS),
               "bwd_weight_grad_bytes": comm.get("bwd_weight_grads", 0), "comm_bytes_per_step": comm,
               "rows_G": plan.rows_G.tolist(), "kept_G": plan.kept_G.tolist(), "cost_G": plan.cost_G().tolist(),
               "replicas": int(plan.is_replica_N.sum()), "dropped": int(plan.dropped_GE.sum()),
               "memory_G": {"base": mem.base_G.tolist(), "replicas": mem.replicas_G.tolist(),
                            "tokens": mem.tokens_G.tolist(), "total": mem.total_G.tolist()}}
        for k in ("rows_G", "kept_G", "cost_G"):
            v = np.asarray(row[k], dtype=float)
            row[k.replace("_G", "_max_over_mean")] = float(v.max() / v.mean()) if v.mean() else 1.0
        if drop > 0:
            per_step = []
            for s in range(args.steps):
                recs = [(g["dist"][s][0], g["dist"][s][1]) for g in gathered]
                per_step.append(kept_distance(recs, [g["dist"][s][2] for g in gathered], drop, E, quota))
            row["kept_set"] = {k: float(np.mean([p[k] for p in per_step])) for k in per_step[0]}
        results.append(row)
        del module
    if r == 0:
        report(args, env, results)
    dist.barrier()
    shutdown()


def label(x):
    q = {"waterfill": "wf", "proportional": "prop"}.get(x["quota"], x["quota"]) if x["quota"] else ""
    return f"C{round(100 * x['drop_ratio'])}" + (f"/{q}" if q else "")


def report(args, env, rows):
    c0 = {x["placement"]: x for x in rows if x["drop_ratio"] == 0}
    checks = {}
    for x in rows:
        base = c0.get(x["placement"])
        if x["drop_ratio"] > 0 and base and base["bwd_row_bytes"]:
            ratio = x["bwd_row_bytes"] / base["bwd_row_bytes"]
            key = f"{x['placement']}_{label(x)}_bwd_bytes_over_{x['placement']}_C0"
            checks[key] = {"value": ratio, "target": f"<= {RATIO_TARGET}", "pass": ratio <= RATIO_TARGET}
            # all backward bytes, the replicas' weight-gradient returns included (they do not shrink with C)
            total = x["bwd_row_bytes"] + x["bwd_weight_grad_bytes"]
            checks[f"{x['placement']}_{label(x)}_bwd_total_bytes_over_{x['placement']}_C0"] = {
                "value": total / (base["bwd_row_bytes"] + base["bwd_weight_grad_bytes"]), "target": "report"}
            if "fixed" in c0 and x["placement"] != "fixed":
                ratio = x["bwd_row_bytes"] / c0["fixed"]["bwd_row_bytes"]
                checks[f"{x['placement']}_{label(x)}_bwd_bytes_over_fixed_C0"] = {"value": ratio, "target": "report"}
                checks[f"{x['placement']}_{label(x)}_bwd_total_bytes_over_fixed_C0"] = {
                    "value": total / c0["fixed"]["bwd_row_bytes"], "target": "report"}  # fixed has no replicas
    head = (f"{'placement':<15}{'C/quota':>8}{'fwd ms':>8}{'plan ms':>8}{'bwd ms':>8}{'bwd a2a MiB':>12}"
            f"{'repl grad MiB':>14}{'fwd a2a MiB':>12}"
            f"{'rows max/mean':>14}{'kept max/mean':>14}{'cost max/mean':>14}{'repl':>5}{'drop':>6}"
            f"{'base MiB':>9}{'repl MiB':>9}{'tok MiB':>8}")
    lines = [f"EP benchmark: {env.backend}, {env.world_size} ranks, {args.tokens} tokens/rank, H={args.hidden}, "
             f"I={args.intermediate}, E={args.experts}, top-{args.top_k}, expert 0 takes {args.hot:.0%} of pairs, "
             f"{args.dtype}, slots/rank E/G+{args.extra_slots}, medians of {args.steps} steps; memory model: max "
             f"over ranks", head, "-" * len(head)]
    for x in rows:
        mem = {k: max(v) / MIB for k, v in x["memory_G"].items()}
        cb = x["comm_bytes_per_step"]
        fwd_mib = (cb.get("fwd_dispatch", 0) + cb.get("fwd_combine", 0)) / MIB
        lines.append(f"{x['placement']:<15}{label(x):>8}{x['fwd_ms']:>8.1f}{x['plan_ms']:>8.1f}{x['bwd_ms']:>8.1f}"
                     f"{x['bwd_row_bytes'] / MIB:>12.3f}{x['bwd_weight_grad_bytes'] / MIB:>14.3f}"
                     f"{fwd_mib:>12.3f}{x['rows_max_over_mean']:>14.2f}"
                     f"{x['kept_max_over_mean']:>14.2f}{x['cost_max_over_mean']:>14.2f}{x['replicas']:>5}"
                     f"{x['dropped']:>6}{mem['base']:>9.2f}{mem['replicas']:>9.2f}{mem['tokens']:>8.2f}")
    for x in rows:
        if "kept_set" in x:
            k = x["kept_set"]
            lines.append(f"{x['placement']} {label(x)}: EP kept set vs single-process top-quota: "
                         f"overlap {k['overlap']:.4f}, score mass ratio {k['score_mass_ratio']:.4f}")
    for name, c in checks.items():
        verdict = f": {'PASS' if c['pass'] else 'FAIL'}" if "pass" in c else ""
        lines.append(f"{name}: {c['value']:.4f} (target {c['target']}){verdict}")
    print("\n".join(lines), flush=True)
    out = Path(args.out) if args.out else ROOT / "results" / "bench" / f"ep_{env.backend}.json"
    payload = {"benchmark": "expert_parallel", "config": {k: (str(v) if isinstance(v, float) and math.isinf(v) else v)
                                                           for k, v in vars(args).items()},
               "backend": env.backend, "world_size": env.world_size, "environment": environment(env.device),
               "rows": rows, "checks": checks, "table": lines}
    write_json(out, payload)
    print(f"wrote {out}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned(rank, args, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(args.world))
    run_rank(args)


def main(argv=None):
    args = parse(argv)
    if "RANK" in os.environ:  # under torchrun
        run_rank(args)
        return
    if args.backend == "nccl" or (args.backend == "auto" and torch.cuda.is_available()):
        n = torch.cuda.device_count()
        if n < args.world:
            if args.backend == "nccl":
                raise SystemExit(f"NCCL needs one GPU per rank: {n} visible, --world {args.world}")
            print(f"{n} GPU(s) visible for --world {args.world}: running with gloo on CPU", flush=True)
            args.backend = "gloo"
    mp.start_processes(_spawned, args=(args, _free_port()), nprocs=args.world, start_method="spawn")


if __name__ == "__main__":
    main()
