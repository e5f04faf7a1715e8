"""Experts with an activation other than the fused SiLU (h = act(gate) * up, the general path)
against an independent per-pair loop (float64): forward and every gradient at drop ratio 0 and,
at drop ratio > 0, the kept pairs' gradients (dropped pairs masked by hand); float64 gradchecks;
the general path with SiLU equals the fused SwiGLU path; validation of the activation."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lrmoe import BackwardPolicy, BackwardRecord, lrmoe_experts
from lrmoe.layer import LRMoEExperts, experts_activation
from oracle import expected_keep, make_case

f64 = torch.float64

ACTIVATIONS = {  # none of these is special-cased by the experts: all take the general path
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "mish": F.mish,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "silu_general": lambda x: x * torch.sigmoid(x),  # SiLU, but not recognised as such
}

CASES = {  # T, H, I, E, K and make_case options
    "random": ((9, 8, 6, 4, 2), {}),
    "odd": ((13, 5, 3, 7, 3), {}),
    "one_token": ((1, 6, 4, 3, 2), {}),
    "empty_experts": ((11, 6, 4, 6, 2), dict(empty=(1, 4))),
    "hot_expert": ((15, 4, 5, 5, 2), dict(hot=3)),
}


def loop_ref(act, x, idx, w, gu, dn, kept=None):
    """y_t = sum_k w_tk * down_e (act(gate_e x_t) * up_e x_t), one pair at a time; a pair with kept
    False keeps its forward value and its routing-weight gradient but sends no gradient through
    its expert (its output detached). Returns (y, ||h||^2 [T, K])."""
    T, K = idx.shape
    rows, h2 = [], torch.zeros(T, K, dtype=f64)
    for t in range(T):
        acc = 0
        for k in range(K):
            e = int(idx[t, k])
            gate, up = (gu[e] @ x[t]).chunk(2)
            h = act(gate) * up
            o = dn[e] @ h
            h2[t, k] = (h.detach() ** 2).sum()
            if kept is not None and not bool(kept[t, k]):
                o = o.detach()
            acc = acc + w[t, k] * o
        rows.append(acc)
    return torch.stack(rows), h2


def run_both(case, act, policy, kept_from_lrmoe=True):
    x, idx, w, gu, dn, dy = case
    ours = [t.clone().requires_grad_() for t in (x, w, gu, dn)]
    rec = BackwardRecord()
    y = lrmoe_experts(ours[0], idx, ours[1], ours[2], ours[3], policy, rec, activation=act)
    y.backward(dy)
    ref = [t.clone().requires_grad_() for t in (x, w, gu, dn)]
    y_ref, h2 = loop_ref(act, ref[0], idx, ref[1], ref[2], ref[3], rec.kept_mask if kept_from_lrmoe else None)
    y_ref.backward(dy)
    return (y, [t.grad for t in ours], rec), (y_ref, [t.grad for t in ref], h2)


def assert_grads(ours, ref, what):
    for name, a, b in zip(("x", "weights", "gate_up_proj", "down_proj"), ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10, msg=lambda m: f"{what}: grad of {name}: {m}")


@pytest.mark.parametrize("case_name", list(CASES))
@pytest.mark.parametrize("act_name", list(ACTIVATIONS))
@pytest.mark.parametrize("mode", ["full", "compact", "mask"])
def test_drop0_equals_loop(mode, act_name, case_name):
    shape, kw = CASES[case_name]
    case = make_case(*shape, **kw)
    (y, grads, rec), (y_ref, grads_ref, _) = run_both(case, ACTIVATIONS[act_name], BackwardPolicy(0.0, mode=mode))
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-12)
    assert_grads(grads, grads_ref, f"{act_name} {mode} {case_name}")
    assert rec.kept_mask.all()


@pytest.mark.parametrize("case_name", list(CASES))
@pytest.mark.parametrize("act_name", ["gelu", "relu", "quick_gelu"])
@pytest.mark.parametrize("mode", ["compact", "mask"])
def test_dropping_kept_pairs_equal_masked_loop(mode, act_name, case_name):
    shape, kw = CASES[case_name]
    case = make_case(*shape, **kw)
    x, idx, w, gu, dn, dy = case
    rho = float(torch.empty(()).uniform_(0.2, 0.6))
    (y, grads, rec), (y_ref, grads_ref, h2) = run_both(case, ACTIVATIONS[act_name], BackwardPolicy(rho, mode=mode))
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-12)  # the forward is complete
    assert_grads(grads, grads_ref, f"{act_name} {mode} {case_name} rho={rho:.2f}")
    # The selection is the lrm score of this activation's h, top quota per expert.
    g2 = (dy**2).sum(-1, keepdim=True)
    torch.testing.assert_close(rec.scores, (w**2 * g2 * h2).float(), rtol=1e-5, atol=1e-6)
    assert torch.equal(rec.kept_mask, expected_keep(rec.scores, idx, rec.quota))
    if shape[0] * shape[4] > 2:
        assert not rec.kept_mask.all()  # something was dropped: the mask is part of the check


@pytest.mark.parametrize("act_name", ["gelu_tanh", "mish", "quick_gelu"])
@pytest.mark.parametrize("mode", ["full", "compact", "mask"])
def test_gradcheck_general_path(mode, act_name):
    x, idx, w, gu, dn, _ = make_case(5, 4, 3, 3, 2, empty=(1,))
    inputs = tuple(t.clone().requires_grad_() for t in (x, w, gu, dn))
    act = ACTIVATIONS[act_name]
    assert torch.autograd.gradcheck(
        lambda a, b, c, d: lrmoe_experts(a, idx, b, c, d, BackwardPolicy(0.0, mode=mode), activation=act), inputs)


@pytest.mark.parametrize("rho", [0.0, 0.4])
@pytest.mark.parametrize("mode", ["full", "compact", "mask"])
def test_general_path_with_silu_equals_fused_swiglu(mode, rho):
    case = make_case(14, 6, 5, 5, 2, hot=0)
    x, idx, w, gu, dn, dy = case
    out = []
    for act in (None, ACTIVATIONS["silu_general"]):
        leaves = [t.clone().requires_grad_() for t in (x, w, gu, dn)]
        rec = BackwardRecord()
        y = lrmoe_experts(leaves[0], idx, leaves[1], leaves[2], leaves[3], BackwardPolicy(rho, mode=mode), rec,
                          activation=act)
        y.backward(dy)
        out.append((y, [t.grad for t in leaves], rec))
    (y0, g0, r0), (y1, g1, r1) = out
    torch.testing.assert_close(y1, y0, rtol=1e-12, atol=1e-13)
    assert torch.equal(r1.kept_mask, r0.kept_mask)
    assert_grads(g1, g0, f"general silu vs fused, {mode} rho={rho}")


def test_general_path_in_bf16_matches_fp32():
    x, idx, w, gu, dn, dy = (t.float() if t.is_floating_point() else t for t in make_case(16, 8, 8, 4, 2, hot=1))
    act = ACTIVATIONS["gelu"]
    res = []
    for dt in (torch.float32, torch.bfloat16):
        leaves = [t.detach().to(dt).clone().requires_grad_() for t in (x, w, gu, dn)]
        y = lrmoe_experts(leaves[0], idx, leaves[1], leaves[2], leaves[3], BackwardPolicy(0.0), activation=act)
        y.backward(dy.to(dt))
        res.append([y] + [t.grad for t in leaves])
    for a, b in zip(*res):
        assert b.dtype == torch.bfloat16
        torch.testing.assert_close(b.float(), a, rtol=5e-2, atol=5e-2)


def test_experts_module_takes_the_activation_option():
    torch.manual_seed(0)
    mod = LRMoEExperts(4, 6, 5, BackwardPolicy(0.0), activation=nn.GELU(approximate="tanh"))
    with torch.no_grad():
        mod.gate_up_proj.normal_(0, 0.4)
        mod.down_proj.normal_(0, 0.4)
    x, idx, w, *_ = make_case(7, 6, 5, 4, 2)
    x, w = x.float(), w.float()
    y = mod(x, idx, w)
    ref, _ = loop_ref(lambda g: F.gelu(g, approximate="tanh"), x.double(), idx, w.double(),
                      mod.gate_up_proj.detach().double(), mod.down_proj.detach().double())
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-6)
    y.sum().backward()
    assert mod.last_backward is not None and mod.gate_up_proj.grad is not None


def test_silu_spellings_take_the_fused_path():
    assert experts_activation(None) is None
    assert experts_activation(F.silu) is None
    assert experts_activation(nn.SiLU()) is None
    gelu = nn.GELU()
    assert experts_activation(gelu) is gelu


@pytest.mark.parametrize("bad,match", [
    (3, "elementwise callable"),
    (nn.PReLU(), "has parameters"),
])
def test_module_refuses_bad_activations(bad, match):
    with pytest.raises(ValueError, match=match):
        LRMoEExperts(2, 4, 3, activation=bad)


def test_function_refuses_non_elementwise_or_non_callable_activation():
    x, idx, w, gu, dn, _ = make_case(4, 4, 3, 3, 2)
    with pytest.raises(ValueError, match="activation must be None"):
        lrmoe_experts(x, idx, w, gu, dn, activation="gelu")
    with pytest.raises(ValueError, match="must be elementwise"):
        lrmoe_experts(x, idx, w, gu, dn, activation=lambda g: g.sum(-1))
