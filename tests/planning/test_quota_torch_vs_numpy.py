"""The layer's torch quotas (lrmoe.quota) and the planners' numpy quotas (lrmoe.planning.quota)
are the same function; each registry stands on its own (explicit built-ins, no silent replace)."""
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch quota policies need torch")

import lrmoe.planning.quota as npq  # noqa: E402
import lrmoe.quota as tq  # noqa: E402
from lrmoe.planning import Cluster, ModelDims  # noqa: E402
from lrmoe.planning.policies import plan_placement  # noqa: E402
from lrmoe.planning.selection import selection_quotas  # noqa: E402

DROP_GRID = [i / 20 for i in range(20)] + [1 / 3, 2 / 3, 0.1666667, 0.999]


def demands(seed):
    """Fresh demands of every awkward shape: empty experts, one hot expert, a single pair, odd sizes."""
    rng = np.random.default_rng(seed)
    yield np.zeros(5, dtype=np.int64)  # nothing routed
    yield np.array([1])  # one pair, one expert
    yield np.array([0, 0, 1, 0])  # one pair among empty experts
    for _ in range(16):
        E = int(rng.choice([1, 2, 3, 7, 13, 64]))
        d = rng.integers(0, int(rng.choice([2, 9, 50])), E)
        kind = rng.integers(3)
        if kind == 0:
            d[rng.random(E) < 0.5] = 0  # empty experts
        elif kind == 1:
            d[int(rng.integers(E))] += int(rng.integers(100, 1000))  # one hot expert
        yield d


@pytest.mark.parametrize("policy, kwargs", [("proportional", {}), ("waterfill", {}), ("waterfill", {"min_keep": 1}),
                                            ("waterfill", {"min_keep": 3}), ("waterfill", {"min_keep": 40})])
def test_torch_and_numpy_quotas_agree_exactly(policy, kwargs, rng_seed):
    for d in demands(rng_seed):
        for rho in DROP_GRID:
            want = npq.compute_quota(d, rho, policy, **kwargs)
            got = tq.compute_quota(torch.as_tensor(d), rho, policy, **kwargs)
            assert got.dtype == torch.int64 and got.tolist() == want.tolist(), (d.tolist(), rho)
        # the planners also ask for other totals (shrunk quotas) without the drop ratio
        P = int(d.sum())
        for n_keep in {0, min(1, P), P // 3, P // 2, max(P - 1, 0), P}:
            want = npq.quota_for(d, n_keep, policy, **kwargs)
            got = tq.quota_for(torch.as_tensor(d), n_keep, policy, **kwargs)
            assert got.tolist() == want.tolist(), (d.tolist(), n_keep)


def test_torch_contract_and_numpy_in_numpy_out(rng_seed):
    for d in demands(rng_seed):
        rho = 0.37
        q = tq.compute_quota(torch.as_tensor(d), rho, "waterfill")
        assert q.dtype == torch.int64 and tuple(q.shape) == d.shape
        assert int(q.sum()) == math.floor((1 - rho) * int(d.sum()) + 0.5)
    q = tq.compute_quota(np.array([5, 0, 9]), 0.5, "waterfill")
    assert isinstance(q, np.ndarray) and q.tolist() == [3, 0, 4]


def test_shared_helpers_are_one_definition():
    assert tq.check_drop_ratio is npq.check_drop_ratio and tq.retained_total is npq.retained_total


def test_torch_registry_contract_check_and_duplicates():
    tq.register_quota_policy("test_first_experts", lambda d, n: torch.minimum(d, torch.full_like(d, n)))
    try:
        assert "test_first_experts" in tq.quota_policies()
        with pytest.raises(ValueError, match="returned sum"):
            tq.compute_quota(torch.tensor([4, 4]), 0.5, "test_first_experts")
    finally:
        tq.unregister_quota_policy("test_first_experts")
    with pytest.raises(ValueError, match=r"unknown quota policy 'x'; registered: \["):
        tq.compute_quota(torch.tensor([1]), 0.5, "x")
    with pytest.raises(ValueError, match=r"drop_ratio must be a number in \[0, 1\), got -0.1"):
        tq.compute_quota(torch.tensor([1]), -0.1)
    with pytest.raises(ValueError, match="1-D"):
        tq.compute_quota(torch.ones(2, 2, dtype=torch.int64), 0.5)
    assert tq.quota_policies() == ["proportional", "waterfill"]
    with pytest.raises(ValueError, match=r"quota policy 'proportional' is already registered .*override=True"):
        tq.register_quota_policy("proportional", lambda d, n: d)
    real = tq.get_quota_policy("proportional")
    tq.register_quota_policy("proportional", tq.waterfill_quota, override=True)
    try:
        assert tq.compute_quota(torch.tensor([4, 2, 3]), 1 / 3, "proportional").tolist() == [2, 2, 2]
    finally:
        tq.register_quota_policy("proportional", real, override=True)
    assert tq.compute_quota(torch.tensor([4, 2, 3]), 1 / 3, "proportional").tolist() == [3, 1, 2]


def test_a_policy_registered_for_torch_only_is_refused_by_the_planners():
    """The planners use the numpy registry; a torch-only policy gives a ValueError that names both."""
    tq.register_quota_policy("test_torch_only", tq.waterfill_quota)
    both = r"unknown quota policy 'test_torch_only' for the planners.*lrmoe\.quota\.register_quota_policy.*" \
           r"lrmoe\.planning\.quota\.register_quota_policy"
    d = np.array([[3, 1, 0, 2], [1, 1, 4, 0]])
    cluster, dims = Cluster(2, 3), ModelDims(8, 4, 4, 2)
    try:
        with pytest.raises(ValueError, match=both):
            plan_placement("lrmoe", d, cluster, dims, math.inf, drop_ratio=0.5, quota_policy="test_torch_only")
        with pytest.raises(ValueError, match=both):
            selection_quotas(plan_placement("fixed", d, cluster, dims, math.inf), dims, 0.5, "test_torch_only")
        npq.register_quota_policy("test_torch_only", npq.waterfill_quota)  # registered for both: planned
        try:
            p = plan_placement("lrmoe", d, cluster, dims, math.inf, drop_ratio=0.5, quota_policy="test_torch_only")
            assert p.kept_E.tolist() == npq.compute_quota(d.sum(0), 0.5, "waterfill").tolist()
        finally:
            npq.unregister_quota_policy("test_torch_only")
    finally:
        tq.unregister_quota_policy("test_torch_only")
