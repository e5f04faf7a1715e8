"""LRMoE reproduction kit: memory-aware MoE training with a selective, compacted expert backward.

Public API::

    from lrmoe import LRMoELayer, BackwardPolicy, BackwardRecord
    from lrmoe.experts import lrmoe_experts
    from lrmoe.scorers import register_scorer
    from lrmoe.quota import register_quota_policy
    from lrmoe.kernels import grouped_mm

The names above are imported on first use, so ``import lrmoe.planning`` (numpy only) does not
load torch. docs/architecture.md shows the layers and where each part lives.
"""
import importlib

__version__ = "0.1.0"

_LAZY = {"LRMoELayer": "lrmoe.layer", "LRMoEExperts": "lrmoe.layer", "SwiGLUMLP": "lrmoe.layer",
         "BackwardPolicy": "lrmoe.policy", "BackwardRecord": "lrmoe.policy", "lrmoe_experts": "lrmoe.experts"}
__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
