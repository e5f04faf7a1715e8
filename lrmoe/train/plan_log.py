"""What the placement planners decided in a step: the ``plans`` entry of an expert-parallel
(``ep > 1``) or virtual-EP (``virtual_ep > 1``) metrics row, and the routing a trace records.

``plans`` maps every MoE layer (its index, as a string) to the step's totals over its calls (one
per micro-batch; a split micro-batch's pieces are one call):

* ``calls``: layer calls; ``routed``: routed pairs (the demand, all ranks);
* ``dropped``: pairs dropped in forward (over capacity: SYMI at capacity factor 1.0, a planner's
  ``drop`` fallback; their output is 0 and they get no backward);
* ``kept``: pairs kept in backward (the plans' backward quotas, summed; the selective backward
  keeps exactly these);
* ``replicas``: the most expert instances away from their owner rank in one plan (SYMI slots on
  other ranks, UltraEP/LRMoE replicas);
* ``memory_bytes``: the largest planned per-rank memory of one plan (``Plan.memory.peak``:
  resident expert weights, gradients, optimizer state, token buffers);
* ``splits``: the most pieces one call was split into (1: not split).
"""
from __future__ import annotations

import numpy as np

PLAN_KEYS = ("calls", "routed", "dropped", "kept", "replicas", "memory_bytes", "splits")


def routing_counts(plans_per_layer: list[list]) -> np.ndarray:
    """[MoE layers, G, E]: the pairs each layer's latest call routed per source rank and expert
    (a split call: its pieces summed)."""
    return np.stack([sum(np.asarray(p.demand_GE, dtype=np.int64) for p in plans) for plans in plans_per_layer])


class PlanLog:
    """The step's plan totals per MoE layer (module docstring); :meth:`add` after every micro-batch."""

    def __init__(self):
        self.layers: dict[int, dict[str, int]] = {}

    def add(self, plans_per_layer: list[list]) -> None:
        for li, plans in enumerate(plans_per_layer):
            if not plans:
                continue
            s = self.layers.setdefault(li, dict.fromkeys(PLAN_KEYS, 0))
            s["calls"] += 1
            s["routed"] += int(sum(int(np.sum(p.demand_GE)) for p in plans))
            s["dropped"] += int(sum(int(np.sum(p.dropped_GE)) for p in plans))
            s["kept"] += int(sum(int(np.sum(p.backward_quota_GN)) for p in plans))
            s["replicas"] = max(s["replicas"], max(int(p.is_replica_N.sum()) for p in plans))
            s["memory_bytes"] = max(s["memory_bytes"], max(int(p.memory.peak) for p in plans))
            s["splits"] = max(s["splits"], len(plans))

    def row(self) -> dict:
        return {str(li): dict(s) for li, s in sorted(self.layers.items())}
