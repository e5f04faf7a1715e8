"""Variable-size grouped GEMM with the semantics of ``torch.nn.functional.grouped_mm``.

Two modes, selected by the ranks of the operands (offsets are int32 cumulative *end* offsets, one
per group, no leading zero; rows/columns past ``offs[-1]`` are outside every group):

* 2D x 3D ("row split", forward and dgrad): ``a [M, K]``, ``b [G, K, N]`` -> ``out [M, N]`` with
  ``out[s_g:e_g] = a[s_g:e_g] @ b[g]``. ``b`` may be a transposed view of a ``[G, N, K]`` tensor.
  Rows of ``out`` past ``offs[-1]`` are zero in the ``loop`` backend and unspecified in the
  ``torch`` backend (never read them).
* 2D x 2D ("contraction split", wgrad): ``a [K, M]``, ``b [M, N]`` -> ``out [G, K, N]`` with
  ``out[g] = a[:, s_g:e_g] @ b[s_g:e_g]``; empty groups give zeros.

Backends: ``loop`` (a plain per-group ``torch.mm`` loop: the oracle, any dtype and device),
``torch`` (``torch.nn.functional.grouped_mm``: fp32/bf16/fp16 with 16-byte aligned strides), and
``triton`` (:mod:`lrmoe.kernels.triton_grouped_gemm`: fp32/bf16/fp16 on CUDA, or on CPU under
``TRITON_INTERPRET=1``; no host synchronisation). ``auto`` picks triton on CUDA for fp32/bf16/fp16
(never for float64), else torch when the operands qualify, else loop.

Optional fused indices (all backends; triton fuses them into its loads/stores, torch and loop run
the explicit reference: gather into a contiguous buffer, GEMM, scatter):
``a_index`` -- logical row ``i`` of ``mat_a`` is ``mat_a[a_index[i]]`` (row split) or logical column
``i`` is ``mat_a[:, a_index[i]]`` (contraction split); ``b_index`` -- logical row ``i`` of a 2D
``mat_b`` is ``mat_b[b_index[i]]``; ``out_index`` -- logical output row ``i`` (row split) goes to
``out[out_index[i]]``, which must not repeat a value; ``out`` -- write into this tensor (default: a
new one of the logical shape); ``accumulate`` -- add into ``out`` instead of overwriting it.
Offsets always count logical rows. What lands in output rows addressed by logical rows past
``offs[-1]`` is unspecified (triton leaves them untouched; the reference writes what its backend
computed there).

Every backend runs the same argument checks (:mod:`lrmoe.kernels.checks`): negative or decreasing
offsets, an ``offs[-1]`` past the logical rows it splits, an index value out of range and a
repeated ``out_index`` are a ValueError for CPU tensors, and on accelerators under
``torch.autograd.set_detect_anomaly(True)`` (elsewhere the check would cost a host sync).

Under ``torch.compile`` the value checks are skipped, alignment is decided by strides only, and a
call that would run ``loop``, or ``torch`` with other operands than bf16 (the only dtype of the
compiled F.grouped_mm), runs the opaque custom operator ``lrmoe::grouped_mm_loop`` instead. A call
that resolves to ``triton`` runs the opaque ``lrmoe::triton_grouped_mm`` (the same kernels, gather
fused; rows past ``offs[-1]`` zero) and applies ``out_index`` / ``out`` / ``accumulate`` afterwards
with torch ops, as the reference path does; that operator has an autograd formula (itself again).
Outside compile nothing changes.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

from .checks import check_call, check_ends, check_grouped_mm_args, split_rows

BACKENDS = ("auto", "triton", "torch", "loop")
_TORCH_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def grouped_mm_loop(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Reference: one ``torch.mm`` per group (one host sync to read the offsets, which are then
    checked: non-negative, non-decreasing, and at most the rows (row split) or the contraction
    length (contraction split) they split)."""
    ends = offs.tolist()
    check_ends(ends, *split_rows(mat_a, mat_b))
    start = 0
    if mat_b.dim() == 3:
        out = mat_a.new_zeros(mat_a.shape[0], mat_b.shape[2])
        for g, end in enumerate(ends):
            if end > start:
                torch.mm(mat_a[start:end], mat_b[g], out=out[start:end])
            start = end
        return out
    out = mat_a.new_zeros(len(ends), mat_a.shape[0], mat_b.shape[1])
    for g, end in enumerate(ends):
        if end > start:
            torch.mm(mat_a[:, start:end], mat_b[start:end], out=out[g])
        start = end
    return out


# The loop as an opaque operator for torch.compile: its per-group slicing reads the offsets on the host,
# which a traced graph cannot do, and F.grouped_mm's compiled (fake) kernel accepts bf16 only. Inside a
# compiled region every GEMM that would run the loop, or F.grouped_mm with another dtype, runs this op
# (as transformers routes its grouped_mm experts to an opaque fallback op there).
@torch.library.custom_op("lrmoe::grouped_mm_loop", mutates_args=())
def grouped_mm_loop_op(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """:func:`grouped_mm_loop` as a custom operator (opaque to torch.compile)."""
    return grouped_mm_loop(mat_a, mat_b, offs)


@grouped_mm_loop_op.register_fake
def _grouped_mm_loop_fake(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    if mat_b.dim() == 3:
        return mat_a.new_empty(mat_a.shape[0], mat_b.shape[2])
    return mat_a.new_empty(offs.shape[0], mat_a.shape[0], mat_b.shape[1])


def compiling() -> bool:
    """Whether torch.compile is tracing the caller (then no host reads, no data pointers)."""
    return torch.compiler.is_compiling()


def aligned(t: torch.Tensor) -> bool:
    """Whether F.grouped_mm accepts ``t``'s layout: a 16-byte aligned base pointer, and the matrix
    (last two dims) row- or column-major with its leading stride a multiple of 16 bytes — decided
    as torch decides it (a [M, 1] matrix with strides (1, 1) counts as row-major with leading stride
    1, which torch rejects), batch strides 16-byte multiples."""
    item = t.element_size()
    *batch, s_r, s_c = t.stride()
    rows, cols = t.shape[-2:]
    if s_c == 1 and s_r >= max(1, cols):
        lead = s_r
    elif s_r == 1 and s_c >= max(1, rows):
        lead = s_c
    else:
        return False
    strides_ok = (lead * item) % 16 == 0 and all((s * item) % 16 == 0 for s in batch)
    # (a traced or fake tensor has no data pointer: the compiled kernel allocates aligned buffers)
    return strides_ok and (compiling() or is_fake(t) or t.data_ptr() % 16 == 0)


def torch_backend_ok(mat_a: torch.Tensor, mat_b: torch.Tensor) -> bool:
    """Whether F.grouped_mm takes these operands: fp32/bf16/fp16 with aligned layouts; inside a
    compiled region bf16 only (its compiled kernel accepts no other dtype)."""
    dtypes = (torch.bfloat16,) if compiling() or is_fake(mat_a) else _TORCH_DTYPES  # (its fake kernel: bf16 too)
    return mat_a.dtype in dtypes and aligned(mat_a) and aligned(mat_b)


def grouped_mm_torch(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return F.grouped_mm(mat_a, mat_b, offs=offs.to(torch.int32))


TRITON_IMPORT_ERROR: list[str] = []  # why lrmoe.kernels.triton_grouped_gemm failed to import, once known


def triton_module():
    """:mod:`lrmoe.kernels.triton_grouped_gemm`, or None when it fails to import (Triton missing or
    broken). The first failure is reported once with ``warnings.warn``: CUDA then runs the
    ``torch`` backend where the operands qualify, else ``loop``."""
    if TRITON_IMPORT_ERROR:
        return None
    try:
        from . import triton_grouped_gemm
    except Exception as e:  # noqa: BLE001 - any import failure: fall back, but say so
        TRITON_IMPORT_ERROR.append(f"{type(e).__name__}: {e}")
        warnings.warn(f"the Triton grouped GEMM failed to import ({TRITON_IMPORT_ERROR[0][:300]}); backend='auto' "
                      "on CUDA runs backend='torch' (F.grouped_mm) where the operands qualify, else backend='loop'",
                      RuntimeWarning, stacklevel=3)
        return None
    return triton_grouped_gemm


def auto_backend(device: torch.device, dtype: torch.dtype, torch_ok: bool) -> str:
    """What ``backend="auto"`` runs for operands of ``dtype`` on ``device``: triton on CUDA for
    fp32/bf16/fp16 (when it imports), else torch when ``torch_ok`` (the operands qualify for
    F.grouped_mm), else loop."""
    if torch.device(device).type == "cuda" and dtype in _TORCH_DTYPES:
        tgg = triton_module()
        if tgg is not None and tgg.supported(device):
            return "triton"
    return "torch" if torch_ok else "loop"


def resolve_backend(backend: str, mat_a: torch.Tensor, mat_b: torch.Tensor) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown grouped_mm backend {backend!r}; accepted: {list(BACKENDS)}")
    if backend != "auto":
        return backend
    return auto_backend(mat_a.device, mat_a.dtype, torch_backend_ok(mat_a, mat_b))


def _reference(mat_a, mat_b, offs, backend: str, auto: bool, a_index, b_index) -> torch.Tensor:
    """The torch and loop backends: explicit gather into contiguous buffers, then the GEMM."""
    if a_index is not None:
        mat_a = mat_a.index_select(0, a_index) if mat_b.dim() == 3 else mat_a.index_select(1, a_index)
    if b_index is not None:
        mat_b = mat_b.index_select(0, b_index)
    if backend == "torch" and auto and not torch_backend_ok(mat_a, mat_b):
        backend = "loop"  # the gathered operands no longer qualify for F.grouped_mm
    if (compiling() or is_fake(mat_a)) and (backend == "loop" or not torch_backend_ok(mat_a, mat_b)):
        return grouped_mm_loop_op(mat_a, mat_b, offs)  # same products as the loop and F.grouped_mm
    if backend == "loop":
        return grouped_mm_loop(mat_a, mat_b, offs)
    if not torch_backend_ok(mat_a, mat_b):
        raise ValueError(f"backend='torch' needs fp32/bf16/fp16 operands with 16-byte aligned strides, got "
                         f"{mat_a.dtype} with strides {mat_a.stride()} and {mat_b.stride()}; use backend='auto'")
    return grouped_mm_torch(mat_a, mat_b, offs)


def grouped_mm(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor, *, backend: str = "auto",
               a_index: torch.Tensor | None = None, b_index: torch.Tensor | None = None,
               out_index: torch.Tensor | None = None, out: torch.Tensor | None = None,
               accumulate: bool = False) -> torch.Tensor:
    """Grouped GEMM with ``torch.nn.functional.grouped_mm`` semantics (see the module docstring),
    optionally with fused gather (``a_index``, ``b_index``) and scatter (``out_index``, ``out``,
    ``accumulate``).

    Not differentiable in eager (only the triton path's operator under torch.compile is): the
    experts function owns the backward and calls this op for every GEMM of it."""
    check_grouped_mm_args(mat_a, mat_b, offs, a_index=a_index, b_index=b_index)
    auto = backend == "auto"
    backend = resolve_backend(backend, mat_a, mat_b)
    tgg = None
    if backend == "triton":  # the wrapper runs the same checks (lrmoe.kernels.checks)
        tgg = triton_module()
        if tgg is None:
            raise ValueError(f"backend='triton' needs the Triton grouped GEMM, which failed to import "
                             f"({TRITON_IMPORT_ERROR[0][:300]}); accepted backends here: auto, torch, loop")
        if not (compiling() or is_fake(mat_a)):  # fake tensors (a memory estimate): the op's fake kernel
            return tgg.grouped_mm(mat_a, mat_b, offs, a_index=a_index, b_index=b_index, out_index=out_index, out=out,
                                  accumulate=accumulate)
    check_call(mat_a, mat_b, offs, a_index, b_index, out_index, out, accumulate)
    if tgg is not None:  # compiled or fake: the opaque operator (gather fused), then the scatter below
        res = tgg.grouped_mm_op(mat_a, mat_b, offs, a_index, b_index)
    else:
        res = _reference(mat_a, mat_b, offs, backend, auto, a_index, b_index)
    if out is None and out_index is None:
        return res
    if out is None:
        out = torch.empty_like(res)
    if out_index is None:
        return out.add_(res) if accumulate else out.copy_(res)
    return out.index_add_(0, out_index, res) if accumulate else out.index_copy_(0, out_index, res)
