"""Megatron-LM fixed expert ownership ("fixed"): the no-balancing baseline.

Expert e lives on rank e // (E/G) in slot e % (E/G), never moves, has no replicas; every
source rank sends each expert's pairs to its owner. Dropless by default; with a capacity
factor cf, each source rank keeps at most ``ceil(T_local * k / E * cf)`` pairs per expert
(Megatron drops on the token side before dispatch) and drops the rest. Every routed pair is
kept in backward. Optimizer state lives on the GPU with its expert.
"""
from __future__ import annotations

import math

import numpy as np

from lrmoe.planning.jit import njit
from lrmoe.planning.memory import memory_constants
from lrmoe.planning.plan import cap_rows_kernel, keep_all_peak, make_plan, owner_layout, resolve_budget


@njit
def capacity_kernel(demand_GE, capacity_factor):
    """ceil(P_r * cf / E) per source rank r (P_r its routed pairs), in the float arithmetic of
    :func:`megatron_capacity`."""
    G, E = demand_GE.shape
    out = np.empty(G, np.int64)
    for g in range(G):
        p = 0
        for e in range(E):
            p += demand_GE[g, e]
        out[g] = math.ceil(p * capacity_factor / E)
    return out


@njit
def fixed_send(demand_GE, capacity_G, row_cap):
    """The pairs each source sends to each owner: at most ``capacity_G[r]`` per (source, expert)
    (an empty capacity: no limit), then at most ``row_cap`` rows per instance (< 0: no cap)."""
    G, E = demand_GE.shape
    send = demand_GE.copy()
    if capacity_G.size:
        for g in range(G):
            c = capacity_G[g]
            for e in range(E):
                if send[g, e] > c:
                    send[g, e] = c
    if row_cap >= 0:
        send = cap_rows_kernel(send, np.full(E, row_cap, np.int64))
    return send


def megatron_capacity(demand_GE: np.ndarray, capacity_factor: float) -> np.ndarray:
    """Per-source capacity per expert: ceil(T_local * k / E * cf), T_local * k = the rank's routed pairs."""
    E = demand_GE.shape[1]
    return np.array([math.ceil(int(p) * capacity_factor / E) for p in demand_GE.sum(1)], dtype=np.int64)


_NO_CAPACITY = np.zeros(0, dtype=np.int64)


def plan_fixed(demand_GE, cluster, dims, budget_bytes, *, state=None, capacity_factor: float | None = None,
               fallback: str = "split", max_split: int = 256):
    """Fixed ownership. capacity_factor: None (dropless, Megatron's default) or > 0.
    fallback under budget pressure: ``split`` (smaller microbatches, default), ``drop`` or ``oom``."""
    if capacity_factor is not None and not (isinstance(capacity_factor, (int, float)) and capacity_factor > 0):
        raise ValueError(f"capacity_factor must be None (dropless) or a number > 0, got {capacity_factor!r}")
    instances = owner_layout(cluster, dims, "fixed")  # instance index == expert index
    mode = "dropless" if capacity_factor is None else f"capacity_factor={capacity_factor}"
    consts = memory_constants(dims)

    def route(d_GE, row_cap):
        cap_G = _NO_CAPACITY if capacity_factor is None else capacity_kernel(d_GE, float(capacity_factor))
        if cap_G.size == 0 and row_cap is None:
            return d_GE.copy(), cap_G
        return fixed_send(d_GE, cap_G, -1 if row_cap is None else int(row_cap)), cap_G

    def build(d_GE, row_cap):
        send, cap_G = route(d_GE, row_cap)
        info = {"mode": mode} if capacity_factor is None else {"mode": mode, "capacity_G": cap_G}
        return make_plan("fixed", d_GE, cluster, dims, budget_bytes, instances, send, info=info)

    def fits(d_GE, row_cap):
        send, _ = route(d_GE, row_cap)
        return keep_all_peak(d_GE, send, instances.rank_N, instances.is_replica_N, consts) <= budget_bytes

    return resolve_budget(build, demand_GE, budget_bytes, fallback, max_split, fits=fits)
