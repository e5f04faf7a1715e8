"""Expert parallelism: placement planners (pure, numpy only) and the torch.distributed runtime.

The planner interface lives in :mod:`lrmoe.parallel.plan` and is re-exported here; the built-in
policies are ``fixed``, ``symi``, ``ultraep``, ``ultraep_greedy`` (``baselines/``) and ``lrmoe``
(:mod:`lrmoe.parallel.lrmoe_plan`). See docs/placement.md.
"""
from .memory import MemoryBreakdown
from .plan import (Cluster, Instance, ModelDims, Plan, get_placement, placement_policies, plan_placement,
                   register_placement)

__all__ = ["Cluster", "Instance", "MemoryBreakdown", "ModelDims", "Plan", "get_placement", "placement_policies",
           "plan_placement", "register_placement"]
