"""Edge cases of the grouped GEMM kernels and the dispatcher, from a review pass (CPU under the
Triton interpreter, or CUDA): strided offsets and index tensors, out_index length, K = 0 with
TMA, auto-resolution after a fused gather, and the same input validation on every backend;
plus tile tails, empty and single-row groups, transposed and strided operands, accumulate and
scatter against a float64 per-group loop."""
import pytest
import torch

pytest.importorskip("triton")
from lrmoe.kernels import grouped_gemm  # noqa: E402
from lrmoe.kernels import triton_grouped_gemm as tgg  # noqa: E402
from lrmoe.kernels.grouped_gemm import grouped_mm  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not tgg.supported(DEV), reason="Triton kernels need CUDA or TRITON_INTERPRET=1")


def offs_from(sizes, dtype=torch.int32):
    return torch.cumsum(torch.tensor(sizes), 0).to(dtype).to(DEV)


def ref_rows(a, b, offs, a_index=None):
    """float64 per-group torch.mm: logical [M, N] result (rows past offs[-1] are zero)."""
    a = a.double()
    if a_index is not None:
        a = a[a_index.long()]
    b = b.double()
    out = torch.zeros(a.shape[0], b.shape[2], dtype=torch.float64, device=a.device)
    start = 0
    for g, end in enumerate(offs.tolist()):
        end = min(end, a.shape[0])
        if end > start:
            out[start:end] = a[start:end] @ b[g]
        start = max(start, end)
    return out


def ref_contr(a, b, offs, a_index=None, b_index=None):
    a, b = a.double(), b.double()
    if a_index is not None:
        a = a[:, a_index.long()]
    if b_index is not None:
        b = b[b_index.long()]
    M = a.shape[1]
    out = torch.zeros(offs.numel(), a.shape[0], b.shape[1], dtype=torch.float64, device=a.device)
    start = 0
    for g, end in enumerate(offs.tolist()):
        end = min(end, M)
        if end > start:
            out[g] = a[:, start:end] @ b[start:end]
        start = max(start, end)
    return out


TOL = {torch.float32: dict(rtol=2e-5, atol=2e-5), torch.bfloat16: dict(rtol=2e-2, atol=5e-2),
       torch.float16: dict(rtol=3e-3, atol=5e-3)}


def close(out, ref, dtype):
    scale = max(1.0, float(ref.abs().max()))
    t = TOL[dtype]
    torch.testing.assert_close(out.double(), ref, rtol=t["rtol"], atol=t["atol"] * scale)


# ---------------- row split ----------------

@pytest.mark.parametrize("K", [1, 3, 33])
@pytest.mark.parametrize("N", [1, 5, 33])
def test_row_split_odd_K_N(K, N):
    sizes = [1, 0, 17, 16, 0, 2]
    M = sum(sizes)
    offs = offs_from(sizes)
    a = torch.randn(M, K)
    b = torch.randn(len(sizes), K, N)
    close(tgg.grouped_mm(a, b, offs), ref_rows(a, b, offs), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_row_split_strided_a_and_transposed_b(dtype):
    sizes = [5, 0, 0, 40, 1]
    M, K, N = sum(sizes) + 4, 20, 36
    offs = offs_from(sizes)
    big = torch.randn(M, K + 7).to(dtype)
    a = big[:, 3:3 + K]  # row stride larger than K, non-zero storage offset
    b = torch.randn(len(sizes), N, K).to(dtype).transpose(1, 2)
    out = tgg.grouped_mm(a, b, offs)
    close(out[:sum(sizes)], ref_rows(a, b, offs)[:sum(sizes)], dtype)
    # a as a transposed view (column major)
    at = torch.randn(K, M).to(dtype).t()
    out = tgg.grouped_mm(at, b, offs)
    close(out[:sum(sizes)], ref_rows(at, b, offs)[:sum(sizes)], dtype)


def test_row_split_many_groups_all_in_last():
    G = 40  # G_POW2 = 64
    sizes = [0] * (G - 1) + [50]
    offs = offs_from(sizes)
    a, b = torch.randn(50, 8), torch.randn(G, 8, 70)  # 3 n-tiles x 4 m-tiles = 12 > 4 programs
    close(tgg.grouped_mm(a, b, offs), ref_rows(a, b, offs), torch.float32)


def test_row_split_many_groups_of_size_one():
    G = 37
    sizes = [1] * G
    offs = offs_from(sizes)
    a, b = torch.randn(G, 8), torch.randn(G, 8, 12)
    close(tgg.grouped_mm(a, b, offs), ref_rows(a, b, offs), torch.float32)


def test_row_split_non_contiguous_out_and_accumulate():
    sizes = [3, 0, 20, 1]
    M, K, N = 30, 8, 12
    offs = offs_from(sizes)
    a, b = torch.randn(M, K), torch.randn(4, K, N)
    base = torch.randn(N, M)
    out = base.clone().t()  # transposed out view
    tgg.grouped_mm(a, b, offs, out=out, accumulate=True)
    n = sum(sizes)
    ref = base.t().double().clone()
    ref[:n] += ref_rows(a, b, offs)[:n]
    close(out, ref, torch.float32)  # rows past offs[-1] untouched


def test_row_split_offs_past_M_with_a_index():
    a = torch.randn(10, 8)
    b = torch.randn(3, 8, 16)
    idx = torch.tensor([9, 9, 0, 3, 3, 3, 7], device=DEV)
    offs = torch.tensor([2, 5, 100], dtype=torch.int32, device=DEV)  # clamped to M=7
    out = tgg.grouped_mm(a, b, offs, a_index=idx)
    close(out, ref_rows(a, b, offs, a_index=idx), torch.float32)


def test_row_split_out_index_permutation_every_row_once():
    sizes = [7, 0, 19, 1, 13]
    M, K, N = sum(sizes), 12, 20
    offs = offs_from(sizes, torch.int64)
    a, b = torch.randn(M, K), torch.randn(5, K, N)
    perm = torch.randperm(M)
    out = torch.full((M, N), float("nan"))
    tgg.grouped_mm(a, b, offs, out_index=perm, out=out)
    ref = torch.empty(M, N, dtype=torch.float64)
    ref[perm] = ref_rows(a, b, offs)
    close(out, ref, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_split_tma_odd_layouts(dtype):
    sizes = [1, 0, 17, 16]
    M, K, N = 40, 40, 24
    offs = offs_from(sizes)
    big = torch.randn(M, 64).to(dtype)
    a = big[:, :K]  # row stride 64 (aligned), descriptor must use it
    b = torch.randn(4, N, K).to(dtype).transpose(1, 2)
    assert tgg._tma_desc(a, [0, 1]) is not None
    n = sum(sizes)
    close(tgg.grouped_mm(a, b, offs, tma=True)[:n], ref_rows(a, b, offs)[:n], dtype)
    # b sliced along N (stride larger than N)
    bb = torch.randn(4, K, 40).to(dtype)[:, :, :N]
    close(tgg.grouped_mm(a, bb, offs, tma=True)[:n], ref_rows(a, bb, offs)[:n], dtype)


def test_row_split_tma_expanded_b():
    """b broadcast over groups (stride 0 on G)."""
    sizes = [5, 11, 4]
    M, K, N = 20, 16, 8
    offs = offs_from(sizes)
    a = torch.randn(M, K)
    b = torch.randn(1, K, N).expand(3, K, N)
    close(tgg.grouped_mm(a, b, offs, tma=True), ref_rows(a, b, offs), torch.float32)
    close(tgg.grouped_mm(a, b, offs, tma=False), ref_rows(a, b, offs), torch.float32)


def test_row_split_out_index_shorter_than_rows_is_rejected():
    """out_index must have one entry per logical row; a shorter one is a shape error (the reference
    path raises), not an out-of-bounds read of the index. Run in a subprocess: it segfaults."""
    import os
    import subprocess
    import sys

    code = (
        "import os; os.environ['TRITON_INTERPRET'] = '1'\n"
        "import torch\n"
        "from lrmoe.kernels import triton_grouped_gemm as tgg\n"
        "a, b = torch.randn(10, 8), torch.randn(2, 8, 4)\n"
        "offs = torch.tensor([4, 10], dtype=torch.int32)\n"
        "try:\n"
        "    tgg.grouped_mm(a, b, offs, out_index=torch.arange(6), out=torch.zeros(10, 4))\n"
        "    print('NO ERROR')\n"
        "except ValueError as e:\n"
        "    print('VALUEERROR', e)\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "VALUEERROR" in r.stdout, (r.returncode, r.stdout[-500:], r.stderr[-300:])


# ---------------- contraction split ----------------

@pytest.mark.parametrize("P,N", [(1, 1), (3, 5), (33, 34)])
def test_contraction_odd_shapes(P, N):
    sizes = [1, 0, 17, 16, 0, 2]
    M = sum(sizes)
    offs = offs_from(sizes)
    a, b = torch.randn(P, M), torch.randn(M, N)  # a contiguous (not dy.t())
    close(tgg.grouped_mm(a, b, offs), ref_contr(a, b, offs), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_contraction_strided_and_offs_past_M(dtype):
    M, P, N = 30, 12, 20
    big = torch.randn(M, P + 5).to(dtype)
    a = big[:, 2:2 + P].t()  # transposed view with a larger row stride
    b = torch.randn(M, N + 3).to(dtype)[:, 1:1 + N]
    offs = torch.tensor([0, 7, 7, 25, 40, 60], dtype=torch.int32, device=DEV)  # past M: clamped
    out = tgg.grouped_mm(a, b, offs)
    close(out, ref_contr(a, b, offs), dtype)


def test_contraction_gather_repeats_and_accumulate_empty_groups():
    P, N, Ma, Mb = 8, 12, 9, 6
    a = torch.randn(P, Ma)
    b = torch.randn(Mb, N)
    a_index = torch.tensor([0, 0, 8, 3, 3, 3, 1, 2, 2, 5, 7], device=DEV)
    b_index = torch.tensor([5, 5, 5, 0, 1, 2, 3, 4, 0, 0, 1], device=DEV)
    offs = torch.tensor([0, 4, 4, 11, 11], dtype=torch.int32, device=DEV)
    base = torch.randn(5, P, N)
    out = tgg.grouped_mm(a, b, offs, a_index=a_index, b_index=b_index, out=base.clone(), accumulate=True)
    close(out, base.double() + ref_contr(a, b, offs, a_index, b_index), torch.float32)
    out = tgg.grouped_mm(a, b, offs, a_index=a_index, b_index=b_index, out=base.clone())
    close(out, ref_contr(a, b, offs, a_index, b_index), torch.float32)


def test_contraction_non_contiguous_out():
    M, P, N = 20, 6, 10
    a, b = torch.randn(P, M), torch.randn(M, N)
    offs = offs_from([5, 0, 15])
    out = torch.randn(N, P, 3).permute(2, 1, 0)
    tgg.grouped_mm(a, b, offs, out=out)
    close(out, ref_contr(a, b, offs), torch.float32)


# ---------------- dispatcher ----------------

def test_dispatcher_auto_with_a_index_contraction_cpu():
    """backend='auto' must pick a backend that works: here it resolves to torch from the ungathered
    operands, then rejects the gathered buffer and tells the user to use backend='auto'."""
    P, Ma, N = 8, 8, 4
    a = torch.randn(P, Ma)
    b = torch.randn(5, N)
    a_index = torch.tensor([0, 2, 4, 6, 7])
    offs = torch.tensor([2, 5], dtype=torch.int32)
    out = grouped_mm(a, b, offs, a_index=a_index, backend="auto")
    close(out, ref_contr(a, b, offs, a_index=a_index), torch.float32)


def test_dispatcher_auto_with_a_index_row_split_cpu():
    """Same in the row split: a [8, 3] with 16-byte row stride qualifies for torch, a[a_index] does not."""
    a = torch.randn(8, 4)[:, :3]
    b = torch.randn(2, 3, 4)
    a_index = torch.tensor([0, 2, 4, 6, 7])
    offs = torch.tensor([2, 5], dtype=torch.int32)
    out = grouped_mm(a, b, offs, a_index=a_index, backend="auto")
    close(out, ref_rows(a, b, offs, a_index=a_index), torch.float32)


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


def test_bad_input_dtypes_devices():
    a, b = torch.randn(8, 4), torch.randn(2, 4, 4)
    offs = torch.tensor([3, 8], dtype=torch.int32)
    for bad_offs in (offs.to(torch.int16), offs.to(torch.uint8), offs.bool(), offs[None]):
        with pytest.raises(ValueError):
            tgg.grouped_mm(a, b, bad_offs)
    with pytest.raises(ValueError):
        tgg.grouped_mm(a, b.half(), offs)
    with pytest.raises(ValueError):
        tgg.grouped_mm(a.t(), torch.randn(8, 3), offs, out=torch.zeros(2, 4, 3, dtype=torch.float16))


# ---------------- more kernel edges ----------------

def test_row_split_K_zero():
    a, b = torch.randn(6, 0), torch.randn(2, 0, 5)
    offs = torch.tensor([2, 6], dtype=torch.int32, device=DEV)
    out = tgg.grouped_mm(a, b, offs)
    assert (out == 0).all()
    base = torch.randn(6, 5)
    out = tgg.grouped_mm(a, b, offs, out=base.clone(), accumulate=True)
    assert torch.equal(out, base)


def test_contraction_M_zero():
    a, b = torch.randn(4, 0), torch.randn(0, 5)
    offs = torch.tensor([0, 0], dtype=torch.int32, device=DEV)
    out = tgg.grouped_mm(a, b, offs)
    assert out.shape == (2, 4, 5) and (out == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_row_split_gather_scatter_accumulate_partial(dtype):
    Ta, K, N, R = 9, 10, 37, 30
    src = torch.randn(Ta, K).to(dtype)
    a_index = torch.randint(0, Ta, (20,))
    sizes = [0, 6, 0, 1, 9]  # 16 of 20 logical rows inside groups
    offs = offs_from(sizes)
    b = torch.randn(5, N, K).to(dtype).transpose(1, 2)
    out_index = torch.randperm(R)[:20]
    base = torch.randn(R, N).to(dtype)
    out = tgg.grouped_mm(src, b, offs, a_index=a_index, out_index=out_index, out=base.clone(), accumulate=True)
    ref = base.double().clone()
    ref[out_index[:16]] += ref_rows(src, b, offs, a_index=a_index)[:16]
    close(out, ref, dtype)


def test_row_split_G_large():
    G = 130  # G_POW2 = 256
    sizes = torch.randint(0, 3, (G,))
    sizes[-1] = 5
    M = int(sizes.sum())
    offs = offs_from(sizes.tolist())
    a, b = torch.randn(M, 4), torch.randn(G, 4, 8)
    close(tgg.grouped_mm(a, b, offs), ref_rows(a, b, offs), torch.float32)
    dy, x = torch.randn(M, 3), torch.randn(M, 5)
    close(tgg.grouped_mm(dy.t(), x, offs), ref_contr(dy.t(), x, offs), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_contraction_long_group_low_precision(dtype):
    M, P, N = 64, 8, 8
    a = torch.randn(P, M).to(dtype)
    b = torch.randn(M, N).to(dtype)
    offs = offs_from([1, 63])
    close(tgg.grouped_mm(a, b, offs), ref_contr(a, b, offs), dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_row_split_tma_tails_scatter(dtype):
    sizes = [3, 0, 18, 14]
    M, K, N = 40, 40, 36
    offs = offs_from(sizes)
    a = torch.randn(M, K).to(dtype)
    b = torch.randn(4, N, K).to(dtype).transpose(1, 2)
    out_index = torch.randperm(50)[:M]
    base = torch.randn(50, N).to(dtype)
    out = tgg.grouped_mm(a, b, offs, out_index=out_index, out=base.clone(), accumulate=True, tma=True)
    ref = base.double().clone()
    n = sum(sizes)
    ref[out_index[:n]] += ref_rows(a, b, offs)[:n]
    close(out, ref, dtype)


def test_row_split_size_one_groups_between_big():
    sizes = [16, 1, 16, 1, 15, 1, 33]
    M = sum(sizes)
    offs = offs_from(sizes)
    a, b = torch.randn(M, 7), torch.randn(len(sizes), 7, 65)
    close(tgg.grouped_mm(a, b, offs), ref_rows(a, b, offs), torch.float32)
    close(tgg.grouped_mm(a, b, offs, tma=True), ref_rows(a, b, offs), torch.float32)


# ---------------- non-contiguous offsets / indices (strided views) ----------------

def test_row_split_strided_offs():
    sizes = [5, 0, 9, 4]
    M, K, N = 18, 8, 12
    offs = torch.stack([offs_from(sizes), torch.full((4,), 999, dtype=torch.int32)], 1)[:, 0]  # stride 2
    assert not offs.is_contiguous()
    a, b = torch.randn(M, K), torch.randn(4, K, N)
    close(tgg.grouped_mm(a, b, offs), ref_rows(a, b, offs), torch.float32)


def test_contraction_strided_offs():
    sizes = [5, 0, 9, 4]
    M, P, N = 18, 6, 10
    offs = torch.stack([offs_from(sizes), torch.zeros(4, dtype=torch.int32)], 1)[:, 0]
    a, b = torch.randn(P, M), torch.randn(M, N)
    close(tgg.grouped_mm(a, b, offs), ref_contr(a, b, offs), torch.float32)


def test_row_split_strided_a_index():
    """a_index as a column of a [P, 2] index tensor (e.g. topk indices [:, 0])."""
    T, K, N = 7, 8, 12
    src = torch.randn(T, K)
    idx2 = torch.randint(0, T, (16, 2))
    a_index = idx2[:, 0]
    assert not a_index.is_contiguous()
    offs = offs_from([6, 10])
    b = torch.randn(2, K, N)
    close(tgg.grouped_mm(src, b, offs, a_index=a_index), ref_rows(src, b, offs, a_index=a_index), torch.float32)


def test_row_split_strided_out_index():
    M, K, N = 16, 8, 12
    a, b = torch.randn(M, K), torch.randn(2, K, N)
    offs = offs_from([6, 10])
    perm2 = torch.stack([torch.randperm(M), torch.randperm(M)], 1)
    out_index = perm2[:, 1]
    out = torch.full((M, N), float("nan"))
    tgg.grouped_mm(a, b, offs, out_index=out_index, out=out)
    ref = torch.empty(M, N, dtype=torch.float64)
    ref[out_index] = ref_rows(a, b, offs)
    close(out, ref, torch.float32)


def test_contraction_strided_b_index():
    T, M, P, N = 5, 12, 6, 8
    a, x = torch.randn(P, M), torch.randn(T, N)
    b_index = torch.randint(0, T, (M, 3))[:, 2]
    offs = offs_from([4, 0, 8])
    close(tgg.grouped_mm(a, x, offs, b_index=b_index), ref_contr(a, x, offs, b_index=b_index), torch.float32)


def test_row_split_b_no_unit_stride_tma():
    sizes = [4, 9, 3]
    M, K, N = 16, 8, 12
    offs = offs_from(sizes)
    a = torch.randn(M, K)
    b = torch.randn(3, 2 * K, 2 * N)[:, ::2, ::2]
    assert 1 not in b.stride()
    close(tgg.grouped_mm(a, b, offs, tma=True), ref_rows(a, b, offs), torch.float32)


def test_row_split_expanded_a_rows():
    """a with row stride 0 (one row broadcast), a legal strided view."""
    sizes = [4, 9, 3]
    K, N = 8, 12
    offs = offs_from(sizes)
    a = torch.randn(1, K).expand(16, K)
    b = torch.randn(3, K, N)
    close(tgg.grouped_mm(a, b, offs), ref_rows(a, b, offs), torch.float32)


def test_row_split_tma_K_zero():
    """K = 0 is a valid grouped_mm (zeros). The 'layout allows' check in _tma_desc lets a [G, 0, N]
    weight through and TensorDescriptor asserts on the zero dimension."""
    a, b = torch.randn(6, 0), torch.randn(2, 0, 8)
    offs = torch.tensor([2, 6], dtype=torch.int32, device=DEV)
    out = tgg.grouped_mm(a, b, offs, tma=True)
    assert (out == 0).all()


def test_row_split_tma_auto_K_zero_does_not_disable_tma(monkeypatch):
    """With tma=None on Hopper, the same degenerate call lands in the compile-failure fallback and
    switches TMA off for the rest of the process (_TMA_FAILED is global, 'for good')."""
    import warnings

    monkeypatch.setattr(tgg, "_tma_auto", lambda device: True)  # pretend to be on Hopper
    monkeypatch.setattr(tgg, "_TMA_FAILED", [])
    a, b = torch.randn(6, 0), torch.randn(2, 0, 8)
    offs = torch.tensor([2, 6], dtype=torch.int32, device=DEV)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = tgg.grouped_mm(a, b, offs)
    assert (out == 0).all()
    assert tgg._TMA_FAILED == [], (tgg._TMA_FAILED, [str(x.message)[:120] for x in w])
