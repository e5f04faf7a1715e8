"""Compile every Triton grouped-GEMM kernel the kit launches for a GPU architecture, on any machine.

No GPU needed: Triton compiles for a named target (default sm_90, Hopper) down to a cubin with the
ptxas bundled in its wheel. The launches come from the real code (``scripts/triton_aot.py``): the
experts' forward and backward in every mode that reaches a different kernel specialisation
(full / compact, fused gather on / off, bf16 / fp16 / fp32 with IEEE or TF32 products), at
Qwen3-30B-A3B-like dimensions scaled down, plus the ``accumulate`` and odd-stride calls of the
public op; each with TMA descriptors (Hopper) and with pointer loads (the fallback). Each distinct
specialisation is compiled for every autotune config (``--quick``: every config for the bf16
layer launches of the first size with TMA, what training runs on Hopper; only the last,
smallest-tile config for the others). The table lists shared memory per
config and whether it fits the target (configs that do not fit are pruned by the autotuner at
run time; a specialisation with no config that fits cannot run and is an error), what the code
uses (``wgmma`` warpgroup MMA, TMA bulk copies, ``cp.async`` pipelined loads) and its registers per
thread, stack frame and register spills (from the ``ptxas -v`` log of the compile).

    python scripts/check_triton_compile.py                 # sm_90, every config, JSON to results/bench/
    python scripts/check_triton_compile.py --quick --arch 90 100
    python scripts/check_triton_compile.py --quick --dtype bf16 --jobs 2   # the test's check (23 s on 2 cores)
Exit status 1 when a kernel fails to compile or no config of a specialisation fits.
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

if os.environ.get("TRITON_INTERPRET", "0") == "1":  # the real kernels, not the interpreter's
    os.environ["TRITON_INTERPRET"] = "0"
# FP fusion is left to Triton's own default, as in a real run (3.9 warns that it will change)
warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION is unset")
if "--reuse-cache" not in sys.argv:  # compile for real (and time it), not from an earlier run's cache
    import atexit
    import shutil
    import tempfile

    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="lrmoe-triton-aot-")
    atexit.register(shutil.rmtree, os.environ["TRITON_CACHE_DIR"], ignore_errors=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # triton_aot, the compile tooling beside this script

import torch  # noqa: E402

from lrmoe.environment import environment  # noqa: E402
from lrmoe.files import write_json  # noqa: E402
from lrmoe.bench.common import markdown_table  # noqa: E402
from lrmoe.kernels import triton_grouped_gemm as tgg  # noqa: E402
import triton_aot as aot  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# (T, E, K) of the layer workloads; H = 256, I = 96 (multiples of 16 as in Qwen3: TMA-eligible).
# Triton specialises integer arguments by value (1 becomes a constant, multiples of 16 get a
# divisibility hint), so the sizes matter: odd row counts with 8 experts; rows and experts
# multiples of 16 (128 experts, top-8, as Qwen3-30B-A3B); a single token, expert and pair (G = 1,
# M = 1: e.g. one local expert under expert parallelism).
SHAPES = {"T61 E8 K4": (61, 8, 4), "T64 E128 K8": (64, 128, 8), "T1 E1 K1": (1, 1, 1)}


def layer_workload(dtype: torch.dtype, *, fuse: bool, mode: str, drop_ratio: float, shape=(61, 8, 4), seed: int = 0):
    """Forward and backward of the experts (the layer's functional core) with the Triton backend."""
    from lrmoe import BackwardPolicy
    from lrmoe.experts import lrmoe_experts

    def run():
        g = torch.Generator().manual_seed(seed)
        (T, E, K), H, I = shape, 256, 96
        x = torch.randn(T, H, generator=g).to(dtype).requires_grad_()
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
        w = torch.rand(T, K, generator=g).to(dtype).requires_grad_()
        w_gu = (torch.randn(E, 2 * I, H, generator=g) * 0.05).to(dtype).requires_grad_()
        w_d = (torch.randn(E, H, I, generator=g) * 0.05).to(dtype).requires_grad_()
        policy = BackwardPolicy(drop_ratio=drop_ratio, mode=mode, backend="triton", fuse_gather=fuse)
        y = lrmoe_experts(x, idx, w, w_gu, w_d, policy)
        y.backward(torch.randn(T, H, generator=g).to(dtype))

    return run


def op_workload(dtype: torch.dtype):
    """The public op's other paths: accumulate into out, a strided (column-major) A, empty groups."""

    def run():
        g = torch.Generator().manual_seed(1)
        r = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
        offs = torch.tensor([0, 40, 40, 77], dtype=torch.int32)
        a, b = r(77, 64), r(4, 64, 48)
        tgg.grouped_mm(a, b, offs, out=r(77, 48), accumulate=True)
        tgg.grouped_mm(r(64, 77).t(), b, offs)  # column-major A
        tgg.grouped_mm(a.t(), r(77, 48), offs, out=r(4, 64, 48), accumulate=True)
        tgg.grouped_mm(a, b, offs.to(torch.int64), a_index=torch.randperm(77, generator=g))
        # scatter into out with an unit-stride (not transposed) weight, as bench_grouped_gemm does
        tgg.grouped_mm(a, b, offs, out_index=torch.randperm(77, generator=g), out=r(77, 48))

    return run


def workloads(dtypes: list[str]):
    """(dtype label, TF32 on, source, workload): every size for bf16 (the paper's dtype; integer
    specialisation does not depend on the dtype), the first size for the others."""
    for name in dtypes:
        dt = DTYPES[name]
        tf32_values = (False, True) if dt == torch.float32 else (False,)
        shapes = SHAPES if name == "bf16" else dict(list(SHAPES.items())[:1])
        for tf32 in tf32_values:
            label = f"{name}{' tf32' if tf32 else ''}"
            for shape_name, shape in shapes.items():
                for fuse in (True, False):
                    for mode, rho in (("full", 0.0), ("compact", 0.2)):
                        yield label, tf32, f"layer {shape_name} {mode} fuse={fuse}", layer_workload(
                            dt, fuse=fuse, mode=mode, drop_ratio=rho, shape=shape)
            yield label, tf32, "op accumulate/strided/int64 offs/out_index", op_workload(dt)


_JOBS: list = []  # (launch, config, arch) to compile; read by the forked workers


def _compile_job(j: int):
    launch, cfg, arch = _JOBS[j]
    return aot.compile_launch(launch, cfg, arch)


def compile_all(jobs: list, processes: int) -> list:
    """``aot.compile_launch`` of every (launch, config, arch), in order; in ``processes`` forked
    workers when more than one (the recorded launches are inherited, not pickled; each worker has its
    own Triton state, so the ptxas-log switch of one compile never meets another's)."""
    if processes <= 1 or len(jobs) <= 1:
        return [aot.compile_launch(*job) for job in jobs]
    import multiprocessing

    _JOBS[:] = jobs
    try:
        with multiprocessing.get_context("fork").Pool(processes) as pool:
            return pool.map(_compile_job, range(len(jobs)), chunksize=1)
    finally:
        _JOBS.clear()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, nargs="+", default=[90], help="compute capabilities (90 = Hopper)")
    ap.add_argument("--dtype", nargs="+", choices=sorted(DTYPES), default=["bf16", "fp16", "fp32"])
    ap.add_argument("--quick", action="store_true",
                    help="every config for the bf16 layer launches of the first size with TMA (what training "
                         "runs on Hopper), only the last (smallest tile) config for the others")
    ap.add_argument("--out", default="results/bench", help="folder for triton_compile_sm<arch>.json ('' = no file)")
    ap.add_argument("--check-binder", action="store_true",
                    help="also run JITFunction.run in warmup mode (stand-in driver, nothing compiled) for every "
                         "compiled launch and config and require the same specialisation and options")
    ap.add_argument("--reuse-cache", action="store_true",
                    help="use Triton's usual kernel cache (default: a fresh one, so that every kernel is compiled)")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads for the (tiny) captured layer runs")
    ap.add_argument("--jobs", type=int, default=1,
                    help="compile in this many processes (forked after the launches are recorded; default 1)")
    a = ap.parse_args(argv)
    if a.jobs < 1:
        ap.error(f"--jobs must be >= 1, got {a.jobs}")

    torch.set_num_threads(a.threads)
    specs = []  # (dtype label, source, launch)
    for label, tf32, source, fn in workloads(a.dtype):
        torch.backends.cuda.matmul.allow_tf32 = tf32
        try:
            for tma in (True, False):
                for launch in aot.run_captured(fn, tma):
                    specs.append((label, f"{source} tma={tma}", launch))
        finally:
            torch.backends.cuda.matmul.allow_tf32 = False

    rows, failed, binder_checks = [], [], []
    first_shape = f"layer {next(iter(SHAPES))} "  # --quick: every config only for this size's TMA launches
    plan = []  # (arch, label, source, launch, configs) per distinct specialisation
    for arch in a.arch:
        seen = set()
        todo = []
        for label, source, launch in specs:
            key = aot.variant_key(launch, aot.configs(launch.kernel)[0], arch)[1]
            if key not in seen:
                seen.add(key)
                todo.append((label, source, launch))
        print(f"sm_{arch}: {len(specs)} launches recorded, {len(todo)} distinct specialisations", flush=True)
        for label, source, launch in todo:
            cfgs = aot.configs(launch.kernel)
            if a.quick and not (label == "bf16" and source.startswith(first_shape) and source.endswith("tma=True")):
                cfgs = cfgs[-1:]  # the last config of each list: the smallest output tile
            plan.append((arch, label, source, launch, cfgs))
    compiled = compile_all([(launch, cfg, arch) for arch, _, _, launch, cfgs in plan for cfg in cfgs], a.jobs)
    done = 0
    for i, (arch, label, source, launch, cfgs) in enumerate(plan, 1):
        if a.check_binder:  # the compile check must bind as JITFunction.run does
            for cfg in cfgs:
                diff = aot.binder_mismatches(launch, cfg, arch)
                binder_checks.append(not diff)
                if diff:
                    failed.append(f"sm_{arch} {label} {source} {launch.kernel} {aot.config_name(cfg)}: binding "
                                  f"differs from JITFunction.run: {'; '.join(diff)[:1500]}")
        results = compiled[done:done + len(cfgs)]
        done += len(cfgs)
        for res in results:
            rows.append({"arch": arch, "dtype": label, "source": source, **res.__dict__})
            if res.error:
                failed.append(f"sm_{arch} {label} {source} {res.kernel} {res.config}: {res.error}")
        if not any(r.fits for r in results) and not any(r.error for r in results):
            failed.append(f"sm_{arch} {label} {source} {launch.kernel}: no config fits in shared memory "
                          f"({[r.shared for r in results]})")
        status = "ok" if all(r.error is None for r in results) else "FAILED"
        print(f"  [{i}/{len(plan)}] sm_{arch} {launch.kernel} {label} {source}: {len(results)} config(s) {status} "
              f"({sum(r.seconds for r in results):.1f} s)", flush=True)

    shown = [{"arch": f"sm_{r['arch']}", "kernel": r["kernel"].strip("_").replace("_kernel", ""),
              "dtype": r["dtype"], "source": r["source"], "config": r["config"],
              "shared": "-" if r["shared"] is None else f"{r['shared'] / 1024:.0f}",
              "fits": {True: "yes", False: "no (pruned)", None: "-"}[r["fits"]],
              "code": "-" if r["mma"] is None else " ".join(
                  [r["mma"]] + ["tma"] * bool(r["tma_loads"]) + ["cp.async"] * bool(r["async_copies"])),
              "regs": "-" if r["registers"] is None else f"{r['registers']}"
                      + (f" (spills {r['spill_store_bytes']} B)" if r["spill_store_bytes"] else ""),
              "s": f"{r['seconds']:.1f}" if r["error"] is None else "ERROR"} for r in rows]
    table = markdown_table(shown, [("arch", "arch", ""), ("kernel", "kernel", ""), ("dtype", "dtype", ""),
                                   ("source", "first launched by", ""), ("config", "config", ""),
                                   ("shared", "shared KiB", ""), ("fits", "fits", ""), ("code", "code", ""),
                                   ("regs", "registers", ""),
                                   ("s", "compile s", "")])
    if a.out:
        path = write_json(Path(a.out) / f"triton_compile_{'_'.join(f'sm{x}' for x in a.arch)}.json",
                          {"benchmark": "triton_compile", "config": vars(a), "environment": environment(torch.device("cpu")),
                           "autotune_configs": {k: [aot.config_name(c) for c in aot.configs(k)] for k in aot.KERNELS},
                           "rows": rows, "failed": failed, "binder_checks": len(binder_checks),
                           "binder_matches": sum(binder_checks), "table": table})
        print(f"wrote {path}")
    print(table)
    for f in failed:
        print("FAILED:", f, file=sys.stderr)
    print(f"{len(rows)} compiles, {len(failed)} failure(s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
