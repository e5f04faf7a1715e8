"""The placement-policy registry and :func:`plan_placement`, the one entry point every caller uses.

Built-in policies are listed here explicitly: ``fixed`` (Megatron-LM fixed ownership,
:mod:`baselines.megatron`), ``symi`` (:mod:`baselines.symi`), ``ultraep`` and ``ultraep_greedy``
(:mod:`baselines.ultraep`) and ``lrmoe`` (:mod:`lrmoe.planning.lrmoe_plan`). Users add their own
with :func:`register_placement` (a name that exists raises unless ``override=True``).
"""
from __future__ import annotations

import functools
import inspect
from typing import Any

from baselines.megatron import plan_fixed
from baselines.symi import plan_symi
from baselines.ultraep import plan_ultraep, plan_ultraep_greedy

from ..registry import Registry
from .lrmoe_plan import plan_lrmoe
from .plan import Cluster, ModelDims, Plan, check_inputs

_PLANNERS = Registry("placement policy", builtins={
    "fixed": plan_fixed, "symi": plan_symi, "ultraep": plan_ultraep, "ultraep_greedy": plan_ultraep_greedy,
    "lrmoe": plan_lrmoe})
#: ``register_placement(name, fn, *, override=False)`` or ``@register_placement(name)``:
#: ``fn(demand_GE, cluster, dims, budget_bytes, *, state=None, **options) -> Plan``.
register_placement = _PLANNERS.register
unregister_placement = _PLANNERS.unregister
#: Names of the registered placement policies (built-in ones included).
placement_policies = _PLANNERS.names
get_placement = _PLANNERS.get


def plan_placement(name: str, demand_GE, cluster: Cluster, dims: ModelDims, budget_bytes: float, *,
                   state: Any = None, **options) -> Plan:
    """Plan one step of one MoE layer with the registered policy ``name`` (see module docstring)."""
    fn = get_placement(name)
    demand_GE = check_inputs(demand_GE, cluster, dims, budget_bytes)
    accepted = _accepted_options(fn)
    if accepted is not None:
        unknown = sorted(set(options) - set(accepted))
        if unknown:
            raise ValueError(f"placement policy {name!r} got unknown options {unknown}; accepted: {list(accepted)}")
    return fn(demand_GE, cluster, dims, budget_bytes, state=state, **options)


@functools.lru_cache(maxsize=None)
def _accepted_options(fn) -> tuple[str, ...] | None:
    """The keyword-only options ``fn`` accepts (``state`` aside), None when it takes ``**options``
    (read once per function: ``inspect.signature`` costs more than a small plan)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return None
    return tuple(n for n, p in params.items() if p.kind is p.KEYWORD_ONLY and n != "state")
