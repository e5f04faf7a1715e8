"""The retention quotas as the experts use them: the number of kept pairs is round((1 - rho) * P) of
the decimal as written, waterfill trims the hot expert first, and custom quota policies (numpy
results, unhashable callables) work through the layer's quota call."""
import dataclasses
import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from lrmoe import BackwardPolicy
from lrmoe.quota import compute_quota, retained_total, waterfill_quota
from oracle import make_case, run_lrmoe


def exact_retained(P, rho_text):
    """round((1 - rho) * P), halves up, for the decimal rho as written."""
    return math.floor((1 - Fraction(rho_text)) * P + Fraction(1, 2))


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


def test_unhashable_callable_quota_policy(temporary_quota_policy):
    """register_quota_policy accepts any callable; a dataclass instance with __call__ (eq=True
    makes it unhashable) then fails with TypeError: unhashable type inside quota_for."""

    @dataclasses.dataclass
    class Waterfill:
        def __call__(self, demand_E, n_keep):
            return waterfill_quota(demand_E, n_keep)

    temporary_quota_policy("test_unhashable", Waterfill())
    q = compute_quota(torch.tensor([4, 4, 2]), 0.5, "test_unhashable")
    assert q.tolist() == compute_quota(torch.tensor([4, 4, 2]), 0.5, "waterfill").tolist()


def test_numpy_drop_ratio_accepted():
    assert retained_total(10, np.float32(0.5)) == 5


def test_hot_expert_is_trimmed_first_by_waterfill():
    case = make_case(40, 6, 4, 5, 1, hot=3)
    _, _, rec = run_lrmoe(case, BackwardPolicy(0.3, quota="waterfill"))
    assert int(rec.demand.argmax()) == 3
    cap = int(rec.quota.max())
    assert rec.quota[3] in (cap, cap - 1) and rec.quota[3] < rec.demand[3]
    cold = rec.demand < cap - 1
    assert torch.equal(rec.quota[cold], rec.demand[cold])  # cold experts keep everything


def test_custom_quota_policy_may_return_numpy_but_not_floats(temporary_quota_policy):
    temporary_quota_policy("test_numpy", lambda d, n: np.asarray(
        compute_quota(d.numpy(), 0.5, "proportional")))
    torch.testing.assert_close(compute_quota(torch.tensor([5, 3, 2]), 0.5, "test_numpy"),
                               compute_quota(torch.tensor([5, 3, 2]), 0.5, "proportional"))
    temporary_quota_policy("test_float", lambda d, n: d.double() * 0.5)
    with pytest.raises(ValueError, match="must return integer quotas"):
        compute_quota(torch.tensor([5, 3, 2]), 0.5, "test_float")
