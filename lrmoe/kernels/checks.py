"""Argument checks of the grouped GEMM, shared by the dispatcher (:mod:`.grouped_gemm`) and the
Triton wrapper (:mod:`.triton_grouped_gemm`), so that every backend refuses the same calls.

Shapes, dtypes and devices are checked on every call (host metadata only). The value rules need
the tensors' contents: offsets non-negative, non-decreasing and at most the number of (logical)
rows they split (``offs[-1] <= M``: rows of ``mat_a``, or ``len(a_index)``, in the row split; the
contraction length in the contraction split); every index value in range (``a_index`` in
``[0, rows of mat_a)`` in the row split, ``[0, columns of mat_a)`` in the contraction split;
``b_index`` in ``[0, rows of mat_b)``; ``out_index`` in ``[0, rows of out)``, ``out`` defaulting
to ``M`` rows); and no repeated ``out_index`` value. They are checked where that costs no host
synchronisation, i.e. for CPU tensors, and on accelerators only under
``torch.autograd.set_detect_anomaly(True)`` (a debugging mode), as the experts check their expert
indices. On CUDA outside anomaly mode a broken value rule is the caller's error: its result is
unspecified, and an out-of-range index is an out-of-bounds access."""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

from .host import host_reads_free

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
    the checks anyway (``torch.autograd.set_detect_anomaly(True)``). Never while ``torch.compile``
    traces: a host read of a data-dependent value cannot be traced (the compiled graph runs
    without these value checks), nor for fake tensors (a memory estimate: no values)."""
    if torch.compiler.is_compiling() or is_fake(t):
        return False
    return host_reads_free(t) or (torch.is_anomaly_enabled() and t.device.type != "meta")


def check_ends(ends: list[int], rows: int | None = None, what: str = "rows") -> None:
    """ValueError unless the offsets ``ends`` (host values) are non-negative and non-decreasing
    and, given ``rows`` (the number of logical rows they split, described by ``what``), end at
    most at ``rows``."""
    start = 0
    for g, end in enumerate(ends):
        if end < start:
            raise ValueError(f"offs must be non-negative, non-decreasing cumulative end offsets, got offs[{g}] = "
                             f"{end} after {'a start of 0' if g == 0 else f'offs[{g - 1}] = {start}'} (offs = {ends})")
        start = end
    if rows is not None and ends and ends[-1] > rows:
        raise ValueError(f"offs[-1] = {ends[-1]} is past the {what}; accepted: non-negative, non-decreasing "
                         f"offsets of at most {rows} (offs = {ends})")


def split_rows(mat_a: torch.Tensor, mat_b: torch.Tensor, a_index: torch.Tensor | None = None) -> tuple[int, str]:
    """The number of logical rows the offsets split, and its description for an error message."""
    gathered = " (the length of a_index)" if a_index is not None else ""
    if mat_b.dim() == 3:
        M = a_index.numel() if a_index is not None else mat_a.shape[0]
        return M, f"{M} {'logical ' if gathered else ''}rows of mat_a{gathered}"
    K = a_index.numel() if a_index is not None else mat_a.shape[1]
    return K, f"contraction length {K} (logical columns of mat_a = logical rows of mat_b)"


def check_offsets_values(offs: torch.Tensor, rows: int | None = None, what: str = "rows") -> None:
    """:func:`check_ends` on ``offs`` where its values are checkable (CPU, or anomaly mode)."""
    if offs.numel() and values_checkable(offs):
        check_ends(offs.tolist(), rows, what)


def check_index_values(name: str, index: torch.Tensor | None, n: int, what: str) -> None:
    """ValueError when a value of ``index`` lies outside ``[0, n)`` (CPU, or anomaly mode): the
    kernels would read or write outside the tensor it addresses (``what``)."""
    if index is None or index.numel() == 0 or not values_checkable(index):
        return
    bad = ((index < 0) | (index >= n)).nonzero()
    if bad.numel():
        i = int(bad[0])
        raise ValueError(f"{name}[{i}] = {int(index[i])} is out of range: accepted values are 0 <= {name} < {n} "
                         f"({what})")


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
    rows, what = split_rows(mat_a, mat_b, a_index)
    check_offsets_values(offs, rows, what)
    if mat_b.dim() == 3:
        check_index_values("a_index", a_index, mat_a.shape[0], f"the rows of mat_a [{mat_a.shape[0]}, K]")
        R = out.shape[0] if out is not None else rows
        check_index_values("out_index", out_index, R, f"the rows of out [{R}, N]" if out is not None else
                           f"the rows of the new out [{R}, N]")
    else:
        check_index_values("a_index", a_index, mat_a.shape[1], f"the columns of mat_a [P, {mat_a.shape[1]}]")
        check_index_values("b_index", b_index, mat_b.shape[0], f"the rows of mat_b [{mat_b.shape[0]}, N]")
    check_out_index_values(out_index)
    return G
