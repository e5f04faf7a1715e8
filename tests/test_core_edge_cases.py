"""Edge cases of the single-process core found by a review pass (each was a bug, now fixed):
drop ratios read as the written decimal, custom scorers' output shapes, a policy changed after
use or between forward and backward, unhashable quota-policy callables, the aux loss of an empty
batch; plus the policy's option checks, double backward and init arguments.

Each test states the documented semantics it checks."""
import dataclasses
import math
from fractions import Fraction

import pytest
import torch

from lrmoe import BackwardPolicy, BackwardRecord, LRMoELayer, lrmoe_experts
from lrmoe.quota import compute_quota, register_quota_policy, retained_total, waterfill_quota
from lrmoe.scorers import register_scorer
from oracle import make_case, moe_loop
from test_experts import run_lrmoe

f64 = torch.float64


def exact_retained(P, rho_text):
    """round((1 - rho) * P), halves up, for the decimal rho as written."""
    return math.floor((1 - Fraction(rho_text)) * P + Fraction(1, 2))


# --- 1. drop_ratio is not read as the decimal the user wrote (quota.py keep_fraction) -----------

@pytest.mark.parametrize("P, rho", [(3, "0.1666667"), (3, "0.8333334"), (2_000_000, "4e-07"),
                                    (2_000_000, "0.9999996")])
def test_retained_total_is_round_of_the_written_decimal(P, rho):
    """Issue 2 / docs: "Σ quota = round((1−ρ)·P) exactly"; keep_fraction claims to read ρ "as the
    decimal the user wrote". limit_denominator(10**6) snaps 0.1666667 to 1/6 and 4e-7 to 0."""
    assert retained_total(P, float(rho)) == exact_retained(P, rho)


def test_layer_keeps_round_of_written_decimal_pairs():
    """End to end: 3 pairs, ρ = 0.1666667 → (1−ρ)·3 = 2.4999999 → 2 pairs kept, not 3."""
    case = make_case(3, 5, 4, 3, 1)
    _, _, rec = run_lrmoe(case, BackwardPolicy(0.1666667))
    assert int(rec.quota.sum()) == 2 and int(rec.kept.sum()) == 2


# --- 2. custom scorer output shape is never validated (experts.py score_pairs) -----------------

def test_custom_scorer_with_transposed_output_fails_clearly():
    """A scorer must return [T, K]; a [K, T] result (T != K) is silently reshaped into [T, K] and
    selects the wrong pairs instead of failing with a clear ValueError."""
    register_scorer("review_transposed", lambda inp: inp.alpha_TK.t().float().contiguous())
    case = make_case(6, 5, 4, 3, 2)
    with pytest.raises(ValueError, match=r"\[6, 2\]"):
        run_lrmoe(case, BackwardPolicy(0.5, scorer="review_transposed"))


def test_custom_scorer_with_broadcastable_output_fails_with_value_error():
    """A [T, 1] result (the natural mistake: grad_norm without expand) dies with a bare
    RuntimeError from reshape deep inside backward, not a ValueError naming the scorer."""
    register_scorer("review_column", lambda inp: inp.grad_norm2_T[:, None])
    case = make_case(6, 5, 4, 3, 2)
    with pytest.raises(ValueError, match="review_column"):
        run_lrmoe(case, BackwardPolicy(0.5, scorer="review_column"))


# --- 3. cached generator survives a change of seed (policy.py generator) -----------------------

def test_changing_seed_after_use_takes_effect():
    """validate() is "called on each use, so a policy mutated after creation is re-checked", but
    the random scorer keeps drawing from the generator seeded with the old seed."""
    case = make_case(30, 6, 4, 4, 2, seed=2)
    pol = BackwardPolicy(0.5, scorer="random", seed=1)
    run_lrmoe(case, pol)
    pol.seed = 2
    kept_mutated = run_lrmoe(case, pol)[2].kept_mask
    kept_fresh = run_lrmoe(case, BackwardPolicy(0.5, scorer="random", seed=2))[2].kept_mask
    assert torch.equal(kept_mutated, kept_fresh)


# --- 4. backward re-reads policy.mode (experts.py backward, mask branch) -----------------------

@pytest.mark.parametrize("new_mode", ["compact", "full"])
def test_mode_mutation_between_forward_and_backward(new_mode):
    """Forward in mask mode fixes the selection (the record's kept_mask has dropped pairs), but if
    policy.mode is changed before backward, the mask is not applied: the expert gradients contain
    the dropped pairs while the record says they were dropped."""
    case = make_case(12, 6, 4, 3, 2, seed=4)
    x, idx, w, gu, dn, dy = case
    pol = BackwardPolicy(0.5, mode="mask")
    leaves = [t.clone().requires_grad_() for t in (x, w, gu, dn)]
    rec = BackwardRecord()
    y = lrmoe_experts(leaves[0], idx, leaves[1], leaves[2], leaves[3], pol, rec)
    pol.mode = new_mode
    y.backward(dy)
    assert not rec.kept_mask.all()
    ref = [t.clone().requires_grad_() for t in (x, w, gu, dn)]
    y_ref, _ = moe_loop(ref[0], idx, ref[1], ref[2], ref[3], rec.kept_mask)
    y_ref.backward(dy)
    for name, a, b in zip(("x", "w", "gate_up", "down"), leaves, ref):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-9, atol=1e-10, msg=lambda m: f"{name}: {m}")


# --- 5. quota_for's lru_cache rejects unhashable callables (quota.py _accepts_drop_ratio) --------

def test_unhashable_callable_quota_policy():
    """register_quota_policy accepts any callable; a dataclass instance with __call__ (eq=True
    makes it unhashable) then fails with TypeError: unhashable type inside quota_for."""

    @dataclasses.dataclass
    class Waterfill:
        def __call__(self, demand_E, n_keep):
            return waterfill_quota(demand_E, n_keep)

    register_quota_policy("review_unhashable", Waterfill())
    q = compute_quota(torch.tensor([4, 4, 2]), 0.5, "review_unhashable")
    assert q.tolist() == compute_quota(torch.tensor([4, 4, 2]), 0.5, "waterfill").tolist()


# --- 6. aux loss of an empty batch is NaN (router.py load_balancing_loss) ----------------------

def test_aux_loss_of_empty_batch_is_finite():
    """An empty batch (an expert-parallel rank with no tokens, which the layer supports) gives a
    NaN aux loss (0/0 in f and in the mean of probs), which poisons the summed training loss."""
    layer = LRMoELayer(8, 4, 4, 2)
    layer(torch.randn(0, 8))
    assert torch.isfinite(layer.aux_loss())


def test_policy_options_are_checked_against_the_functions():
    with pytest.raises(ValueError, match=r"quota policy 'proportional' does not accept the options \['min_keep'\]"):
        BackwardPolicy(0.2, quota="proportional", quota_kwargs={"min_keep": 1})
    with pytest.raises(ValueError, match=r"\['drop_ratio'\] are set by the layer"):
        BackwardPolicy(0.2, quota="proportional", quota_kwargs={"drop_ratio": 0.5})
    with pytest.raises(ValueError, match="quota_kwargs must be a dict"):
        BackwardPolicy(0.2, quota_kwargs=None)
    with pytest.raises(ValueError, match=r"scorer 'lrm' does not accept the options \['temperature'\]"):
        BackwardPolicy(0.2, scorer_kwargs={"temperature": 2.0})
    with pytest.raises(ValueError, match="seed must be an int or None"):
        BackwardPolicy(0.2, seed=True)
    assert BackwardPolicy(0.2, quota="waterfill", quota_kwargs={"min_keep": 2}).quota_kwargs == {"min_keep": 2}


def test_double_backward_fails_clearly():
    x, idx, w, gu, dn, dy = make_case(6, 8, 4, 4, 2)
    x.requires_grad_()
    y = lrmoe_experts(x, idx, w, gu, dn, BackwardPolicy(0.0, mode="full"))
    (gx,) = torch.autograd.grad((y * dy).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|does not require grad|double backward"):
        gx.sum().backward()


def test_layer_init_arguments():
    layer = LRMoELayer(8, 4, 4, 2, init_std=0.0)  # an explicit std of 0 means zeros, not the default
    assert layer.experts.gate_up_proj.abs().max() == 0 and layer.gate.weight.abs().max() == 0
    with pytest.raises(ValueError, match="hidden_size must be a positive int, got True"):
        LRMoELayer(True, 4, 4, 2)
    with pytest.raises(ValueError, match="top_k must be an int"):
        LRMoELayer(8, 4, 4, True)


def test_numpy_drop_ratio_accepted():
    import numpy as np

    assert retained_total(10, np.float32(0.5)) == 5
