"""BackwardPolicy: validation of every field at construction and on each use, the options checked
against the scorer's and quota policy's signatures, the per-call snapshot (a policy changed between
forward and backward does not change that backward) and the seeded generators."""
import pytest
import torch

from lrmoe import BackwardPolicy, BackwardRecord, LRMoELayer, lrmoe_experts
from oracle import make_case, moe_loop, run_lrmoe


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


def test_policy_is_rechecked_on_use():
    x, idx, w, gu, dn, _ = make_case(4, 6, 4, 3, 2)
    pol = BackwardPolicy(0.2)
    pol.mode = "drop"  # mutated after creation
    with pytest.raises(ValueError, match="unknown backward mode 'drop'"):
        lrmoe_experts(x, idx, w, gu, dn, pol)
    with pytest.raises(ValueError, match=r"drop_ratio must be a number in \[0, 1\), got -0.1"):
        BackwardPolicy(-0.1)


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


def test_seeded_random_policy_forward_on_meta():
    """The policy snapshot used to create the random scorer's generator on the meta device, which
    torch refuses: a shape-only forward of a seeded dropping layer failed."""
    meta = torch.device("meta")
    layer = LRMoELayer(16, 8, 4, 2, policy=BackwardPolicy(0.5, scorer="random", seed=1)).to(meta, torch.bfloat16)
    with torch.no_grad():
        y = layer(torch.randn(5, 16, device=meta, dtype=torch.bfloat16))
    assert y.device == meta and y.shape == (5, 16)


# --- fields that were accepted and failed late, or never -----------------------------------------------

@pytest.mark.parametrize("kwargs, match", [
    (dict(quota_kwargs={"min_keep": -1}), r"min_keep must be an int >= 0, got -1"),
    (dict(quota_kwargs={"min_keep": 1.5}), r"min_keep must be an int >= 0, got 1.5"),
    (dict(fuse_gather=1), r"fuse_gather must be None, True or False, got 1"),
    (dict(fuse_gather=0), r"fuse_gather must be None, True or False, got 0"),
    (dict(profile="yes"), r"profile must be a bool \(True or False\), got 'yes'"),
    (dict(profile=1), r"profile must be a bool \(True or False\), got 1"),
])
def test_bad_fields_are_refused_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BackwardPolicy(0.3, **kwargs)


def test_bad_fields_set_after_construction_are_refused_on_use():
    x, idx, w, gu, dn, _ = make_case(4, 6, 4, 3, 2)
    for field, value in (("profile", "yes"), ("fuse_gather", 1), ("quota_kwargs", {"min_keep": -1})):
        pol = BackwardPolicy(0.3)
        setattr(pol, field, value)
        with pytest.raises(ValueError, match=field.split("_kwargs")[0] if field != "quota_kwargs" else "min_keep"):
            lrmoe_experts(x, idx, w, gu, dn, pol)


def test_valid_fields_are_kept():
    pol = BackwardPolicy(0.3, quota_kwargs={"min_keep": 0}, fuse_gather=False, profile=True)
    assert pol.quota_kwargs == {"min_keep": 0} and pol.fuse_gather is False and pol.profile is True
    assert BackwardPolicy(fuse_gather=None).fuse_gather is None and BackwardPolicy(fuse_gather=True).fuse_gather is True
