#!/usr/bin/env python
"""Grouped GEMM benchmark: Triton kernels vs torch.nn.functional.grouped_mm at one EP8 rank's shapes.

Shapes (16 local experts, 32768 tokens x top-8 = 262144 rows before drops): Qwen3-30B-A3B
(H=2048, I=768) and GLM-4.5-Air (H=4096, I=1408); group sizes balanced, skewed (Zipf-like, the
hottest expert at 4x the mean) and both compacted at C20 (waterfill quotas keeping 80 % of rows).
Sections:
  gemm     forward (gate_up, down), dgrad (dh, dX), wgrad (dW_d, dW_gu): TFLOP/s, % of the bf16
           peak measured in the same run (dense 8192^3 torch.mm), ratio to F.grouped_mm;
  fused    gather/scatter fused into the Triton loads/stores vs explicit gather -> contiguous
           buffer -> GEMM (Triton and F.grouped_mm);
  experts  the LRMoE experts function forward+backward (C0 full, C20 compact; triton and torch
           backends) vs the transformers Qwen3-MoE experts with the grouped_mm implementation.

    PYTHONPATH=. python scripts/bench_grouped_gemm.py                # CUDA, bf16, all sections
    PYTHONPATH=. python scripts/bench_grouped_gemm.py --smoke        # CPU: tiny shapes, interpreter
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the Triton kernels run under the interpreter on CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402

from lrmoe import BackwardPolicy, lrmoe_experts  # noqa: E402
from lrmoe.environment import environment  # noqa: E402
from lrmoe.files import write_json  # noqa: E402
from lrmoe.bench.common import markdown_table, median, rel_err  # noqa: E402
from lrmoe.kernels import triton_grouped_gemm as tgg  # noqa: E402
from lrmoe.quota import quota_for, retained_total  # noqa: E402

MODELS = {"qwen3-30b-a3b": (2048, 768), "glm-4.5-air": (4096, 1408)}  # H, I
ROWS, EXPERTS = 32768 * 8, 16
SMOKE = {"smoke": (64, 32)}
SMOKE_ROWS, SMOKE_EXPERTS = 192, 4
PEAK_REF_TFLOPS = 790.0  # dense bf16 matmul TFLOP/s measured on an H200 (the percentage-of-peak reference)


# ---------------------------------------------------------------- group sizes

def zipf_sizes(P: int, E: int, hot: float = 4.0) -> torch.Tensor:
    """Sizes proportional to 1/(e+1)^s with s chosen so that the largest is ``hot`` x the mean."""
    ranks = torch.arange(1, E + 1, dtype=torch.float64)
    lo, hi = 0.0, 8.0
    for _ in range(60):
        s = (lo + hi) / 2
        w = ranks**-s
        lo, hi = (s, hi) if w[0] / w.mean() < hot else (lo, s)
    return _integer_sizes(ranks**-lo, P)


def _integer_sizes(w: torch.Tensor, P: int) -> torch.Tensor:
    sizes = torch.floor(w / w.sum() * P).long()
    sizes[: P - int(sizes.sum())] += 1
    return sizes


def size_cases(P: int, E: int) -> dict[str, torch.Tensor]:
    balanced = _integer_sizes(torch.ones(E, dtype=torch.float64), P)
    skewed = zipf_sizes(P, E)
    keep = retained_total(P, 0.2)
    return {"balanced": balanced, "skewed": skewed,
            "balanced-C20": quota_for(balanced, keep, "waterfill"), "skewed-C20": quota_for(skewed, keep, "waterfill")}


# ---------------------------------------------------------------- timing

def bench_interleaved(fns, device, reps: int, warmup: int = 2) -> list[list[float]]:
    """Seconds of each of ``fns`` over ``reps`` rounds, the functions alternating within a round
    (so drift hits each alike). On CUDA: CUDA events around each call, L2 flushed before it
    (a 256 MiB write; the H200's L2 is 60 MB), after ``warmup`` untimed rounds."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    if device.type != "cuda":
        out = [[] for _ in fns]
        for _ in range(reps):
            for k, fn in enumerate(fns):
                t0 = time.perf_counter()
                fn()
                out[k].append(time.perf_counter() - t0)
        return out
    flush = torch.empty(64 * 1024 * 1024, dtype=torch.int32, device=device)
    events = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
              for _ in fns]
    torch.cuda.synchronize()
    for i in range(reps):
        for k, fn in enumerate(fns):
            flush.zero_()
            events[k][i][0].record()
            fn()
            events[k][i][1].record()
    torch.cuda.synchronize()
    return [[a.elapsed_time(b) / 1e3 for a, b in ev] for ev in events]


def bench(fn, device, reps: int) -> float:
    """Median seconds of fn() (see :func:`bench_interleaved`)."""
    return median(bench_interleaved([fn], device, reps)[0])


TOL = 2e-2  # bf16 results against a reference computed in bf16 by another kernel


def measured_peak(device, dtype) -> float | None:
    if device.type != "cuda":
        return None
    a = torch.randn(8192, 8192, device=device, dtype=dtype)
    t = bench(lambda: torch.mm(a, a), device, 20)
    return 2 * 8192**3 / t / 1e12


# ---------------------------------------------------------------- sections

def operands(H, I, E, P, device, dtype):
    g = torch.Generator(device=device).manual_seed(0)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device=device, generator=g) * scale).to(dtype)

    return dict(X=rnd(P, H), h=rnd(P, I), G=rnd(P, H), dGU=rnd(P, 2 * I),
                W_gu=rnd(E, 2 * I, H, scale=H**-0.5), W_d=rnd(E, H, I, scale=I**-0.5))


def gemm_list(t, M):
    """(pass, name, mat_a, mat_b, flop-defining (K, N)) for the six GEMMs of an experts layer."""
    X, h, G, dGU = t["X"][:M], t["h"][:M], t["G"][:M], t["dGU"][:M]
    return [("fwd", "gate_up", X, t["W_gu"].transpose(1, 2)), ("fwd", "down", h, t["W_d"].transpose(1, 2)),
            ("dgrad", "dh", G, t["W_d"]), ("dgrad", "dX", dGU, t["W_gu"]),
            ("wgrad", "dW_d", G.t(), h), ("wgrad", "dW_gu", dGU.t(), X)]


def flops(a, b, M):
    if b.dim() == 3:
        return 2 * M * a.shape[1] * b.shape[2]
    return 2 * M * a.shape[0] * b.shape[1]


def gemm_section(model, H, I, E, P, device, dtype, reps, peak):
    t = operands(H, I, E, P, device, dtype)
    rows = []
    for case, sizes in size_cases(P, E).items():
        M = int(sizes.sum())
        offs = torch.cumsum(sizes, 0).to(torch.int32).to(device)
        for pas, name, a, b in gemm_list(t, M):
            fl = flops(a, b, M)
            tri, ref = (lambda: tgg.grouped_mm(a, b, offs)), (lambda: F.grouped_mm(a, b, offs=offs))
            err = rel_err(tri(), ref())  # checked before timing; the row says whether it held
            s_tri, s_torch = bench_interleaved([tri, ref], device, reps)
            rows.append(dict(model=model, sizes=case, rows=M, max_group=int(sizes.max()), pass_=pas, gemm=name,
                             flop=fl, triton_ms=1e3 * median(s_tri), torch_ms=1e3 * median(s_torch),
                             max_rel_err=err, valid=err <= TOL, triton_samples_ms=[1e3 * x for x in s_tri],
                             torch_samples_ms=[1e3 * x for x in s_torch]))
    for r in rows:
        r["triton_tflops"] = r["flop"] / r["triton_ms"] / 1e9
        r["torch_tflops"] = r["flop"] / r["torch_ms"] / 1e9
        r["pct_peak"] = 100 * r["triton_tflops"] / peak if peak else None
        r["vs_torch"] = r["torch_ms"] / r["triton_ms"]
    return rows


def per_pass(rows):
    """Aggregate the two GEMMs of each pass: total flop / total time."""
    out = {}
    for r in rows:
        k = (r["model"], r["sizes"], r["pass_"])
        o = out.setdefault(k, dict(model=k[0], sizes=k[1], pass_=k[2], rows=r["rows"], flop=0, triton_ms=0.0, torch_ms=0.0,
                                   valid=True))
        o["valid"] = o["valid"] and r.get("valid", True)
        o["flop"] += r["flop"]
        o["triton_ms"] += r["triton_ms"]
        o["torch_ms"] += r["torch_ms"]
        o["pct_peak"] = None
    for o in out.values():
        o["triton_tflops"] = o["flop"] / o["triton_ms"] / 1e9
        o["torch_tflops"] = o["flop"] / o["torch_ms"] / 1e9
        o["vs_torch"] = o["torch_ms"] / o["triton_ms"]
    return list(out.values())


def fused_section(model, H, I, E, P, device, dtype, reps):
    """Fused index loads/stores vs explicit gather -> contiguous buffer -> GEMM (-> scatter)."""
    t = operands(H, I, E, P, device, dtype)
    g = torch.Generator(device=device).manual_seed(1)
    rows = []
    for case, sizes in size_cases(P, E).items():
        if case not in ("skewed", "skewed-C20"):
            continue
        M = int(sizes.sum())
        offs = torch.cumsum(sizes, 0).to(torch.int32).to(device)
        token = torch.randint(0, P, (M,), device=device, generator=g)  # rows of the hidden states
        pair = torch.randperm(P, device=device, generator=g)[:M]  # pair-order destination (injective)
        X, W_gu, dGU = t["X"], t["W_gu"], t["dGU"][:M]
        out = torch.zeros(P, H, device=device, dtype=dtype)
        cases = {
            "fwd gate_up, A rows gathered": (
                lambda: tgg.grouped_mm(X, W_gu.transpose(1, 2), offs, a_index=token),
                lambda: tgg.grouped_mm(X[token], W_gu.transpose(1, 2), offs),
                lambda: F.grouped_mm(X[token], W_gu.transpose(1, 2), offs=offs)),
            "dgrad dX, rows scattered": (
                lambda: tgg.grouped_mm(dGU, W_gu, offs, out_index=pair, out=out),
                lambda: out.index_copy_(0, pair, tgg.grouped_mm(dGU, W_gu, offs)),
                lambda: out.index_copy_(0, pair, F.grouped_mm(dGU, W_gu, offs=offs))),
            "wgrad dW_gu, B rows gathered": (
                lambda: tgg.grouped_mm(dGU.t(), X, offs, b_index=token),
                lambda: tgg.grouped_mm(dGU.t(), X[token], offs),
                lambda: F.grouped_mm(dGU.t(), X[token], offs=offs)),
        }
        for name, (fused, explicit, torch_explicit) in cases.items():
            err = rel_err(fused().clone(), torch_explicit().clone())  # out is shared: copy each result
            tf, te, tt = (median(x) for x in bench_interleaved([fused, explicit, torch_explicit], device, reps))
            rows.append(dict(model=model, sizes=case, rows=M, op=name, fused_ms=1e3 * tf, explicit_triton_ms=1e3 * te,
                             explicit_torch_ms=1e3 * tt, fused_speedup=te / tf, max_rel_err=err, valid=err <= TOL))
    return rows


def experts_section(model, H, I, E, P, device, dtype, reps, warmup):
    """LRMoE experts function fwd+bwd vs the transformers Qwen3-MoE experts (grouped_mm), top-1 over
    the local experts: each of the P rows an EP8 rank receives is one routed pair."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=1)
    cfg._experts_implementation = "grouped_mm"
    hf = Qwen3MoeExperts(cfg).to(device, dtype)
    torch.nn.init.normal_(hf.gate_up_proj, std=H**-0.5)
    torch.nn.init.normal_(hf.down_proj, std=I**-0.5)
    gu, dn = hf.gate_up_proj, hf.down_proj
    x = torch.randn(P, H, device=device, dtype=dtype)
    dy = torch.randn(P, H, device=device, dtype=dtype)
    weights = torch.rand(P, 1, device=device, dtype=dtype)
    variants = {"hf_grouped_mm": None}
    for backend in ("triton", "torch"):
        variants[f"C0_full_{backend}"] = BackwardPolicy(0.0, mode="full", backend=backend)
        variants[f"C20_compact_{backend}"] = BackwardPolicy(0.2, mode="compact", backend=backend)
    rows = []
    for case in ("balanced", "skewed"):
        sizes = size_cases(P, E)[case]
        index = torch.repeat_interleave(torch.arange(E), sizes)[torch.randperm(P)].view(P, 1).to(device)
        times = {v: [] for v in variants}

        def step(policy):
            for p in (gu, dn):
                p.grad = None
            xr = x.detach().requires_grad_()
            y = hf(xr, index, weights) if policy is None else lrmoe_experts(xr, index, weights, gu, dn, policy)
            y.backward(dy)
            return [y.detach(), xr.grad, gu.grad.clone(), dn.grad.clone()]

        # checked before timing: every C0 variant against the transformers experts (y, dX, dW)
        ref = step(None)
        errs = {v: max(rel_err(a, b) for a, b in zip(step(pol), ref)) for v, pol in variants.items()
                if pol is not None and pol.drop_ratio == 0}

        for it in range(warmup + reps):
            for v, pol in variants.items():  # interleaved, so drift hits every variant alike
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                step(pol)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                if it >= warmup:
                    times[v].append(time.perf_counter() - t0)
        hf_ms = 1e3 * median(times["hf_grouped_mm"])
        for v in variants:
            ms = 1e3 * median(times[v])
            rows.append(dict(model=model, sizes=case, variant=v, fwd_bwd_ms=ms, vs_hf=ms / hf_ms,
                             samples_ms=[1e3 * t for t in times[v]], max_rel_err=errs.get(v),
                             valid=errs.get(v, 0.0) <= TOL))
    return rows


# ---------------------------------------------------------------- main

def autotune_choices() -> dict:
    """The config autotune picked per kernel and key (empty under the interpreter: one config)."""
    return {name: {str(k): str(v) for k, v in getattr(kernel, "cache", {}).items()}
            for name, kernel in (("row_split", tgg.row_split_kernel), ("contraction_split", tgg.contraction_split_kernel))}


def targets(pass_rows, peak) -> list[str]:
    lines = []
    for r in pass_rows:
        if not r.get("valid", True):
            lines.append(f"[MISS] {r['model']} {r['sizes']} {r['pass_']}: Triton result differs from F.grouped_mm "
                         f"by more than {TOL} (relative); timings not judged")
            continue
        ok = r["vs_torch"] >= 1.0
        lines.append(f"[{'PASS' if ok else 'MISS'}] {r['model']} {r['sizes']} {r['pass_']}: "
                     f"{r['vs_torch']:.2f}x F.grouped_mm (target >= 1.0x)")
        if peak and r["sizes"] in ("balanced", "skewed"):  # the "large shapes": uncompacted
            pct = 100 * r["triton_tflops"] / peak
            lines.append(f"[{'PASS' if pct >= 55 else 'MISS'}] {r['model']} {r['sizes']} {r['pass_']}: "
                         f"{pct:.0f}% of the measured peak (target >= 55%)")
    return lines


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (runs on CPU under the Triton interpreter)")
    ap.add_argument("--model", action="append", choices=sorted(MODELS), help="repeatable; default: both")
    ap.add_argument("--sections", default="gemm,fused,experts", help="comma-separated subset of gemm,fused,experts")
    ap.add_argument("--reps", type=int, default=7, help="timed repeats per measurement (medians; samples kept)")
    ap.add_argument("--out", type=Path, default=Path("results/bench"), help="folder for bench_grouped_gemm_<device>.json")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.smoke:
        ap.error("no CUDA GPU: the real shapes need one; use --smoke on CPU")
    sections = set(args.sections.split(","))
    if not sections <= {"gemm", "fused", "experts"}:
        ap.error(f"unknown sections in {args.sections!r}")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    models = SMOKE if args.smoke else {m: MODELS[m] for m in (args.model or MODELS)}
    P, E = (SMOKE_ROWS, SMOKE_EXPERTS) if args.smoke else (ROWS, EXPERTS)
    reps = 1 if args.smoke and device.type == "cpu" else args.reps

    peak = measured_peak(device, dtype)
    print(f"device {device} ({torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}), {dtype}, "
          f"measured dense peak {peak and round(peak)} TFLOP/s (reference {PEAK_REF_TFLOPS:.0f})", flush=True)
    gemm_rows, fused_rows, expert_rows, errors = [], [], [], []
    path = args.out / f"bench_grouped_gemm_{device.type}.json"

    def save(done: bool):
        """Written after every section, so a run stopped by a time limit keeps what it measured."""
        pass_rows = per_pass(gemm_rows)
        for r in pass_rows:
            r["pct_peak"] = 100 * r["triton_tflops"] / peak if peak else None
        lines = targets(pass_rows, peak) if not args.smoke else []
        payload = {"benchmark": "grouped_gemm", "complete": done, "smoke": args.smoke, "dtype": str(dtype), "reps": reps,
                   "tolerance": TOL, "invalid": [f"{r['model']} {r['sizes']} {r.get('gemm') or r.get('op') or r.get('variant')}"
                                                 for r in gemm_rows + fused_rows + expert_rows if not r.get("valid", True)],
                   "rows_per_rank": P, "local_experts": E, "models": {m: dict(H=h, I=i) for m, (h, i) in models.items()},
                   "peak_tflops_measured": peak, "peak_tflops_reference": PEAK_REF_TFLOPS,
                   "tma_failed": tgg.TMA_FAILED, "autotune": autotune_choices(), "environment": environment(device),
                   "gemm": gemm_rows,
                   "passes": pass_rows, "fused": fused_rows, "experts": expert_rows, "targets": lines, "errors": errors}
        write_json(path, payload)
        return payload, pass_rows, lines

    for section in ("gemm", "fused", "experts"):  # section-major: a failure late loses nothing earlier
        if section not in sections:
            continue
        for model, (H, I) in models.items():
            print(f"[{section}] {model}", flush=True)
            try:
                if section == "gemm":
                    gemm_rows += gemm_section(model, H, I, E, P, device, dtype, reps, peak)
                elif section == "fused":
                    fused_rows += fused_section(model, H, I, E, P, device, dtype, reps)
                else:
                    expert_rows += experts_section(model, H, I, E, P, device, dtype, reps=reps,
                                                   warmup=0 if args.smoke else 2)
            except Exception as e:  # noqa: BLE001 - record, keep measuring the rest
                if args.smoke:
                    raise
                errors.append(f"{section} {model}: {type(e).__name__}: {e}")
                print("ERROR", errors[-1], flush=True)
            save(False)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    payload, pass_rows, lines = save(True)

    if fused_rows:
        print(markdown_table(fused_rows, [("model", "model", ""), ("sizes", "sizes", ""), ("op", "op", ""),
                                          ("fused_ms", "fused ms", ".3f"), ("explicit_triton_ms", "gather+triton ms", ".3f"),
                                          ("explicit_torch_ms", "gather+torch ms", ".3f"),
                                          ("fused_speedup", "fused speed-up", ".2f")]))
    if expert_rows:
        print(markdown_table(expert_rows, [("model", "model", ""), ("sizes", "sizes", ""), ("variant", "variant", ""),
                                           ("fwd_bwd_ms", "fwd+bwd ms", ".2f"), ("vs_hf", "vs HF grouped_mm", ".3f")]))
    if pass_rows:
        print(markdown_table(pass_rows, [("model", "model", ""), ("sizes", "sizes", ""), ("pass_", "pass", ""),
                                         ("rows", "rows", "d"), ("triton_tflops", "triton TFLOP/s", ".1f"),
                                         ("pct_peak", "% peak", ".0f"), ("torch_tflops", "F.grouped_mm TFLOP/s", ".1f"),
                                         ("vs_torch", "vs F.grouped_mm", ".2f")]))
    print("\n".join(lines + [f"ERROR {e}" for e in errors]))
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
