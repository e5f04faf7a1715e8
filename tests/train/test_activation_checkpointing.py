"""Activation checkpointing per decoder layer (lrmoe.hf.checkpointing) in one process: the same loss,
gradients and selected pairs as without it, every layer really recomputed once in the backward, and
the recompute invisible to the kit's records and timers. The expert-parallel side (the plan reused,
SYMI's state advanced once) is checked on torchrun ranks in tests/train/test_fsdp.py."""
import pytest
import torch

import lrmoe.hf as hf
from lrmoe import BackwardPolicy
from lrmoe.hf.checkpointing import checkpoint_layers, is_checkpointed
from lrmoe.recompute import recompute, recomputing
from lrmoe.train.config import TrainConfig
from lrmoe.train.timer import MoETimer

V = 61


def model_pair(preset="qwen3-moe-tiny", layers=2, dtype=torch.float32, **policy):
    kw = dict(vocab_size=V, seed=3, num_hidden_layers=layers, dtype=dtype)
    a = hf.build_model(preset, policy=BackwardPolicy(**policy), **kw)
    b = hf.build_model(preset, policy=BackwardPolicy(**policy), **kw)
    b.load_state_dict(a.state_dict())
    return a, b


def step(model, ids):
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("preset,layers,policy", [
    ("qwen3-moe-tiny", 2, dict(drop_ratio=0.3)),
    ("qwen3-moe-tiny", 2, dict(drop_ratio=0.5, mode="mask")),
    ("qwen3-moe-tiny", 1, dict(drop_ratio=0.0, mode="full")),
    ("glm4-moe-tiny", 3, dict(drop_ratio=0.2)),  # layer 0 dense, then MoE layers with shared experts
])
def test_checkpointed_step_equals_the_plain_one(preset, layers, policy):
    plain, ckpt = model_pair(preset, layers, dtype=torch.float64, **policy)
    assert checkpoint_layers(ckpt) == layers and is_checkpointed(ckpt) and not is_checkpointed(plain)
    ids = torch.randint(0, V, (3, 11), generator=torch.Generator().manual_seed(1))
    l_p, g_p = step(plain, ids)
    l_c, g_c = step(ckpt, ids)
    torch.testing.assert_close(l_c, l_p, rtol=1e-12, atol=1e-12)
    assert g_p.keys() == g_c.keys() and len(g_p) > 0
    for n in g_p:
        torch.testing.assert_close(g_c[n], g_p[n], rtol=1e-10, atol=1e-12, msg=lambda m: f"grad of {n}: {m}")
    # the same pairs kept in every MoE layer's backward (one record each, filled once)
    for rp, rc in zip(hf.backward_records(plain), hf.backward_records(ckpt)):
        assert rp is not None and rc is not None
        assert torch.equal(rp.kept, rc.kept) and torch.equal(rp.kept_mask, rc.kept_mask)


def test_every_layer_is_recomputed_once_and_the_recompute_is_flagged():
    plain, ckpt = model_pair(drop_ratio=0.3)
    checkpoint_layers(ckpt)
    calls = {"plain": [], "ckpt": []}
    for name, m in (("plain", plain), ("ckpt", ckpt)):
        for i, mod in enumerate(hf.experts_modules(m)):
            mod.register_forward_pre_hook(lambda mod, args, i=i, name=name: calls[name].append((i, recomputing())))
    ids = torch.randint(0, V, (2, 8), generator=torch.Generator().manual_seed(2))
    step(plain, ids)
    step(ckpt, ids)
    assert calls["plain"] == [(0, False), (1, False)]
    # the forward, then the backward recomputes the layers last to first, flagged
    assert calls["ckpt"] == [(0, False), (1, False), (1, True), (0, True)]
    assert not recomputing()


def test_timer_ignores_the_recompute():
    _, ckpt = model_pair(drop_ratio=0.3)
    checkpoint_layers(ckpt)
    mods = hf.experts_modules(ckpt)
    timer = MoETimer(mods, torch.device("cpu"))
    kinds = []
    add = timer._add
    timer._add = lambda events, kind, start, end: kinds.append(kind) or add(events, kind, start, end)
    timer.enabled = True
    step(ckpt, torch.randint(0, V, (2, 8), generator=torch.Generator().manual_seed(3)))
    timer.enabled = False
    # one forward and one backward interval per layer: none for the recompute
    assert sorted(kinds) == ["bwd"] * len(mods) + ["fwd"] * len(mods)
    assert not timer._starts
    timer.remove()


def test_recompute_flag_nests_and_resets():
    assert not recomputing()
    with recompute():
        with recompute():
            assert recomputing()
        assert recomputing()
    assert not recomputing()
    with pytest.raises(KeyError):
        with recompute():
            raise KeyError("x")
    assert not recomputing()


def test_checkpointing_twice_is_refused():
    _, m = model_pair()
    checkpoint_layers(m)
    with pytest.raises(ValueError, match="already activation-checkpointed"):
        checkpoint_layers(m)


@pytest.mark.parametrize("over,msg", [
    (dict(activation_checkpointing=1), "activation_checkpointing must be true or false"),
    (dict(activation_checkpointing=True, virtual_ep=2, micro_batch=4), "not supported with virtual_ep"),
])
def test_config_errors(over, msg):
    with pytest.raises(ValueError, match=msg):
        TrainConfig(**over)
