"""The selective experts function against an independent per-pair loop (float64): forward, gradients
of every input in every mode, selection by quota and score, non-finite gradients, empty batches,
the fused-gather path, mixed dtypes, float64 gradchecks, and its input validation."""
import pytest
import torch

from lrmoe import BackwardPolicy, lrmoe_experts
from lrmoe.quota import retained_total
from oracle import assert_close_all, expected_keep, make_case, run_loop, run_lrmoe


f64 = torch.float64


SHAPES = [  # T, H, I, E, K
    (9, 8, 6, 4, 2),
    (13, 5, 3, 7, 3),  # odd sizes
    (1, 6, 4, 3, 2),  # one token
    (6, 4, 4, 3, 3),  # top_k == num_experts
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mode", ["full", "compact", "mask"])
def test_keep_all_equals_plain_moe(shape, mode):
    case = make_case(*shape)
    y, grads, rec = run_lrmoe(case, BackwardPolicy(0.0, mode=mode))
    y_ref, grads_ref, _ = run_loop(case)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-12)
    assert_close_all(grads, grads_ref, f"keep-all {mode}")
    assert rec.kept_mask.all() and torch.equal(rec.kept, rec.demand)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("quota", ["waterfill", "proportional"])
@pytest.mark.parametrize("scorer", ["lrm", "lrm_input", "grad_norm", "abs_grad", "random"])
def test_dropping_matches_loop_on_kept_pairs(shape, quota, scorer):
    case = make_case(*shape)
    x, idx, w, gu, dn, dy = case
    rho = float(torch.empty(()).uniform_(0.1, 0.6))
    pol = BackwardPolicy(rho, scorer=scorer, quota=quota, seed=7)
    y, grads, rec = run_lrmoe(case, pol)
    y_ref, grads_ref, h2 = run_loop(case, kept=rec.kept_mask)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-12)  # forward is complete
    assert_close_all(grads, grads_ref, f"{scorer}/{quota} rho={rho:.2f}")

    # The quotas are the policy's, the scores are the definition, the selection is top-quota.
    demand = torch.bincount(idx.reshape(-1), minlength=gu.shape[0])
    assert torch.equal(rec.demand, demand)
    n_keep = int(rec.quota.sum())
    assert n_keep == retained_total(idx.numel(), rho) and ((rec.quota >= 0) & (rec.quota <= demand)).all()
    if quota == "proportional":  # the policy's defining property, checked independently
        assert ((rec.quota.double() - (1 - rho) * demand.double()).abs() < 1).all()
    else:  # waterfill: a common cap, +1 for rounding
        trimmed = rec.quota < demand
        if trimmed.any():
            tau = int(rec.quota[trimmed].min())
            assert (rec.quota[trimmed] <= tau + 1).all() and (demand[~trimmed] <= tau + 1).all()
    g2 = (dy**2).sum(-1, keepdim=True)
    expected_scores = {
        "lrm": w**2 * g2 * h2,
        "lrm_input": w**2 * g2 * (x**2).sum(-1, keepdim=True),
        "grad_norm": g2.expand_as(w),
        "abs_grad": dy.abs().sum(-1, keepdim=True).expand_as(w),
    }
    if scorer in expected_scores:
        torch.testing.assert_close(rec.scores, expected_scores[scorer].float(), rtol=1e-5, atol=1e-6)
    assert torch.equal(rec.kept_mask, expected_keep(rec.scores, idx, rec.quota))
    assert torch.equal(rec.kept, rec.quota)


@pytest.mark.parametrize("case_kind", ["empty", "hot", "odd"])
def test_compact_and_mask_give_the_same_gradients(case_kind):
    kw = {"empty": dict(empty=(1, 4)), "hot": dict(hot=2), "odd": {}}[case_kind]
    case = make_case(17, 7, 5, 6, 2, **kw)
    rho = float(torch.empty(()).uniform_(0.15, 0.7))
    _, g_c, r_c = run_lrmoe(case, BackwardPolicy(rho, mode="compact"))
    _, g_m, r_m = run_lrmoe(case, BackwardPolicy(rho, mode="mask"))
    assert torch.equal(r_c.kept_mask, r_m.kept_mask)
    assert_close_all(g_c, g_m, "compact vs mask")
    assert r_c.buffer_bytes < r_m.buffer_bytes  # compaction shrinks the execution buffers
    if case_kind == "empty":
        assert r_c.demand[1] == 0 and r_c.demand[4] == 0
        assert g_c[2][1].abs().sum() == 0 and g_c[3][4].abs().sum() == 0


def test_gradcheck_full_mode():
    x, idx, w, gu, dn, _ = make_case(5, 4, 3, 3, 2)
    inputs = tuple(t.clone().requires_grad_() for t in (x, w, gu, dn))
    assert torch.autograd.gradcheck(
        lambda a, b, c, d: lrmoe_experts(a, idx, b, c, d, BackwardPolicy(0.0, mode="full")), inputs)


@pytest.mark.parametrize("mode", ["compact", "mask", "full"])
def test_nonfinite_gradient_is_kept_and_counted(mode):
    x, idx, w, gu, dn, dy = make_case(12, 5, 4, 3, 2)
    dy[4, 2] = float("nan")
    _, grads, rec = run_lrmoe((x, idx, w, gu, dn, dy), BackwardPolicy(0.4, mode=mode))
    assert rec.nonfinite == 2  # the two pairs of token 4
    assert rec.kept_mask[4].all()  # non-finite scores rank first
    for e in idx[4].tolist():
        assert torch.isnan(grads[2][e]).any() and torch.isnan(grads[3][e]).any()
    assert torch.isnan(grads[1][4]).all()  # router gradient of that token
    assert torch.isfinite(grads[1][torch.arange(12) != 4]).all()


def test_buffer_bytes_are_proportional_to_kept_rows():
    case = make_case(20, 8, 4, 4, 2)
    recs = [run_lrmoe(case, BackwardPolicy(r))[2] for r in (0.0, 0.5)]
    n0, n1 = (int(r.kept.sum()) for r in recs)
    assert n1 == 20 and n0 == 40
    assert recs[1].buffer_bytes * n0 == recs[0].buffer_bytes * n1  # proportional to kept rows


def test_bad_inputs():
    x, idx, w, gu, dn, _ = make_case(4, 6, 4, 3, 2)
    with pytest.raises(ValueError, match=r"expert indices must be in \[0, 2\]"):
        lrmoe_experts(x, idx + 1, w, gu, dn)
    with pytest.raises(ValueError, match=r"expert indices"):
        lrmoe_experts(x, idx - 3, w, gu, dn)
    with pytest.raises(ValueError, match="hidden size"):
        lrmoe_experts(x[:, :5], idx, w, gu, dn)
    with pytest.raises(ValueError, match=r"\[T=4, K\]"):
        lrmoe_experts(x, idx, w[:, :1], gu, dn)
    with pytest.raises(ValueError, match="integer"):
        lrmoe_experts(x, idx.double(), w, gu, dn)
    with pytest.raises(ValueError, match=r"drop_ratio must be a number in \[0, 1\), got 1.5"):
        BackwardPolicy(1.5)
    with pytest.raises(ValueError, match=r"unknown scorer 'nope'; registered: \[.*'lrm'"):
        BackwardPolicy(scorer="nope")
    with pytest.raises(ValueError, match=r"unknown quota policy 'nope'; registered: \[.*'waterfill'"):
        BackwardPolicy(quota="nope")
    with pytest.raises(ValueError, match=r"unknown backward mode 'drop'; accepted: \['full', 'compact', 'mask'\]"):
        BackwardPolicy(mode="drop")


def test_mask_equals_compact_when_nonfinite_pairs_are_dropped():
    """More NaN pairs than quota: the dropped NaN rows must not leak into mask mode's GEMMs."""
    x, idx, w, gu, dn, dy = make_case(16, 5, 4, 2, 1)
    dy[:12] = float("nan")
    case = (x, idx, w, gu, dn, dy)
    _, g_c, r_c = run_lrmoe(case, BackwardPolicy(0.5, mode="compact"))
    _, g_m, r_m = run_lrmoe(case, BackwardPolicy(0.5, mode="mask"))
    assert r_c.nonfinite == 12 and int((~r_c.kept_mask[:12]).sum()) > 0  # some NaN pairs dropped
    for a, b in zip(g_c, g_m):
        torch.testing.assert_close(a, b, equal_nan=True)
    assert torch.isfinite(g_c[0][~r_c.kept_mask.squeeze(1)]).all()  # dropped tokens: router path only


@pytest.mark.parametrize("mode", ["full", "compact", "mask"])
def test_no_tokens(mode):
    """An empty batch (e.g. an expert-parallel rank with no tokens) gives empty outputs and zero grads."""
    x, idx, w, gu, dn, dy = make_case(3, 6, 4, 3, 2)
    case = (x[:0], idx[:0], w[:0], gu, dn, dy[:0])
    y, grads, rec = run_lrmoe(case, BackwardPolicy(0.3, mode=mode))
    assert y.shape == (0, 6) and grads[0].shape == (0, 6)
    assert grads[2].abs().sum() == 0 and grads[3].abs().sum() == 0
    assert rec.demand.sum() == 0 and rec.kept.sum() == 0


@pytest.mark.parametrize("mode", ["full", "compact", "mask"])
def test_fused_gather_path_matches_loop(mode):
    """fuse_gather=True (index-reading GEMMs; here through the reference backends) equals the oracle."""
    case = make_case(11, 6, 4, 5, 2, empty=(3,))
    rho = 0.0 if mode == "full" else float(torch.empty(()).uniform_(0.2, 0.6))
    y, grads, rec = run_lrmoe(case, BackwardPolicy(rho, mode=mode, fuse_gather=True))
    y_ref, grads_ref, _ = run_loop(case, kept=rec.kept_mask)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-12)
    assert_close_all(grads, grads_ref, f"fused {mode}")


@pytest.mark.parametrize("mode", ["full", "compact"])
def test_nonfinite_count_sees_inf_of_either_sign(mode):
    x, idx, w, gu, dn, dy = make_case(9, 5, 4, 3, 2)
    dy[2, 0], dy[5, 3] = float("-inf"), float("inf")
    _, _, rec = run_lrmoe((x, idx, w, gu, dn, dy), BackwardPolicy(0.3 if mode == "compact" else 0.0, mode=mode))
    assert rec.nonfinite == 4  # both pairs of tokens 2 and 5


@pytest.mark.parametrize("I", [3, 6])
@pytest.mark.parametrize("mode", ["full", "compact", "mask"])
def test_fp32_odd_intermediate_size(I, mode):
    """Unaligned widths rule out F.grouped_mm for some GEMMs only: each GEMM picks its own backend."""
    x, idx, w, gu, dn, dy = (t.float() if t.is_floating_point() else t for t in make_case(10, 8, I, 4, 2))
    leaves = [t.clone().requires_grad_() for t in (x, w, gu, dn)]
    rho = 0.0 if mode == "full" else 0.4
    y = lrmoe_experts(leaves[0], idx, leaves[1], leaves[2], leaves[3], BackwardPolicy(rho, mode=mode))
    y.backward(dy)
    ref = [t.clone().requires_grad_() for t in (x, w, gu, dn)]
    y_ref = lrmoe_experts(ref[0], idx, ref[1], ref[2], ref[3], BackwardPolicy(rho, mode=mode, backend="loop"))
    y_ref.backward(dy)
    torch.testing.assert_close(y, y_ref)
    for a, b in zip(leaves, ref):
        torch.testing.assert_close(a.grad, b.grad)


def test_bf16_experts_with_fp32_routing_weights():
    """GLM's router returns fp32 weights while the experts run in bf16: output and gradients in the
    right dtypes and close to the float64 oracle."""
    x, idx, w, gu, dn, dy = make_case(12, 16, 8, 4, 2)
    leaves = [x.bfloat16(), w.float(), gu.bfloat16(), dn.bfloat16()]
    leaves = [t.clone().requires_grad_() for t in leaves]
    y = lrmoe_experts(leaves[0], idx, leaves[1], leaves[2], leaves[3], BackwardPolicy(0.0))
    y.backward(dy.bfloat16())
    assert y.dtype == torch.bfloat16 and leaves[1].grad.dtype == torch.float32
    y_ref, grads_ref, _ = run_loop((x, idx, w, gu, dn, dy))
    torch.testing.assert_close(y.double(), y_ref, rtol=5e-2, atol=5e-2)
    for name, a, b in zip(("x", "weights", "gate_up", "down"), leaves, grads_ref):
        torch.testing.assert_close(a.grad.double(), b, rtol=5e-2, atol=1e-1, msg=lambda m: f"{name}: {m}")


def test_random_scorer_keeps_and_counts_nonfinite_gradients():
    x, idx, w, gu, dn, dy = make_case(20, 5, 4, 3, 2)
    dy[4, 2] = float("nan")
    for seed in range(8):  # whatever the random draw, the NaN token is kept and counted
        _, grads, rec = run_lrmoe((x, idx, w, gu, dn, dy), BackwardPolicy(0.6, scorer="random", seed=seed))
        assert rec.kept_mask[4].all() and rec.nonfinite == 2
        assert all(torch.isnan(grads[2][e]).any() for e in idx[4].tolist())


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


def test_double_backward_fails_clearly():
    x, idx, w, gu, dn, dy = make_case(6, 8, 4, 4, 2)
    x.requires_grad_()
    y = lrmoe_experts(x, idx, w, gu, dn, BackwardPolicy(0.0, mode="full"))
    (gx,) = torch.autograd.grad((y * dy).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|does not require grad|double backward"):
        gx.sum().backward()


# --- inputs that gave silently wrong results are refused --------------------------------------------

def test_integer_hidden_states_are_refused():
    x, idx, w, gu, dn, _ = make_case(4, 6, 4, 3, 2)
    with pytest.raises(ValueError, match="hidden_TH must be a floating-point tensor, got torch.int64"):
        lrmoe_experts(torch.arange(24).view(4, 6), idx, w, gu, dn)


def test_hidden_states_more_precise_than_the_weights_are_refused():
    """float64 states into float32 weights were computed in float32 and returned as float64."""
    x, idx, w, gu, dn, _ = make_case(4, 6, 4, 3, 2)
    with pytest.raises(ValueError, match=r"hidden_TH is torch.float64 but the experts compute in torch.float32.*"
                                         r"promote_types"):
        lrmoe_experts(x, idx, w, gu.float(), dn.float())
    with pytest.raises(ValueError, match="hidden_TH is torch.float32 but the experts compute in torch.bfloat16"):
        lrmoe_experts(x.float(), idx, w, gu.bfloat16(), dn.bfloat16())
    y = lrmoe_experts(x.bfloat16(), idx, w.float(), gu.float(), dn.float())  # bf16 into fp32: exact, allowed
    assert y.dtype == torch.bfloat16


def test_inputs_on_another_device_are_refused():
    x, idx, w, gu, dn, _ = make_case(4, 6, 4, 3, 2)
    meta = torch.device("meta")
    with pytest.raises(ValueError, match="hidden_TH is on meta but the expert weights are on cpu"):
        lrmoe_experts(x.to(meta), idx, w, gu, dn)
    with pytest.raises(ValueError, match="down_proj is on meta but gate_up_proj is on cpu"):
        lrmoe_experts(x, idx, w, gu, dn.to(meta))
    with pytest.raises(ValueError, match="top_k_weights is on meta but gate_up_proj is on cpu"):
        lrmoe_experts(x, idx, w.to(meta), gu, dn)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("T", [0, 1, 7])
def test_combine_is_the_weighted_sum_and_not_a_view(dtype, T):
    """experts.combine (the forward's last step, in the single-process and EP Functions): the plain
    weighted sum over the top-k outputs, in the promoted dtype, as a tensor of its own (FSDP2 warned
    "returned a view tensor" for every EP experts module it wrapped)."""
    from lrmoe.experts import combine

    g = torch.Generator().manual_seed(T)
    alpha = torch.rand(T, 3, generator=g, dtype=torch.float32)
    O = torch.randn(T, 3, 5, generator=g, dtype=torch.float64).to(dtype)
    y = combine(alpha, O, dtype)
    ref = (alpha.double().unsqueeze(-1) * O.double()).sum(1)
    assert y.shape == (T, 5) and y.dtype == dtype and not y._is_view()
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-12
    torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol)
