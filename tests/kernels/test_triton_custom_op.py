"""The Triton grouped GEMM as the custom operator ``lrmoe::triton_grouped_mm`` (what ``grouped_mm``
runs for ``backend="triton"`` inside torch.compile), on CPU under the Triton interpreter.

Fresh random operands per test (the conftest seeds from the test id); group sizes with an empty
group, one hot group holding every row, a single row, odd sizes, rows past ``offs[-1]``; both
split modes, with and without gathers. Checks: the forward against the loop backend, opcheck,
gradients against torch autograd over a per-group float64 ``torch.mm`` loop, the dispatcher under
``torch.compile(fullgraph=True)`` (it used to trace into the launcher and raise ``Unsupported``)
with the operator in the graph, and a compiled MoE block with the Triton backend against eager."""
import copy

import pytest
import torch

pytest.importorskip("triton")
from lrmoe import BackwardPolicy, LRMoELayer  # noqa: E402
from lrmoe.kernels import grouped_gemm  # noqa: E402
from lrmoe.kernels import triton_grouped_gemm as tgg  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not tgg.supported(DEV), reason="Triton kernels need CUDA or TRITON_INTERPRET=1")

OP = torch.ops.lrmoe.triton_grouped_mm
# group sizes, and logical rows past offs[-1] (in no group)
CASES = {"empty": ([3, 0, 4, 2], 2), "hot": ([0, 9, 0], 0), "single": ([1], 1), "odd": ([5, 1, 0, 7, 3], 0)}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()  # no graph or automatic-dynamic decision carried over from another test
    yield
    torch._dynamo.reset()


def operands(mode, indexed, case, dtype=torch.float32, requires_grad=False):
    """(mat_a, mat_b, offs, a_index, b_index) of odd sizes; a row split's B is a transposed view
    of [G, N, K] weights; gathers repeat rows (as tokens do under top-k)."""
    sizes, tail = CASES[case]
    G, M = len(sizes), sum(sizes) + tail
    offs = torch.cumsum(torch.tensor(sizes), 0).to(torch.int32).to(DEV)
    a_index = b_index = None
    if mode == "rows":
        K, N = 5, 6
        Ma = 4 if indexed else M
        a = torch.randn(Ma, K, device=DEV)
        b = torch.randn(G, N, K, device=DEV).to(dtype).transpose(1, 2)
        if indexed:
            a_index = torch.randint(0, Ma, (M,), device=DEV)
    else:
        P, N = 3, 5
        Ma, Mb = (M + 2, M + 1) if indexed else (M, M)
        a = torch.randn(P, Ma, device=DEV)
        b = torch.randn(Mb, N, device=DEV).to(dtype)
        if indexed:
            a_index = torch.randperm(Ma, device=DEV)[:M]
            b_index = torch.randint(0, Mb, (M,), device=DEV, dtype=torch.int32)
    a = a.to(dtype)
    if requires_grad:
        a.requires_grad_()
        b.requires_grad_()
    return a, b, offs, a_index, b_index


def loop_ref(a, b, offs, a_index=None, b_index=None):
    """Differentiable reference: explicit gathers, one torch.mm per group (rows past offs[-1] zero)."""
    if a_index is not None:
        a = a.index_select(0, a_index) if b.dim() == 3 else a.index_select(1, a_index)
    if b_index is not None:
        b = b.index_select(0, b_index)
    ends, start, parts = offs.tolist(), 0, []
    for g, end in enumerate(ends):
        parts.append(a[start:end] @ b[g] if b.dim() == 3 else a[:, start:end] @ b[start:end])
        start = end
    if b.dim() == 2:
        return torch.stack(parts)
    return torch.cat(parts + [a.new_zeros(a.shape[0] - start, b.shape[2])])


def tol(dtype, ref):
    rel = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2}[dtype]
    return dict(rtol=rel, atol=rel * max(1.0, float(ref.abs().max())))


def op_calls(gm: torch.fx.GraphModule) -> int:
    """Calls of the custom operator in ``gm`` and its subgraphs (e.g. an autograd.Function's)."""
    return sum(n.op == "call_function" and n.target in (OP, OP.default)
               for m in gm.modules() if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes)


def recording_aot_eager(graphs: list):
    """The aot_eager backend, recording the graph dynamo hands it."""
    aot_eager = torch._dynamo.lookup_backend("aot_eager")

    def backend(gm, example_inputs):
        graphs.append(gm)
        return aot_eager(gm, example_inputs)
    return backend


MODES = [(m, i) for m in ("rows", "contraction") for i in (False, True)]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("mode,indexed", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_op_matches_the_loop_backend(mode, indexed, case, dtype):
    a, b, offs, a_index, b_index = operands(mode, indexed, case, dtype)
    out = OP(a, b, offs, a_index, b_index)
    ref = grouped_gemm.grouped_mm(a, b, offs, backend="loop", a_index=a_index, b_index=b_index)
    assert out.dtype == dtype and out.shape == ref.shape
    if mode == "rows":  # rows past offs[-1]: zero, as in the loop
        assert (out[int(offs[-1]):] == 0).all()
    torch.testing.assert_close(out.float(), ref.float(), **tol(dtype, ref.float()))


@pytest.mark.parametrize("mode,indexed", MODES)
def test_opcheck(mode, indexed):
    """Schema, fake kernel (also with dynamic shapes), autograd registration and AOT dispatch:
    every opcheck sub-test applies."""
    args = operands(mode, indexed, "empty", requires_grad=True)
    torch.library.opcheck(OP, args)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("mode,indexed", MODES)
def test_op_gradients_match_autograd_over_a_loop(mode, indexed, case):
    """fp32 gradients (Triton has no float64) against float64 autograd over the loop, cast down."""
    a, b, offs, a_index, b_index = operands(mode, indexed, case, requires_grad=True)
    out = OP(a, b, offs, a_index, b_index)
    g = torch.randn_like(out)
    da, db = torch.autograd.grad(out, (a, b), g)
    a64, b64 = (t.detach().double().requires_grad_() for t in (a, b))
    ref = loop_ref(a64, b64, offs, a_index, b_index)
    da_ref, db_ref = torch.autograd.grad(ref, (a64, b64), g.double())
    for got, want in ((da, da_ref), (db, db_ref)):
        assert got.shape == want.shape and got.dtype == torch.float32
        torch.testing.assert_close(got, want.float(), **tol(torch.float32, want))


@pytest.mark.parametrize("mode,indexed", MODES)
def test_compiled_fullgraph_dispatch_runs_the_op(mode, indexed):
    """grouped_mm(backend="triton") under torch.compile(fullgraph=True): dynamo used to trace into
    the launcher and raise Unsupported; now the graph calls the operator, and the forward equals
    eager (the fused kernels) and the gradients autograd over the loop."""
    a, b, offs, a_index, b_index = operands(mode, indexed, "empty", requires_grad=True)

    def fn(a, b):
        return grouped_gemm.grouped_mm(a, b, offs, backend="triton", a_index=a_index, b_index=b_index)
    graphs = []
    out = torch.compile(fn, fullgraph=True, backend=recording_aot_eager(graphs))(a, b)
    assert sum(op_calls(gm) for gm in graphs) == 1
    with torch.no_grad():
        eager = fn(a, b)
    n = int(offs[-1]) if mode == "rows" else None  # eager leaves rows past offs[-1] uninitialised
    torch.testing.assert_close(out[:n], eager[:n], rtol=0, atol=0)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (a, b), g)
    want = torch.autograd.grad(loop_ref(a, b, offs, a_index, b_index), (a, b), g)
    for got, ref in zip(grads, want):
        torch.testing.assert_close(got, ref, **tol(torch.float32, ref))


@pytest.mark.parametrize("accumulate", [False, True])
def test_compiled_scatter_into_out(accumulate):
    """out_index / out / accumulate under compile (torch ops after the operator) equal eager's fused
    scatter; the gradients through the accumulation equal autograd over the loop."""
    a, b, offs, a_index, _ = operands("rows", True, "odd", requires_grad=True)
    M, N = a_index.numel(), b.shape[2]
    out_index = torch.randperm(M + 3, device=DEV)[:M]
    base = torch.randn(M + 3, N, device=DEV, requires_grad=True)

    def fn(a, b, base):
        return grouped_gemm.grouped_mm(a, b, offs, backend="triton", a_index=a_index, out_index=out_index,
                                       out=base * 2, accumulate=accumulate)
    graphs = []
    out = torch.compile(fn, fullgraph=True, backend=recording_aot_eager(graphs))(a, b, base)
    assert sum(op_calls(gm) for gm in graphs) == 1
    with torch.no_grad():
        torch.testing.assert_close(out, fn(a, b, base), **tol(torch.float32, out))
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (a, b, base), g)
    scatter = torch.Tensor.index_add if accumulate else torch.Tensor.index_copy
    ref = scatter(base * 2, 0, out_index, loop_ref(a, b, offs, a_index))
    for got, want in zip(grads, torch.autograd.grad(ref, (a, b, base), g)):
        torch.testing.assert_close(got, want, **tol(torch.float32, want))


@pytest.mark.parametrize("mode,rho", [("full", 0.0), ("compact", 0.3)])
def test_compiled_moe_block_with_the_triton_backend(mode, rho):
    """A tiny LRMoE block with backend="triton" (fused gather/scatter), compiled with fullgraph=True
    and aot_eager: output and every gradient equal eager's; its GEMMs ran the operator."""
    eager = LRMoELayer(8, 6, 4, 2, policy=BackwardPolicy(rho, mode=mode, backend="triton"))
    model = copy.deepcopy(eager)
    x = torch.randn(5, 8, device=DEV)
    x_e, x_c = x.clone().requires_grad_(), x.clone().requires_grad_()
    g = torch.randn(5, 8, device=DEV)
    y_e = eager(x_e)
    y_e.backward(g)
    graphs = []
    y_c = torch.compile(model, fullgraph=True, backend=recording_aot_eager(graphs))(x_c)
    y_c.backward(g)
    assert sum(op_calls(gm) for gm in graphs) == 6  # forward 2 (gate/up, down), backward 4
    torch.testing.assert_close(y_c, y_e)
    torch.testing.assert_close(x_c.grad, x_e.grad)
    for (name, p), q in zip(eager.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=lambda m: f"grad of {name}: {m}")
