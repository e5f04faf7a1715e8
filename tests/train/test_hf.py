"""transformers integration (lrmoe.hf): the "lrmoe" experts implementation in Qwen3-MoE and GLM-4.5
models, against transformers' own experts; the block-causal mask over packed documents."""
import contextlib

import pytest
import torch

import lrmoe.hf as hf
from lrmoe import BackwardPolicy


def train_steps(model, batches):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses, grads = [], []
    for ids in batches:
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
    return losses, grads


@pytest.mark.parametrize("preset", ["qwen3-moe-tiny", "glm4-moe-tiny"])
def test_drop0_matches_grouped_mm_over_optimizer_steps(preset):
    """Four AdamW steps (lr 3e-3, fp32): every step's loss within 1e-5 (relative) and gradients within
    1e-4 of stock's, and every parameter after the last step within 1e-4 relative + 1e-5 absolute
    (weights ~0.02 moved by up to 4 x lr = 1.2e-2; AdamW divides by sqrt(v), so a last-bit gradient
    difference where v is tiny moves a weight by more than 1e-6: 1.6e-6 seen, GLM), except elements
    whose gradient is rounding noise."""
    ref = hf.build_model(preset, experts_implementation="grouped_mm", vocab_size=97, seed=3)
    ours = hf.build_model(preset, vocab_size=97, seed=3, policy=BackwardPolicy(0.0))
    ours.load_state_dict(ref.state_dict())
    start = {n: p.detach().clone() for n, p in ours.named_parameters()}
    batches = [torch.randint(0, 97, (2, 12)) for _ in range(4)]
    (l1, g1), (l2, g2) = train_steps(ref, batches), train_steps(ours, batches)
    for step, (a, b, ga, gb) in enumerate(zip(l1, l2, g1, g2)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=lambda m: f"loss at step {step}: {m}")
        assert ga.keys() == gb.keys()
        for n in ga:
            torch.testing.assert_close(gb[n], ga[n], rtol=1e-4, atol=1e-6, msg=lambda m: f"step {step} {n}: {m}")
    pr = dict(ref.named_parameters())
    for n, p in ours.named_parameters():
        assert not torch.equal(p, start[n]) or n.endswith("e_score_correction_bias"), n  # every weight moved
        # Elements whose gradient is rounding noise (< 1e-7 at every step; GLM's key biases on the
        # un-rotated half of each head, where softmax ignores a bias): AdamW steps them by +-lr with
        # the noise's sign, in either implementation; not comparable, so left out.
        noise = torch.stack([g[n].abs() for g in g1]).amax(0) < 1e-7 if n in g1[0] else torch.zeros_like(p, dtype=bool)
        if noise.any():
            assert n.endswith("k_proj.bias"), n
        torch.testing.assert_close(p[~noise], pr[n][~noise], rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"parameter {n} after 4 steps: {m}")


def test_policies_and_records_per_layer():
    model = hf.build_model("qwen3-moe-tiny", vocab_size=50)
    n = len(hf.experts_modules(model))
    assert n == 2
    hf.set_policy(model, [BackwardPolicy(0.0), BackwardPolicy(0.5, scorer="grad_norm")])
    assert [p.drop_ratio for p in hf.get_policies(model)] == [0.0, 0.5]
    assert hf.backward_records(model) == [None, None]
    ids = torch.randint(0, 50, (2, 10))
    model(input_ids=ids, labels=ids).loss.backward()
    r0, r1 = hf.backward_records(model)
    assert r0.kept_fraction == 1.0 and r1.kept_fraction == 0.5
    assert r1.kept_mask.shape == (20, 2)


def test_set_policy_errors():
    model = hf.build_model("glm4-moe-tiny", vocab_size=50)
    with pytest.raises(ValueError, match="got 3 policies for 1 MoE layers"):
        hf.set_policy(model, [BackwardPolicy()] * 3)
    with pytest.raises(ValueError, match="no routed-experts modules"):
        hf.set_policy(torch.nn.Linear(2, 2), BackwardPolicy())
    with pytest.raises(ValueError, match="unknown model preset 'gpt2'"):
        hf.model_config("gpt2")


def test_paper_configs_have_the_published_dimensions():
    q = hf.model_config("qwen3-30b-a3b")
    assert (q.hidden_size, q.moe_intermediate_size, q.num_experts, q.num_experts_per_tok, q.num_hidden_layers) == (
        2048, 768, 128, 8, 48)
    g = hf.model_config("glm-4.5-air")
    assert (g.hidden_size, g.moe_intermediate_size, g.n_routed_experts, g.num_experts_per_tok) == (4096, 1408, 128, 8)
    assert g.rope_parameters["rope_theta"] == 1e6 if hasattr(g, "rope_parameters") else g.rope_theta == 1e6


def _compare(preset, dtype, impl="eager", **over):
    ref = hf.build_model(preset, experts_implementation=impl, vocab_size=97, seed=3, dtype=dtype, **over)
    ours = hf.build_model(preset, vocab_size=97, seed=3, dtype=dtype, policy=BackwardPolicy(0.0), **over)
    # a non-zero GLM correction bias (changes which experts are chosen, not the weights)
    for m in ref.modules():
        if hasattr(m, "e_score_correction_bias"):
            m.e_score_correction_bias.copy_(torch.linspace(-0.3, 0.3, m.e_score_correction_bias.numel()))
    ours.load_state_dict(ref.state_dict())
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(0))
    la = ref(input_ids=ids, labels=ids)
    lb = ours(input_ids=ids, labels=ids)
    la.loss.backward()
    lb.loss.backward()
    return ref, ours, la, lb


@pytest.mark.parametrize("preset,over", [
    ("qwen3-moe-tiny", dict(norm_topk_prob=False)),
    ("glm4-moe-tiny", dict(norm_topk_prob=False, routed_scaling_factor=2.5)),
    ("glm4-moe-tiny", dict()),
])
def test_forward_matches_eager_fp32(preset, over):
    ref, ours, la, lb = _compare(preset, torch.float32, **over)
    torch.testing.assert_close(lb.logits, la.logits, rtol=1e-4, atol=1e-5)
    gr = dict(ref.named_parameters())
    for n, p in ours.named_parameters():
        if gr[n].grad is None:
            assert p.grad is None, n
            continue
        torch.testing.assert_close(p.grad, gr[n].grad, rtol=1e-3, atol=1e-5, msg=lambda m: f"{n}: {m}")


# measured here (largest relative norm error over the parameters): bf16 1.0-1.4e-2, fp16 1.5-2.3e-3
GRAD_TOL = {torch.bfloat16: 3e-2, torch.float16: 1e-2}


def _assert_grads_near(ref, ours, tol, what):
    """Every gradient of ``ours`` within ``tol`` of ``ref``'s, in norm relative to ``ref``'s
    (low precision: element-wise rounding differences of one ulp are not errors)."""
    gr = dict(ref.named_parameters())
    n_checked = 0
    for n, p in ours.named_parameters():
        if gr[n].grad is None:
            assert p.grad is None, n
            continue
        a, b = gr[n].grad.float(), p.grad.float()
        assert p.grad.dtype == gr[n].grad.dtype and torch.isfinite(b).all(), n
        assert (b - a).norm() <= tol * a.norm() + 1e-6, f"{what} {n}: {float((b - a).norm() / a.norm()):.3g}"
        n_checked += 1
    assert n_checked > 10


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("preset", ["qwen3-moe-tiny", "glm4-moe-tiny"])
def test_low_precision_weights_match_eager(preset, dtype):
    """bf16 / fp16 weights: logits, loss and every gradient (in norm) near stock's at the same dtype."""
    ref, ours, la, lb = _compare(preset, dtype)
    assert lb.logits.dtype == la.logits.dtype == dtype
    torch.testing.assert_close(lb.logits.float(), la.logits.float(), rtol=3e-2, atol=3e-2)
    assert abs(float(lb.loss.detach()) - float(la.loss.detach())) < 2e-2
    _assert_grads_near(ref, ours, GRAD_TOL[dtype], str(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("preset", ["qwen3-moe-tiny", "glm4-moe-tiny"])
def test_cpu_autocast_matches_grouped_mm(preset, dtype):
    """fp32 weights under ``torch.autocast("cpu", dtype)``: logits, loss and every (fp32) gradient near
    stock's grouped_mm. (Not the eager loop: its bf16 per-expert linears round differently; here its
    layer-1 expert gradients are 26 % from the fp32 ones, grouped_mm's and lrmoe's 1 %.)"""
    ref = hf.build_model(preset, experts_implementation="grouped_mm", vocab_size=97, seed=3)
    ours = hf.build_model(preset, vocab_size=97, seed=3)
    ours.load_state_dict(ref.state_dict())
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(0))
    out = []
    for m in (ref, ours):
        with torch.autocast("cpu", dtype=dtype):
            o = m(input_ids=ids, labels=ids)
        o.loss.backward()
        out.append(o)
    a, b = out
    torch.testing.assert_close(b.logits.float(), a.logits.float(), rtol=5e-2, atol=5e-2)
    assert abs(float(b.loss.detach()) - float(a.loss.detach())) < 2e-2
    _assert_grads_near(ref, ours, GRAD_TOL[dtype], f"autocast {dtype}")


def test_packed_documents_do_not_attend_to_each_other():
    """With use_cache=False (as train() and evaluate() call the model) the mask follows
    position_ids: document 2 packed after document 1 gives the logits of document 2 alone.
    With transformers' default cache the mask would be plainly causal (the control)."""
    model = hf.build_model("qwen3-moe-tiny", vocab_size=97, seed=1)
    model.train()
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(0, 97, (1, 7), generator=g), torch.randint(0, 97, (1, 9), generator=g)
    packed = torch.cat([a, b], 1)
    pos = torch.cat([torch.arange(7), torch.arange(9)]).unsqueeze(0)
    with torch.no_grad():
        alone = model(input_ids=b, position_ids=torch.arange(9).unsqueeze(0), use_cache=False).logits
        together = model(input_ids=packed, position_ids=pos, use_cache=False).logits[:, 7:]
        cached = model(input_ids=packed, position_ids=pos).logits[:, 7:]
    torch.testing.assert_close(together, alone, rtol=1e-4, atol=1e-5)
    assert (cached - alone).abs().max() > 1e-2  # the control: the cache's causal mask mixes them


# --------------------------------------------------------------------------- activations
def _stock_and_lrmoe_experts(act, H=6, I=5, E=5, dtype=torch.float64, seed=0):
    """transformers' own Qwen3-MoE experts module (eager loop, the reference) and the same module
    class run by the "lrmoe" implementation, with the same weights."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    hf.register()
    mods = []
    for impl in ("eager", "lrmoe"):
        cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, hidden_act=act,
                             experts_implementation=impl)
        mods.append(Qwen3MoeExperts(cfg).to(dtype))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        mods[0].gate_up_proj.copy_(torch.randn(E, 2 * I, H, generator=g, dtype=dtype) / H**0.5)
        mods[0].down_proj.copy_(torch.randn(E, H, I, generator=g, dtype=dtype) / I**0.5)
    mods[1].load_state_dict(mods[0].state_dict())
    return mods


def _routing(kind, T, E, K, g):
    if kind == "hot":  # every token's first slot on expert 2, the others never or rarely routed
        idx = torch.stack([torch.cat([torch.tensor([2]), torch.tensor([e for e in range(E) if e != 2])[
            torch.randperm(E - 1, generator=g)[:K - 1]]]) for _ in range(T)])
    elif kind == "empty":  # experts 0 and 3 get no pair
        allowed = torch.tensor([1, 2, 4])
        idx = torch.stack([allowed[torch.randperm(3, generator=g)[:K]] for _ in range(T)])
    else:
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    return idx


# silu and gelu_pytorch_tanh are transformers' own classes; relu is nn.ReLU; mish and quick_gelu
# are classes the integration knows nothing of.
@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_pytorch_tanh", "relu", "mish", "quick_gelu"])
@pytest.mark.parametrize("kind,T", [("random", 9), ("hot", 7), ("empty", 6), ("random", 1)])
@pytest.mark.parametrize("mode", ["full", "compact"])
def test_experts_match_stock_for_every_activation(act, kind, T, mode):
    stock, ours = _stock_and_lrmoe_experts(act)
    hf.set_policy(ours, BackwardPolicy(0.0, mode=mode))
    assert (hf.activation_of(ours) is None) == (act == "silu")  # only SiLU takes the fused path
    g = torch.Generator().manual_seed(T)
    E, K, H = 5, 2, 6
    idx = _routing(kind, T, E, K, g)
    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    w = torch.rand(T, K, generator=g, dtype=torch.float64) + 0.1
    dy = torch.randn(T, H, generator=g, dtype=torch.float64)
    res = []
    for mod in (stock, ours):
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = mod(xx, idx, ww)
        y.backward(dy)
        res.append((y, xx.grad, ww.grad, mod.gate_up_proj.grad, mod.down_proj.grad))
    for name, a, b in zip(("y", "x", "weights", "gate_up_proj", "down_proj"), *res):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12, msg=lambda m: f"{act} {kind}: {name}: {m}")
    assert hf.backward_records(ours)[0].kept_mask.all()


@pytest.mark.parametrize("act", ["gelu", "relu"])
def test_model_with_activation_matches_grouped_mm(act):
    ref = hf.build_model("qwen3-moe-tiny", experts_implementation="grouped_mm", vocab_size=61, seed=2, hidden_act=act)
    ours = hf.build_model("qwen3-moe-tiny", vocab_size=61, seed=2, hidden_act=act, policy=BackwardPolicy(0.0))
    ours.load_state_dict(ref.state_dict())
    ids = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(1))
    la, lb = ref(input_ids=ids, labels=ids), ours(input_ids=ids, labels=ids)
    la.loss.backward()
    lb.loss.backward()
    torch.testing.assert_close(lb.logits, la.logits, rtol=1e-5, atol=1e-6)
    gr = dict(ref.named_parameters())
    for n, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, gr[n].grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{act} {n}: {m}")


def test_check_supported_refusals():
    _, ours = _stock_and_lrmoe_experts("gelu")
    hf.check_supported(ours)  # any activation, for the single-process and the expert-parallel experts
    _, silu = _stock_and_lrmoe_experts("silu")
    hf.check_supported(silu)
    ours.act_fn = torch.nn.PReLU()
    with pytest.raises(ValueError, match="has parameters"):
        hf.check_supported(ours)

    class CustomGate(type(silu)):
        def _apply_gate(self, gate_up_out):
            return gate_up_out[..., ::2]

    silu.__class__ = CustomGate
    with pytest.raises(ValueError, match="custom _apply_gate"):
        hf.check_supported(silu)


# --------------------------------------------------------------------------- what models do with their experts
def _twin_models(preset="qwen3-moe-tiny", policy=None, stock="grouped_mm", **over):
    """transformers' own experts (``stock``) and "lrmoe" in two models with the same weights."""
    over = {"vocab_size": 61, "seed": 5, **over}
    ref = hf.build_model(preset, experts_implementation=stock, **over)
    ours = hf.build_model(preset, policy=policy or BackwardPolicy(0.0), **over)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def _loss_and_grads(model, ids):
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(a, b, what, rtol=1e-5, atol=1e-6):
    (la, ga), (lb, gb) = a, b
    torch.testing.assert_close(lb, la, rtol=rtol, atol=atol, msg=lambda m: f"{what} loss: {m}")
    assert ga.keys() == gb.keys() and ga
    for n in ga:
        torch.testing.assert_close(gb[n], ga[n], rtol=rtol, atol=atol, msg=lambda m: f"{what} {n}: {m}")


def _enable_checkpointing(model, kind):
    # transformers 5.17 has gradient_checkpointing_enable only (use_reentrant=False by default); later 5.x
    # add activation_checkpointing_enable with the same default and deprecate the old name (FutureWarning)
    renamed = hasattr(model, "activation_checkpointing_enable")
    if kind == "default":  # the entry point this version has, with its defaults
        return model.activation_checkpointing_enable() if renamed else model.gradient_checkpointing_enable()
    # the old name with either kind of torch.utils.checkpoint; a deprecated alias where the new one exists
    with pytest.warns(FutureWarning, match="gradient_checkpointing_enable") if renamed else contextlib.nullcontext():
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": kind == "reentrant"})


@pytest.mark.parametrize("kind", ["default", "reentrant", "non-reentrant"])
@pytest.mark.parametrize("preset", ["qwen3-moe-tiny", "glm4-moe-tiny"])
def test_gradient_checkpointing(preset, kind, monkeypatch):
    """At drop 0 equal to stock with checkpointing; at drop 0.3 the recomputed forward selects the
    same pairs, so checkpointing changes no gradient. Both kinds of torch.utils.checkpoint
    (use_reentrant True: the recomputation inside an autograd Function's backward; False: saved-
    tensor hooks)."""
    import lrmoe.hf.integration as integration

    calls = []
    run = integration.lrmoe_experts
    monkeypatch.setattr(integration, "lrmoe_experts", lambda *a, **k: calls.append(1) or run(*a, **k))
    ids = torch.randint(0, 61, (2, 10), generator=torch.Generator().manual_seed(3))
    ref, ours = _twin_models(preset)
    for m in (ref, ours):
        m.train()
        _enable_checkpointing(m, kind)
    assert all(layer.gradient_checkpointing for layer in ours.model.layers)
    _assert_same(_loss_and_grads(ref, ids), _loss_and_grads(ours, ids), f"checkpointed ({kind}) drop 0")
    assert len(calls) == 2 * len(hf.experts_modules(ours))  # forward, then the recomputation in backward
    plain = _loss_and_grads(_twin_models(preset, BackwardPolicy(0.3))[1].train(), ids)
    hf.set_policy(ours, BackwardPolicy(0.3))
    _assert_same(plain, _loss_and_grads(ours, ids), "checkpointed vs plain at drop 0.3", rtol=1e-6, atol=1e-7)
    assert hf.backward_records(ours)[0].kept_fraction == 14 / 20  # round(0.7 * 20) pairs kept


def _cache_param(cache, preset):
    # transformers' offloaded caches assert CUDA (stock fails on CPU too)
    return pytest.param(cache, preset, marks=[pytest.mark.cuda] if cache.startswith("offloaded") else [])


# Every cache_implementation transformers accepts (generation.configuration_utils.ALL_CACHE_IMPLEMENTATIONS, the
# same list in 5.17 and 5.25; sliding_window/hybrid/hybrid_chunked are deprecated names of static layer
# structures); "paged" is continuous batching (tests/train/test_hf_parity.py).
CACHES = ["dynamic", "static", "sliding_window", "hybrid", "hybrid_chunked", "quantized", "offloaded",
          "offloaded_static", "offloaded_hybrid", "offloaded_hybrid_chunked"]


def test_cache_list_is_transformers_list():
    from transformers.generation.configuration_utils import ALL_CACHE_IMPLEMENTATIONS

    assert sorted(CACHES) == sorted(ALL_CACHE_IMPLEMENTATIONS)


# every cache for Qwen3-MoE; dynamic and static for GLM too (the experts see the same calls)
@pytest.mark.parametrize("cache,preset", [_cache_param(c, "qwen3-moe-tiny") for c in CACHES] +
                         [_cache_param(c, "glm4-moe-tiny") for c in ("dynamic", "static")])
def test_generate_matches_stock(cache, preset):
    """With a policy that drops half the pairs from the backward: the policy changes no forward."""
    if cache == "quantized":  # transformers' quantized cache needs optimum-quanto or hqq (stock fails too)
        pytest.importorskip("optimum.quanto", reason="the quantized cache needs optimum-quanto (not installed)")
    ref, ours = _twin_models(preset, policy=BackwardPolicy(0.5))
    device = "cuda" if cache.startswith("offloaded") else "cpu"
    ref, ours = ref.to(device), ours.to(device)
    ids = torch.randint(0, 61, (2, 5), generator=torch.Generator().manual_seed(4)).to(device)
    torch.testing.assert_close(ours(input_ids=ids, labels=ids).loss, ref(input_ids=ids, labels=ids).loss,
                               rtol=1e-6, atol=1e-6)  # (with gradients enabled, as in training)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, cache_implementation=cache)
    out_ref, out = ref.generate(ids, **kw), ours.generate(ids, **kw)
    assert out.shape == (2, 11)
    assert torch.equal(out, out_ref)


@pytest.mark.parametrize("preset", ["qwen3-moe-tiny", "glm4-moe-tiny"])
@pytest.mark.parametrize("how", ["plain", "bf16", "sharded"])
def test_save_and_load_pretrained(tmp_path, preset, how):
    """Saved with lrmoe, loaded with lrmoe and with stock: the same state dict and logits. ``bf16``:
    loaded with dtype=bfloat16 (lrmoe vs stock at that dtype); ``sharded``: saved in several
    safetensors shards, loaded with low_cpu_mem_usage=True (accepted and ignored by transformers 5,
    which always builds on the meta device and loads into it)."""
    from transformers import AutoModelForCausalLM

    _, ours = _twin_models(preset, policy=BackwardPolicy(0.3))
    ours.save_pretrained(tmp_path / "m", **({"max_shard_size": "100KB"} if how == "sharded" else {}))
    if how == "sharded":
        assert len(list((tmp_path / "m").glob("*.safetensors"))) > 1
    kw = {"bf16": {"dtype": torch.bfloat16}, "sharded": {"low_cpu_mem_usage": True}}.get(how, {})
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m", experts_implementation="lrmoe", **kw)
    stock = AutoModelForCausalLM.from_pretrained(tmp_path / "m", experts_implementation="grouped_mm", **kw)
    assert hf.experts_modules(loaded) and set(loaded.state_dict()) == set(ours.state_dict())
    assert loaded.config._experts_implementation == "lrmoe"
    want = ours.state_dict()
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, want[k].to(v.dtype)), k
    ids = torch.randint(0, 61, (2, 7), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        a, b, c = (m(input_ids=ids).logits.float() for m in (ours, loaded, stock))
    if how == "bf16":
        assert loaded.dtype == torch.bfloat16
        torch.testing.assert_close(b, c, rtol=3e-2, atol=3e-2)
    else:
        torch.testing.assert_close(b, a, rtol=0, atol=0)
        torch.testing.assert_close(c, a, rtol=1e-5, atol=1e-6)
    assert hf.get_policies(loaded)[0].drop_ratio == 0.0  # a policy is set on the model, not saved with it
