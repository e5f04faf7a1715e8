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

# The torch.distributed runtime (lrmoe.parallel.runtime, .hf, .launch; docs/expert_parallel.md),
# imported on first use so that the planners stay importable on their own.
_LAZY = {"ExpertParallel": "runtime", "ExpertParallelExperts": "runtime", "ep_experts": "runtime",
         "EPCommunicationError": "runtime", "EPOutOfMemoryError": "runtime", "finish_grad_sync": "runtime",
         "parallelize_experts": "hf", "init_distributed": "launch"}
__all__ += sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
