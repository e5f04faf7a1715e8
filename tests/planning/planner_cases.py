"""Shared cases of the planner tests: a model, a cluster, seeded demands of four kinds."""
import math

import numpy as np

from lrmoe.planning import Cluster, ModelDims
from lrmoe.planning.policies import plan_placement

DIMS = ModelDims(hidden=64, intermediate=32, num_experts=8, top_k=2)
CLUSTER = Cluster(num_ranks=4, slots_per_rank=4)  # 2 owned + 2 replica slots per rank
OPTIONS = {"fixed": {}, "symi": {}, "ultraep": {"min_tokens": 4}, "ultraep_greedy": {}, "lrmoe": {"drop_ratio": 0.2}}
DROPLESS = {"fixed", "ultraep", "ultraep_greedy", "lrmoe"}
KINDS = ("random", "skewed", "zero_rank", "empty_experts")
SEEDS = (0, 1, 2, 3)


def make_demand(kind, seed, G=4, E=8):
    rng = np.random.default_rng(seed)
    d = rng.integers(0, 60, (G, E))
    if kind == "skewed":  # one expert carries half of all pairs
        hot = int(rng.integers(E))
        d[:, hot] = 0
        d[:, hot] = np.diff(np.r_[0, np.sort(rng.integers(0, d.sum() + 1, G - 1)), d.sum()])
    elif kind == "zero_rank":
        d[int(rng.integers(G))] = 0
    elif kind == "empty_experts":
        d[:, rng.permutation(E)[: E // 2]] = 0
    return d


def plan(name, d, budget=math.inf, cluster=CLUSTER, dims=DIMS, **kw):
    return plan_placement(name, d, cluster, dims, budget, **{**OPTIONS[name], **kw})


def skewed_demand(rng, G, E, kind):
    """Log-normal popularity (sigma 1), up to 400 pairs per rank; ``hot``: one expert 30x as popular;
    ``empty``: about 40 % of the experts never routed; any other kind: as drawn."""
    pop = rng.lognormal(0, 1, E)
    if kind == "hot":
        pop[int(rng.integers(E))] *= 30
    d = np.stack([rng.multinomial(int(rng.integers(0, 400)), pop / pop.sum()) for _ in range(G)])
    if kind == "empty":
        d[:, rng.random(E) < 0.4] = 0
    return d


def plain_largest_remainder(total, w):
    """The definition: floor(w * total / W), then one more to the largest remainders (ties: lower index)."""
    w = np.asarray(w, dtype=object)  # exact integers at any size
    W = int(w.sum())
    if total == 0 or W == 0:
        return np.zeros(w.size, dtype=np.int64)
    base = np.array([int(v) * total // W for v in w], dtype=object)
    rem = np.array([int(v) * total % W for v in w], dtype=object)
    order = sorted(range(w.size), key=lambda i: (-rem[i], i))
    for i in order[:total - int(base.sum())]:
        base[i] += 1
    return base.astype(np.int64)
