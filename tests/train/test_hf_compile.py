"""torch.compile of transformers models with the "lrmoe" experts (CPU): the compiled model against
the same model run eagerly (same weights, same batch): loss and every gradient, in every backward
mode, with fullgraph=True and False, fp32 and bf16, a non-SiLU activation, a batch of another
shape (dynamic shapes), the random scorer and a changed drop ratio (graph-break path), and the
records (none from a compiled backward). Models are one layer deep to keep compilation short;
most tests use the aot_eager backend (dynamo + AOTAutograd: every tracing rule; no code
generation); inductor, torch.compile's default, compiles one MoE block."""
import pytest
import torch

import lrmoe.hf as hf
from lrmoe import BackwardPolicy

V = 61


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()  # no graph or recompile count carried over from another test
    yield
    torch._dynamo.reset()


def twins(preset, policy, dtype=torch.float32, **over):
    """Two identical one-layer models (policies: ``policy()`` each, so seeded generators match)."""
    kw = {"vocab_size": V, "seed": 4, "num_hidden_layers": 1, "dtype": dtype, **over}
    eager, compiled = hf.build_model(preset, policy=policy(), **kw), hf.build_model(preset, policy=policy(), **kw)
    compiled.load_state_dict(eager.state_dict())
    return eager, compiled


def step(model, ids):
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_step(eager, compiled_fn, compiled, ids, rtol=1e-5, atol=1e-6, what=""):
    """One step of ``eager`` and of ``compiled_fn`` (torch.compile of ``compiled``, whose parameters
    it fills: read under ``compiled``'s names): equal loss and every gradient."""
    l_e, g_e = step(eager, ids)
    l_c, _ = step(compiled_fn, ids)
    g_c = {n: p.grad.clone() for n, p in compiled.named_parameters() if p.grad is not None}
    torch.testing.assert_close(l_c.float(), l_e.float(), rtol=rtol, atol=atol, msg=lambda m: f"{what} loss: {m}")
    assert g_c.keys() == g_e.keys() and len(g_e) > 0
    for n in g_e:
        torch.testing.assert_close(g_c[n].float(), g_e[n].float(), rtol=rtol, atol=atol,
                                   msg=lambda m: f"{what} grad of {n}: {m}")


def batch(shape, seed=0):
    return torch.randint(0, V, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("mode,act", [("full", "silu"), ("compact", "silu"), ("mask", "silu"), ("compact", "gelu")])
def test_fullgraph_matches_eager_in_every_mode(mode, act):
    rho = 0.0 if mode == "full" else 0.3
    eager, model = twins("qwen3-moe-tiny", lambda: BackwardPolicy(rho, mode=mode), hidden_act=act)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    assert_same_step(eager, compiled, model, batch((2, 8)), what=f"{mode}/{act}")
    kept = hf.backward_records(eager)[0].kept_fraction
    assert kept == (1.0 if mode == "full" else 11 / 16)  # round(0.7 * 16) pairs: the selection was real


def test_fullgraph_compact_with_batches_of_other_shapes():
    eager, model = twins("qwen3-moe-tiny", lambda: BackwardPolicy(0.4))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    for i, shape in enumerate([(2, 8), (3, 5)]):  # the second compiles with dynamic shapes
        assert_same_step(eager, compiled, model, batch(shape, i), what=f"batch {shape}")


def test_fullgraph_glm_full_mode():  # (layer 0 is dense: two layers for one MoE layer)
    eager, model = twins("glm4-moe-tiny", lambda: BackwardPolicy(0.0, mode="full"), num_hidden_layers=2)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    assert_same_step(eager, compiled, model, batch((2, 8)), what="glm")


def test_fullgraph_bf16_compact():
    eager, model = twins("qwen3-moe-tiny", lambda: BackwardPolicy(0.3), dtype=torch.bfloat16)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    assert_same_step(eager, compiled, model, batch((2, 8)), rtol=2e-2, atol=2e-2, what="bf16")


def test_graph_breaks_random_scorer_and_changed_drop_ratio():
    """fullgraph=False: the random scorer's generator is not traced (the experts run eagerly behind a
    graph break), and a changed drop ratio recompiles; both stay equal to eager."""
    policy = lambda: BackwardPolicy(0.3, scorer="random", seed=11)  # noqa: E731
    eager, model = twins("qwen3-moe-tiny", policy)
    compiled = torch.compile(model, backend="aot_eager")
    assert_same_step(eager, compiled, model, batch((2, 8)), what="random")
    assert_same_step(eager, compiled, model, batch((2, 8), 1), what="random, second draw")
    for m in (eager, model):
        hf.set_policy(m, BackwardPolicy(0.5, mode="mask"))
    assert_same_step(eager, compiled, model, batch((2, 8), 2), what="rho 0.5")
    assert hf.backward_records(eager)[0].kept_fraction == 0.5


def test_compiled_backward_leaves_no_stale_record():
    eager, model = twins("qwen3-moe-tiny", lambda: BackwardPolicy(0.3))
    ids = batch((2, 8))
    step(model, ids)
    assert hf.backward_records(model)[0] is not None
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    step(compiled, ids)
    assert hf.backward_records(model) == [None]  # a compiled backward fills none; the eager one is gone
    step(model, ids)
    assert hf.backward_records(model)[0].kept_fraction == 11 / 16


def test_generate_with_compiled_forward_and_static_cache():
    """transformers' generation tests compile the forward (fullgraph) and decode with a static
    cache: the same tokens as stock's uncompiled model (inference: no record, no backward)."""
    kw = {"vocab_size": V, "seed": 4, "num_hidden_layers": 1}
    stock = hf.build_model("qwen3-moe-tiny", experts_implementation="grouped_mm", **kw).eval()
    model = hf.build_model("qwen3-moe-tiny", policy=BackwardPolicy(0.3), **kw).eval()
    model.load_state_dict(stock.state_dict())
    ids = batch((2, 6))
    gen = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, cache_implementation="static")
    want = stock.generate(ids, **gen)
    from torch._dynamo.backends.debugging import aot_eager

    graphs = []
    model.forward = torch.compile(model.forward, fullgraph=True,
                                  backend=lambda gm, example: graphs.append(gm) or aot_eager(gm, example))
    assert torch.equal(model.generate(ids, **gen), want)
    assert graphs  # it ran compiled (prefill and decoding steps)


@pytest.mark.parametrize("device,dtype", [
    pytest.param("cpu", torch.float32, marks=pytest.mark.slow),
    pytest.param("cuda", torch.bfloat16, marks=pytest.mark.cuda),  # run by scripts/gpu_check.sh (its compile step)
], ids=["cpu-fp32", "cuda-bf16"])
def test_inductor_fullgraph_moe_block_compact(device, dtype):
    """torch.compile's default backend (inductor: code generation, ~20 s cold on 2 CPU cores) on one
    transformers MoE block (router + lrmoe experts), compact mode at drop 0.3: output, input and
    every parameter gradient equal to the same block run eagerly; on CUDA in bf16 (Triton code from
    inductor, F.grouped_mm inside the graph), within 2 % in norm of each tensor."""
    model = hf.build_model("qwen3-moe-tiny", vocab_size=V, seed=4, num_hidden_layers=1, policy=BackwardPolicy(0.3))
    block = model.model.layers[0].mlp.to(device, dtype)
    x = torch.randn(2, 8, model.config.hidden_size, generator=torch.Generator().manual_seed(0)).to(device, dtype)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    out = []
    for fn in (block, torch.compile(block, fullgraph=True)):
        block.zero_grad()
        xx = x.clone().requires_grad_()
        y = fn(xx)
        y.backward(dy)
        out.append([y.detach(), xx.grad] + [p.grad.clone() for p in block.parameters()])
    assert len(out[0]) == 2 + len(list(block.parameters()))
    for i, (a, b) in enumerate(zip(*out)):
        assert b.dtype == a.dtype == dtype and b.device == a.device
        if dtype == torch.float32:
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=lambda m: f"tensor {i}: {m}")
        else:
            err = float((b.float() - a.float()).norm() / a.float().norm())
            assert err < 2e-2, f"tensor {i}: compiled vs eager differ by {err:.3g} in norm"
    assert all(g.abs().sum() > 0 for g in out[0][1:])  # every gradient was computed, none is zero
