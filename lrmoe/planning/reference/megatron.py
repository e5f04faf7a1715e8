"""[Reference: ``baselines/megatron.py`` as of revision 2cf58af, frozen; see :mod:`lrmoe.planning.reference`.]

Megatron-LM fixed expert ownership ("fixed"): the no-balancing baseline.

Expert e lives on rank e // (E/G) in slot e % (E/G), never moves, has no replicas; every
source rank sends each expert's pairs to its owner. Dropless by default; with a capacity
factor cf, each source rank keeps at most ``ceil(T_local * k / E * cf)`` pairs per expert
(Megatron drops on the token side before dispatch) and drops the rest. Every routed pair is
kept in backward. Optimizer state lives on the GPU with its expert.
"""
from __future__ import annotations

import math

import numpy as np

from lrmoe.planning.plan import make_plan

from .routing import cap_rows, owner_instances, resolve_budget


def megatron_capacity(demand_GE: np.ndarray, capacity_factor: float) -> np.ndarray:
    """Per-source capacity per expert: ceil(T_local * k / E * cf), T_local * k = the rank's routed pairs."""
    E = demand_GE.shape[1]
    return np.array([math.ceil(int(p) * capacity_factor / E) for p in demand_GE.sum(1)], dtype=np.int64)


def plan_fixed(demand_GE, cluster, dims, budget_bytes, *, state=None, capacity_factor: float | None = None,
               fallback: str = "split", max_split: int = 256):
    """Fixed ownership. capacity_factor: None (dropless, Megatron's default) or > 0.
    fallback under budget pressure: ``split`` (smaller microbatches, default), ``drop`` or ``oom``."""
    if capacity_factor is not None and not (isinstance(capacity_factor, (int, float)) and capacity_factor > 0):
        raise ValueError(f"capacity_factor must be None (dropless) or a number > 0, got {capacity_factor!r}")
    instances = owner_instances(cluster, dims, "fixed")  # instance index == expert index

    def build(d_GE, row_cap):
        send = d_GE.copy()
        info = {"mode": "dropless" if capacity_factor is None else f"capacity_factor={capacity_factor}"}
        if capacity_factor is not None:
            cap_G = megatron_capacity(d_GE, capacity_factor)
            send = np.minimum(send, cap_G[:, None])
            info["capacity_G"] = cap_G
        if row_cap is not None:
            send = cap_rows(send, row_cap)
        return make_plan("fixed", d_GE, cluster, dims, budget_bytes, instances, send, info=info)

    return resolve_budget(build, demand_GE, budget_bytes, fallback, max_split)
