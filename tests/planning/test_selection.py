"""Backward quotas over a baseline placement (lrmoe.planning.selection.selection_quotas)."""
import math

import numpy as np

from lrmoe.planning import Cluster, ModelDims
from lrmoe.planning.policies import plan_placement
from lrmoe.planning.quota import compute_quota
from lrmoe.planning.selection import selection_quotas

DIMS = ModelDims(4, 3, 4, 1, 8)


def test_selection_quotas_pass_the_drop_ratio(rng_seed):
    """Baseline placements at C>0 get the single-process layer's quotas, proportional policy
    included (which targets (1 - rho) d_e and needs rho, not n_keep / P)."""
    rng = np.random.default_rng(rng_seed)
    for quota in ("proportional", "waterfill"):
        for _ in range(20):
            d = rng.integers(0, 5, (2, 4))
            d[0, 0] += 1
            rho = float(rng.choice([0.3, 0.5]))
            fixed = selection_quotas(plan_placement("fixed", d, Cluster(2, 2), DIMS, math.inf), DIMS, rho, quota)
            np.testing.assert_array_equal(fixed.kept_E, compute_quota(d.sum(0), rho, quota), err_msg=str(d))
    d = np.array([[1, 0, 2, 0], [0, 1, 1, 0]])  # n_keep / P * d_e would give [1, 0, 2, 0]
    p = selection_quotas(plan_placement("fixed", d, Cluster(2, 2), DIMS, math.inf), DIMS, 0.5, "proportional")
    np.testing.assert_array_equal(p.kept_E, [1, 1, 1, 0])


def test_selection_quotas_split_over_instances_and_sources(rng_seed):
    """Every (source, instance) quota is within its sent pairs, each expert keeps exactly its quota,
    and the memory is that of the kept rows."""
    rng = np.random.default_rng(rng_seed)
    dims = ModelDims(16, 8, 8, 2)
    for name in ("fixed", "symi", "ultraep_greedy"):
        d = rng.integers(0, 30, (4, 8))
        d[:, int(rng.integers(8))] += 200
        base = plan_placement(name, d, Cluster(4, 4), dims, math.inf)
        p = selection_quotas(base, dims, 0.4, "waterfill", {"min_keep": 2})
        assert ((p.backward_quota_GN >= 0) & (p.backward_quota_GN <= p.send_GN)).all()
        sent_E = np.bincount(p.expert_N, weights=p.send_GN.sum(0), minlength=8).astype(np.int64)
        np.testing.assert_array_equal(p.kept_E, compute_quota(sent_E, 0.4, "waterfill", min_keep=2))
        assert np.array_equal(p.send_GN, base.send_GN) and p.memory.peak <= base.memory.peak
        assert p.info["n_keep"] == int(p.kept_E.sum())
