"""The grouped GEMM dispatcher's reference backends (loop, torch, auto) against a float64 per-row loop:
both split modes, empty groups, fused indices on the reference path, the F.grouped_mm layout rule,
argument validation (offsets, out_index, out, indices) and the Triton-import fallback."""
import itertools
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

from lrmoe.kernels import grouped_gemm, grouped_mm, grouped_mm_loop
from lrmoe.kernels.grouped_gemm import aligned


def random_offsets(M, G, *, zeros=True):
    cuts = torch.sort(torch.randint(0, M + 1, (G - 1,))).values
    offs = torch.cat([cuts, torch.tensor([M])])
    if zeros and G > 2:
        offs[1] = offs[0]  # an empty group
    return offs.to(torch.int32)


def naive_rows(a, b, offs):
    out, start = torch.zeros(a.shape[0], b.shape[2], dtype=torch.float64), 0
    for g, end in enumerate(offs.tolist()):
        for i in range(start, end):
            out[i] = a[i].double() @ b[g].double()
        start = end
    return out


def naive_contraction(a, b, offs):
    out, start = torch.zeros(offs.numel(), a.shape[0], b.shape[1], dtype=torch.float64), 0
    for g, end in enumerate(offs.tolist()):
        for i in range(start, end):
            out[g] += torch.outer(a[:, i].double(), b[i].double())
        start = end
    return out


# torch.nn.functional.grouped_mm has no float64 kernel: float64 goes through loop (and auto).
CASES = [(b, d) for b in ("loop", "torch", "auto") for d in (torch.float32, torch.bfloat16, torch.float64)
         if not (b == "torch" and d == torch.float64)]


@pytest.mark.parametrize("backend,dtype", CASES)
@pytest.mark.parametrize("G", [1, 3, 8])
def test_row_split(backend, dtype, G):
    M, K, N = 37, 16, 24
    a = torch.randn(M, K, dtype=dtype)
    w = torch.randn(G, N, K, dtype=dtype)  # transposed view: never copied
    offs = random_offsets(M, G)
    out = grouped_mm(a, w.transpose(1, 2), offs, backend=backend)
    ref = naive_rows(a, w.transpose(1, 2), offs)
    n = int(offs[-1])
    tol = dict(rtol=2e-2, atol=2e-1) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out[:n].double(), ref[:n], **tol)
    assert out.dtype == dtype


@pytest.mark.parametrize("backend", ["loop", "torch"])
def test_contraction_split_with_empty_groups(backend):
    M, K, N, G = 41, 16, 8, 5
    x, dy = torch.randn(M, K), torch.randn(M, N)
    offs = random_offsets(M, G)
    out = grouped_mm(x.t(), dy, offs, backend=backend)
    torch.testing.assert_close(out.double(), naive_contraction(x.t(), dy, offs), rtol=1e-4, atol=1e-4)
    assert out[1].abs().sum() == 0  # the empty group


def test_rows_past_last_offset_are_zero_in_loop():
    a, b = torch.randn(10, 4), torch.randn(2, 4, 3)
    out = grouped_mm(a, b, torch.tensor([3, 6], dtype=torch.int32), backend="loop")
    assert out[6:].abs().sum() == 0


def test_grouped_mm_errors():
    a, b = torch.randn(6, 4), torch.randn(2, 4, 3)
    offs = torch.tensor([3, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="mat_b has 2 groups but offs has 3"):
        grouped_mm(a, b, torch.tensor([1, 2, 6], dtype=torch.int32))
    with pytest.raises(ValueError, match="inner dimensions differ"):
        grouped_mm(a, torch.randn(2, 5, 3), offs)
    with pytest.raises(ValueError, match="2D x 3D"):
        grouped_mm(a[None], b, offs)
    with pytest.raises(ValueError, match="int32"):
        grouped_mm(a, b, offs.float())
    with pytest.raises(ValueError, match="unknown grouped_mm backend 'cuda'"):
        grouped_mm(a, b, offs, backend="cuda")
    with pytest.raises(ValueError, match="16-byte aligned"):
        grouped_mm(torch.randn(6, 3), torch.randn(2, 3, 3), offs, backend="torch")


def test_dispatcher_auto_with_a_index_contraction_cpu():
    """backend='auto' must pick a backend that works: here it resolves to torch from the ungathered
    operands, then rejects the gathered buffer and tells the user to use backend='auto'."""
    P, Ma, N = 8, 8, 4
    a = torch.randn(P, Ma)
    b = torch.randn(5, N)
    a_index = torch.tensor([0, 2, 4, 6, 7])
    offs = torch.tensor([2, 5], dtype=torch.int32)
    out = grouped_mm(a, b, offs, a_index=a_index, backend="auto")
    torch.testing.assert_close(out.double(), naive_contraction(a[:, a_index], b, offs), rtol=2e-5, atol=2e-5)


def test_dispatcher_auto_with_a_index_row_split_cpu():
    """Same in the row split: a [8, 3] with 16-byte row stride qualifies for torch, a[a_index] does not."""
    a = torch.randn(8, 4)[:, :3]
    b = torch.randn(2, 3, 4)
    a_index = torch.tensor([0, 2, 4, 6, 7])
    offs = torch.tensor([2, 5], dtype=torch.int32)
    out = grouped_mm(a, b, offs, a_index=a_index, backend="auto")
    torch.testing.assert_close(out.double(), naive_rows(a[a_index], b, offs), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("backend", ["loop", "torch"])
def test_dispatcher_reference_rejects_bad_out(backend):
    """docs/kernels.md: 'an out of the wrong shape or dtype' is a ValueError (all backends)."""
    a, b = torch.randn(8, 4), torch.randn(2, 4, 4)
    offs = torch.tensor([3, 8], dtype=torch.int32)
    with pytest.raises(ValueError):
        grouped_mm(a, b, offs, backend=backend, out=torch.zeros(8, 4, dtype=torch.float64))
    with pytest.raises(ValueError):
        grouped_mm(a, b, offs, backend=backend, out=torch.zeros(2, 8, 4))


@pytest.mark.parametrize("backend", ["loop", "torch"])
def test_dispatcher_reference_rejects_bad_index(backend):
    """docs/kernels.md: indices that are not 1-D int32/int64 tensors are a ValueError."""
    a, b = torch.randn(8, 4), torch.randn(2, 4, 4)
    offs = torch.tensor([3, 8], dtype=torch.int32)
    with pytest.raises(ValueError):
        grouped_mm(a, b, offs, backend=backend, a_index=torch.arange(8).float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_aligned_agrees_with_grouped_mm(dtype):
    """``backend="auto"`` picks F.grouped_mm only for layouts it accepts: a [M, 1] matrix with
    strides (1, 1) is row-major with leading stride 1 for torch, which it rejects."""
    b = torch.randn(3, 8, 8, dtype=dtype)
    checked = 0
    for M, N, transposed in itertools.product((1, 2, 3, 4, 8, 16), (1, 2, 4, 8), (False, True)):
        a = torch.randn(N, M, dtype=dtype).t() if transposed else torch.randn(M, N, dtype=dtype)
        offs = torch.tensor([M // 2, M, M], dtype=torch.int32)
        try:
            F.grouped_mm(a, b[:, :N], offs=offs)
            accepted = True
        except RuntimeError:
            accepted = False
        assert (aligned(a) and aligned(b[:, :N])) == accepted, (M, N, transposed, a.stride(), b[:, :N].stride())
        checked += 1
    assert checked == 48


# --- offsets and out_index are checked where that needs no host synchronisation (CPU) ----------------

@pytest.mark.parametrize("backend", ["loop", "torch", "auto"])
@pytest.mark.parametrize("bad", [[5, 3, 8], [-1, 4, 8]])
def test_decreasing_or_negative_offsets_are_refused(backend, bad):
    """The loop and torch backends read such offsets differently; every backend refuses them."""
    a, b = torch.randn(8, 16), torch.randn(3, 16, 16)
    with pytest.raises(ValueError, match=r"non-negative, non-decreasing.*offs = \[" + str(bad[0])):
        grouped_mm(a, b, torch.tensor(bad, dtype=torch.int32), backend=backend)
    with pytest.raises(ValueError, match="non-decreasing"):
        grouped_mm(a.t().contiguous(), torch.randn(8, 16), torch.tensor(bad, dtype=torch.int32), backend=backend)
    with pytest.raises(ValueError, match="non-decreasing"):
        grouped_mm_loop(a, b, torch.tensor(bad, dtype=torch.int32))


@pytest.mark.parametrize("backend", ["loop", "torch"])
def test_repeated_out_index_is_refused(backend):
    a, b, offs = torch.randn(6, 16), torch.randn(2, 16, 16), torch.tensor([2, 6], dtype=torch.int32)
    out_index = torch.randperm(6)
    out_index[3] = out_index[1]
    with pytest.raises(ValueError, match=f"out_index must not repeat a value.*got {int(out_index[1])} more than once"):
        grouped_mm(a, b, offs, backend=backend, out_index=out_index, out=torch.zeros(6, 16))
    perm = torch.randperm(6)  # a permutation is fine
    out = grouped_mm(a, b, offs, backend=backend, out_index=perm, out=torch.zeros(6, 16))
    torch.testing.assert_close(out[perm].double(), naive_rows(a, b, offs), rtol=2e-5, atol=2e-5)


# --- a Triton that fails to import is reported, once, with the backend that runs instead ------------

def test_failed_triton_import_warns_once_and_names_the_fallback(monkeypatch):
    """What ``auto`` does for CUDA operands, exercised on a CPU-only machine through the resolver with a
    "cuda" device: the import fails, a RuntimeWarning names the error and the fallback backend."""
    import lrmoe.kernels

    monkeypatch.setitem(sys.modules, "lrmoe.kernels.triton_grouped_gemm", None)  # import fails
    monkeypatch.delattr(lrmoe.kernels, "triton_grouped_gemm", raising=False)
    monkeypatch.setattr(grouped_gemm, "TRITON_IMPORT_ERROR", [])
    cuda = torch.device("cuda")
    with pytest.warns(RuntimeWarning, match=r"Triton grouped GEMM failed to import \(ModuleNotFoundError.*"
                                            r"backend='torch'.*else backend='loop'"):
        assert grouped_gemm.auto_backend(cuda, torch.bfloat16, torch_ok=True) == "torch"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: no second warning
        assert grouped_gemm.auto_backend(cuda, torch.float32, torch_ok=False) == "loop"
        assert grouped_gemm.auto_backend(torch.device("cpu"), torch.float32, torch_ok=True) == "torch"
    with pytest.raises(ValueError, match="backend='triton' needs the Triton grouped GEMM, which failed to import"):
        grouped_mm(torch.randn(4, 16), torch.randn(1, 16, 16), torch.tensor([4], dtype=torch.int32), backend="triton")


def test_cpu_never_tries_triton(monkeypatch):
    """On CPU ``auto`` resolves without importing Triton (so without a warning when it is missing)."""
    import lrmoe.kernels

    monkeypatch.setitem(sys.modules, "lrmoe.kernels.triton_grouped_gemm", None)
    monkeypatch.delattr(lrmoe.kernels, "triton_grouped_gemm", raising=False)
    monkeypatch.setattr(grouped_gemm, "TRITON_IMPORT_ERROR", [])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert grouped_gemm.auto_backend(torch.device("cpu"), torch.bfloat16, torch_ok=False) == "loop"
    assert grouped_gemm.TRITON_IMPORT_ERROR == []


# --- offsets past the rows they split, and index values out of range, are refused (CPU) -------------
# Fresh random shapes and values per test (the rng_seed fixture); K = N = 16 and contraction
# lengths that are multiples of 4 keep every operand 16-byte aligned for the torch backend.

BACKENDS_CPU = ["loop", "torch", "auto"]


def rint(lo, hi):
    """A random int in [lo, hi)."""
    return int(torch.randint(lo, hi, ()))


def past(offs, rows):
    """``offs`` with its last end moved 1 to 3 rows past ``rows``."""
    offs = offs.clone()
    offs[-1] = rows + rint(1, 4)
    return offs


@pytest.mark.parametrize("backend", BACKENDS_CPU)
@pytest.mark.parametrize("gather", [False, True])
def test_offsets_past_the_rows_are_refused_row_split(backend, gather):
    """2D x 3D: offs[-1] may not exceed the (logical) rows of mat_a; with a_index the bound is
    len(a_index), even where mat_a itself has more rows than offs[-1]."""
    M, G, K, N = rint(4, 13), rint(1, 5), 16, 16
    src = torch.randn(M + 8 if gather else M, K)
    a_index = torch.randint(0, src.shape[0], (M,)) if gather else None
    b = torch.randn(G, K, N)
    offs = past(random_offsets(M, G), M)
    end = int(offs[-1])
    with pytest.raises(ValueError, match=rf"offs\[-1\] = {end} is past the {M} .*at most {M}"):
        grouped_mm(src, b, offs, backend=backend, a_index=a_index)
    if not gather:
        with pytest.raises(ValueError, match=rf"offs\[-1\] = {end} is past the {M} "):
            grouped_mm_loop(src, b, offs)


@pytest.mark.parametrize("backend", BACKENDS_CPU)
@pytest.mark.parametrize("gather", ["", "a", "b", "ab"])
def test_offsets_past_the_contraction_are_refused(backend, gather):
    """2D x 2D: offs[-1] may not exceed the (logical) contraction length K."""
    K, G, P, N = 4 * rint(1, 4), rint(1, 5), 8, 16
    a = torch.randn(P, K + 8 if "a" in gather else K)
    b = torch.randn(K + 8 if "b" in gather else K, N)
    a_index = torch.randperm(K + 8)[:K] if "a" in gather else None
    b_index = torch.randint(0, K + 8, (K,)) if "b" in gather else None
    offs = past(random_offsets(K, G), K)
    end = int(offs[-1])
    with pytest.raises(ValueError, match=rf"offs\[-1\] = {end} is past the contraction length {K} .*at most {K}"):
        grouped_mm(a, b, offs, backend=backend, a_index=a_index, b_index=b_index)
    if not gather:
        with pytest.raises(ValueError, match=rf"offs\[-1\] = {end} is past the contraction length {K} "):
            grouped_mm_loop(a, b, offs)


def bad_value(n, bad):
    """An index value just outside [0, n): negative (-1 .. -n-1) or n itself."""
    return -rint(1, n + 2) if bad == "negative" else n


@pytest.mark.parametrize("backend", BACKENDS_CPU)
@pytest.mark.parametrize("bad", ["negative", "rows"])
@pytest.mark.parametrize("with_out", [False, True])
def test_out_index_out_of_range_is_refused(backend, bad, with_out):
    """out_index values must address rows of out (of the new [M, N] output without out=)."""
    M, G, K, N = rint(2, 12), rint(1, 4), 16, 16
    R = M + rint(0, 5) if with_out else M
    out_index = torch.randperm(R)[:M]
    i = rint(0, M)
    out_index[i] = v = bad_value(R, bad)  # still no repeated value
    a, b, offs = torch.randn(M, K), torch.randn(G, K, N), random_offsets(M, G)
    out = torch.zeros(R, N) if with_out else None
    with pytest.raises(ValueError, match=rf"out_index\[{i}\] = {v} is out of range.*0 <= out_index < {R}"):
        grouped_mm(a, b, offs, backend=backend, out_index=out_index, out=out)


@pytest.mark.parametrize("backend", BACKENDS_CPU)
@pytest.mark.parametrize("which", ["a_index rows", "a_index columns", "b_index"])
@pytest.mark.parametrize("bad", ["negative", "rows"])
def test_gather_index_out_of_range_is_refused(backend, which, bad):
    """a_index must address rows of mat_a (row split) or columns of mat_a (contraction split);
    b_index rows of mat_b."""
    M, G, T, P, N = 4 * rint(1, 4), rint(1, 4), rint(2, 10), 8, 16
    offs = random_offsets(M, G)
    index = torch.randint(0, T, (M,))
    i = rint(0, M)
    index[i] = v = bad_value(T, bad)
    name = which.split()[0]
    with pytest.raises(ValueError, match=rf"{name}\[{i}\] = {v} is out of range.*0 <= {name} < {T}"):
        if which == "a_index rows":
            grouped_mm(torch.randn(T, 16), torch.randn(G, 16, N), offs, backend=backend, a_index=index)
        elif which == "a_index columns":
            grouped_mm(torch.randn(P, T), torch.randn(M, N), offs, backend=backend, a_index=index)
        else:
            grouped_mm(torch.randn(P, M), torch.randn(T, N), offs, backend=backend, b_index=index)


def edge_offsets(end):
    """Random offsets with empty groups (the first and the last, one more maybe) whose last end is
    a multiple of 4, and the row count they split: offs[-1] itself ("rows") or 1 to 8 more ("short")."""
    G = rint(3, 7)
    sizes = torch.randint(0, 4, (G,))
    sizes[0] = sizes[-1] = 0
    sizes[1] += 1 + (-int(sizes.sum()) - 1) % 4  # at least one row; total a multiple of 4
    offs = torch.cumsum(sizes, 0).to(torch.int32)
    n = int(offs[-1])
    return offs, n, n if end == "rows" else n + 4 * rint(1, 3)


@pytest.mark.parametrize("backend", BACKENDS_CPU)
@pytest.mark.parametrize("end", ["rows", "short"])
def test_in_range_edge_cases_still_pass(backend, end):
    """Empty groups, offs[-1] == rows or < rows, and index values at both ends of their range run
    and match the float64 reference (rows past offs[-1] are not compared)."""
    offs, n, M = edge_offsets(end)
    G, K, N, P = offs.numel(), 16, 16, 8
    tol = dict(rtol=2e-5, atol=2e-5)
    # row split, plain and with gather + scatter into a larger out
    a, b = torch.randn(M, K), torch.randn(G, K, N)
    torch.testing.assert_close(grouped_mm(a, b, offs, backend=backend)[:n].double(), naive_rows(a, b, offs)[:n], **tol)
    T, R = rint(1, 6), M + rint(0, 4)
    src = torch.randn(T, K)
    a_index = torch.randint(0, T, (M,))
    a_index[0], a_index[-1] = 0, T - 1
    out_index = torch.cat([torch.tensor([0, R - 1]), torch.randperm(R - 2)[:M - 2] + 1])[torch.randperm(M)]
    out = grouped_mm(src, b, offs, backend=backend, a_index=a_index, out_index=out_index, out=torch.zeros(R, N))
    torch.testing.assert_close(out[out_index[:n]].double(), naive_rows(src[a_index], b, offs)[:n], **tol)
    # contraction split, plain and with both gathers
    a, b = torch.randn(P, M), torch.randn(M, N)
    torch.testing.assert_close(grouped_mm(a, b, offs, backend=backend).double(), naive_contraction(a, b, offs), **tol)
    a_index, b_index = torch.randint(0, M + 4, (M,)), torch.randint(0, T, (M,))
    a_index[0], a_index[-1], b_index[0], b_index[-1] = M + 3, 0, T - 1, 0
    a, b = torch.randn(P, M + 4), torch.randn(T, N)
    out = grouped_mm(a, b, offs, backend=backend, a_index=a_index, b_index=b_index)
    torch.testing.assert_close(out.double(), naive_contraction(a[:, a_index], b[b_index], offs), **tol)
