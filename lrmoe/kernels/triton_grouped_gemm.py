"""Triton variable-size grouped GEMMs (row split and contraction split) with fused gather/scatter.

Semantics are those of ``torch.nn.functional.grouped_mm`` (``offs``: int32/int64 cumulative *end*
offsets, one per group, no leading zero), extended with optional row indices so that compaction
and un-permutation need no separate copy (ScatterMoE's idea: the gather happens in the load):

* row split, 2D x 3D (forward, dgrad): ``mat_a [Ma, K]``, ``mat_b [G, K, N]`` (any strides, e.g. a
  transposed view of ``[G, N, K]`` weights). Logical rows ``i in [0, M)`` with ``M = len(a_index)``
  (or ``Ma``); logical A row ``i`` is ``mat_a[a_index[i]]``; the rows of group ``g`` are
  ``offs[g-1] <= i < offs[g]``; logical output row ``i = A_i @ mat_b[g]`` is written to
  ``out[out_index[i]]`` (or ``out[i]``), or added to it with ``accumulate=True``. ``out`` defaults
  to a new ``[M, N]`` tensor. ``out_index`` must not repeat a value (no atomics: each output row
  is owned by one program). Output rows that no logical row addresses are left untouched (rows
  of a new ``out`` past ``offs[-1]`` are uninitialised, as in torch: never read them).
* contraction split, 2D x 2D (wgrad): ``mat_a [P, Ma]``, ``mat_b [Mb, N]`` -> ``out [G, P, N]``
  with ``out[g] = sum_{offs[g-1] <= i < offs[g]} mat_a[:, a_index[i]] (outer) mat_b[b_index[i]]``;
  empty groups give zeros (or leave ``out[g]`` unchanged with ``accumulate=True``).

Offsets must be non-negative, non-decreasing and at most the rows they split, index values must
be in range and ``out_index`` must not repeat a value (checked for CPU tensors, and on CUDA only
under anomaly detection: :mod:`lrmoe.kernels.checks`). On CUDA outside anomaly mode the offsets
are clamped to ``M`` inside the kernels, so rows past ``M`` are never read, but an out-of-range
index is an out-of-bounds access.
fp32 / bf16 / fp16 operands, fp32 accumulation, output in the input dtype; fp32 uses IEEE fp32
products unless ``torch.backends.cuda.matmul.allow_tf32`` is set. All address arithmetic is int64.

No host synchronisation: the row-split kernel is persistent (one program per SM) and derives its
(group, m-tile, n-tile) work list on the device from ``offs``; the contraction split gives one
program to each (group, output tile), which loops over its group's rows. On Hopper the row split
loads the weights (3-D descriptor: a K tail is zero-filled, never the next expert) and ungathered
A rows through TMA descriptors, falling back to pointer loads if they fail to compile.
See docs/kernels.md.

:func:`grouped_mm` is not traceable by ``torch.compile`` (data pointers, autotuning, warnings);
:data:`grouped_mm_op` (``lrmoe::triton_grouped_mm``) wraps it, gather only, as an opaque custom
operator with a shape-only fake kernel and an autograd formula, for compiled regions.

Runs on CUDA, or on CPU tensors under ``TRITON_INTERPRET=1`` (set before this module is imported),
where bf16/fp16 operands are cast to fp32 before ``tl.dot`` (the interpreter's low-precision dot is
wrong) and a single autotune config is used.
"""
from __future__ import annotations

import os
import warnings

import torch
import triton
import triton.language as tl

from .checks import check_call

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - Triton without host-side TMA descriptors
    TensorDescriptor = None

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"  # fixed when the kernels are defined
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def supported(device) -> bool:
    """True where these kernels run: CUDA, or CPU when the Triton interpreter was on at import."""
    device = torch.device(device)
    return device.type == "cuda" or (device.type == "cpu" and INTERPRET)


def _set_tma_blocks(nargs) -> None:
    """Autotune pre-hook: give the host-side TMA descriptors the block shape of the chosen config."""
    bm, bn, bk = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
    if nargs.get("a_desc") is not None:
        nargs["a_desc"].block_shape = [bm, bk]
    if nargs.get("b_desc") is not None:
        nargs["b_desc"].block_shape = [1, bn, bk] if nargs["B_KMAJOR"] else [1, bk, bn]


def _configs(hopper: list[tuple[int, int, int, int, int]], interp: tuple[int, int, int], pre_hook=None):
    if INTERPRET:
        hopper = [(*interp, 4, 1)]
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s, pre_hook=pre_hook)
            for bm, bn, bk, w, s in hopper]


# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): Hopper bf16 tiles for N, K in {768..4096}.
_ROW_CONFIGS = _configs([(128, 256, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4),
                         (64, 256, 64, 8, 4), (128, 64, 64, 4, 4)], (16, 32, 32), _set_tma_blocks)
# Contraction split: BLOCK_M tiles the output rows (P), BLOCK_K the summed rows of the group.
_WGRAD_CONFIGS = _configs([(128, 256, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4),
                           (128, 128, 32, 4, 5), (64, 128, 64, 4, 4)], (32, 32, 16))


@triton.jit
def _mma(a, b, acc, CAST_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    if CAST_FP32:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=INPUT_PRECISION)


@triton.autotune(configs=_ROW_CONFIGS, key=["N", "K", "G", "HAS_A_IDX", "HAS_OUT_IDX", "A_TMA", "B_TMA"],
                 restore_value=["out_ptr"])
@triton.jit
def row_split_kernel(a_ptr, b_ptr, out_ptr, offs_ptr, a_idx_ptr, out_idx_ptr, a_desc, b_desc, M, N, K, G,
                      s_am, s_ak, s_bg, s_bk, s_bn, s_om, s_on,
                      HAS_A_IDX: tl.constexpr, HAS_OUT_IDX: tl.constexpr, ACCUMULATE: tl.constexpr,
                      A_TMA: tl.constexpr, B_TMA: tl.constexpr, B_KMAJOR: tl.constexpr,
                      G_POW2: tl.constexpr, CAST_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # Work list, on the device: group g has ceil(size_g / BLOCK_M) m-tiles; tiles are numbered
    # group-major; the group of m-tile t is the number of groups whose tiles all end at or before t.
    gid = tl.arange(0, G_POW2)
    end = tl.minimum(tl.load(offs_ptr + gid, mask=gid < G, other=0).to(tl.int64), M)
    start = tl.minimum(tl.load(offs_ptr + gid - 1, mask=(gid > 0) & (gid < G), other=0).to(tl.int64), M)
    size = tl.where(gid < G, tl.maximum(end - start, 0), 0)
    m_tiles = ((size + BLOCK_M - 1) // BLOCK_M).to(tl.int32)
    m_tiles_end = tl.cumsum(m_tiles, 0)
    n_tiles = tl.cdiv(N, BLOCK_N)
    total = tl.sum(m_tiles) * n_tiles  # int32: tile counts are far below 2**31

    for tile in range(tl.program_id(0), total, tl.num_programs(0)):
        mt = tile // n_tiles  # n-fastest: concurrent programs share A rows and one expert's weights
        nt = tile % n_tiles
        g = tl.sum((m_tiles_end <= mt).to(tl.int32))
        mine = gid == g
        row0 = tl.sum(tl.where(mine, start + (mt - m_tiles_end + m_tiles) * BLOCK_M, 0))
        row_end = tl.sum(tl.where(mine, end, 0))

        rows = row0 + tl.arange(0, BLOCK_M).to(tl.int64)
        row_ok = rows < row_end
        a_rows = tl.load(a_idx_ptr + rows, mask=row_ok, other=0).to(tl.int64) if HAS_A_IDX else rows
        cols = nt * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
        col_ok = cols < N
        ks = tl.arange(0, BLOCK_K).to(tl.int64)
        a_ptrs = a_ptr + a_rows[:, None] * s_am + ks[None, :] * s_ak
        b_ptrs = b_ptr + g.to(tl.int64) * s_bg + ks[:, None] * s_bk + cols[None, :] * s_bn
        row0_i32 = row0.to(tl.int32)  # TMA coordinates are int32
        n0 = (nt * BLOCK_N).to(tl.int32)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # per-step pointer advances in int64 (BLOCK_K * stride is int32 when a stride is specialised
        # as int32: a column-major A with >= 2**25 rows would wrap)
        a_step = tl.full((), BLOCK_K, tl.int64) * s_ak
        b_step = tl.full((), BLOCK_K, tl.int64) * s_bk
        for k0 in range(0, K, BLOCK_K):
            k_ok = ks < K - k0
            if A_TMA:  # rows of the next group are read too, but their outputs are never stored
                a = a_desc.load([row0_i32, k0])
            else:
                a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            if B_TMA:  # 3-D box: the K tail is zero-filled, never the next expert's rows
                if B_KMAJOR:
                    b = b_desc.load([g, n0, k0]).reshape(BLOCK_N, BLOCK_K).T
                else:
                    b = b_desc.load([g, k0, n0]).reshape(BLOCK_K, BLOCK_N)
            else:
                b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc = _mma(a, b, acc, CAST_FP32, INPUT_PRECISION)
            a_ptrs += a_step
            b_ptrs += b_step

        o_rows = tl.load(out_idx_ptr + rows, mask=row_ok, other=0).to(tl.int64) if HAS_OUT_IDX else rows
        o_ptrs = out_ptr + o_rows[:, None] * s_om + cols[None, :] * s_on
        o_ok = row_ok[:, None] & col_ok[None, :]
        if ACCUMULATE:
            acc += tl.load(o_ptrs, mask=o_ok, other=0.0).to(tl.float32)
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=o_ok)


@triton.autotune(configs=_WGRAD_CONFIGS, key=["P", "N", "G"], restore_value=["out_ptr"])
@triton.jit
def contraction_split_kernel(a_ptr, b_ptr, out_ptr, offs_ptr, order_ptr, a_idx_ptr, b_idx_ptr, M, P, N, G,
                              s_ap, s_am, s_bm, s_bn, s_og, s_op, s_on,
                              HAS_A_IDX: tl.constexpr, HAS_B_IDX: tl.constexpr, ACCUMULATE: tl.constexpr,
                              CAST_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # One program per (group, output tile); it loops over the group's rows (BLOCK_K at a time).
    # Groups are taken largest first (order_ptr), so a hot expert's long tiles do not start last.
    p_tiles = tl.cdiv(P, BLOCK_M)
    n_tiles = tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(0)
    g = tl.load(order_ptr + pid // (p_tiles * n_tiles))
    pt = (pid // n_tiles) % p_tiles
    nt = pid % n_tiles
    end = tl.minimum(tl.load(offs_ptr + g).to(tl.int64), M)
    start = tl.minimum(tl.load(offs_ptr + g - 1, mask=g > 0, other=0).to(tl.int64), M)

    ps = pt * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    ns = nt * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    p_ok = ps < P
    n_ok = ns < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for m0 in range(start, end, BLOCK_K):
        ms = m0 + tl.arange(0, BLOCK_K).to(tl.int64)
        m_ok = ms < end
        a_cols = tl.load(a_idx_ptr + ms, mask=m_ok, other=0).to(tl.int64) if HAS_A_IDX else ms
        b_rows = tl.load(b_idx_ptr + ms, mask=m_ok, other=0).to(tl.int64) if HAS_B_IDX else ms
        a = tl.load(a_ptr + ps[:, None] * s_ap + a_cols[None, :] * s_am, mask=p_ok[:, None] & m_ok[None, :], other=0.0)
        b = tl.load(b_ptr + b_rows[:, None] * s_bm + ns[None, :] * s_bn, mask=m_ok[:, None] & n_ok[None, :], other=0.0)
        acc = _mma(a, b, acc, CAST_FP32, INPUT_PRECISION)

    o_ptrs = out_ptr + g.to(tl.int64) * s_og + ps[:, None] * s_op + ns[None, :] * s_on
    o_ok = p_ok[:, None] & n_ok[None, :]
    if ACCUMULATE:
        acc += tl.load(o_ptrs, mask=o_ok, other=0.0).to(tl.float32)
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=o_ok)


_NUM_SMS: dict[int, int] = {}


def _num_programs(device: torch.device) -> int:
    """Persistent grid size: one program per SM (a few under the interpreter)."""
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NUM_SMS[idx]


def _kernel_flags(dtype: torch.dtype) -> dict:
    tf32 = dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32 and not INTERPRET
    precision = ("tf32" if tf32 else "ieee") if dtype == torch.float32 else None  # None: the default for 16-bit
    return dict(CAST_FP32=INTERPRET and dtype != torch.float32, INPUT_PRECISION=precision)


TMA_FAILED: list[str] = []  # set once when TMA descriptors fail to compile here; then pointer loads only


def tma_auto(device: torch.device) -> bool:
    return (TensorDescriptor is not None and not TMA_FAILED and device.type == "cuda"
            and torch.cuda.get_device_capability(device)[0] >= 9)


def tma_desc(t: torch.Tensor, dims: list[int]):
    """Host TMA descriptor over ``t`` with its dimensions in the order ``dims`` (the last must have
    unit stride), or None where TMA cannot address it (16-byte aligned base and strides needed)."""
    shape, strides = [t.shape[d] for d in dims], [t.stride(d) for d in dims]
    item = t.element_size()
    if (strides[-1] != 1 or t.data_ptr() % 16 or any(s * item % 16 for s in strides[:-1]) or shape[-1] * item < 16
            or 0 in shape or 0 in strides[:-1]):  # empty or broadcast (stride-0) dimensions: pointer loads
        return None
    return TensorDescriptor(t, shape, strides, [1] * len(dims))  # block shape set per config (_set_tma_blocks)


def grouped_mm(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor, *,
               a_index: torch.Tensor | None = None, b_index: torch.Tensor | None = None,
               out_index: torch.Tensor | None = None, out: torch.Tensor | None = None,
               accumulate: bool = False, tma: bool | None = None) -> torch.Tensor:
    """Grouped GEMM with optional fused gather/scatter (semantics in the module docstring).

    ``a_index`` gathers rows of ``mat_a`` (row split) or columns of ``mat_a`` (contraction split);
    ``b_index`` gathers rows of ``mat_b`` (contraction split only); ``out_index`` scatters output
    rows (row split only); ``accumulate`` adds into ``out`` instead of overwriting it.
    ``tma``: load the row split's weights (and its A rows when not gathered) through TMA
    descriptors where the layout allows; None (default) = on Hopper or newer, falling back to
    pointer loads for good if compilation fails; True = wherever the layout allows (also under
    the interpreter, for tests), errors propagate; False = never."""
    G = check_call(mat_a, mat_b, offs, a_index, b_index, out_index, out, accumulate)
    dtype, device = mat_a.dtype, mat_a.device
    if dtype not in DTYPES:
        raise ValueError(f"the triton grouped_mm supports {[str(d) for d in DTYPES]}, got {dtype}; use backend='loop'")
    if not supported(device) or mat_b.device != device or offs.device != device:
        raise ValueError(f"the triton grouped_mm runs on CUDA (or CPU under TRITON_INTERPRET=1 set before import); "
                         f"got mat_a on {device}, mat_b on {mat_b.device}, offs on {offs.device}")
    # the kernels read offsets and indices at base + i: make strided views (e.g. idx[:, 0]) dense
    offs = offs.contiguous()
    a_index, b_index, out_index = (None if t is None else t.contiguous() for t in (a_index, b_index, out_index))
    flags = _kernel_flags(dtype)
    dummy = offs  # stands in for absent index pointers (never read)

    if mat_b.dim() == 3:
        M = a_index.numel() if a_index is not None else mat_a.shape[0]
        K, N = mat_b.shape[1], mat_b.shape[2]
        if out is None:
            out = torch.empty(M, N, dtype=dtype, device=device)
        if M == 0 or N == 0 or G == 0:
            return out
        nprog = _num_programs(device)
        grid = lambda meta: (min(nprog, (triton.cdiv(M, meta["BLOCK_M"]) + G) * triton.cdiv(N, meta["BLOCK_N"])),)

        def launch(use_tma: bool):
            a_desc = tma_desc(mat_a, [0, 1]) if use_tma and a_index is None else None
            b_kmajor = mat_b.stride(2) != 1
            b_desc = tma_desc(mat_b, [0, 2, 1] if b_kmajor else [0, 1, 2]) if use_tma else None
            row_split_kernel[grid](
                mat_a, mat_b, out, offs, a_index if a_index is not None else dummy,
                out_index if out_index is not None else dummy, a_desc, b_desc, M, N, K, G,
                *mat_a.stride(), *mat_b.stride(), *out.stride(),
                HAS_A_IDX=a_index is not None, HAS_OUT_IDX=out_index is not None, ACCUMULATE=accumulate,
                A_TMA=a_desc is not None, B_TMA=b_desc is not None, B_KMAJOR=b_kmajor,
                G_POW2=max(16, triton.next_power_of_2(G)), **flags)

        if tma is None and tma_auto(device):
            try:
                launch(True)
            except Exception as e:  # noqa: BLE001 - any compile failure: fall back to pointer loads
                TMA_FAILED.append(f"{type(e).__name__}: {e}")
                warnings.warn(f"TMA descriptors failed in the Triton grouped GEMM ({TMA_FAILED[0][:300]}); "
                              "using pointer loads from now on")
                launch(False)
        else:
            launch(bool(tma))
        return out

    P, N = mat_a.shape[0], mat_b.shape[1]
    M = a_index.numel() if a_index is not None else mat_a.shape[1]
    if out is None:
        out = torch.empty(G, P, N, dtype=dtype, device=device)
    if out.numel() == 0:
        return out
    grid = lambda meta: (G * triton.cdiv(P, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)
    sizes = torch.diff(offs, prepend=offs.new_zeros(1))
    order = torch.argsort(sizes, descending=True, stable=True).to(torch.int32)  # on the device: no sync
    contraction_split_kernel[grid](
        mat_a, mat_b, out, offs, order, a_index if a_index is not None else dummy,
        b_index if b_index is not None else dummy, M, P, N, G,
        *mat_a.stride(), *mat_b.stride(), *out.stride(),
        HAS_A_IDX=a_index is not None, HAS_B_IDX=b_index is not None, ACCUMULATE=accumulate, **flags)
    return out


# The launcher above reads data pointers, autotunes and may warn: torch.compile cannot trace it. Inside a
# compiled region the dispatcher (lrmoe.kernels.grouped_gemm) calls this opaque operator instead: the
# gather fused as in eager, the scatter (out_index, out, accumulate) left to plain torch ops. Its
# autograd formula is the same operator again (so compiled code that differentiates through a grouped
# GEMM sees one op forward and two backward, each with its gather/scatter).
@torch.library.custom_op("lrmoe::triton_grouped_mm", mutates_args=())
def grouped_mm_op(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor, a_index: torch.Tensor | None = None,
                  b_index: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`grouped_mm` with the gather only, as a custom operator returning a new tensor. Rows of
    a row split's output past ``offs[-1]`` are zero (as in the loop backend), not uninitialised."""
    out = None
    if mat_b.dim() == 3:
        M = a_index.numel() if a_index is not None else mat_a.shape[0]
        out = mat_a.new_zeros(M, mat_b.shape[2])
    return grouped_mm(mat_a, mat_b, offs, a_index=a_index, b_index=b_index, out=out)


@grouped_mm_op.register_fake
def _grouped_mm_op_fake(mat_a, mat_b, offs, a_index=None, b_index=None):
    if mat_b.dim() == 3:
        M = a_index.shape[0] if a_index is not None else mat_a.shape[0]
        return mat_a.new_empty(M, mat_b.shape[2])
    return mat_a.new_empty(offs.shape[0], mat_a.shape[0], mat_b.shape[1])


def _setup_context(ctx, inputs, output):
    mat_a, mat_b, offs, a_index, b_index = inputs
    ctx.save_for_backward(mat_a, mat_b, offs, a_index, b_index)


def _scatter_rows(rows: torch.Tensor, index: torch.Tensor | None, n: int) -> torch.Tensor:
    """``rows`` (logical rows) summed into ``n`` physical rows through ``index`` (identity without)."""
    if index is None:
        return rows
    return rows.new_zeros(n, rows.shape[1]).index_add_(0, index, rows)


def _backward(ctx, grad):
    mat_a, mat_b, offs, a_index, b_index = ctx.saved_tensors
    need_a, need_b = ctx.needs_input_grad[:2]
    grad_a = grad_b = None
    if mat_b.dim() == 3:  # out[seg_g] = A[seg_g] @ B[g]
        if need_a:  # dA[seg_g] = dOut[seg_g] @ B[g]^T
            grad_a = _scatter_rows(grouped_mm_op(grad, mat_b.transpose(1, 2), offs), a_index, mat_a.shape[0])
        if need_b:  # dB[g] = A[seg_g]^T @ dOut[seg_g]
            grad_b = grouped_mm_op(mat_a.t(), grad, offs, a_index)
    else:  # out[g] = A[:, seg_g] @ B[seg_g]
        if need_a:  # dA[:, seg_g]^T = B[seg_g] @ dOut[g]^T
            grad_a = _scatter_rows(grouped_mm_op(mat_b, grad.transpose(1, 2), offs, b_index), a_index,
                                   mat_a.shape[1]).t()
        if need_b:  # dB[seg_g] = A[:, seg_g]^T @ dOut[g]
            grad_b = _scatter_rows(grouped_mm_op(mat_a.t(), grad, offs, a_index), b_index, mat_b.shape[0])
    return grad_a, grad_b, None, None, None


grouped_mm_op.register_autograd(_backward, setup_context=_setup_context)
