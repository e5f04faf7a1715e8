"""The MoE layer and routers, including equality with the transformers modules."""
import pytest
import torch
from transformers import Glm4MoeConfig, Qwen3MoeConfig
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from lrmoe import BackwardPolicy, LRMoELayer
from lrmoe.router import SigmoidTopKRouter, SoftmaxTopKRouter, update_correction_bias


# transformers' routers compute in float32 whatever the input dtype, so equality with them is
# checked in float32 (float64 exactness is checked against the per-pair loop in test_experts.py).
def qwen_pair(H=16, I=8, E=6, K=2, dtype=torch.float32, impl="grouped_mm"):
    cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=K,
                         norm_topk_prob=True)
    cfg._experts_implementation = impl
    hf = Qwen3MoeSparseMoeBlock(cfg).to(dtype)
    ours = LRMoELayer(H, I, E, K, router="softmax", norm_topk_prob=True).to(dtype)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
        ours.gate.weight.copy_(hf.gate.weight)
        ours.experts.gate_up_proj.copy_(hf.experts.gate_up_proj)
        ours.experts.down_proj.copy_(hf.experts.down_proj)
    return hf, ours


def grads_of(module, names):
    params = dict(module.named_parameters())
    return [params[n].grad for n in names]


@pytest.mark.parametrize("impl", ["grouped_mm", "eager"])
def test_qwen3_block_equality_at_c0(impl):
    dtype = torch.float32
    hf, ours = qwen_pair(impl=impl)
    ours.policy = BackwardPolicy(0.0)
    x = torch.randn(3, 5, 16, dtype=dtype)
    dy = torch.randn(3, 5, 16, dtype=dtype)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = hf(x1), ours(x2)
    y1.backward(dy)
    y2.backward(dy)
    tol = dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(y2, y1, **tol)
    torch.testing.assert_close(x2.grad, x1.grad, **tol)
    names = ["gate.weight", "experts.gate_up_proj", "experts.down_proj"]
    for n, a, b in zip(names, grads_of(ours, names), grads_of(hf, names)):
        torch.testing.assert_close(a, b, **tol, msg=lambda m: f"{n}: {m}")


def test_glm_block_equality_at_c0():
    H, I, E, K = 16, 8, 8, 3
    cfg = Glm4MoeConfig(hidden_size=H, moe_intermediate_size=I, n_routed_experts=E, num_experts_per_tok=K,
                        n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True)
    cfg._experts_implementation = "eager"
    hf = Glm4MoeMoE(cfg)
    ours = LRMoELayer(H, I, E, K, router="sigmoid", n_shared_experts=1, n_group=2, topk_group=1,
                      routed_scaling_factor=2.5, policy=BackwardPolicy(0.0))
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
        hf.gate.e_score_correction_bias.normal_(0, 0.1)
        missing = ours.load_state_dict(hf.state_dict(), strict=False)
        assert not missing.missing_keys, missing
    x = torch.randn(2, 7, H)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = hf(x1), ours(x2)
    tol = dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(y2, y1, **tol)
    y1.sum().backward()
    y2.sum().backward()
    torch.testing.assert_close(x2.grad, x1.grad, **tol)
    for name, p in hf.named_parameters():
        torch.testing.assert_close(dict(ours.named_parameters())[name].grad, p.grad, **tol, msg=lambda m: f"{name}: {m}")


def test_sigmoid_router_uses_bias_for_choice_only():
    r = SigmoidTopKRouter(8, 4, 2, norm_topk_prob=False, routed_scaling_factor=1.0).double()
    torch.nn.init.normal_(r.weight)
    x = torch.randn(10, 8, dtype=torch.float64)
    r.e_score_correction_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 10.0]))
    _, w, idx = r(x)
    assert (idx == 3).any(dim=1).all()  # the bias forces expert 3 into every choice
    torch.testing.assert_close(w, torch.sigmoid(x @ r.weight.t()).gather(1, idx))  # unbiased weights


def test_softmax_router_precision():
    r = SoftmaxTopKRouter(8, 5, 2).bfloat16()
    torch.nn.init.normal_(r.weight)
    logits, w, idx = r(torch.randn(4, 8, dtype=torch.bfloat16))
    assert w.dtype == torch.bfloat16 and idx.shape == (4, 2)
    torch.testing.assert_close(w.float().sum(-1), torch.ones(4), rtol=1e-2, atol=1e-2)


def test_correction_bias_update():
    b = torch.zeros(4)
    update_correction_bias(b, torch.tensor([10, 0, 5, 5]), rate=0.1)
    torch.testing.assert_close(b, torch.tensor([-0.1, 0.1, 0.0, 0.0]))


def test_aux_loss_is_one_when_balanced_and_higher_when_not():
    layer = LRMoELayer(8, 4, 4, 1)
    layer(torch.randn(64, 8))
    loss = layer.aux_loss()
    assert loss.requires_grad and float(loss.detach()) >= 0.5
    with torch.no_grad():
        layer.gate.weight.zero_()
        layer.gate.weight[2] = 5.0
    layer(torch.rand(64, 8) + 0.5)  # everyone picks expert 2
    assert float(layer.aux_loss().detach()) > 1.5


def test_last_backward_tracks_latest_backward():
    layer = LRMoELayer(8, 4, 4, 2, policy=BackwardPolicy(0.5))
    assert layer.last_backward is None
    y = layer(torch.randn(6, 8))
    assert layer.last_backward is None  # forward alone records nothing
    y.sum().backward()
    rec = layer.last_backward
    assert rec.filled and rec.kept_mask.shape == (6, 2) and int(rec.kept.sum()) == 6
    with torch.no_grad():
        layer(torch.randn(3, 8))
    assert layer.last_backward is rec


def test_layer_bad_inputs():
    with pytest.raises(ValueError, match=r"top_k must be an int in \[1, num_experts=4\], got 5"):
        LRMoELayer(8, 4, 4, 5)
    with pytest.raises(ValueError, match=r"top_k must be an int in \[1, num_experts=4\], got 0"):
        LRMoELayer(8, 4, 4, 0)
    with pytest.raises(ValueError, match=r"unknown router 'relu'; accepted: \['softmax', 'sigmoid'\]"):
        LRMoELayer(8, 4, 4, 2, router="relu")
    with pytest.raises(ValueError, match="top_k=3 exceeds the experts of the topk_group=1 selected groups"):
        LRMoELayer(8, 4, 4, 3, router="sigmoid", n_group=2, topk_group=1)
    layer = LRMoELayer(8, 4, 4, 2)
    with pytest.raises(ValueError, match="last dimension must be hidden_size=8"):
        layer(torch.randn(3, 7))
    with pytest.raises(ValueError, match="policy must be a BackwardPolicy"):
        layer.policy = "lrm"
