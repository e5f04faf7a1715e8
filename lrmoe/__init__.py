"""LRMoE reproduction kit: memory-aware MoE training with a selective, compacted expert backward."""
__version__ = "0.1.0"
