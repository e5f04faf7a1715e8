"""Triton grouped GEMMs against the float64 loop reference (CPU: Triton interpreter, tiny shapes).

Every case draws fresh random operands and group sizes; the reference is ``grouped_mm_loop`` run in
float64 on the same (rounded) inputs, with tolerances of the input dtype."""
import pytest
import torch

pytest.importorskip("triton")
from lrmoe import BackwardPolicy, LRMoELayer  # noqa: E402
from lrmoe.kernels import grouped_gemm  # noqa: E402
from lrmoe.kernels import triton_grouped_gemm as tgg  # noqa: E402
from lrmoe.kernels.grouped_gemm import grouped_mm, grouped_mm_loop  # noqa: E402

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
    assert tgg._tma_desc(b, [0, 2, 1] if transposed else [0, 1, 2]) is not None
    check(tgg.grouped_mm(a, b, offs, tma=True), ref64(a, b, offs), dtype)
    index = torch.randint(0, M, (M,), device=DEV)  # gathered A: weights only through TMA
    check(tgg.grouped_mm(a, b, offs, a_index=index, tma=True), ref64(a, b, offs, a_index=index), dtype)
    odd = rand(M, 10, dtype=torch.float32)  # 40-byte rows: no descriptor, pointer loads
    b_odd = rand(G, 10, N, dtype=torch.float32)
    assert tgg._tma_desc(odd, [0, 1]) is None
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


def test_rows_past_last_offset_are_left_untouched(rng_seed):
    M, K, N, G = 20, 8, 16, 3
    a, b = rand(M, K, dtype=torch.float32), rand(G, K, N, dtype=torch.float32)
    offs = offsets(group_sizes(12, G, "random"))
    out = torch.full((M, N), 7.0, device=DEV)
    tgg.grouped_mm(a, b, offs, out=out)
    assert (out[12:] == 7.0).all()
    check(out[:12], ref64(a, b, offs)[:12], torch.float32)
    # Offsets past M are clamped to M: rows past the end of mat_a are never read.
    tgg.grouped_mm(a, b, torch.tensor([5, 30, 30], dtype=torch.int32, device=DEV))


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


def test_bench_script_smoke(tmp_path):
    """scripts/bench_grouped_gemm.py runs end to end at its tiny --smoke shapes and writes JSON."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "bench_grouped_gemm.py"
    spec = importlib.util.spec_from_file_location("bench_grouped_gemm", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    sizes = bench.zipf_sizes(1000, 16)
    assert int(sizes.sum()) == 1000 and 3.9 <= float(sizes.max()) / (1000 / 16) <= 4.1
    bench.main(["--smoke", "--sections", "gemm", "--out", str(tmp_path)])
    data = json.loads(next(tmp_path.glob("bench_grouped_gemm_*.json")).read_text())
    assert data["complete"] and {r["pass_"] for r in data["passes"]} == {"fwd", "dgrad", "wgrad"}


# ---- CUDA only: real shapes (one EP8 rank of Qwen3-30B-A3B), bf16, against F.grouped_mm ----

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
