"""Triton grouped GEMMs against float64 loop references (CPU: Triton interpreter, tiny shapes; CUDA:
the compiled kernels).

Every case draws fresh random operands and group sizes; the reference is ``grouped_mm_loop`` (or a
per-group float64 ``torch.mm``) on the same (rounded) inputs, with tolerances of the input dtype.
Besides the main paths: tile tails, empty and single-row groups, transposed and strided operands
(offsets and index tensors included), K = 0 with TMA, accumulate and scatter, and the wrapper's
input validation."""
import pytest
import torch

pytest.importorskip("triton")
from lrmoe import BackwardPolicy, LRMoELayer  # noqa: E402
from lrmoe.kernels import grouped_gemm  # noqa: E402
from lrmoe.kernels import triton_grouped_gemm as tgg  # noqa: E402
from lrmoe.kernels.grouped_gemm import grouped_mm  # noqa: E402


DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


pytestmark = pytest.mark.skipif(not tgg.supported(DEV), reason="Triton kernels need CUDA or TRITON_INTERPRET=1")


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def group_sizes(M, G, kind):
    """Random sizes summing to M: 'random' (with an empty group), 'one' (all rows in one group),
    'tiny' (many groups of 0-3 rows)."""
    if kind == "one":
        sizes = torch.zeros(G, dtype=torch.int64)
        sizes[torch.randint(0, G, ())] = M
        return sizes
    w = torch.rand(G) if kind == "random" else torch.randint(0, 4, (G,)).double()
    if kind == "random" and G > 2:
        w[torch.randint(0, G, ())] = 0
    sizes = torch.floor(w / w.sum() * M).long()
    sizes[torch.argmax(w)] += M - sizes.sum()
    return sizes


def offsets(sizes, dtype=torch.int32):
    return torch.cumsum(sizes, 0).to(dtype).to(DEV)


def rand(*shape, dtype):
    return torch.randn(*shape, device=DEV).to(dtype)


def tol(dtype, ref):
    """Tolerances for dtype rounding of outputs (the interpreter truncates when casting to bf16)."""
    scale = max(1.0, float(ref.abs().max()))
    rel = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}[dtype]
    return dict(rtol=rel, atol=rel * scale)


def check(out, ref, dtype):
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, **tol(dtype, ref))


def ref64(a, b, offs, **kw):
    return grouped_mm(a.double(), b.double(), offs, backend="loop", **kw)


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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind,transposed", [("random", True), ("one", False), ("tiny", True)])
def test_row_split(dtype, kind, transposed, rng_seed):
    G = 19 if kind == "tiny" else 5
    M, K, N = 41, 24, 40
    sizes = group_sizes(M - 3, G, kind)  # 3 rows past the last offset
    offs = offsets(sizes)
    a = rand(M, K, dtype=dtype)
    b = rand(G, N, K, dtype=dtype).transpose(1, 2) if transposed else rand(G, K, N, dtype=dtype)
    out = tgg.grouped_mm(a, b, offs)
    assert out.shape == (M, N)
    n = M - 3
    check(out[:n], ref64(a, b, offs)[:n], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("transposed", [True, False])
def test_row_split_tma_descriptors(dtype, transposed, rng_seed):
    """The TMA path (weights through a 3-D descriptor, A rows through a 2-D one), forced on."""
    M, K, N, G = 37, 48, 40, 5  # K is not a multiple of the K tile: the descriptor zero-fills the tail
    offs = offsets(group_sizes(M, G, "random"))
    a = rand(M, K, dtype=dtype)
    b = rand(G, N, K, dtype=dtype).transpose(1, 2) if transposed else rand(G, K, N, dtype=dtype)
    assert tgg.tma_desc(b, [0, 2, 1] if transposed else [0, 1, 2]) is not None
    check(tgg.grouped_mm(a, b, offs, tma=True), ref64(a, b, offs), dtype)
    index = torch.randint(0, M, (M,), device=DEV)  # gathered A: weights only through TMA
    check(tgg.grouped_mm(a, b, offs, a_index=index, tma=True), ref64(a, b, offs, a_index=index), dtype)
    odd = rand(M, 10, dtype=torch.float32)  # 40-byte rows: no descriptor, pointer loads
    b_odd = rand(G, 10, N, dtype=torch.float32)
    assert tgg.tma_desc(odd, [0, 1]) is None
    check(tgg.grouped_mm(odd, b_odd, offs, tma=True), ref64(odd, b_odd, offs), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["random", "tiny"])
def test_contraction_split(dtype, kind, rng_seed):
    G = 17 if kind == "tiny" else 4
    M, P, N = 45, 24, 40
    sizes = group_sizes(M, G, kind)
    offs = offsets(sizes)
    dy = rand(M, P, dtype=dtype)  # wgrad reads the transposed view dy.t()
    x = rand(M, N, dtype=dtype)
    out = tgg.grouped_mm(dy.t(), x, offs)
    assert out.shape == (G, P, N)
    check(out, ref64(dy.t(), x, offs), dtype)
    assert (out[sizes.to(DEV) == 0] == 0).all()  # empty groups give zeros


def test_contraction_split_all_rows_in_one_group(rng_seed):
    M, P, N, G = 40, 16, 24, 3
    sizes = group_sizes(M, G, "one")
    offs = offsets(sizes, torch.int64)  # int64 offsets are accepted too
    a, b = rand(P, M, dtype=torch.float32), rand(M, N, dtype=torch.float32)
    out = tgg.grouped_mm(a, b, offs)
    check(out, ref64(a, b, offs), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_split_gather_scatter(dtype, rng_seed):
    """Forward of the experts: A rows gathered by token, output rows scattered to pair order."""
    T, K, N, G, k = 13, 24, 32, 6, 3
    P = T * k
    src = rand(T, K, dtype=dtype)
    a_index = torch.randint(0, T, (P,), device=DEV)  # tokens, with repeats
    out_index = torch.randperm(P, device=DEV)
    offs = offsets(group_sizes(P, G, "random"))
    b = rand(G, N, K, dtype=dtype).transpose(1, 2)
    out = tgg.grouped_mm(src, b, offs, a_index=a_index, out_index=out_index)
    check(out, ref64(src, b, offs, a_index=a_index, out_index=out_index), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_split_scatter_accumulate_into_larger_out(dtype, rng_seed):
    """dgrad of kept rows written (or added) into a larger pair-order buffer; other rows untouched."""
    M, K, N, G, R = 21, 16, 24, 4, 50
    a = rand(M, K, dtype=dtype)
    b = rand(G, K, N, dtype=dtype)
    offs = offsets(group_sizes(M, G, "random"))
    out_index = torch.randperm(R, device=DEV)[:M]
    base = rand(R, N, dtype=dtype)
    for accumulate in (False, True):
        out = tgg.grouped_mm(a, b, offs, out_index=out_index, out=base.clone(), accumulate=accumulate)
        ref = ref64(a, b, offs, out_index=out_index, out=base.double(), accumulate=accumulate)
        check(out, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_contraction_split_gathered(dtype, rng_seed):
    """wgrad over gathered X: dW = dGU^T X[token]; columns of A and rows of B read through indices."""
    T, M, P, N, G = 11, 30, 16, 24, 5
    dgu = rand(40, P, dtype=dtype)
    x = rand(T, N, dtype=dtype)
    a_index = torch.randperm(40, device=DEV)[:M]
    b_index = torch.randint(0, T, (M,), device=DEV)
    offs = offsets(group_sizes(M, G, "random"))
    out = tgg.grouped_mm(dgu.t(), x, offs, a_index=a_index, b_index=b_index)
    check(out, ref64(dgu.t(), x, offs, a_index=a_index, b_index=b_index), dtype)
    acc = rand(G, P, N, dtype=dtype)
    out = tgg.grouped_mm(dgu.t(), x, offs, b_index=b_index, a_index=a_index, out=acc.clone(), accumulate=True)
    check(out, ref64(dgu.t(), x, offs, a_index=a_index, b_index=b_index, out=acc.double(), accumulate=True), dtype)


def refused_past_rows_or_clamped(call, ref, dtype=torch.float32):
    """offs[-1] past the logical rows is refused where the values are checked (CPU tensors, or
    anomaly mode). On CUDA outside anomaly mode it is unchecked; the kernels clamp the offsets to
    the logical row count, so they never read past it."""
    with torch.autograd.set_detect_anomaly(True), pytest.raises(ValueError, match=r"offs\[-1\] = \d+ is past the"):
        call()
    if DEV.type == "cuda":
        close(call(), ref, dtype)


def test_rows_past_last_offset_are_left_untouched(rng_seed):
    M, K, N, G = 20, 8, 16, 3
    a, b = rand(M, K, dtype=torch.float32), rand(G, K, N, dtype=torch.float32)
    offs = offsets(group_sizes(12, G, "random"))
    out = torch.full((M, N), 7.0, device=DEV)
    tgg.grouped_mm(a, b, offs, out=out)
    assert (out[12:] == 7.0).all()
    check(out[:12], ref64(a, b, offs)[:12], torch.float32)
    # Offsets past M: refused where checked, else clamped to M (rows past mat_a are never read).
    past = torch.tensor([5, 30, 30], dtype=torch.int32, device=DEV)
    refused_past_rows_or_clamped(lambda: tgg.grouped_mm(a, b, past), ref_rows(a, b, past))


def test_dispatcher_routes_and_auto_rules(rng_seed):
    a, b = rand(10, 8, dtype=torch.float32), rand(2, 8, 16, dtype=torch.float32)
    offs = offsets(torch.tensor([4, 6]))
    check(grouped_mm(a, b, offs, backend="triton"), ref64(a, b, offs), torch.float32)
    assert grouped_gemm.resolve_backend("auto", a.double(), b.double()) != "triton"  # never for float64
    if DEV.type == "cpu":
        assert grouped_gemm.resolve_backend("auto", a, b) == "torch"
    else:
        assert grouped_gemm.resolve_backend("auto", a, b) == "triton"


def test_bad_input():
    a, b = torch.randn(10, 8, device=DEV), torch.randn(3, 8, 16, device=DEV)
    offs = torch.tensor([3, 6, 10], dtype=torch.int32, device=DEV)
    bad = [
        ((a, b, offs[:2]), {}, "groups"),  # group count mismatch
        ((a, torch.randn(3, 9, 16, device=DEV), offs), {}, "inner dimensions"),
        ((a[0], b, offs), {}, "2D x 3D"),  # wrong rank
        ((a, b, offs.float()), {}, "int32"),
        ((a.t(), torch.randn(9, 4, device=DEV), offs), {}, "contraction"),
        ((a.double(), b.double(), offs), {}, "backend='loop'"),
        ((a, b, offs), {"b_index": offs}, "contraction split"),
        ((a.t(), torch.randn(10, 4, device=DEV), offs), {"out_index": offs}, "row split"),
        ((a, b, offs), {"accumulate": True}, "out="),
        ((a, b, offs), {"out": torch.empty(10, 15, device=DEV)}, "out must be"),
        ((a, b, offs), {"a_index": offs.float()}, "a_index"),
    ]
    for args, kw, match in bad:
        with pytest.raises(ValueError, match=match):
            tgg.grouped_mm(*args, **kw)


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
    """With a_index the rows are len(a_index) = 7 (mat_a has 10): offs[-1] = 7 runs, 8 and 100 do not."""
    a = torch.randn(10, 8, device=DEV)
    b = torch.randn(3, 8, 16, device=DEV)
    idx = torch.tensor([9, 9, 0, 3, 3, 3, 7], device=DEV)
    offs = torch.tensor([2, 5, 7], dtype=torch.int32, device=DEV)
    close(tgg.grouped_mm(a, b, offs, a_index=idx), ref_rows(a, b, offs, a_index=idx), torch.float32)
    for end in (8, 100):
        past = torch.tensor([2, 5, end], dtype=torch.int32, device=DEV)
        refused_past_rows_or_clamped(lambda: tgg.grouped_mm(a, b, past, a_index=idx), ref_rows(a, b, past, a_index=idx))


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
    assert tgg.tma_desc(a, [0, 1]) is not None
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
    offs = torch.tensor([0, 7, 7, 25, 30, 30], dtype=torch.int32, device=DEV)  # ends at M, last group empty
    close(tgg.grouped_mm(a, b, offs), ref_contr(a, b, offs), dtype)
    past = torch.tensor([0, 7, 7, 25, 40, 60], dtype=torch.int32, device=DEV)
    refused_past_rows_or_clamped(lambda: tgg.grouped_mm(a, b, past), ref_contr(a, b, past), dtype)


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
    """K = 0 is a valid grouped_mm (zeros). The 'layout allows' check in tma_desc lets a [G, 0, N]
    weight through and TensorDescriptor asserts on the zero dimension."""
    a, b = torch.randn(6, 0), torch.randn(2, 0, 8)
    offs = torch.tensor([2, 6], dtype=torch.int32, device=DEV)
    out = tgg.grouped_mm(a, b, offs, tma=True)
    assert (out == 0).all()


def test_row_split_tma_auto_K_zero_does_not_disable_tma(monkeypatch):
    """With tma=None on Hopper, the same degenerate call lands in the compile-failure fallback and
    switches TMA off for the rest of the process (TMA_FAILED is global, 'for good')."""
    import warnings

    monkeypatch.setattr(tgg, "tma_auto", lambda device: True)  # pretend to be on Hopper
    monkeypatch.setattr(tgg, "TMA_FAILED", [])
    a, b = torch.randn(6, 0), torch.randn(2, 0, 8)
    offs = torch.tensor([2, 6], dtype=torch.int32, device=DEV)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = tgg.grouped_mm(a, b, offs)
    assert (out == 0).all()
    assert tgg.TMA_FAILED == [], (tgg.TMA_FAILED, [str(x.message)[:120] for x in w])


@pytest.mark.parametrize("mode,rho", [("full", 0.0), ("compact", 0.4), ("mask", 0.4)])
def test_layer_triton_matches_loop(mode, rho, rng_seed):
    """The whole LRMoE layer, forward and backward, with backend='triton' vs backend='loop'."""
    H, I, E, k, T = 16, 8, 6, 2, 12
    layers = []
    for backend in ("triton", "loop"):
        torch.manual_seed(rng_seed)
        pol = BackwardPolicy(rho, mode=mode, scorer="random", seed=3, backend=backend)
        layers.append(LRMoELayer(H, I, E, k, policy=pol).to(DEV))
    x = torch.randn(T, H, device=DEV)
    dy = torch.randn(T, H, device=DEV)
    results = []
    for layer in layers:
        xi = x.clone().requires_grad_()
        y = layer(xi)
        y.backward(dy)
        results.append([y, xi.grad] + [p.grad for p in layer.parameters()])
    assert torch.equal(layers[0].last_backward.kept_mask, layers[1].last_backward.kept_mask)
    for u, v in zip(*results):
        torch.testing.assert_close(u, v, rtol=1e-4, atol=1e-5)


def test_bench_script_helpers():
    """scripts/bench_grouped_gemm.py's routing sizes (its run end to end at the --smoke shapes, JSON
    included, is checked by the GPU check's dry run: tests/cli/test_gpu_check.py)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "bench_grouped_gemm.py"
    spec = importlib.util.spec_from_file_location("bench_grouped_gemm", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    sizes = bench.zipf_sizes(1000, 16)
    assert int(sizes.sum()) == 1000 and 3.9 <= float(sizes.max()) / (1000 / 16) <= 4.1


def _skewed_offsets(M, G):
    w = 1.0 / torch.arange(1, G + 1).double() ** 1.1
    sizes = torch.floor(w / w.sum() * M).long()
    sizes[0] += M - sizes.sum()
    sizes[3] = 0
    return offsets(sizes)


@pytest.mark.cuda
@pytest.mark.parametrize("tma", [True, False])
@pytest.mark.parametrize("H,I", [(2048, 768), (4096, 1408)])
def test_cuda_real_shapes_match_torch(H, I, tma):
    M, G = 16384, 16
    offs = _skewed_offsets(M, G)
    x = torch.randn(M, H, device="cuda", dtype=torch.bfloat16)
    w_gu = torch.randn(G, 2 * I, H, device="cuda", dtype=torch.bfloat16) / H**0.5
    dgu = torch.randn(M, 2 * I, device="cuda", dtype=torch.bfloat16)
    F = torch.nn.functional
    pairs = [
        (tgg.grouped_mm(x, w_gu.transpose(1, 2), offs, tma=tma), F.grouped_mm(x, w_gu.transpose(1, 2), offs=offs)),
        (tgg.grouped_mm(dgu, w_gu, offs, tma=tma), F.grouped_mm(dgu, w_gu, offs=offs)),  # dgrad
        (tgg.grouped_mm(dgu.t(), x, offs), F.grouped_mm(dgu.t(), x, offs=offs)),  # wgrad
    ]
    for out, ref in pairs:
        torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2 * float(ref.float().abs().max()))
    token = torch.randint(0, M, (M,), device="cuda")
    fused = tgg.grouped_mm(x, w_gu.transpose(1, 2), offs, a_index=token, tma=tma)
    torch.testing.assert_close(fused, tgg.grouped_mm(x[token], w_gu.transpose(1, 2), offs, tma=tma))
    fused = tgg.grouped_mm(dgu.t(), x, offs, b_index=token)
    torch.testing.assert_close(fused, tgg.grouped_mm(dgu.t(), x[token], offs))


@pytest.mark.cuda
@pytest.mark.parametrize("tma", [None, False])
def test_cuda_int64_addressing(tma):
    """An operand with more than 2**31 elements: the last group's rows lie past element 2**31."""
    K, N, G = 4096, 256, 2
    M = 2**31 // K + 1024
    a = torch.empty(M, K, device="cuda", dtype=torch.bfloat16).normal_()
    b = torch.randn(G, K, N, device="cuda", dtype=torch.bfloat16)
    offs = torch.tensor([512, M], dtype=torch.int32, device="cuda")
    out = tgg.grouped_mm(a, b, offs, tma=tma)
    tail = slice(M - 256, M)
    ref = a[tail].float() @ b[1].float()
    torch.testing.assert_close(out[tail].float(), ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max()))
    offs = torch.tensor([M - 512, M], dtype=torch.int32, device="cuda")  # wgrad: the last 512 rows
    wg = tgg.grouped_mm(a.t(), a[:, :N], offs)
    ref = a[M - 512:].t().float() @ a[M - 512:, :N].float()
    torch.testing.assert_close(wg[1].float(), ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max()))


@pytest.mark.cuda
@pytest.mark.parametrize("mode,rho", [("full", 0.0), ("compact", 0.2)])
def test_cuda_layer_triton_matches_torch(mode, rho):
    H, I, E, k, T = 2048, 768, 16, 8, 2048
    outs = []
    for backend in ("triton", "torch"):
        torch.manual_seed(0)
        pol = BackwardPolicy(rho, mode=mode, scorer="random", seed=3, backend=backend)
        layer = LRMoELayer(H, I, E, k, policy=pol).to("cuda", torch.bfloat16)
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        y = layer(x)
        y.backward(torch.randn_like(y))
        outs.append([y, x.grad, layer.experts.gate_up_proj.grad, layer.experts.down_proj.grad])
    for u, v in zip(*outs):
        torch.testing.assert_close(u.float(), v.float(), rtol=3e-2, atol=3e-2 * float(v.float().abs().max()))


def test_triton_refuses_decreasing_offsets_and_repeated_out_index():
    """The kernels clamp offsets, so bad ones gave a silently different result than the loop."""
    a, b = rand(8, 16, dtype=torch.float32), rand(3, 16, 16, dtype=torch.float32)
    for bad in ([5, 3, 8], [-1, 4, 8]):
        with pytest.raises(ValueError, match="non-negative, non-decreasing"):
            tgg.grouped_mm(a, b, torch.tensor(bad, dtype=torch.int32, device=DEV))
    out_index = torch.tensor([0, 1, 2, 3, 4, 5, 6, 6], device=DEV)
    with pytest.raises(ValueError, match="out_index must not repeat a value.*got 6"):
        tgg.grouped_mm(a, b, torch.tensor([2, 5, 8], dtype=torch.int32, device=DEV), out_index=out_index,
                       out=torch.zeros(8, 16, device=DEV))


# --- offsets past the rows they split, and index values out of range, are refused -------------------
# Checked for CPU tensors always, on CUDA under anomaly mode (lrmoe.kernels.checks): `checked()`.

def checked():
    import contextlib

    return torch.autograd.set_detect_anomaly(True) if DEV.type == "cuda" else contextlib.nullcontext()


def rint(lo, hi):
    return int(torch.randint(lo, hi, ()))


def random_offs(M, G):
    """Random valid offsets of M rows into G groups (an empty group when G > 2), on DEV."""
    return offsets(group_sizes(M, G, "random"))


def test_triton_refuses_offsets_past_the_rows(rng_seed):
    """The kernels clamp offsets to the logical row count, so offs[-1] past it silently computed
    fewer rows than asked. Row split (plain and gathered: the bound is len(a_index) even where
    mat_a has more rows) and contraction split (plain and gathered)."""
    M, G, K, N, P = rint(3, 9), rint(1, 4), 8, 8, 4
    b = rand(G, K, N, dtype=torch.float32)
    src = rand(M + 5, K, dtype=torch.float32)
    a_index = torch.randint(0, M + 5, (M,), device=DEV)
    for split, call in [
        ("rows", lambda offs: tgg.grouped_mm(src[:M], b, offs)),
        ("rows", lambda offs: tgg.grouped_mm(src, b, offs, a_index=a_index)),
        ("contraction length", lambda offs: tgg.grouped_mm(rand(P, M, dtype=torch.float32), src[:M], offs)),
        ("contraction length", lambda offs: tgg.grouped_mm(rand(P, M + 5, dtype=torch.float32), src, offs,
                                                           a_index=a_index, b_index=a_index)),
    ]:
        offs = random_offs(M, G)
        offs[-1] = end = M + rint(1, 4)
        with checked(), pytest.raises(ValueError, match=rf"offs\[-1\] = {end} is past the .*{M}.*at most {M}"):
            call(offs)


BAD_INDEX_SCRIPT = r"""
import os, sys; os.environ['TRITON_INTERPRET'] = '1'
import torch
from lrmoe.kernels import triton_grouped_gemm as tgg
torch.manual_seed(int(sys.argv[1]))
r = lambda lo, hi: int(torch.randint(lo, hi, ()))
M, G, K, N, P = r(2, 8), r(1, 4), 8, 8, 4
offs = torch.cat([torch.sort(torch.randint(0, M + 1, (G - 1,))).values, torch.tensor([M])]).to(torch.int32)
def bad(n, kind):
    return -r(1, n + 2) if kind == 'negative' else n
for kind in ('negative', 'rows'):
    for case in ('out_index new', 'out_index out', 'a_index rows', 'a_index columns', 'b_index'):
        name = case.split()[0]
        T = M + r(0, 4)
        index = torch.randperm(T)[:M] if name == 'out_index' else torch.randint(0, T, (M,))
        i = r(0, M)
        if case == 'out_index new':
            T, index = M, torch.randperm(M)
        index[i] = v = bad(T, kind)
        try:
            if name == 'out_index':
                out = torch.zeros(T, N) if case == 'out_index out' else None
                tgg.grouped_mm(torch.randn(M, K), torch.randn(G, K, N), offs, out_index=index, out=out)
            elif case == 'a_index rows':
                tgg.grouped_mm(torch.randn(T, K), torch.randn(G, K, N), offs, a_index=index)
            elif case == 'a_index columns':
                tgg.grouped_mm(torch.randn(P, T), torch.randn(M, N), offs, a_index=index)
            else:
                tgg.grouped_mm(torch.randn(P, M), torch.randn(T, N), offs, b_index=index)
            print(case, kind, 'NO ERROR', flush=True)
        except ValueError as e:
            want = f'{name}[{i}] = {v} is out of range'
            ok = want in str(e) and f'0 <= {name} < {T}' in str(e)
            print(case, kind, 'OK' if ok else f'WRONG MESSAGE {e}', flush=True)
"""


def test_triton_refuses_out_of_range_indices(rng_seed):
    """out_index (with and without out=), a_index (row and contraction split) and b_index values that
    are negative or equal to the rows they address: a ValueError naming the value and the range.
    Unchecked, the kernels read or write outside the operands (the interpreter corrupted the heap:
    munmap_chunk(): invalid pointer), so the calls run in a subprocess."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-c", BAD_INDEX_SCRIPT, str(rng_seed)], cwd=root, capture_output=True,
                       text=True, timeout=300)
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and len(lines) == 10 and all(x.endswith(" OK") for x in lines), (
        r.returncode, lines, r.stderr[-500:])


@pytest.mark.parametrize("end", ["rows", "short"])
def test_triton_in_range_edge_cases_still_pass(end, rng_seed):
    """Empty groups (first and last among them), offs[-1] == rows or < rows, and index values at both
    ends of their range run and match the float64 reference."""
    G = rint(3, 6)
    sizes = torch.randint(0, 3, (G,))
    sizes[0] = sizes[-1] = 0
    sizes[1] += 2
    n = int(sizes.sum())
    M = n if end == "rows" else n + rint(1, 4)
    offs = offsets(sizes)
    K, N, P = 8, 8, 4
    a, b = rand(M, K, dtype=torch.float32), rand(G, K, N, dtype=torch.float32)
    with checked():
        close(tgg.grouped_mm(a, b, offs)[:n], ref_rows(a, b, offs)[:n], torch.float32)
        T, R = rint(1, 5), M + rint(0, 3)
        a_index = torch.randint(0, T, (M,), device=DEV)
        a_index[0], a_index[-1] = T - 1, 0
        out_index = torch.cat([torch.tensor([R - 1, 0]), torch.randperm(R - 2)[:M - 2] + 1])[torch.randperm(M)]
        out_index = out_index[:M].to(DEV)
        src = rand(T, K, dtype=torch.float32)
        out = tgg.grouped_mm(src, b, offs, a_index=a_index, out_index=out_index,
                             out=torch.zeros(R, N, device=DEV))
        close(out[out_index[:n]], ref_rows(src, b, offs, a_index=a_index)[:n], torch.float32)
        a, x = rand(P, M + 2, dtype=torch.float32), rand(T, N, dtype=torch.float32)
        a_index = torch.randint(0, M + 2, (M,), device=DEV)
        a_index[0], a_index[-1] = M + 1, 0
        b_index = torch.randint(0, T, (M,), device=DEV)
        b_index[0], b_index[-1] = 0, T - 1
        close(tgg.grouped_mm(a, x, offs, a_index=a_index, b_index=b_index),
              ref_contr(a, x, offs, a_index, b_index), torch.float32)
        close(tgg.grouped_mm(a[:, :M], x[:1].expand(M, N), offs), ref_contr(a[:, :M], x[:1].expand(M, N), offs),
              torch.float32)
