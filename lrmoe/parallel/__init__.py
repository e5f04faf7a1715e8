"""Expert parallelism on torch.distributed: the runtime that executes a placement plan.

The planners it executes are pure and live in :mod:`lrmoe.planning`; the transformers integration
(``parallelize_experts``) in :mod:`lrmoe.hf.parallel`; EP training in :mod:`lrmoe.train.ep`.
See docs/expert_parallel.md. Names are imported on first use.
"""
import importlib

_LAZY = {"ExpertParallel": "lrmoe.parallel.runtime", "ExpertParallelExperts": "lrmoe.parallel.runtime",
         "ep_experts": "lrmoe.parallel.runtime", "EPCommunicationError": "lrmoe.parallel.collectives",
         "EPOutOfMemoryError": "lrmoe.parallel.runtime", "finish_grad_sync": "lrmoe.parallel.grad_sync",
         "init_distributed": "lrmoe.parallel.launch"}
__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
