"""Tensor ops only (no modules; no autograd but the compiled Triton GEMM operator's formula): grouped GEMM
and pair bookkeeping.

Every op has a fast implementation and a plain reference loop next to it (the test oracle)."""
from .grouped_gemm import BACKENDS, grouped_mm, grouped_mm_loop
from .routing import kept_positions, select_top_quota, select_top_quota_loop, sort_pairs_by_expert

__all__ = ["BACKENDS", "grouped_mm", "grouped_mm_loop", "kept_positions", "select_top_quota",
           "select_top_quota_loop", "sort_pairs_by_expert"]
