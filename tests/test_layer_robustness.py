"""Robustness of the single-process layer, from a review pass (each test failed before its fix):
F.grouped_mm's layout rule at size-1 dimensions, copying and pickling a used layer, the sigmoid
router's float32 bias, non-finite routing weights and activations, the policy snapshot taken in
forward, and bad inputs that raised something other than a ValueError naming what is accepted."""
import copy
import io
import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lrmoe import BackwardPolicy, BackwardRecord, LRMoELayer, lrmoe_experts
from lrmoe.kernels.grouped_gemm import _aligned, grouped_mm
from lrmoe.quota import compute_quota, register_quota_policy
from oracle import make_case
from test_experts import run_lrmoe


# --- F.grouped_mm layouts (grouped_gemm._aligned) ---------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_aligned_agrees_with_grouped_mm(dtype):
    """``backend="auto"`` picks F.grouped_mm only for layouts it accepts: a [M, 1] matrix with
    strides (1, 1) is row-major with leading stride 1 for torch, which it rejects."""
    b = torch.randn(3, 8, 8, dtype=dtype)
    checked = 0
    for M, N, transposed in itertools.product((1, 2, 3, 4, 8, 16), (1, 2, 4, 8), (False, True)):
        a = torch.randn(N, M, dtype=dtype).t() if transposed else torch.randn(M, N, dtype=dtype)
        offs = torch.tensor([M // 2, M, M], dtype=torch.int32)
        try:
            F.grouped_mm(a, b[:, :N], offs=offs)
            accepted = True
        except RuntimeError:
            accepted = False
        assert (_aligned(a) and _aligned(b[:, :N])) == accepted, (M, N, transposed, a.stride(), b[:, :N].stride())
        checked += 1
    assert checked == 48


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


# --- copies and pickles of a used layer --------------------------------------------------------

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


# --- sigmoid router bias ------------------------------------------------------------------------

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


# --- non-finite factors other than the incoming gradient ----------------------------------------

@pytest.mark.parametrize("scorer", ["grad_norm", "abs_grad", "random"])
def test_nan_routing_weight_is_kept_and_counted(scorer):
    """A NaN routing weight makes the pair's gradient term NaN: it ranks first (kept, counted) with
    every scorer, instead of being dropped silently by scorers that do not look at alpha."""
    x, idx, w, gu, dn, dy = make_case(8, 6, 4, 2, 1, seed=0)
    w[1, 0] = float("nan")
    dy[1] *= 1e-3  # the smallest gradient: dropped first by a gradient scorer
    _, grads, rec = run_lrmoe((x, idx, w, gu, dn, dy), BackwardPolicy(0.5, scorer=scorer, seed=0))
    assert bool(rec.kept_mask[1, 0]) and rec.nonfinite == 1
    assert not torch.isfinite(grads[3]).all()  # the NaN reaches the down projection's gradient


def test_overflowing_activation_gives_same_gradients_in_mask_and_compact():
    """An activation that overflows (||phi||^2 = inf) is kept: compact and mask agree, NaN pattern
    included (mask used to multiply the dropped row's 0 by inf)."""
    x, idx, w, gu, dn, dy = make_case(8, 6, 4, 2, 1, seed=0)
    x[0] = 1e300
    dy[0] *= 1e-3
    res = {m: run_lrmoe((x, idx, w, gu, dn, dy), BackwardPolicy(0.5, scorer="grad_norm", mode=m))
           for m in ("compact", "mask")}
    for m, (_, _, rec) in res.items():
        assert bool(rec.kept_mask[0, 0]) and rec.nonfinite >= 1, m
    for a, b in zip(res["compact"][1], res["mask"][1]):
        torch.testing.assert_close(a, b, equal_nan=True)


# --- the policy is snapshotted in forward ------------------------------------------------------

def test_backward_uses_the_scorer_of_its_forward():
    """Changing the policy's scorer (even to an unregistered name) after forward changes neither the
    pending backward nor its record."""
    case = make_case(12, 6, 4, 4, 2, seed=5)
    _, ref_grads, ref = run_lrmoe(case, BackwardPolicy(0.5, scorer="lrm"))
    x, idx, w, gu, dn, dy = case
    leaves = [t.clone().requires_grad_() for t in (x, w, gu, dn)]
    policy, rec = BackwardPolicy(0.5, scorer="lrm"), BackwardRecord()
    y = lrmoe_experts(leaves[0], idx, leaves[1], leaves[2], leaves[3], policy, rec)
    policy.scorer = "no_such_scorer"
    y.backward(dy)
    assert rec.scorer == "lrm" and torch.equal(rec.kept_mask, ref.kept_mask)
    for a, b in zip((t.grad for t in leaves), ref_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    _, _, full = run_lrmoe(case, BackwardPolicy(0.0))
    assert full.scorer is None


# --- bad inputs -------------------------------------------------------------------------------

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


def test_custom_quota_policy_may_return_numpy_but_not_floats():
    register_quota_policy("review_numpy", lambda d, n: np.asarray(
        compute_quota(d.numpy(), 0.5, "proportional")))
    torch.testing.assert_close(compute_quota(torch.tensor([5, 3, 2]), 0.5, "review_numpy"),
                               compute_quota(torch.tensor([5, 3, 2]), 0.5, "proportional"))
    register_quota_policy("review_float", lambda d, n: d.double() * 0.5)
    with pytest.raises(ValueError, match="must return integer quotas"):
        compute_quota(torch.tensor([5, 3, 2]), 0.5, "review_float")


def test_seeded_random_policy_forward_on_meta():
    """The policy snapshot used to create the random scorer's generator on the meta device, which
    torch refuses: a shape-only forward of a seeded dropping layer failed."""
    meta = torch.device("meta")
    layer = LRMoELayer(16, 8, 4, 2, policy=BackwardPolicy(0.5, scorer="random", seed=1)).to(meta, torch.bfloat16)
    with torch.no_grad():
        y = layer(torch.randn(5, 16, device=meta, dtype=torch.bfloat16))
    assert y.device == meta and y.shape == (5, 16)


def test_casting_the_router_keeps_its_bias_unrounded():
    """The bias was cast to bf16 and back: 0.3001 became 0.30078."""
    layer = LRMoELayer(8, 4, 4, 2, router="sigmoid")
    values = torch.tensor([0.3001, 1.0009, 2.0007, -0.1234])
    layer.gate.e_score_correction_bias.copy_(values)
    layer = layer.to(torch.bfloat16)
    assert layer.gate.e_score_correction_bias.dtype == torch.float32
    assert torch.equal(layer.gate.e_score_correction_bias, values)
    assert torch.equal(layer.half().gate.e_score_correction_bias, values)
