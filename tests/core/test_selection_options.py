"""BackwardPolicy's phi (which activation norm the LRM score uses) and selection (top | sample)
through lrmoe_experts, against the per-pair loop (float64): scores, kept sets, gradients with the
1/pi scaling, the exact quota, unbiasedness of the sampled expert gradients over many draws
(and the bias of top-quota under the same test), a finite-difference check, validation."""
import pytest
import torch

from lrmoe import BackwardPolicy, BackwardRecord, lrmoe_experts
from lrmoe.kernels.sampling import inclusion_probabilities_loop
from lrmoe.quota import retained_total
from oracle import assert_close_all, expected_keep, make_case, moe_loop, run_loop, run_lrmoe

f64 = torch.float64

CASES = {  # T, H, I, E, K and make_case options
    "odd": ((13, 5, 3, 7, 3), {}),
    "empty": ((11, 6, 4, 6, 2), dict(empty=(1, 4))),
    "hot": ((17, 4, 5, 5, 2), dict(hot=2)),
    "one_token": ((1, 6, 4, 3, 2), {}),
}


def _lrm(case, h2, phi):
    x, idx, w, gu, dn, dy = case
    g2 = (dy**2).sum(-1, keepdim=True)
    x2 = (x**2).sum(-1, keepdim=True)
    return {"h": w**2 * g2 * h2, "x": w**2 * g2 * x2, "both": w**2 * g2 * (h2 + x2)}[phi]


@pytest.mark.parametrize("kind", list(CASES))
@pytest.mark.parametrize("phi", ["h", "x", "both"])
@pytest.mark.parametrize("mode", ["compact", "mask"])
def test_phi_top_matches_loop(kind, phi, mode):
    shape, kw = CASES[kind]
    case = make_case(*shape, **kw)
    rho = float(torch.empty(()).uniform_(0.2, 0.7))
    y, grads, rec = run_lrmoe(case, BackwardPolicy(rho, phi=phi, mode=mode))
    _, _, h2 = run_loop(case)
    torch.testing.assert_close(rec.scores, _lrm(case, h2, phi).float(), rtol=1e-5, atol=1e-6)
    assert torch.equal(rec.kept_mask, expected_keep(rec.scores, case[1], rec.quota))
    _, grads_ref, _ = run_loop(case, kept=rec.kept_mask)
    assert_close_all(grads, grads_ref, f"phi={phi} {kind}")
    assert rec.selection == "top" and rec.inclusion is None


def test_lrm_input_is_lrm_with_phi_x():
    case = make_case(9, 8, 6, 4, 2)
    _, g_a, r_a = run_lrmoe(case, BackwardPolicy(0.4, scorer="lrm_input"))
    _, g_b, r_b = run_lrmoe(case, BackwardPolicy(0.4, scorer="lrm", phi="x"))
    assert torch.equal(r_a.scores, r_b.scores) and torch.equal(r_a.kept_mask, r_b.kept_mask)
    assert all(torch.equal(a, b) for a, b in zip(g_a, g_b))
    _, _, r_c = run_lrmoe(case, BackwardPolicy(0.4, scorer="lrm_input", phi="x"))
    assert torch.equal(r_a.scores, r_c.scores)


@pytest.mark.parametrize("kind", list(CASES))
@pytest.mark.parametrize("scorer,phi", [("lrm", "h"), ("lrm", "both"), ("grad_norm", "h"), ("random", "h")])
@pytest.mark.parametrize("mode", ["compact", "mask"])
def test_sample_matches_loop(kind, scorer, phi, mode):
    shape, kw = CASES[kind]
    case = make_case(*shape, **kw)
    x, idx, w, gu, dn, dy = case
    rho = float(torch.empty(()).uniform_(0.2, 0.8))
    y, grads, rec = run_lrmoe(case, BackwardPolicy(rho, scorer=scorer, phi=phi, mode=mode, selection="sample", seed=3))
    assert rec.selection == "sample"
    # exactly the quota of every expert, the quotas of the policy
    assert torch.equal(rec.kept, rec.quota) and int(rec.quota.sum()) == retained_total(idx.numel(), rho)
    # the recorded inclusion probabilities: pi ~ sqrt(score), capped and iterated (to the draw's 2^-32 grid)
    pi_ref = torch.tensor(inclusion_probabilities_loop(rec.scores.reshape(-1), idx.reshape(-1), rec.quota), dtype=f64)
    torch.testing.assert_close(rec.inclusion.reshape(-1), pi_ref, rtol=1e-6, atol=1e-8)
    assert (rec.inclusion[rec.kept_mask] > 0).all()
    # gradients: the loop restricted to the kept pairs, each kept pair's expert gradient x 1/pi
    scale = torch.where(rec.kept_mask, 1 / rec.inclusion, torch.zeros_like(rec.inclusion))
    y_ref, grads_ref, _ = run_loop(case, kept=rec.kept_mask, scale=scale)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-12)
    assert_close_all(grads, grads_ref, f"sample {scorer}/{phi} {kind} {mode}")


def test_sample_in_compact_and_mask_gives_the_same_gradients():
    case = make_case(17, 7, 5, 6, 2, hot=1)
    _, g_c, r_c = run_lrmoe(case, BackwardPolicy(0.5, selection="sample", seed=11))
    _, g_m, r_m = run_lrmoe(case, BackwardPolicy(0.5, selection="sample", seed=11, mode="mask"))
    assert torch.equal(r_c.kept_mask, r_m.kept_mask) and torch.equal(r_c.inclusion, r_m.inclusion)
    assert_close_all(g_c, g_m, "sample compact vs mask")


def test_drop_zero_and_full_mode_do_not_sample():
    case = make_case(9, 8, 6, 4, 2)
    _, g_full, _ = run_lrmoe(case, BackwardPolicy(0.0, mode="full"))
    for pol in (BackwardPolicy(0.0, selection="sample"), BackwardPolicy(0.0, phi="both", selection="sample")):
        _, g, rec = run_lrmoe(case, pol)
        assert rec.scores is None and rec.inclusion is None and rec.selection is None
        assert all(torch.equal(a, b) for a, b in zip(g, g_full))


def test_sampled_expert_gradients_are_unbiased():
    """The mean over many draws of the sampled gradients converges to the full gradient: every
    element within 6 standard errors (float64; the draws are fixed by the seed, so this cannot fail
    by chance). Top-quota's gradient, by the same test, is biased."""
    x, idx, w, gu, dn, dy = make_case(24, 5, 4, 4, 2, hot=0, seed=21)
    leaves = [t.clone().requires_grad_() for t in (x, w, gu, dn)]

    def grads(policy, n):
        y = lrmoe_experts(leaves[0], idx, leaves[1], leaves[2], leaves[3], policy)
        out = []
        for _ in range(n):
            for t in leaves:
                t.grad = None
            y.backward(dy, retain_graph=True)  # each backward selects anew (fresh draws)
            out.append(torch.cat([leaves[0].grad.reshape(-1), leaves[2].grad.reshape(-1), leaves[3].grad.reshape(-1)]))
        return torch.stack(out)

    full = grads(BackwardPolicy(0.0), 1)[0]
    n = 1000
    draws = grads(BackwardPolicy(0.5, selection="sample", seed=0), n)
    mean, se = draws.mean(0), draws.std(0) / n**0.5
    z = (mean - full).abs() / se.clamp(min=1e-300)
    always = se == 0  # elements only certain pairs reach: exact in every draw
    assert torch.allclose(mean[always], full[always], rtol=1e-10, atol=1e-12)
    assert z[~always].max() < 6, f"max z {z[~always].max():.2f}"
    rel = (mean - full).norm() / full.norm()
    assert rel < 0.05, rel
    top = grads(BackwardPolicy(0.5), 1)[0]
    assert ((top - full).abs() / se.clamp(min=1e-300))[~always].max() > 20  # the test sees a bias


def test_sampled_gradient_equals_finite_differences_of_its_estimator():
    """float64 check without autograd: the sampled backward is the gradient of the estimator
    F(theta) = sum over kept pairs of (1/pi) alpha g . O(theta) + router terms at fixed O, by central
    differences of the loop."""
    x, idx, w, gu, dn, dy = case = make_case(5, 4, 3, 3, 2, seed=2)
    _, grads, rec = run_lrmoe(case, BackwardPolicy(0.5, selection="sample", seed=4))
    scale = torch.where(rec.kept_mask, 1 / rec.inclusion, torch.zeros_like(rec.inclusion))
    y0, _ = moe_loop(x, idx, w, gu, dn)

    def F(x_, w_, gu_, dn_):
        y_kept, _ = moe_loop(x_, idx, w, gu_, dn_)  # routing weights fixed: the expert path
        out = 0.0
        for t in range(idx.shape[0]):
            for k in range(idx.shape[1]):
                o, _ = moe_loop(x_[t:t + 1], idx[t:t + 1, k:k + 1], torch.ones(1, 1, dtype=f64), gu_, dn_)
                o0, _ = moe_loop(x[t:t + 1], idx[t:t + 1, k:k + 1], torch.ones(1, 1, dtype=f64), gu, dn)
                out = out + float(scale[t, k]) * w[t, k] * (dy[t] * o[0]).sum() + w_[t, k] * (dy[t] * o0[0]).sum()
        return out

    eps = 1e-6
    base = [x, w, gu, dn]
    for i, (name, g_fast) in enumerate(zip(("x", "weights", "gate_up", "down"), grads)):
        num = torch.zeros_like(base[i])
        flat = num.view(-1)
        for j in range(flat.numel()):
            args_p = [b.clone() for b in base]
            args_m = [b.clone() for b in base]
            args_p[i].view(-1)[j] += eps
            args_m[i].view(-1)[j] -= eps
            flat[j] = (F(*args_p) - F(*args_m)) / (2 * eps)
        torch.testing.assert_close(g_fast, num, rtol=1e-6, atol=1e-8, msg=lambda m: f"{name}: {m}")


def test_sampled_nonfinite_gradient_is_kept_and_counted():
    x, idx, w, gu, dn, dy = make_case(9, 8, 6, 4, 2)
    dy[3, 0] = float("nan")
    _, _, rec = run_lrmoe((x, idx, w, gu, dn, dy), BackwardPolicy(0.7, selection="sample", seed=1))
    assert rec.kept_mask[3].all() and rec.nonfinite == idx.shape[1]
    assert (rec.inclusion[3] == 1).all() and torch.equal(rec.kept, rec.quota)


def test_seed_makes_sampling_reproducible():
    case = make_case(13, 5, 3, 7, 3, seed=8)
    a = run_lrmoe(case, BackwardPolicy(0.5, selection="sample", seed=5))
    b = run_lrmoe(case, BackwardPolicy(0.5, selection="sample", seed=5))
    assert torch.equal(a[2].kept_mask, b[2].kept_mask) and all(torch.equal(u, v) for u, v in zip(a[1], b[1]))


@pytest.mark.parametrize("kw,msg", [
    (dict(phi="z"), "unknown phi 'z'; accepted: ['h', 'x', 'both']"),
    (dict(phi=None), "unknown phi None"),
    (dict(selection="bottom"), "unknown selection 'bottom'; accepted: ['top', 'sample']"),
    (dict(scorer="grad_norm", phi="x"), "scorer 'grad_norm' does not use phi"),
    (dict(scorer="random", phi="both"), "scorer 'random' does not use phi"),
    (dict(scorer="lrm_input", phi="both"), "scorer 'lrm_input' is 'lrm' with phi 'x'"),
])
def test_bad_options_are_refused(kw, msg):
    with pytest.raises(ValueError, match=msg.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        BackwardPolicy(0.2, **kw)
    pol = BackwardPolicy(0.2)
    for k, v in kw.items():
        setattr(pol, k, v)
    with pytest.raises(ValueError):  # mutated after construction: refused on use
        pol.snapshot(torch.device("cpu"))


def test_user_scorer_reads_phi(temporary_scorer):
    seen = []
    temporary_scorer("phi_probe", lambda inp: seen.append(inp.phi) or inp.alpha_TK.float())
    case = make_case(9, 8, 6, 4, 2)
    run_lrmoe(case, BackwardPolicy(0.3, scorer="phi_probe", phi="both"))
    assert seen == ["both"]
    rec = BackwardRecord()
    assert rec.selection is None and rec.inclusion is None
