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
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

BACKENDS = ("auto", "triton", "torch", "loop")
_TORCH_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_grouped_mm_args(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor, *,
                          a_index: torch.Tensor | None = None, b_index: torch.Tensor | None = None) -> int:
    """Validate operands (the contraction length counts logical, i.e. indexed, rows); return the number of groups."""
    if offs.dim() != 1 or offs.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"offs must be a 1-D int32 (or int64) tensor of cumulative end offsets, got "
                         f"{offs.dtype} of shape {tuple(offs.shape)}")
    if mat_a.dim() != 2 or mat_b.dim() not in (2, 3):
        raise ValueError(f"grouped_mm accepts 2D x 3D (row split) or 2D x 2D (contraction split), got "
                         f"{mat_a.dim()}D x {mat_b.dim()}D")
    if mat_a.dtype != mat_b.dtype:
        raise ValueError(f"mat_a and mat_b must share a dtype, got {mat_a.dtype} and {mat_b.dtype}")
    G = offs.numel()
    if mat_b.dim() == 3:
        if mat_b.shape[0] != G:
            raise ValueError(f"mat_b has {mat_b.shape[0]} groups but offs has {G}")
        if mat_a.shape[1] != mat_b.shape[1]:
            raise ValueError(f"inner dimensions differ: mat_a [M, {mat_a.shape[1]}] vs mat_b [G, {mat_b.shape[1]}, N]")
    else:
        m_a = a_index.numel() if a_index is not None else mat_a.shape[1]
        m_b = b_index.numel() if b_index is not None else mat_b.shape[0]
        if m_a != m_b:
            raise ValueError(f"contraction dimensions differ: mat_a [K, {m_a}] vs mat_b [{m_b}, N] (logical, after indexing)")
    return G


def check_index(name: str, index: torch.Tensor | None, device: torch.device) -> None:
    if index is None:
        return
    if index.dim() != 1 or index.dtype not in (torch.int32, torch.int64) or index.device != device:
        raise ValueError(f"{name} must be a 1-D int32/int64 tensor on {device}, got {index.dtype} of shape "
                         f"{tuple(index.shape)} on {index.device}")


def check_out(out: torch.Tensor, shape: tuple, dtype: torch.dtype, device: torch.device, exact: bool) -> None:
    ok = out.dtype == dtype and out.device == device and out.dim() == len(shape)
    ok = ok and (tuple(out.shape) == shape if exact else tuple(out.shape[1:]) == shape[1:])
    if not ok:
        want = f"[{shape[0] if exact else '*'}, {', '.join(map(str, shape[1:]))}]"
        raise ValueError(f"out must be a {dtype} tensor of shape {want} on {device}, got {out.dtype} of shape "
                         f"{tuple(out.shape)} on {out.device}")


def check_fused_args(mat_a, mat_b, offs, a_index, b_index, out_index, out) -> None:
    """ValueError for indices that are not 1-D int32/int64 on the operands' device, an ``out_index``
    of the wrong length, or an ``out`` of the wrong shape, dtype or device (every backend)."""
    device = mat_a.device
    for name, index in (("a_index", a_index), ("b_index", b_index), ("out_index", out_index)):
        check_index(name, index, device)
    if mat_b.dim() == 3:
        M = a_index.numel() if a_index is not None else mat_a.shape[0]
        if out_index is not None and out_index.numel() != M:
            raise ValueError(f"out_index must hold one output row per logical row of mat_a ({M}), got "
                             f"{out_index.numel()}")
        if out is not None:
            check_out(out, (M, mat_b.shape[2]), mat_a.dtype, device, exact=out_index is None)
    elif out is not None:
        check_out(out, (offs.numel(), mat_a.shape[0], mat_b.shape[1]), mat_a.dtype, device, exact=True)


def grouped_mm_loop(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Reference: one ``torch.mm`` per group (one host sync to read the offsets)."""
    ends = offs.tolist()
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


def _aligned(t: torch.Tensor) -> bool:
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
    return (lead * item) % 16 == 0 and all((s * item) % 16 == 0 for s in batch) and t.data_ptr() % 16 == 0


def torch_backend_ok(mat_a: torch.Tensor, mat_b: torch.Tensor) -> bool:
    return mat_a.dtype in _TORCH_DTYPES and _aligned(mat_a) and _aligned(mat_b)


def grouped_mm_torch(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return F.grouped_mm(mat_a, mat_b, offs=offs.to(torch.int32))


def _triton_available(device: torch.device) -> bool:
    try:
        from . import triton_grouped_gemm  # noqa: F401
    except Exception:  # pragma: no cover - triton missing or failing to import
        return False
    return triton_grouped_gemm.supported(device)


def resolve_backend(backend: str, mat_a: torch.Tensor, mat_b: torch.Tensor) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown grouped_mm backend {backend!r}; accepted: {list(BACKENDS)}")
    if backend != "auto":
        return backend
    if mat_a.is_cuda and mat_a.dtype in _TORCH_DTYPES and _triton_available(mat_a.device):
        return "triton"
    return "torch" if torch_backend_ok(mat_a, mat_b) else "loop"


def grouped_mm(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor, *, backend: str = "auto",
               a_index: torch.Tensor | None = None, b_index: torch.Tensor | None = None,
               out_index: torch.Tensor | None = None, out: torch.Tensor | None = None,
               accumulate: bool = False) -> torch.Tensor:
    """Grouped GEMM with ``torch.nn.functional.grouped_mm`` semantics (see the module docstring),
    optionally with fused gather (``a_index``, ``b_index``) and scatter (``out_index``, ``out``,
    ``accumulate``).

    Not differentiable by itself: the experts function owns the backward and calls this op for
    every GEMM of it."""
    check_grouped_mm_args(mat_a, mat_b, offs, a_index=a_index, b_index=b_index)
    if b_index is not None and mat_b.dim() == 3:
        raise ValueError("b_index applies to the contraction split (2D x 2D) only")
    if out_index is not None and mat_b.dim() == 2:
        raise ValueError("out_index applies to the row split (2D x 3D) only")
    if accumulate and out is None:
        raise ValueError("accumulate=True needs out=")
    auto = backend == "auto"
    backend = resolve_backend(backend, mat_a, mat_b)
    if backend == "triton":  # validates its own indices and out
        from . import triton_grouped_gemm

        return triton_grouped_gemm.grouped_mm(mat_a, mat_b, offs, a_index=a_index, b_index=b_index,
                                              out_index=out_index, out=out, accumulate=accumulate)
    check_fused_args(mat_a, mat_b, offs, a_index, b_index, out_index, out)
    # Reference path for the fused indices: explicit gather into contiguous buffers.
    if a_index is not None:
        mat_a = mat_a.index_select(0, a_index) if mat_b.dim() == 3 else mat_a.index_select(1, a_index)
    if b_index is not None:
        mat_b = mat_b.index_select(0, b_index)
    if backend == "torch" and auto and not torch_backend_ok(mat_a, mat_b):
        backend = "loop"  # the gathered operands no longer qualify for F.grouped_mm
    if backend == "loop":
        res = grouped_mm_loop(mat_a, mat_b, offs)
    else:
        if not torch_backend_ok(mat_a, mat_b):
            raise ValueError(f"backend='torch' needs fp32/bf16/fp16 operands with 16-byte aligned strides, got "
                             f"{mat_a.dtype} with strides {mat_a.stride()} and {mat_b.stride()}; use backend='auto'")
        res = grouped_mm_torch(mat_a, mat_b, offs)
    if out is None and out_index is None:
        return res
    if out is None:
        out = torch.empty_like(res)
    if out_index is None:
        return out.add_(res) if accumulate else out.copy_(res)
    return out.index_add_(0, out_index, res) if accumulate else out.index_copy_(0, out_index, res)
