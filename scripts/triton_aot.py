"""Ahead-of-time compilation of the Triton grouped-GEMM kernels for a GPU target, without a GPU.

Triton compiles for a target named by architecture (``GPUTarget("cuda", 90, 32)`` is Hopper) all
the way to PTX and a cubin, with the ``ptxas`` bundled in its wheel; no GPU or driver is needed.
This module compiles exactly what the kit would launch:

1. :func:`capture` runs a function that calls :func:`lrmoe.kernels.triton_grouped_gemm.grouped_mm`
   (directly or through the layer) on CPU tensors, with the two kernels replaced by recorders:
   every launch's arguments are kept, the kernel is not run (the outputs are zero-filled so that
   code after the GEMMs sees finite values). ``tma=True`` makes the wrapper build its TMA
   descriptors as it does on Hopper.
2. :func:`compile_launch` compiles one recorded launch for one autotune config through Triton's
   own binder, as ``JITFunction.run`` does before a real launch: the same specialisation of every
   argument (dtype pointers, int32/int64, value-1 and divisible-by-16 specialisation, the TMA
   descriptors' block shapes as set by the autotune pre-hook) and the same compile options.

The kernel module must have been imported with the interpreter off (``TRITON_INTERPRET`` unset):
under the interpreter the kernels are defined with the interpreter's single small config.
Compile tooling, not a tensor op: it lives beside ``scripts/check_triton_compile.py``, which
imports it (with ``scripts/`` on ``sys.path``); ``tests/kernels/test_triton_compile.py`` runs that script.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
from typing import Callable

# Largest shared memory one block may use (opt-in), in bytes, per compute capability (CUDA
# programming guide, "Technical specifications per compute capability"); unknown ones: not judged.
SHARED_LIMIT = {80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448, 100: 232448, 103: 232448,
                120: 101376}
KERNELS = ("row_split_kernel", "contraction_split_kernel")


@dataclasses.dataclass
class Launch:
    """One recorded kernel launch: which kernel and the arguments the wrapper passed."""

    kernel: str
    args: tuple
    kwargs: dict


@dataclasses.dataclass
class Compiled:
    """The outcome of compiling one launch with one autotune config."""

    kernel: str
    variant: str  # the specialised signature, short form
    config: str
    shared: int | None  # bytes of shared memory the kernel needs
    fits: bool | None  # within the target's shared-memory limit (None: compile failed)
    cubin_bytes: int | None
    seconds: float
    error: str | None = None
    mma: str | None = None  # "wgmma" (Hopper warpgroup MMA), "mma.sync" (pre-Hopper tensor cores) or "none"
    tma_loads: bool | None = None  # TMA bulk tensor copies in the PTX
    async_copies: bool | None = None  # cp.async (pipelined pointer loads) in the PTX
    registers: int | None = None  # per thread (ptxas -v)
    stack_bytes: int | None = None  # per-thread stack frame (ptxas -v); spills live there
    spill_store_bytes: int | None = None  # register spill stores (ptxas -v; 0: none)
    spill_load_bytes: int | None = None


def _module():
    from lrmoe.kernels import triton_grouped_gemm as tgg

    if tgg.INTERPRET:
        raise RuntimeError("lrmoe.kernels.triton_grouped_gemm was imported with TRITON_INTERPRET=1; the AOT check "
                           "needs the real kernels: run it in a process with TRITON_INTERPRET unset")
    return tgg


class _Recorder:
    """Stands in for an autotuned kernel: ``kernel[grid](*args, **kwargs)`` records the launch."""

    def __init__(self, name: str, sink: list[Launch]):
        self.name, self.sink = name, sink

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.sink.append(Launch(self.name, args, dict(kwargs)))
            out = args[2]  # out_ptr in both kernels: give later code finite values
            if not kwargs.get("ACCUMULATE", False):
                out.zero_()

        return launch


@contextlib.contextmanager
def capture(tma: bool):
    """Within the block, Triton grouped GEMMs on CPU tensors are recorded, not run.

    ``tma``: build the TMA descriptors where the layout allows (as on Hopper with ``tma=None``),
    or use pointer loads only (the fallback, and pre-Hopper GPUs). Yields the list of launches."""
    tgg = _module()
    launches: list[Launch] = []
    saved = {name: getattr(tgg, name) for name in (*KERNELS, "supported", "tma_auto")}
    try:
        for name in KERNELS:
            setattr(tgg, name, _Recorder(name, launches))
        tgg.supported = lambda device: True
        tgg.tma_auto = lambda device: tma
        yield launches
    finally:
        for name, value in saved.items():
            setattr(tgg, name, value)


def configs(kernel: str) -> list:
    """The autotune configs of ``kernel`` (``triton.Config`` objects)."""
    return list(getattr(_module(), kernel).configs)


def config_name(cfg) -> str:
    kw = cfg.kwargs
    return f"{kw['BLOCK_M']}x{kw['BLOCK_N']}x{kw['BLOCK_K']} w{cfg.num_warps} s{cfg.num_stages}"


def _bind(launch: Launch, cfg, backend):
    """Triton's binder on the recorded arguments with ``cfg`` applied (its pre-hook included):
    (options, signature, constexprs, attrs) exactly as a real launch would compile them."""
    from triton import knobs
    from triton.runtime.jit import create_function_from_signature

    tgg = _module()
    autotuner = getattr(tgg, launch.kernel)
    jit_fn = autotuner.fn
    kwargs = {**launch.kwargs, **cfg.all_kwargs()}
    if cfg.pre_hook is not None:
        cfg.pre_hook({**dict(zip(jit_fn.arg_names, launch.args)), **kwargs})
    # what JITFunction.run adds before binding (the knobs this Triton has: 3.6 lacks fpsan_*)
    kwargs["debug"] = kwargs.get("debug", jit_fn.debug) or knobs.runtime.debug
    for knob in ("instrumentation_mode", "fpsan_homomorphic_casts"):
        if hasattr(knobs.compilation, knob):
            kwargs[knob] = getattr(knobs.compilation, knob)
    binder = create_function_from_signature(jit_fn.signature, jit_fn.params, backend)
    bound_args, specialization, options = binder(*launch.args, **kwargs)
    return jit_fn, jit_fn._pack_args(backend, kwargs, bound_args, specialization, options)


def variant_key(launch: Launch, cfg, capability: int = 90) -> tuple[str, str]:
    """(short signature, full key) of ``launch`` under ``cfg``: launches with equal keys compile to
    the same kernel."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    backend = make_backend(GPUTarget("cuda", capability, 32))
    _, (options, signature, constexprs, attrs) = _bind(launch, cfg, backend)
    short = ", ".join(f"{k}={v}" for k, v in signature.items()
                      if v != "constexpr" and (v.startswith("*") or v.startswith("tensordesc")))
    flags = ", ".join(f"{k}={launch.kwargs[k]}" for k in sorted(launch.kwargs) if k.isupper() and k != "G_POW2")
    full = repr((launch.kernel, sorted(signature.items()), sorted((str(k), repr(v)) for k, v in constexprs.items()),
                 sorted((str(k), repr(v)) for k, v in attrs.items()), repr(options)))
    return f"{short}; {flags}", full


def compile_launch(launch: Launch, cfg, capability: int = 90) -> Compiled:
    """Compile ``launch`` with autotune config ``cfg`` for ``sm_<capability>`` down to a cubin."""
    import time

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    short, _ = variant_key(launch, cfg, capability)
    t0 = time.perf_counter()
    log = io.StringIO()
    try:
        jit_fn, (options, signature, constexprs, attrs) = _bind(launch, cfg, backend)
        with _ptxas_log(log):
            kernel = triton.compile(ASTSource(jit_fn, signature, constexprs, attrs), target=target,
                                    options=options.__dict__)
    except Exception as e:  # noqa: BLE001 - reported per variant
        return Compiled(launch.kernel, short, config_name(cfg), None, None, None, time.perf_counter() - t0,
                        f"{type(e).__name__}: {str(e)[-2000:]}")
    shared = int(kernel.metadata.shared)
    limit = SHARED_LIMIT.get(capability)
    return Compiled(launch.kernel, short, config_name(cfg), shared, None if limit is None else shared <= limit,
                    len(kernel.asm["cubin"]), time.perf_counter() - t0,
                    **code_facts(kernel.asm["ptx"], log.getvalue()))


@contextlib.contextmanager
def _ptxas_log(sink: io.StringIO):
    """Triton runs ``ptxas -v`` and prints its log when ``knobs.nvidia.dump_ptxas_log`` is set:
    collect it in ``sink`` (nothing is printed when the kernel comes from Triton's cache)."""
    from triton import knobs

    before = knobs.nvidia.dump_ptxas_log
    knobs.nvidia.dump_ptxas_log = True
    try:
        with contextlib.redirect_stdout(sink):
            yield
    finally:
        knobs.nvidia.dump_ptxas_log = before


def code_facts(ptx: str, ptxas_log: str) -> dict:
    """What the compiled code uses: MMA instruction family, TMA, cp.async (from the PTX); registers,
    stack frame and register spills (from the ``ptxas -v`` log; None when there is none)."""
    import re

    facts = {"mma": "wgmma" if "wgmma.mma_async" in ptx else "mma.sync" if "mma.sync" in ptx else "none",
             "tma_loads": "cp.async.bulk.tensor" in ptx,
             "async_copies": bool(re.search(r"cp\.async\.c[ag]\.", ptx))}
    regs = re.search(r"Used (\d+) registers", ptxas_log)
    frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", ptxas_log)
    if regs and frame:
        facts.update(registers=int(regs.group(1)), stack_bytes=int(frame.group(1)),
                     spill_store_bytes=int(frame.group(2)), spill_load_bytes=int(frame.group(3)))
    return facts


def jit_run_specialisation(launch: Launch, cfg, capability: int = 90):
    """What ``JITFunction.run`` itself would compile for ``launch`` under ``cfg`` on
    ``sm_<capability>``: (options, signature, constexprs, attrs). Obtained by running it in warmup
    mode, as the autotuner would after applying ``cfg`` (its pre-hook included), with a stand-in
    driver for the target and the compile step intercepted (nothing is compiled). Checks that
    :func:`compile_launch` binds exactly as a real launch does (``tests/kernels/test_triton_compile.py``)."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    class _TargetOnly:
        def get_current_device(self):
            return 0

        def get_current_stream(self, device):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", capability, 32)

    jit_fn = getattr(_module(), launch.kernel).fn
    seen = []

    def intercept(key, signature, device, constexprs, options, attrs, warmup):
        seen.append((options, signature, constexprs, attrs))
        return None

    kwargs = {**launch.kwargs, **cfg.all_kwargs()}
    if cfg.pre_hook is not None:
        cfg.pre_hook({**dict(zip(jit_fn.arg_names, launch.args)), **kwargs})
    previous = getattr(driver, "_active", None)  # None here without a GPU driver
    driver.set_active(_TargetOnly())
    jit_fn._do_compile = intercept  # instance attribute: shadows the method for this call only
    try:
        jit_fn.device_caches.clear()  # binders built for the stand-in target
        jit_fn.run(*launch.args, grid=(1,), warmup=True, **kwargs)
    finally:
        del jit_fn._do_compile
        jit_fn.device_caches.clear()
        driver._active = previous  # reset_active() would build the default driver, which needs a GPU
    if len(seen) != 1:
        raise RuntimeError(f"JITFunction.run compiled {len(seen)} times for one warmup launch")
    return seen[0]


def binder_mismatches(launch: Launch, cfg, capability: int = 90) -> list[str]:
    """Where :func:`compile_launch`'s binding differs from :func:`jit_run_specialisation` (empty: none)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    real = jit_run_specialisation(launch, cfg, capability)
    _, mine = _bind(launch, cfg, make_backend(GPUTarget("cuda", capability, 32)))
    names = ("options", "signature", "constexprs", "attrs")
    return [f"{n}: JITFunction.run {a!r} vs compile check {b!r}" for n, a, b in zip(names, real, mine)
            if (a.__dict__ if n == "options" else repr(a)) != (b.__dict__ if n == "options" else repr(b))]


def run_captured(fn: Callable[[], object], tma: bool) -> list[Launch]:
    """Run ``fn`` under :func:`capture` and return its launches."""
    with capture(tma) as launches:
        fn()
    return list(launches)
