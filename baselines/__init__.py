"""Baseline placement policies (pure numpy), listed in :mod:`lrmoe.planning.policies`.

fixed: Megatron-LM fixed expert ownership (baselines.megatron)
symi: SYMI, slots from the previous step's popularity (baselines.symi)
ultraep, ultraep_greedy: UltraEP's threshold solver and its EPLB-like fallback (baselines.ultraep)
"""
