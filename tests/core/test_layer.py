"""The MoE layer (lrmoe.layer): equality with the transformers modules at C0, the backward record,
copies and pickles of a used layer, size-one dimensions, init and input validation (dtype, device,
shape) at construction and call."""
import copy
import io

import pytest
import torch
from transformers import Glm4MoeConfig, Qwen3MoeConfig
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from lrmoe import BackwardPolicy, LRMoELayer, lrmoe_experts
from lrmoe.kernels import grouped_mm
from lrmoe.quota import compute_quota
from oracle import make_case


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


def test_layer_init_arguments():
    layer = LRMoELayer(8, 4, 4, 2, init_std=0.0)  # an explicit std of 0 means zeros, not the default
    assert layer.experts.gate_up_proj.abs().max() == 0 and layer.gate.weight.abs().max() == 0
    with pytest.raises(ValueError, match="hidden_size must be a positive int, got True"):
        LRMoELayer(True, 4, 4, 2)
    with pytest.raises(ValueError, match="top_k must be an int"):
        LRMoELayer(8, 4, 4, True)


@pytest.mark.parametrize("H, I", [(8, 1), (1, 4)])
def test_float32_layer_with_a_size_one_dimension(H, I):
    """hidden_size or intermediate_size 1 in float32 ran F.grouped_mm on a layout it rejects."""
    torch.manual_seed(0)
    x = torch.randn(5, H)
    out = {}
    for backend in ("auto", "loop"):
        torch.manual_seed(1)
        layer = LRMoELayer(H, I, 4, 2, policy=BackwardPolicy(0.25, backend=backend))
        xx = x.clone().requires_grad_()
        y = layer(xx)
        y.backward(torch.ones_like(y))
        out[backend] = [y, xx.grad, layer.experts.gate_up_proj.grad, layer.experts.down_proj.grad]
    for a, b in zip(out["auto"], out["loop"]):
        torch.testing.assert_close(a, b)
    a, b, offs = torch.randn(16, 1), torch.randn(2, 1, 8), torch.tensor([5, 16], dtype=torch.int32)
    torch.testing.assert_close(grouped_mm(a, b, offs), grouped_mm(a, b, offs, backend="loop"))


def pickle_roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def test_deepcopy_and_pickle_after_backward():
    """An EMA / reference copy or ``torch.save(layer)`` after training steps: the last call's router
    logits belong to its autograd graph and the record's callback to the module, not to copies."""
    torch.manual_seed(0)
    layer = LRMoELayer(8, 4, 4, 2, router="sigmoid", n_shared_experts=1, policy=BackwardPolicy(0.5, seed=3))
    x = torch.randn(6, 8)
    layer(x).sum().backward()
    assert layer.last_backward is not None and layer.last_router_logits is not None
    for other in (copy.deepcopy(layer), pickle_roundtrip(layer)):
        assert other.last_backward is None and other.last_router_logits is None
        torch.testing.assert_close(other(x), layer(x), rtol=0, atol=0)
        other(x).sum().backward()  # the copy records its own backward
        assert other.last_backward is not None and other.last_backward.filled
    rec = pickle_roundtrip(layer.last_backward)
    assert rec.filled and torch.equal(rec.kept, layer.last_backward.kept)


@pytest.mark.parametrize("make, match", [
    (lambda: BackwardPolicy(scorer=["lrm"]), "unknown scorer"),
    (lambda: BackwardPolicy(quota={"waterfill": 1}), "unknown quota policy"),
    (lambda: LRMoELayer(8, 4, 4, 2, router="sigmoid", scale=2.0), "sigmoid router does not take"),
    (lambda: LRMoELayer(8, 4, 4, 2, router="softmax", scale=2.0), "softmax router does not take"),
    (lambda: LRMoELayer(8, 4, 4, 2, router="sigmoid", n_group=0), "n_group must be a positive int"),
    (lambda: LRMoELayer(8, 4, 4, 2, policy="lrm"), "policy must be a BackwardPolicy"),
    (lambda: LRMoELayer(8, 4, 4, 2)(torch.tensor(1.0)), "last dimension must be hidden_size"),
    (lambda: lrmoe_experts(*make_case(4, 6, 4, 3, 2)[:5], 0.2), "policy must be a BackwardPolicy"),
    (lambda: compute_quota(torch.tensor([5, 3, 2]), 0.5, "waterfill", min_keep=1.5), "min_keep must be an int"),
])
def test_bad_input_raises_value_error(make, match):
    with pytest.raises(ValueError, match=match):
        make()


# --- inputs that gave silently wrong results are refused --------------------------------------------

def test_integer_input_is_refused():
    """The layer returned an int64 tensor (the expert outputs truncated) for integer hidden states."""
    with pytest.raises(ValueError, match="the layer's input must be a floating-point tensor, got torch.int64"):
        LRMoELayer(16, 8, 4, 2)(torch.arange(48).view(3, 16))


def test_float64_input_into_float32_weights_is_refused():
    """float64 hidden states were computed in float32 and returned as float64; the rule (docs/method.md):
    the experts compute in the weights' dtype, and hidden states must be of a dtype it holds exactly."""
    layer = LRMoELayer(16, 8, 4, 2)
    with pytest.raises(ValueError, match="the layer's input is torch.float64 but the experts compute in torch.float32"):
        layer(torch.randn(3, 16, dtype=torch.float64))
    assert layer.double()(torch.randn(3, 16, dtype=torch.float64)).dtype == torch.float64
    assert LRMoELayer(16, 8, 4, 2)(torch.randn(3, 16).bfloat16()).dtype == torch.bfloat16  # exact in fp32


def test_input_on_another_device_is_refused():
    """Torch's error named a dtype; the layer's names both devices."""
    with pytest.raises(ValueError, match="the layer's input is on meta but the expert weights are on cpu"):
        LRMoELayer(16, 8, 4, 2)(torch.randn(3, 16, device="meta"))


@pytest.mark.parametrize("std", [-1, -0.5, float("nan"), float("inf"), "0.1", True])
def test_bad_init_std_is_refused(std):
    with pytest.raises(ValueError, match=r"init_std must be a finite number >= 0 .* got " + repr(std).replace("'", ".")):
        LRMoELayer(8, 4, 4, 2, init_std=std)
    layer = LRMoELayer(8, 4, 4, 2)
    with pytest.raises(ValueError, match="std must be a finite number >= 0"):
        layer.reset_parameters(std)


def test_explicit_init_std_is_the_spread_of_every_projection():
    layer = LRMoELayer(64, 32, 8, 2, init_std=0.02, n_shared_experts=1)
    for p in (layer.gate.weight, layer.experts.gate_up_proj, layer.experts.down_proj, layer.shared_experts.up_proj.weight):
        assert 0.015 < float(p.detach().std()) < 0.025
