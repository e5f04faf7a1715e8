"""LRMoE reproduction kit: memory-aware MoE training with a selective, compacted expert backward.

Public API::

    from lrmoe import LRMoELayer, BackwardPolicy, BackwardRecord
    from lrmoe.experts import lrmoe_experts
    from lrmoe.scorers import register_scorer
    from lrmoe.quota import register_quota_policy
    from lrmoe.kernels import grouped_mm
"""
from .experts import lrmoe_experts
from .layer import LRMoEExperts, LRMoELayer, SwiGLUMLP
from .policy import BackwardPolicy, BackwardRecord

__version__ = "0.1.0"
__all__ = ["LRMoELayer", "LRMoEExperts", "SwiGLUMLP", "BackwardPolicy", "BackwardRecord", "lrmoe_experts"]
