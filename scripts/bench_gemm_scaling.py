"""How the four backward grouped GEMMs of the experts scale with the rows kept per expert.

The compacted backward can only be as much faster than C0 as its GEMMs are: this measures each
backward GEMM alone (dh = G W_d, dW_d = G^T h, dW_gu = dGU^T X, dX = dGU W_gu), on balanced groups
with ``fraction x (P / E)`` rows per expert, for the grouped-GEMM backends, interleaved, medians
after warm-up. The ideal time ratio is the row fraction; what is above it is the hardware's (and
the BLAS's) per-call cost, e.g. weight-gradient outputs written whatever the row count.

    python scripts/bench_gemm_scaling.py                        # CPU, fp32, the layer benchmark's shapes
    python scripts/bench_gemm_scaling.py --device cuda     # bf16, Qwen3-30B-A3B's layer (the default there)

Every backend's result is compared with the per-group torch.mm loop on the same operands before
timing (``max_rel_err`` / ``valid`` per row, ``invalid`` in the JSON).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lrmoe.environment import environment  # noqa: E402
from lrmoe.files import write_json  # noqa: E402
from lrmoe.bench.common import markdown_table, median, rel_err, timed  # noqa: E402
from lrmoe.bench.layer import DTYPES, SHAPES  # noqa: E402
from lrmoe.kernels import grouped_mm  # noqa: E402

GEMMS = ("dh", "dW_d", "dW_gu", "dX")


def cases(shape, fraction, dtype, device, backend):
    T, H, I, E, K = shape
    n = int(T * K * fraction) // E  # rows per expert
    N = n * E
    offs = torch.arange(1, E + 1, dtype=torch.int32, device=device) * n
    r = lambda *s: torch.randn(*s, dtype=dtype, device=device)  # noqa: E731
    w_gu, w_d = r(E, 2 * I, H), r(E, H, I)
    G, X, h, dGU = r(N, H), r(N, H), r(N, I), r(N, 2 * I)
    def make(b):
        return {
            "dh": lambda: grouped_mm(G, w_d, offs, backend=b),
            "dW_d": lambda: grouped_mm(G.t(), h, offs, backend=b),
            "dW_gu": lambda: grouped_mm(dGU.t(), X, offs, backend=b),
            "dX": lambda: grouped_mm(dGU, w_gu, offs, backend=b),
        }

    fns, ref = make(backend), make("loop")
    # checked once before timing against the per-group torch.mm loop on the same operands
    errs = {g: rel_err(fns[g](), ref[g]()) for g in GEMMS} if backend != "loop" else dict.fromkeys(GEMMS, 0.0)
    return n, fns, errs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", action="append", choices=sorted(SHAPES), help="repeatable (default: cpu-small, cpu-wide)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default fp32 on CPU, bf16 on CUDA")
    ap.add_argument("--backend", action="append", choices=["torch", "loop", "triton"],
                    help="repeatable (default: torch and loop; triton too on CUDA)")
    ap.add_argument("--fractions", type=float, nargs="+", default=[1.0, 0.8, 0.5])
    ap.add_argument("--threads", type=int, default=2, help="CPU threads")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default="results/bench", help="output folder for bench_gemm_scaling_<device>.json")
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    if device.type == "cpu":
        torch.set_num_threads(a.threads)
    dtype = DTYPES[a.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    shapes = a.shape or (["qwen3-30b-a3b"] if device.type == "cuda" else ["cpu-small", "cpu-wide"])
    tol = 1e-4 if dtype in (torch.float32, torch.float64) else 2e-2
    backends = a.backend or (["torch", "loop", "triton"] if device.type == "cuda" else ["torch", "loop"])
    if 1.0 not in a.fractions:
        ap.error("--fractions must include 1.0 (the C0 reference)")
    rows = []
    for name in shapes:
        print(f"{name} {SHAPES[name]} (T, H, I, E, K) {dtype} on {device} ...", flush=True)
        fns, per_expert, errs = {}, {}, {}
        for f in a.fractions:
            for b in backends:
                per_expert[f], fns[(f, b)], errs[(f, b)] = cases(SHAPES[name], f, dtype, device, b)
        samples = {(f, b, g): [] for (f, b) in fns for g in GEMMS}
        for rep in range(a.warmup + a.repeats):  # interleaved: every case once per round
            for (f, b), gemms in fns.items():
                for g, fn in gemms.items():
                    t = timed(fn, device)
                    if rep >= a.warmup:
                        samples[(f, b, g)].append(t)
        for b in backends:
            for f in a.fractions:
                row = {"shape": name, "backend": b, "fraction": f, "rows_per_expert": per_expert[f]}
                total = total_ref = 0.0
                for g in GEMMS:
                    ms, ref = median(samples[(f, b, g)]) * 1e3, median(samples[(1.0, b, g)]) * 1e3
                    row[f"{g}_ms"], row[f"{g}_vs_full"] = ms, ms / ref
                    row[f"{g}_samples_ms"] = [t * 1e3 for t in samples[(f, b, g)]]
                    total, total_ref = total + ms, total_ref + ref
                row["total_ms"], row["total_vs_full"] = total, total / total_ref
                row["max_rel_err"] = max(errs[(f, b)].values())
                row["valid"] = row["max_rel_err"] <= tol
                rows.append(row)
    cols = [("shape", "shape", ""), ("backend", "backend", ""), ("fraction", "rows kept", ".2f"),
            ("rows_per_expert", "rows/expert", "d")]
    cols += [(f"{g}_vs_full", f"{g} / full", ".3f") for g in GEMMS]
    cols += [("total_ms", "total ms", ".1f"), ("total_vs_full", "total / full", ".3f"),
             ("max_rel_err", "max rel err vs loop", ".1e")]
    table = markdown_table(rows, cols)
    print(table)
    out = write_json(Path(a.out) / f"bench_gemm_scaling_{device.type}.json",
                     {"benchmark": "gemm_scaling", "dtype": str(dtype), "repeats": a.repeats, "warmup": a.warmup,
                      "shapes": {s: SHAPES[s] for s in shapes}, "environment": environment(device), "tolerance": tol,
                      "invalid": [f"{r['shape']} {r['backend']} {r['fraction']}" for r in rows if not r["valid"]],
                      "rows": rows, "table": table})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
