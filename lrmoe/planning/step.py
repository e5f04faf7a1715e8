"""One MoE layer's plan for one step, exactly as the expert-parallel runtime makes it: the placement
policy's plan, and for a baseline placement under a selecting backward the runtime's backward
quotas (:func:`lrmoe.planning.selection.selection_quotas`). The runtime
(:meth:`lrmoe.parallel.runtime.ExpertParallel.plan`) and the cluster simulator (:mod:`lrmoe.sim`)
both call :func:`plan_layer`, so a simulated plan is the plan the runtime would execute.

``selects``: whether the backward scores and selects pairs (``BackwardPolicy.selects``: mode
compact or mask with a drop ratio > 0); ``drop_ratio``, ``quota`` and ``quota_options`` are the
backward policy's. For ``lrmoe`` they become the planner's options unless ``options`` sets them; a
backward that does not select keeps every row, so LRMoE's quotas may not shrink
(``max_drop_ratio = 0``). ``piece``: a piece of a split microbatch, planned with fallback ``oom``
(executed even when still over the budget)."""
from __future__ import annotations

from typing import Any

import numpy as np

from .plan import Cluster, ModelDims, Plan
from .policies import plan_placement
from .selection import selection_quotas


def layer_options(placement: str, options: dict, *, selects: bool, drop_ratio: float, quota: str,
                  quota_options: dict) -> dict:
    """The placement policy's keyword options for this layer and backward policy (module docstring)."""
    opts = dict(options)
    if placement == "lrmoe":
        opts.setdefault("drop_ratio", drop_ratio if selects else 0.0)
        if not selects:
            opts["max_drop_ratio"] = 0.0
        opts.setdefault("quota_policy", quota)
        opts.setdefault("quota_options", dict(quota_options))
    return opts


def plan_layer(placement: str, demand_GE: np.ndarray, cluster: Cluster, dims: ModelDims, budget_bytes: float, *,
               options: dict | None = None, selects: bool = False, drop_ratio: float = 0.0, quota: str = "waterfill",
               quota_options: dict | None = None, state: Any = None, piece: bool = False) -> Plan:
    """The plan the runtime executes for ``demand_GE`` (module docstring)."""
    opts = layer_options(placement, options or {}, selects=selects, drop_ratio=drop_ratio, quota=quota,
                         quota_options=quota_options or {})
    if piece:
        opts["fallback"] = "oom"
    plan = plan_placement(placement, demand_GE, cluster, dims, budget_bytes, state=state, **opts)
    if selects and plan.policy != "lrmoe":
        plan = selection_quotas(plan, dims, drop_ratio, quota, quota_options or {})
    return plan
