"""Planner quota policies (numpy, lrmoe.planning.quota): the contract, each policy's defining
property, the registry."""
import math
from fractions import Fraction

import numpy as np
import pytest

from lrmoe.planning.quota import (compute_quota, quota_for, quota_policies, register_quota_policy, retained_total,
                                  unregister_quota_policy, waterfill_quota)


def random_demands(seed, n=200):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        E = int(rng.integers(1, 12))
        d = rng.integers(0, 40, E)
        d[rng.random(E) < 0.25] = 0  # empty experts
        if rng.random() < 0.3:
            d[int(rng.integers(E))] += 200  # one hot expert
        yield d, float(rng.random()) * 0.99


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
def test_contract(policy, rng_seed):
    for d, rho in random_demands(rng_seed):
        q = compute_quota(d, rho, policy)
        assert isinstance(q, np.ndarray) and q.dtype == np.int64 and q.shape == d.shape
        assert (q >= 0).all() and (q <= d).all()
        assert int(q.sum()) == math.floor((1 - rho) * int(d.sum()) + 0.5)


def test_proportional_is_within_one_of_the_exact_share(rng_seed):
    for d, rho in random_demands(rng_seed):
        q = compute_quota(d, rho, "proportional")
        exact = d * (1 - rho)  # |q_e - (1 - rho) d_e| < 1
        assert (np.abs(q - exact) < 1).all(), (d, rho, q)
    # A case where rounding n_keep / P instead of (1 - rho) would miss by 1.12:
    assert compute_quota(np.array([1, 48, 1]), 0.69, "proportional").tolist() == [1, 15, 0]


def test_waterfill_is_a_common_cap(rng_seed):
    for d, rho in random_demands(rng_seed):
        q = compute_quota(d, rho, "waterfill")
        if int(q.sum()) == int(d.sum()):
            assert np.array_equal(q, d)
            continue
        trimmed = q < d
        tau = int(q[trimmed].min())
        # every trimmed expert sits at tau or tau+1, every untrimmed one has demand <= tau+1
        assert ((q[trimmed] == tau) | (q[trimmed] == tau + 1)).all(), (d, q)
        assert (d[~trimmed] <= tau + 1).all(), (d, q)


def test_waterfill_floor():
    d = np.array([100, 3, 1, 0, 50])
    q = compute_quota(d, 0.8, "waterfill", min_keep=2)
    assert int(q.sum()) == 31 and q[1] >= 2 and q[2] == 1 and q[3] == 0
    # floors alone above n_keep: n_keep is waterfilled inside the floors
    assert waterfill_quota(np.array([5, 5, 5, 0]), 4, min_keep=3).tolist() == [2, 1, 1, 0]
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match=r"min_keep must be an int >= 0, got"):
            compute_quota(d, 0.5, "waterfill", min_keep=bad)


def test_paper_example():
    # The paper's figure: loads [4, 2, 3] become [3, 1, 2] (a proportional trim of 1/3).
    assert compute_quota(np.array([4, 2, 3]), 1 / 3, "proportional").tolist() == [3, 1, 2]
    assert compute_quota(np.array([4, 2, 3]), 1 / 3, "waterfill").tolist() == [2, 2, 2]


def test_registry_and_contract_check():
    register_quota_policy("test_first_experts", lambda d, n: np.minimum(d, n))
    try:
        assert "test_first_experts" in quota_policies()
        with pytest.raises(ValueError, match="returned sum"):
            compute_quota(np.array([4, 4]), 0.5, "test_first_experts")
    finally:
        unregister_quota_policy("test_first_experts")
    assert "test_first_experts" not in quota_policies()
    with pytest.raises(ValueError, match=r"unknown quota policy 'x' for the planners; registered in "
                                         r"lrmoe.planning.quota: \['proportional', 'waterfill'\]"):
        compute_quota(np.array([1]), 0.5, "x")
    with pytest.raises(ValueError, match=r"drop_ratio must be a number in \[0, 1\), got -0.1"):
        compute_quota(np.array([1]), -0.1)
    with pytest.raises(ValueError, match="1-D"):
        compute_quota(np.ones((2, 2), dtype=np.int64), 0.5)


@pytest.mark.parametrize("result, match", [
    (lambda d, n: np.zeros(len(d) + 1, dtype=np.int64), "returned shape"),
    (lambda d, n: d.astype(float), "must return integer quotas, got dtype float64"),
    (lambda d, n: d > 0, "must return integer quotas, got dtype bool"),
    (lambda d, n: -d, r"outside \[0, demand\]"),
    (lambda d, n: "three", "array of per-expert counts"),
])
def test_contract_check_names_what_is_wrong(result, match):
    register_quota_policy("test_bad", result)
    try:
        with pytest.raises(ValueError, match=match):
            quota_for(np.array([2, 1]), 2, "test_bad")
    finally:
        unregister_quota_policy("test_bad")


def test_builtins_are_explicit_and_duplicates_raise():
    """The built-ins are there without importing anything else; a name that exists is not replaced
    silently, only with override=True."""
    assert quota_policies() == ["proportional", "waterfill"]
    mine = lambda d, n: waterfill_quota(d, n)  # noqa: E731
    with pytest.raises(ValueError, match=r"planner quota policy 'waterfill' is already registered "
                                         r"\(lrmoe.planning.quota.waterfill_quota\); pass override=True"):
        register_quota_policy("waterfill", mine)
    register_quota_policy("test_dup", mine)
    try:
        register_quota_policy("test_dup", mine)  # the same function again is not a conflict
        with pytest.raises(ValueError, match="already registered"):
            register_quota_policy("test_dup", lambda d, n: d)
        register_quota_policy("test_dup", lambda d, n: np.minimum(d, 0) + (np.arange(len(d)) < n), override=True)
        assert quota_for(np.array([3, 3, 3]), 2, "test_dup").tolist() == [1, 1, 0]
    finally:
        unregister_quota_policy("test_dup")
