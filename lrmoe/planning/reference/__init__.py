"""The placement planners as of revision 2cf58af, frozen: the speed and quality reference.

``lrmoe bench planners`` times them beside the live planners (:mod:`lrmoe.planning.policies`) in
the same run, and ``tests/planning/test_reference.py`` compares the plans of both. Nothing in
the runtime uses them. The search code is copied unchanged (``lrmoe_plan``, ``megatron``,
``symi``, ``ultraep`` and the routing helpers and budget fallbacks of :mod:`lrmoe.planning.plan`
in ``routing``); the interface types, plan assembly (``make_plan``: drops, memory, checks), the
memory model and the quota policies are imported from the live modules, so a plan of the
reference means what a live plan means.

    plan = reference_plan("lrmoe", demand_GE, cluster, dims, budget_bytes, drop_ratio=0.2)

Stateful policies (symi) take and return their own state type: pass the reference plan's
``state`` to the next reference call, never a live plan's.
"""
from __future__ import annotations

from typing import Any

from lrmoe.planning.plan import Cluster, ModelDims, Plan, check_inputs

from .lrmoe_plan import plan_lrmoe
from .megatron import plan_fixed
from .symi import plan_symi
from .ultraep import plan_ultraep, plan_ultraep_greedy

REFERENCE_PLANNERS = {"fixed": plan_fixed, "symi": plan_symi, "ultraep": plan_ultraep,
                      "ultraep_greedy": plan_ultraep_greedy, "lrmoe": plan_lrmoe}


def reference_plan(name: str, demand_GE, cluster: Cluster, dims: ModelDims, budget_bytes: float, *,
                   state: Any = None, **options) -> Plan:
    """Plan one step of one MoE layer with the frozen built-in policy ``name`` (options as the live one's)."""
    if name not in REFERENCE_PLANNERS:
        raise ValueError(f"no reference planner {name!r}; known: {sorted(REFERENCE_PLANNERS)}")
    demand_GE = check_inputs(demand_GE, cluster, dims, budget_bytes)
    return REFERENCE_PLANNERS[name](demand_GE, cluster, dims, budget_bytes, state=state, **options)
