"""Argument checks of the grouped GEMM, shared by the dispatcher (:mod:`.grouped_gemm`) and the
Triton wrapper (:mod:`.triton_grouped_gemm`), so that every backend refuses the same calls.

Shapes, dtypes and devices are checked on every call (host metadata only). The offsets' values
(non-negative, non-decreasing) and the uniqueness of ``out_index`` need the tensors' contents:
they are checked where that costs no host synchronisation, i.e. for CPU tensors, and on
accelerators only under ``torch.autograd.set_detect_anomaly(True)`` (a debugging mode), as the
experts check their expert indices. On CUDA outside anomaly mode a bad offset or a repeated
``out_index`` is the caller's error and its result is unspecified."""
from __future__ import annotations

import torch

INDEX_DTYPES = (torch.int32, torch.int64)


def check_grouped_mm_args(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor, *,
                          a_index: torch.Tensor | None = None, b_index: torch.Tensor | None = None) -> int:
    """Validate operands (the contraction length counts logical, i.e. indexed, rows); return the number of groups."""
    if offs.dim() != 1 or offs.dtype not in INDEX_DTYPES:
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
    if index.dim() != 1 or index.dtype not in INDEX_DTYPES or index.device != device:
        raise ValueError(f"{name} must be a 1-D int32/int64 tensor on {device}, got {index.dtype} of shape "
                         f"{tuple(index.shape)} on {index.device}")


def check_out(out: torch.Tensor, shape: tuple, dtype: torch.dtype, device: torch.device, exact: bool) -> None:
    ok = out.dtype == dtype and out.device == device and out.dim() == len(shape)
    ok = ok and (tuple(out.shape) == shape if exact else tuple(out.shape[1:]) == shape[1:])
    if not ok:
        want = f"[{shape[0] if exact else '*'}, {', '.join(map(str, shape[1:]))}]"
        raise ValueError(f"out must be a {dtype} tensor of shape {want} on {device}, got {out.dtype} of shape "
                         f"{tuple(out.shape)} on {out.device}")


def check_fused_args(mat_a, mat_b, offs, a_index, b_index, out_index, out, accumulate: bool = False) -> None:
    """ValueError for an index given to the wrong mode, indices that are not 1-D int32/int64 on the
    operands' device, an ``out_index`` of the wrong length, an ``out`` of the wrong shape, dtype or
    device, or ``accumulate`` without ``out`` (every backend)."""
    if b_index is not None and mat_b.dim() == 3:
        raise ValueError("b_index applies to the contraction split (2D x 2D) only")
    if out_index is not None and mat_b.dim() == 2:
        raise ValueError("out_index applies to the row split (2D x 3D) only")
    if accumulate and out is None:
        raise ValueError("accumulate=True needs out=")
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


def values_checkable(t: torch.Tensor) -> bool:
    """Whether reading ``t``'s values costs no host synchronisation (CPU), or the user asked for
    the checks anyway (``torch.autograd.set_detect_anomaly(True)``)."""
    return t.device.type == "cpu" or (torch.is_anomaly_enabled() and t.device.type != "meta")


def check_ends(ends: list[int]) -> None:
    """ValueError unless the offsets ``ends`` (host values) are non-negative and non-decreasing."""
    start = 0
    for g, end in enumerate(ends):
        if end < start:
            raise ValueError(f"offs must be non-negative, non-decreasing cumulative end offsets, got offs[{g}] = "
                             f"{end} after {'a start of 0' if g == 0 else f'offs[{g - 1}] = {start}'} (offs = {ends})")
        start = end


def check_offsets_values(offs: torch.Tensor) -> None:
    """:func:`check_ends` on ``offs`` where its values are checkable (CPU, or anomaly mode)."""
    if offs.numel() and values_checkable(offs):
        check_ends(offs.tolist())


def check_out_index_values(out_index: torch.Tensor | None) -> None:
    """ValueError when ``out_index`` repeats a value (CPU, or anomaly mode): two logical rows would
    write one output row, and the backends would disagree on which one lands."""
    if out_index is None or out_index.numel() < 2 or not values_checkable(out_index):
        return
    s = torch.sort(out_index).values
    dup = (s[1:] == s[:-1]).nonzero()
    if dup.numel():
        raise ValueError(f"out_index must not repeat a value (each output row is written by one logical row), "
                         f"got {int(s[int(dup[0])])} more than once")


def check_call(mat_a, mat_b, offs, a_index=None, b_index=None, out_index=None, out=None,
               accumulate: bool = False) -> int:
    """Every check of one grouped_mm call (see the module docstring); returns the number of groups."""
    G = check_grouped_mm_args(mat_a, mat_b, offs, a_index=a_index, b_index=b_index)
    check_fused_args(mat_a, mat_b, offs, a_index, b_index, out_index, out, accumulate)
    check_offsets_values(offs)
    check_out_index_values(out_index)
    return G
