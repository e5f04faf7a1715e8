"""Backward quotas over a placement that keeps every pair (the baselines), for a selective backward.

:func:`selection_quotas` applies the same rule as the LRMoE planner: q_e = the quota policy over
the global computed demand (the pairs sent), split over e's instances in proportion to their
rows, then over each instance's source ranks in proportion to the pairs each sent (largest
remainder both times). The expert-parallel runtime calls it for every baseline placement when
the layer's backward selects; the simulator calls it the same way.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from .memory import plan_memory
from .lrmoe_jit import selection_quota_matrix
from .plan import ModelDims, Plan, expert_sum, largest_remainder
from .quota import quota_for, retained_total


def selection_quotas(plan: Plan, dims: ModelDims, drop_ratio: float, quota_policy: str = "waterfill",
                     quota_options: dict | None = None) -> Plan:
    """``plan`` with per-(source, instance) backward quotas that keep round((1 - drop_ratio) P) of
    the P sent pairs, by the planner quota policy ``quota_policy`` (:mod:`lrmoe.planning.quota`)
    with ``quota_options``; its memory is recomputed for the kept rows."""
    ex = plan.expert_N
    E = plan.demand_GE.shape[1]
    sent_E = expert_sum(plan.send_GN, ex, E).sum(0)
    P = int(sent_E.sum())
    # n_keep is exactly round((1 - rho) P): pass rho on, as the single-process layer does (the
    # proportional policy targets (1 - rho) d_e, not n_keep / P * d_e).
    q_E = quota_for(sent_E, retained_total(P, drop_ratio), quota_policy, drop_ratio=drop_ratio,
                    **dict(quota_options or {}))
    # compiled (lrmoe_jit.selection_quota_matrix); the plain loop is selection_quota_matrix_py
    quota = selection_quota_matrix(q_E, ex, plan.rows_N, np.ascontiguousarray(plan.send_GN, dtype=np.int64))
    mem = plan_memory(dims, plan.demand_GE.shape[0], plan.rank_N, plan.is_replica_N, plan.send_GN, quota,
                      optimizer_on_gpu=plan.policy != "symi", pairs_G=plan.demand_GE.sum(1))
    info = {**plan.info, "quota_E": q_E, "n_keep": int(q_E.sum()), "selection": "runtime quotas over a baseline placement"}
    return dataclasses.replace(plan, backward_quota_GN=quota, memory=mem, info=info).check()


def selection_quota_matrix_py(q_E, expert_N, rows_N, send_GN) -> np.ndarray:
    """The plain loop :func:`lrmoe.planning.lrmoe_jit.selection_quota_matrix` compiles (its oracle)."""
    quota = np.zeros_like(send_GN)
    for e in range(len(q_E)):
        cols = np.flatnonzero(expert_N == e)
        if q_E[e] == 0:
            continue
        for n, b in zip(cols, largest_remainder(int(q_E[e]), rows_N[cols])):
            quota[:, n] = largest_remainder(int(b), send_GN[:, n])
    return quota
