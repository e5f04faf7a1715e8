"""Compiles the planners' numba functions once, into numba's on-disk cache, before the tests need them.

A fresh clone has no cache: the first process that plans compiles every placement policy's loops
(about a minute on 2 cores, mostly LRMoE's), and the first expert-parallel test would pay it in
each of its ranks at once. ``tests/conftest.py`` runs this script in the background at the start of
the session, beside the tests that plan nothing, and makes the first test that plans wait for it.
It goes through the public paths the runtime and the simulator take (``plan_layer`` for every
policy, with and without selection, unpressured and pressured, whole and as a split piece; the
runtime's layout), so the compiled signatures are the ones they use. Run by hand:
``python tests/warm_planners.py``.
"""
from __future__ import annotations

import math
import sys
import time

import numpy as np


def warm() -> float:
    t0 = time.perf_counter()
    from lrmoe.planning import Cluster, ModelDims
    from lrmoe.planning.step import plan_layer

    rng = np.random.default_rng(0)
    G, E, K = 2, 8, 2
    dims = ModelDims(hidden=16, intermediate=16, num_experts=E, top_k=K, dtype_bytes=4)
    cluster = Cluster(G, E // G + 2)
    demand = np.stack([rng.multinomial(200, [0.5] + [0.5 / (E - 1)] * (E - 1)) for _ in range(G)]).astype(np.int64)
    unpressured = plan_layer("fixed", demand, cluster, dims, math.inf)
    tight = 0.6 * unpressured.memory.peak
    plans = []
    for placement, options in (("fixed", {}), ("symi", {}), ("symi", {"capacity_factor": None}),
                               ("ultraep", {"min_tokens": 1}), ("lrmoe", {})):
        for selects, drop in ((False, 0.0), (True, 0.2)):
            for budget in (math.inf, tight):
                for piece in (False, True):
                    state = None
                    for _ in range(2):  # stateful planners (SYMI) plan again from their state
                        p = plan_layer(placement, demand, cluster, dims, budget, options=options, selects=selects,
                                       drop_ratio=drop, state=state, piece=piece)
                        state = p.state
                        plans.append((p, selects))
    try:
        import torch

        from lrmoe.parallel.layout import Layout
    except ImportError:
        return time.perf_counter() - t0
    for p, selects in plans:
        for r in range(G):
            compacts = selects and bool((p.backward_quota_GN != p.send_GN).any())
            Layout(p, r, E // G, compacts, torch.device("cpu"))
    return time.perf_counter() - t0


if __name__ == "__main__":
    print(f"planners compiled (or loaded from numba's cache) in {warm():.1f} s", file=sys.stderr)
