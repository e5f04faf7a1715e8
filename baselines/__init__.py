"""Baseline placement policies, registered in :mod:`lrmoe.parallel.plan` on import.

fixed: Megatron-LM fixed expert ownership (baselines.megatron)
symi: SYMI, slots from the previous step's popularity (baselines.symi)
ultraep, ultraep_greedy: UltraEP's threshold solver and its EPLB-like fallback (baselines.ultraep)
"""
from . import megatron, symi, ultraep  # noqa: F401  (registration side effects)
