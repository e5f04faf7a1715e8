"""What a transformers model does with its experts works with "lrmoe" as with transformers' own
experts (issue 16): the stock model is the reference (same weights, same inputs) for Qwen3-MoE and
GLM-4-MoE. Tiny and degenerate configurations, generation beyond greedy decoding (sampling, beam
search and beam sampling, assisted decoding and prompt lookup, left padding, continuing from a
cache, from inputs_embeds, continuous batching), batching equivalence, torch.export, switching the
experts implementation back and forth, meta-device construction, and the checks transformers' own
model tests make (their tester configuration: gelu, top-2 of 8 and GLM's top-8 of 8, padded
batches; every head class, router logits and the load-balancing loss, hidden states, inputs_embeds).
Dtypes, autocast, checkpointing, caches, save/load and optimizer steps: tests/train/test_hf.py."""
import dataclasses
import inspect

import pytest
import torch

import lrmoe.hf as hf
from lrmoe import BackwardPolicy

from .test_hf import _assert_same, _loss_and_grads, _twin_models

PRESETS = ["qwen3-moe-tiny", "glm4-moe-tiny"]
N_EXPERTS = {"qwen3-moe-tiny": "num_experts", "glm4-moe-tiny": "n_routed_experts"}
# hidden 16 instead of the presets' 64: these tests are about configurations, not widths
SMALL = dict(hidden_size=16, intermediate_size=32, moe_intermediate_size=8, head_dim=8, num_attention_heads=2,
             num_key_value_heads=1, vocab_size=64)
V = 64


def ids_of(shape, seed=0, vocab=V):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def routed(model):
    """Collect the expert indices every experts module receives (hooks; remove with .remove())."""
    seen = []

    def hook(_module, args, kwargs):
        seen.append((args[1] if len(args) > 1 else kwargs["top_k_index"]).detach().clone())

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in hf.experts_modules(model)]
    return seen, handles


# --------------------------------------------------------------------------- tiny and odd configurations
def odd_config(preset, case):
    """(config overrides, stock implementation) of a degenerate configuration. ``grouped_mm`` needs
    16-byte strides (transformers' grouped_mm refuses hidden or expert width 1 on CPU: "strides should
    be multiple of 16 bytes"), so those compare against the eager per-expert loop."""
    e = N_EXPERTS[preset]
    if case == "fewest-experts":  # GLM scores groups by their top-2 experts: it needs two (stock fails with one)
        return {e: 1 if preset.startswith("qwen") else 2, "num_experts_per_tok": 1}, "grouped_mm"
    if case == "top-k-equals-E":
        return {e: 4, "num_experts_per_tok": 4}, "grouped_mm"
    if case == "hidden-1":
        return dict(hidden_size=1, num_attention_heads=1, num_key_value_heads=1, head_dim=4), "eager"
    if case == "expert-width-1":
        return dict(moe_intermediate_size=1), "eager"
    assert case == "never-routed"
    return {e: 5, "num_experts_per_tok": 2}, "grouped_mm"


def never_route_last_expert(model):
    """Router rows [w1, -w1, w2, -w2, 0]: for every token max(l0, l1) = |w1.x| >= 0 and max(l2, l3)
    >= 0 are two logits at least the last expert's 0 (softmax and sigmoid keep the order), so the
    last expert is never among the top 2."""
    with torch.no_grad():
        for m in model.modules():
            w = getattr(getattr(m, "gate", None), "weight", None)
            if isinstance(w, torch.Tensor) and w.shape[0] == 5:
                w[1].copy_(-w[0])
                w[3].copy_(-w[2])
                w[4].zero_()


@pytest.mark.parametrize("case", ["fewest-experts", "top-k-equals-E", "hidden-1", "expert-width-1", "never-routed"])
@pytest.mark.parametrize("preset", PRESETS)
def test_odd_configuration_matches_stock(preset, case):
    """At drop 0: loss, logits and every gradient equal to stock's. At drop 0.5 (compact): the same
    loss, finite gradients and exactly half the pairs kept (the quota total is round(0.5 * P))."""
    over, stock = odd_config(preset, case)
    ref, ours = _twin_models(preset, stock=stock, **{**SMALL, **over})
    if case == "never-routed":
        never_route_last_expert(ref)
        ours.load_state_dict(ref.state_dict())
    seen, handles = routed(ours)
    ids = ids_of((2, 6), 1)
    a, b = _loss_and_grads(ref, ids), _loss_and_grads(ours, ids)
    _assert_same(a, b, case)
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-5, atol=1e-6)
    for h in handles:
        h.remove()
    idx = torch.cat([s.flatten() for s in seen])
    n_exp, k = getattr(ours.config, N_EXPERTS[preset]), ours.config.num_experts_per_tok
    if case == "never-routed":
        assert idx.max() < n_exp - 1 and set(idx.tolist()) == set(range(n_exp - 1))  # the premise holds
        for n, g in b[1].items():
            if n.split(".")[-2] == "experts":  # the routed experts' gate_up_proj and down_proj
                assert g[n_exp - 1].abs().max() == 0, n  # no gradient for the idle expert, as stock
    if case == "top-k-equals-E":
        assert all(torch.equal(s.sort(-1).values, torch.arange(k).expand_as(s)) for s in seen)  # every token: every expert
    hf.set_policy(ours, BackwardPolicy(0.5, mode="compact"))
    loss, grads = _loss_and_grads(ours, ids)
    torch.testing.assert_close(loss, a[0], rtol=1e-5, atol=1e-6)  # the policy changes no forward
    assert all(torch.isfinite(g).all() for g in grads.values())
    records = [r for r in hf.backward_records(ours) if r is not None]
    assert records and all(r.kept_fraction == 0.5 for r in records)


# --------------------------------------------------------------------------- generation beyond greedy
def _generate(model, mode, ids):
    kw = dict(max_new_tokens=5, pad_token_id=0)
    if mode == "sample":
        torch.manual_seed(123)
        return model.generate(ids, do_sample=True, top_k=8, temperature=1.5, **kw)
    if mode == "beam-search":
        return model.generate(ids, do_sample=False, num_beams=3, num_return_sequences=2, **kw)
    if mode == "beam-sample":
        torch.manual_seed(321)
        return model.generate(ids, do_sample=True, num_beams=2, top_k=8, **kw)
    if mode == "assistant-model":  # assisted decoding (batch size 1) with the model as its own assistant
        return model.generate(ids[:1], do_sample=False, assistant_model=model, **kw)
    if mode == "prompt-lookup":  # assisted decoding (batch size 1): candidates from the prompt, verified by the model
        return model.generate(ids[:1], do_sample=False, prompt_lookup_num_tokens=2, **kw)
    if mode == "left-padded":
        mask = torch.ones_like(ids)
        mask[0, :3] = 0
        return model.generate(ids, attention_mask=mask, do_sample=False, **kw)
    if mode == "continue-from-cache":
        first = model.generate(ids, do_sample=False, return_dict_in_generate=True, **{**kw, "max_new_tokens": 3})
        # the cache's name: past_key_values in transformers 5.17, cache in later 5.x (past_key_values deprecated)
        name = "cache" if "cache" in {f.name for f in dataclasses.fields(first)} else "past_key_values"
        cache = getattr(first, name)
        out = model.generate(first.sequences, do_sample=False, **{name: cache}, **kw)
        assert cache.get_seq_length() == out.shape[1] - 1  # that cache was continued
        return out
    if mode == "inputs-embeds":
        return model.generate(inputs_embeds=model.get_input_embeddings()(ids), do_sample=False, **kw)
    assert mode == "continuous-batching"  # transformers' paged cache (cache_implementation="paged")
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    # tokens per cache page: block_size in transformers 5.17, page_size in later 5.x. 5.17 checks the paged cache
    # against free memory even with num_blocks and max_batch_tokens given, on CPU through psutil (a test dependency)
    page = "page_size" if "page_size" in inspect.signature(ContinuousBatchingConfig).parameters else "block_size"
    out = model.generate_batch(ids.tolist(), GenerationConfig(max_new_tokens=5, do_sample=False, eos_token_id=V - 1),
                               ContinuousBatchingConfig(num_blocks=8, max_batch_tokens=64, **{page: 16}), warmup=False)
    return torch.tensor([out[k].generated_tokens for k in sorted(out)])


@pytest.mark.parametrize("mode", ["sample", "beam-search", "beam-sample", "assistant-model", "prompt-lookup",
                                  "left-padded", "continue-from-cache", "inputs-embeds", "continuous-batching"])
@pytest.mark.parametrize("preset", PRESETS)
def test_generation_modes_match_stock(preset, mode):
    """With a policy that drops half the pairs from the backward (it changes no forward): the same
    tokens as stock."""
    ref, ours = _twin_models(preset, BackwardPolicy(0.5), **SMALL)
    ids = ids_of((2, 6), 2)
    ids[:, 3:5] = ids[:, :2]  # a repeated n-gram: prompt lookup finds candidates
    out_ref, out = _generate(ref, mode, ids), _generate(ours, mode, ids)
    assert out.shape == out_ref.shape and out.shape[-1] >= 5 and out.shape[0] >= 1
    assert torch.equal(out, out_ref)
    if mode == "continuous-batching":  # the paged cache gives greedy decoding's tokens
        assert torch.equal(out, ref.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)[:, 6:])


# --------------------------------------------------------------------------- switching the implementation
@pytest.mark.parametrize("stock", ["grouped_mm", "batched_mm", "eager"])
@pytest.mark.parametrize("preset", PRESETS)
def test_set_experts_implementation_back_and_forth(preset, stock):
    """stock -> lrmoe -> stock on one model: the same loss and gradients at every stage (bit for bit
    once back on stock), the state dict untouched, no record left over; back on lrmoe the policy
    set before applies again (a policy lives on the module)."""
    hf.register()
    model = hf.build_model(preset, experts_implementation=stock, seed=7, **SMALL)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ids = ids_of((2, 7), 3)
    first = _loss_and_grads(model, ids)
    model.set_experts_implementation("lrmoe")
    assert model.get_experts_implementation()[""] == "lrmoe"
    _assert_same(first, _loss_and_grads(model, ids), f"{stock} -> lrmoe")
    hf.set_policy(model, BackwardPolicy(0.5))
    torch.testing.assert_close(_loss_and_grads(model, ids)[0], first[0], rtol=1e-5, atol=1e-6)
    assert all(r.kept_fraction == 0.5 for r in hf.backward_records(model))
    model.set_experts_implementation(stock)
    assert hf.backward_records(model) == [None] * len(hf.experts_modules(model))  # stock runs now: no record
    _assert_same(first, _loss_and_grads(model, ids), f"lrmoe -> {stock}", rtol=0, atol=0)
    after = model.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(after[k], state[k]) for k in state)
    model.set_experts_implementation("lrmoe")
    assert [p.drop_ratio for p in hf.get_policies(model)] == [0.5] * len(hf.experts_modules(model))


# --------------------------------------------------------------------------- meta-device initialisation
@pytest.mark.parametrize("preset", PRESETS)
def test_meta_device_construction_then_init(preset):
    """Built under ``torch.device("meta")`` (no memory), ``to_empty`` + ``init_weights``: the lrmoe
    model is initialised exactly as the stock one (same seed: identical state dicts, experts drawn
    with the configured std, tied embeddings tied) and trains identically. (from_pretrained in
    transformers 5 always builds on meta first; ``low_cpu_mem_usage`` is ignored: test_hf.py.)"""
    from transformers import AutoModelForCausalLM

    hf.register()
    models = []
    for impl in ("grouped_mm", "lrmoe"):
        with torch.device("meta"):
            m = AutoModelForCausalLM.from_config(hf.model_config(preset, **SMALL), experts_implementation=impl)
        assert all(p.is_meta for p in m.parameters())
        m.to_empty(device="cpu")
        torch.manual_seed(11)
        m.init_weights()
        models.append(m)
    stock, ours = models
    a, b = stock.state_dict(), ours.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    std = ours.config.initializer_range
    for e in hf.experts_modules(ours):
        for w in (e.gate_up_proj, e.down_proj):
            assert 0.8 * std < float(w.detach().std()) < 1.2 * std and torch.isfinite(w).all()
    assert ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()
    hf.set_policy(ours, BackwardPolicy(0.0))
    ids = ids_of((2, 6), 4)
    _assert_same(_loss_and_grads(stock, ids), _loss_and_grads(ours, ids), "meta-initialised")


# --------------------------------------------------------------------------- transformers' own model tests
def stock_tester_config(preset):
    """The configuration transformers' Qwen3-MoE / GLM-4-MoE model testers build (CausalLMModelTester
    defaults: hidden 32, 2 layers, 2 heads, gelu, experts of width 12, 8 experts, top-2; GLM's tester
    routes every token to all 8 experts), with router logits and the load-balancing loss on."""
    from transformers import Glm4MoeConfig, Qwen3MoeConfig

    common = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                  intermediate_size=37, hidden_act="gelu", moe_intermediate_size=12, max_position_embeddings=512,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=0.02)
    if preset == "qwen3-moe-tiny":
        return Qwen3MoeConfig(**common, num_experts=8, num_experts_per_tok=2, output_router_logits=True)
    return Glm4MoeConfig(**common, n_routed_experts=8, n_shared_experts=1, n_group=1, topk_group=1,
                         num_experts_per_tok=8)


HEADS = [("qwen3-moe-tiny", c) for c in ("Model", "ForCausalLM", "ForSequenceClassification",
                                          "ForTokenClassification", "ForQuestionAnswering")] + \
        [("glm4-moe-tiny", c) for c in ("Model", "ForCausalLM")]


@pytest.mark.parametrize("preset,head", HEADS)
def test_model_tester_checks_match_stock(preset, head):
    """Every model class of the family on the tester's padded batch (13 x 7, attention mask tril):
    every output (logits or hidden states, all hidden states, losses, router logits, the aux loss)
    and every gradient equal to stock's; inputs_embeds gives what input_ids gives."""
    import transformers

    hf.register()
    cls = getattr(transformers, ("Qwen3Moe" if preset.startswith("qwen") else "Glm4Moe") + head)
    cfg = stock_tester_config(preset)
    cfg.num_labels = 3
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 99, (13, 7), generator=g)
    batch = dict(input_ids=ids, attention_mask=torch.tril(torch.ones_like(ids)), output_hidden_states=True)
    labels = {"ForCausalLM": ids, "ForSequenceClassification": torch.randint(0, 3, (13,), generator=g),
              "ForTokenClassification": torch.randint(0, 3, (13, 7), generator=g)}
    if head in labels:
        batch["labels"] = labels[head]
    if head == "ForQuestionAnswering":
        batch.update(start_positions=torch.randint(0, 7, (13,), generator=g),
                     end_positions=torch.randint(0, 7, (13,), generator=g))
    outs, grads, models = [], [], []
    for impl in ("grouped_mm", "lrmoe"):
        cfg._experts_implementation_internal = None
        torch.manual_seed(0)
        model = cls._from_config(cfg, experts_implementation=impl)
        if models:
            model.load_state_dict(models[0].state_dict())
        model.train()
        out = model(**batch)
        flat = [t for t in out.values() if isinstance(t, torch.Tensor)]
        flat += [t for v in out.values() if isinstance(v, tuple) for t in v if isinstance(t, torch.Tensor)]
        objective = out.loss if out.get("loss") is not None else sum(t.float().square().mean() for t in flat)
        objective.backward()
        outs.append(flat)
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
        models.append(model)
    assert len(outs[1]) == len(outs[0]) >= 3  # an output, the hidden states of every layer (+ router logits, losses)
    for i, (a, b) in enumerate(zip(*outs)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=lambda m: f"{head} output {i}: {m}")
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-4, atol=1e-6, msg=lambda m: f"{head} {n}: {m}")
    if preset.startswith("qwen") and head == "ForCausalLM":
        out = models[1](**batch)
        assert out.aux_loss is not None and len(out.router_logits) == 2
    with torch.no_grad():
        ours = models[1].eval()
        base = ours if head == "Model" else ours.base_model
        embeds = base.embed_tokens(ids)
        a = base(input_ids=ids, attention_mask=batch["attention_mask"]).last_hidden_state
        b = base(inputs_embeds=embeds, attention_mask=batch["attention_mask"]).last_hidden_state
    torch.testing.assert_close(b, a, rtol=0, atol=0)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("preset", PRESETS)
def test_batching_equivalence_and_attention_implementations(preset, attn):
    """A batch gives each row's own result (rows run alone: same logits within 1e-5), with either
    attention implementation, equal to stock's."""
    ref, ours = _twin_models(preset, attn_implementation=attn, **SMALL)
    assert ours.config._attn_implementation == attn
    ids = ids_of((3, 6), 6)
    with torch.no_grad():
        full, full_ref = ours(input_ids=ids).logits, ref(input_ids=ids).logits
        rows = torch.cat([ours(input_ids=ids[i:i + 1]).logits for i in range(3)])
    torch.testing.assert_close(full, full_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rows, full, rtol=1e-5, atol=1e-5)


def test_torch_export_matches_eager():
    """torch.export of the lrmoe model (inference, no cache): the exported program's logits equal the
    eager model's and stock's."""
    ref, ours = _twin_models("qwen3-moe-tiny", **SMALL)
    ours.eval()
    ids = ids_of((2, 6), 7)
    program = torch.export.export(ours, (), {"input_ids": ids, "use_cache": False})
    with torch.no_grad():
        exported = program.module()(input_ids=ids, use_cache=False).logits
        eager, stock = ours(input_ids=ids, use_cache=False).logits, ref(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(exported, eager, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(exported, stock, rtol=1e-5, atol=1e-6)
