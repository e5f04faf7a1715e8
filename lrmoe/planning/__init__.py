"""Placement and quota planning: pure functions over demand counts (numpy; no torch).

The expert-parallel runtime (:mod:`lrmoe.parallel`) and the cluster simulator call the same
planners, so a simulated plan and an executed one are the same plan. See docs/placement.md.

- :mod:`lrmoe.planning.plan`: the interface types (:class:`Cluster`, :class:`ModelDims`,
  :class:`Plan`) and the helpers every planner shares;
- :mod:`lrmoe.planning.memory`: the per-GPU memory model;
- :mod:`lrmoe.planning.policies`: the registry and ``plan_placement``, the one entry point;
- :mod:`lrmoe.planning.lrmoe_plan` and ``baselines/``: the policies themselves;
- :mod:`lrmoe.planning.quota`: the backward quota policies (numpy twins of :mod:`lrmoe.quota`);
- :mod:`lrmoe.planning.selection`: backward quotas over a baseline placement.

This package's namespace holds only the types: the policies import them from here, so importing
the registry from here too would make ``import baselines.symi`` circular.
"""
from .memory import MemoryBreakdown, plan_memory
from .plan import Cluster, Instance, ModelDims, Plan

__all__ = ["Cluster", "Instance", "MemoryBreakdown", "ModelDims", "Plan", "plan_memory"]
