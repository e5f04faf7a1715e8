"""Routers (lrmoe.router): the softmax (Qwen3-MoE) and sigmoid (GLM-4.5) routers, norm_topk_prob,
group-limited choice, the correction bias (its update and its float32 storage under casts) and the
load-balancing loss."""
import pytest
import torch

from lrmoe import LRMoELayer
from lrmoe.router import (SigmoidTopKRouter, SoftmaxTopKRouter, load_balancing_loss, make_router,
                          update_correction_bias)


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


def test_aux_loss_of_empty_batch_is_finite():
    """An empty batch (an expert-parallel rank with no tokens, which the layer supports) gives a
    NaN aux loss (0/0 in f and in the mean of probs), which poisons the summed training loss."""
    layer = LRMoELayer(8, 4, 4, 2)
    layer(torch.randn(0, 8))
    assert torch.isfinite(layer.aux_loss())


def test_sigmoid_router_bias_stays_float32_in_a_bf16_layer():
    """Steps of 1e-3 round away in bf16 once |bias| >= 0.25; the bias stays float32 (as transformers
    keeps GLM's), while float64 and device moves apply as usual."""
    layer = LRMoELayer(8, 4, 4, 2, router="sigmoid").to(torch.bfloat16)
    assert layer.gate.weight.dtype == torch.bfloat16
    assert layer.gate.e_score_correction_bias.dtype == torch.float32
    for _ in range(2000):
        layer.gate.update_bias(torch.tensor([100, 0, 0, 0]), rate=1e-3)
    torch.testing.assert_close(layer.gate.e_score_correction_bias, torch.tensor([-2.0, 2.0, 2.0, 2.0]), atol=1e-4, rtol=0)
    assert layer(torch.randn(3, 8, dtype=torch.bfloat16)).dtype == torch.bfloat16
    assert LRMoELayer(8, 4, 4, 2, router="sigmoid").double().gate.e_score_correction_bias.dtype == torch.float64


def test_float32_softmax_router_takes_bf16_activations():
    """The sigmoid router and the experts cast 16-bit inputs; the softmax router raised a dtype error."""
    torch.manual_seed(0)
    layer = LRMoELayer(8, 4, 4, 2)
    x = torch.randn(5, 8).to(torch.bfloat16)
    torch.testing.assert_close(layer(x), layer(x.float()).to(torch.bfloat16), rtol=0, atol=0)


def test_casting_the_router_keeps_its_bias_unrounded():
    """The bias was cast to bf16 and back: 0.3001 became 0.30078."""
    layer = LRMoELayer(8, 4, 4, 2, router="sigmoid")
    values = torch.tensor([0.3001, 1.0009, 2.0007, -0.1234])
    layer.gate.e_score_correction_bias.copy_(values)
    layer = layer.to(torch.bfloat16)
    assert layer.gate.e_score_correction_bias.dtype == torch.float32
    assert torch.equal(layer.gate.e_score_correction_bias, values)
    assert torch.equal(layer.half().gate.e_score_correction_bias, values)


@pytest.mark.parametrize("norm", [True, False])
def test_softmax_router_is_softmax_then_top_k(norm):
    """Weights are the k largest softmax probabilities, renormalised to sum 1 with norm_topk_prob."""
    E, K = 6, 2
    r = SoftmaxTopKRouter(8, E, K, norm_topk_prob=norm).double()
    torch.nn.init.normal_(r.weight)
    x = torch.randn(9, 8, dtype=torch.float64)
    logits, w, idx = r(x)
    torch.testing.assert_close(logits, x @ r.weight.t())
    probs = torch.softmax(logits, -1)
    top, top_idx = probs.topk(K, -1)
    assert torch.equal(idx, top_idx)
    torch.testing.assert_close(w, top / top.sum(-1, keepdim=True) if norm else top)


def test_sigmoid_router_scaling_and_normalisation():
    E, K = 6, 3
    x = torch.randn(9, 8, dtype=torch.float64)
    for norm in (True, False):
        r = SigmoidTopKRouter(8, E, K, norm_topk_prob=norm, routed_scaling_factor=2.5).double()
        torch.nn.init.normal_(r.weight)
        _, w, idx = r(x)
        s = torch.sigmoid(x @ r.weight.t())
        assert torch.equal(idx.sort(-1).values, s.topk(K, -1).indices.sort(-1).values)
        want = s.gather(1, idx)
        want = want / want.sum(-1, keepdim=True) if norm else want
        torch.testing.assert_close(w, 2.5 * want)


def test_sigmoid_router_chooses_inside_the_best_groups():
    """n_group=3, topk_group=1: every token's experts lie in the group with the best top-2 score sum."""
    E, K = 6, 2
    r = SigmoidTopKRouter(8, E, K, n_group=3, topk_group=1).double()
    torch.nn.init.normal_(r.weight)
    x = torch.randn(20, 8, dtype=torch.float64)
    _, _, idx = r(x)
    s = torch.sigmoid(x @ r.weight.t()).view(20, 3, 2)
    best = s.topk(2, -1).values.sum(-1).argmax(-1)  # [T]
    assert torch.equal(idx // 2, best[:, None].expand(20, K))


def test_load_balancing_loss_is_the_switch_formula():
    E, K, T = 5, 2, 30
    logits = torch.randn(T, E, dtype=torch.float64)
    idx = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    f = torch.bincount(idx.reshape(-1), minlength=E).double() / (T * K)
    P = torch.softmax(logits, -1).mean(0)
    torch.testing.assert_close(load_balancing_loss(logits, idx, E).double(), E * (f * P).sum())


def test_update_correction_bias_moves_toward_balance():
    bias = torch.zeros(4)
    update_correction_bias(bias, torch.tensor([10, 0, 5, 5]), rate=0.1)
    torch.testing.assert_close(bias, torch.tensor([-0.1, 0.1, 0.0, 0.0]))


def test_make_router_refuses_unknown_kinds_and_options():
    with pytest.raises(ValueError, match=r"unknown router 'topk'; accepted: \['softmax', 'sigmoid'\]"):
        make_router("topk", 8, 4, 2)
    with pytest.raises(ValueError, match="softmax router does not take \\['n_group'\\]"):
        make_router("softmax", 8, 4, 2, n_group=2)
    with pytest.raises(ValueError, match="n_group must divide num_experts"):
        make_router("sigmoid", 8, 6, 2, n_group=4, topk_group=1)
    assert isinstance(make_router("sigmoid", 8, 4, 2, routed_scaling_factor=2.0), SigmoidTopKRouter)
