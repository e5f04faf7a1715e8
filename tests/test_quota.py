"""Quota policies: the contract, each policy's defining property, the registry."""
import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from lrmoe.quota import compute_quota, quota_policies, register_quota_policy, retained_total


def random_demands(n=200):
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    for _ in range(n):
        E = int(torch.randint(1, 12, (), generator=g))
        d = torch.randint(0, 40, (E,), generator=g)
        d[torch.rand(E, generator=g) < 0.25] = 0  # empty experts
        if torch.rand((), generator=g) < 0.3:
            d[int(torch.randint(0, E, (), generator=g))] += 200  # one hot expert
        yield d, float(torch.rand((), generator=g)) * 0.99


def test_retained_total_rounds_half_up_exactly():
    assert retained_total(10, 0.25) == 8  # 7.5 -> 8
    assert retained_total(45, 0.3) == 32  # 31.5 -> 32 (the float product is 31.499999...)
    assert retained_total(15, 0.9) == 2  # 1.5 -> 2
    assert retained_total(5, 0.9) == 1  # 0.5 -> 1
    assert retained_total(9, 0.0) == 9
    assert retained_total(0, 0.5) == 0
    for P in range(0, 120):
        for rho in ("0.1", "0.2", "0.3", "0.5", "0.7", "0.9", "0.95"):
            exact = (1 - Fraction(rho)) * P + Fraction(1, 2)
            assert retained_total(P, float(rho)) == math.floor(exact), (P, rho)


@pytest.mark.parametrize("policy", ["waterfill", "proportional"])
def test_contract(policy):
    for d, rho in random_demands():
        q = compute_quota(d, rho, policy)
        assert q.dtype == torch.int64 and q.shape == d.shape
        assert (q >= 0).all() and (q <= d).all()
        assert int(q.sum()) == math.floor((1 - rho) * int(d.sum()) + 0.5)


def test_proportional_is_within_one_of_the_exact_share():
    for d, rho in random_demands():
        q = compute_quota(d, rho, "proportional")
        exact = d.double() * (1 - rho)  # the property: |q_e - (1 - rho) d_e| < 1
        assert ((q.double() - exact).abs() < 1).all(), (d, rho, q)
    # A case where rounding n_keep / P instead of (1 - rho) would miss by 1.12:
    assert compute_quota(torch.tensor([1, 48, 1]), 0.69, "proportional").tolist() == [1, 15, 0]


def test_waterfill_is_a_common_cap():
    for d, rho in random_demands():
        q = compute_quota(d, rho, "waterfill")
        if int(q.sum()) == int(d.sum()):
            assert torch.equal(q, d)
            continue
        trimmed = q < d
        tau = int(q[trimmed].min())
        # every trimmed expert sits at tau or tau+1, every untrimmed one has demand <= tau+1
        assert ((q[trimmed] == tau) | (q[trimmed] == tau + 1)).all(), (d, q)
        assert (d[~trimmed] <= tau + 1).all(), (d, q)


def test_waterfill_floor():
    d = torch.tensor([100, 3, 1, 0, 50])
    q = compute_quota(d, 0.8, "waterfill", min_keep=2)
    assert int(q.sum()) == 31 and q[1] >= 2 and q[2] == 1 and q[3] == 0
    with pytest.raises(ValueError, match="min_keep"):
        compute_quota(d, 0.5, "waterfill", min_keep=-1)


def test_paper_example():
    # The paper's figure: loads [4, 2, 3] become [3, 1, 2] (a proportional trim of 1/3).
    assert compute_quota(torch.tensor([4, 2, 3]), 1 / 3, "proportional").tolist() == [3, 1, 2]
    assert compute_quota(torch.tensor([4, 2, 3]), 1 / 3, "waterfill").tolist() == [2, 2, 2]


def test_numpy_in_numpy_out():
    q = compute_quota(np.array([5, 0, 9]), 0.5, "waterfill")
    assert isinstance(q, np.ndarray) and q.tolist() == [3, 0, 4]


def test_registry_and_contract_check():
    register_quota_policy("test_first_experts", lambda d, n: torch.minimum(d, torch.full_like(d, n)))
    assert "test_first_experts" in quota_policies()
    with pytest.raises(ValueError, match="returned sum"):
        compute_quota(torch.tensor([4, 4]), 0.5, "test_first_experts")
    with pytest.raises(ValueError, match=r"unknown quota policy 'x'; registered: \["):
        compute_quota(torch.tensor([1]), 0.5, "x")
    with pytest.raises(ValueError, match=r"drop_ratio must be a number in \[0, 1\), got -0.1"):
        compute_quota(torch.tensor([1]), -0.1)
    with pytest.raises(ValueError, match="1-D"):
        compute_quota(torch.ones(2, 2, dtype=torch.int64), 0.5)
