"""Replay a routing trace through the real planners and the cost model, per method.

For every step and MoE layer of the trace, each method's plan is made by
:func:`lrmoe.planning.step.plan_layer` (the function the expert-parallel runtime calls), timed on
this host, and executed as the runtime executes it: a ``split_microbatch:N`` plan runs N pieces,
each planned on its own demand with fallback ``oom`` (the simulator has counts, not tokens: piece
j gets ``d * (j + 1) // N - d * j // N`` of every count, where the runtime splits its tokens into
contiguous slices), each paying its fixed costs; an ``oom`` plan cannot run (no time, no useful
pairs, counted). SYMI's state carries from step to step per layer, as in the runtime.

Per method the result holds the memory of the executed plans (worst rank per component, median
and max over the (step, layer) plans), the forward and backward time per layer (mean over the
executed (step, layer) plans, so that layers x steps x mean is the cumulative MoE-layer time; also
per phase), the host time (the median of the planner's host times and the median of the layouts'
host times, :func:`host_layout_seconds`, each charged to every plan's forward unless
``include_planning=False``), the fallbacks, and the throughput: useful pairs (pairs
computed in forward: routed pairs minus those dropped over capacity) per second of MoE-layer time.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections import Counter
from typing import Callable

import numpy as np

from ..planning.memory import GIB
from ..planning.layout import layout_counts
from ..planning.plan import Cluster, ModelDims
from ..planning.step import plan_layer
from .cost import BACKWARD, FORWARD, layer_cost
from .hardware import Hardware, get_hardware

MODES = ("compact", "mask", "full")


@dataclasses.dataclass(frozen=True)
class Method:
    """One method as the runtime runs it: a placement policy and its options, and the backward
    policy's drop ratio, mode and quota policy (a baseline at drop 0 keeps every pair)."""

    name: str
    placement: str
    options: dict = dataclasses.field(default_factory=dict)
    drop_ratio: float = 0.0
    mode: str = "compact"
    quota: str = "waterfill"
    quota_options: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"method {self.name!r}: mode must be one of {MODES}, got {self.mode!r}")
        if not 0.0 <= self.drop_ratio < 1.0:
            raise ValueError(f"method {self.name!r}: drop_ratio must be in [0, 1), got {self.drop_ratio!r}")

    @property
    def selects(self) -> bool:
        return self.mode != "full" and self.drop_ratio > 0


#: The paper's four methods: baselines dropless with the full backward, LRMoE at C20 (waterfill).
PAPER_METHODS = (Method("fixed", "fixed"), Method("symi", "symi"), Method("ultraep", "ultraep"),
                 Method("lrmoe", "lrmoe", drop_ratio=0.2))


def even_pieces(demand_GE: np.ndarray, n: int) -> list[np.ndarray]:
    """n pieces of every count, as even as possible (sum to the demand exactly)."""
    return [demand_GE * (j + 1) // n - demand_GE * j // n for j in range(n)]


def _summ(values) -> dict:
    v = list(values)
    if not v:
        return {"median": None, "max": None, "mean": None}
    return {"median": statistics.median(v), "max": max(v), "mean": statistics.fmean(v)}


def compacted_token_bytes(plan, dims: ModelDims) -> np.ndarray:
    """[G] bytes of the token buffers compaction sizes: the backward execution buffers of the kept
    received rows and the backward all-to-all buffers of the kept sent rows (send + receive, ``2 H b``
    per row, as the memory model's dispatch term counts them). The paper's T4 may count only these
    (its fixed-ownership subtotal matches the full model at balanced routing; docs/simulator.md)."""
    mem = plan.memory
    kept_sent_G = plan.backward_quota_GN.sum(1).astype(np.int64)
    return mem.backward_G + 2 * dims.hidden * dims.dtype_bytes * kept_sent_G


def host_layout_seconds(plan, *, selects: bool, compact: bool = True) -> float:
    """Host seconds of the slowest rank's layout of ``plan`` (:func:`lrmoe.planning.layout.layout_counts`
    with the runtime's arguments, each rank timed in turn): what the runtime's ``Layout`` computes on
    the host per MoE layer and rank (``moe_layout_s``), the device's index expansion excluded."""
    G, E = plan.demand_GE.shape
    compacts = selects and compact and bool((plan.backward_quota_GN != plan.send_GN).any())
    worst = 0.0
    for r in range(G):
        t0 = time.perf_counter()
        layout_counts(np.ascontiguousarray(plan.expert_N, dtype=np.int64), np.ascontiguousarray(plan.rank_N, dtype=np.int64),
                      np.ascontiguousarray(plan.send_GN, dtype=np.int64),
                      np.ascontiguousarray(plan.backward_quota_GN, dtype=np.int64),
                      np.ascontiguousarray(plan.demand_GE[r], dtype=np.int64), r, E // G, compacts)
        worst = max(worst, time.perf_counter() - t0)
    return worst


def run_method(method: Method, counts_SLGE: np.ndarray, cluster: Cluster, dims: ModelDims, hw: Hardware,
               budget_bytes: float, *, include_planning: bool = True,
               progress: Callable[[int, int], None] | None = None) -> dict:
    """Replay counts [steps, layers, G, E] for one method (module docstring)."""
    S, L = counts_SLGE.shape[:2]
    states: list = [None] * L
    kw = dict(options=method.options, selects=method.selects, drop_ratio=method.drop_ratio, quota=method.quota,
              quota_options=method.quota_options)
    fallbacks: Counter = Counter()
    mem = {k: [] for k in ("base", "replicas", "tokens", "subtotal", "tokens_compacted", "subtotal_compacted")}
    fwd, bwd, plan_ms, layout_ms = [], [], [], []
    phases = {("forward", p): [] for p in FORWARD} | {("backward", p): [] for p in BACKWARD}
    useful = routed = dropped = kept = replicas = 0
    oom = 0
    for s in range(S):
        for layer in range(L):
            d = counts_SLGE[s, layer]
            t0 = time.perf_counter()
            plan = plan_layer(method.placement, d, cluster, dims, budget_bytes, state=states[layer], **kw)
            plan_s = time.perf_counter() - t0
            states[layer] = plan.state
            routed += int(d.sum())
            fallbacks[plan.fallback or "none"] += 1
            if plan.fallback == "oom":
                oom += 1
                plan_ms.append(plan_s * 1e3)
                continue
            pieces = [plan] if plan.num_splits == 1 else []
            for piece in (even_pieces(d, plan.num_splits) if plan.num_splits > 1 else []):
                t1 = time.perf_counter()
                pieces.append(plan_layer(method.placement, piece, cluster, dims, budget_bytes, state=states[layer],
                                         piece=True, **kw))
                plan_s += time.perf_counter() - t1
            plan_ms.append(plan_s * 1e3)
            costs = [layer_cost(p, cluster, dims, hw, selects=method.selects, compact=method.mode == "compact")
                     for p in pieces]
            layout_ms.append(1e3 * sum(host_layout_seconds(p, selects=method.selects, compact=method.mode == "compact")
                                       for p in pieces))
            summaries = [p.memory.summary() for p in pieces]
            mem["base"].append(max(m["base"] for m in summaries) / GIB)
            mem["replicas"].append(max(m["replicas"] for m in summaries) / GIB)
            mem["tokens"].append(max(m["tokens"] for m in summaries) / GIB)
            mem["subtotal"].append(max(m["total"] for m in summaries) / GIB)
            # the other reading of T4's token buffers: only those compaction sizes (the backward's
            # execution buffers and its all-to-all of kept rows), per rank, worst rank
            compacted = [compacted_token_bytes(p, dims) for p in pieces]
            mem["tokens_compacted"].append(max(int(c.max(initial=0)) for c in compacted) / GIB)
            mem["subtotal_compacted"].append(max(int((p.memory.base_G + p.memory.replicas_G + c).max(initial=0))
                                                 for p, c in zip(pieces, compacted)) / GIB)
            fwd.append(sum(c["forward_s"] for c in costs) * 1e3)
            bwd.append(sum(c["backward_s"] for c in costs) * 1e3)
            for (part, p), v in phases.items():
                v.append(sum(c[part][p] for c in costs) * 1e3)
            u = sum(c["pairs"] for c in costs)
            useful += u
            dropped += int(d.sum()) - u
            kept += sum(c["kept"] for c in costs)
            replicas += sum(int(p.is_replica_N.sum()) for p in pieces)
        if progress is not None:
            progress(s + 1, S)
    ran = len(fwd)
    # planning is charged to every executed plan at the median of the planner times measured on this
    # host: the planner's cost, robust to the host's other load (a mean would carry its spikes)
    plan_charge = (_summ(plan_ms)["median"] or 0.0) if include_planning else 0.0
    layout_charge = (_summ(layout_ms)["median"] or 0.0) if include_planning else 0.0  # likewise the layouts
    fwd = [f + plan_charge + layout_charge for f in fwd]
    phases[("forward", "plan")] = [plan_charge] * ran
    phases[("forward", "layout")] = [layout_charge] * ran
    host_charge = plan_charge + layout_charge
    total_s = (sum(fwd) + sum(bwd)) / 1e3
    return {
        "method": dataclasses.asdict(method),
        "plans": S * L, "ran": ran, "oom": oom, "fallbacks": dict(sorted(fallbacks.items())),
        "memory_gib": {k: _summ(v)["median"] for k, v in mem.items()},
        "memory_gib_max": {k: _summ(v)["max"] for k, v in mem.items()},
        "forward_ms_per_layer": _summ(fwd)["mean"], "backward_ms_per_layer": _summ(bwd)["mean"],
        "total_ms_per_layer": _summ([a + b for a, b in zip(fwd, bwd)])["mean"],
        "total_ms_per_layer_median": _summ([a + b for a, b in zip(fwd, bwd)])["median"],
        "planning_ms_per_layer": plan_charge if include_planning else _summ(plan_ms)["median"],
        "planning_ms_measured": _summ(plan_ms),
        "layout_ms_per_layer": layout_charge if include_planning else _summ(layout_ms)["median"],
        "layout_ms_measured": _summ(layout_ms),
        "planning_included": include_planning,
        "phases_ms": {part: {p: _summ(phases[(part, p)])["mean"] for p in (FORWARD if part == "forward" else BACKWARD)}
                      for part in ("forward", "backward")},
        "pairs": {"routed": routed, "useful": useful, "dropped_over_capacity": dropped, "kept_backward": kept},
        "useful_share": useful / routed if routed else None,
        "replicas_per_plan": replicas / ran if ran else None,
        "moe_seconds": total_s,
        "pairs_per_s": useful / total_s if total_s > 0 else 0.0,
        "pairs_per_s_without_planning": useful / (total_s - ran * host_charge / 1e3)
        if total_s - ran * host_charge / 1e3 > 0 else 0.0,
    }


def simulate(counts_SLGE: np.ndarray, methods, cluster: Cluster, dims: ModelDims, hardware: str | Hardware,
             budget_bytes: float = math.inf, *, include_planning: bool = True,
             progress: Callable[[str, int, int], None] | None = None) -> dict:
    """Every method on the same counts; ``{"hardware": ..., "methods": {name: run_method(...)}}``."""
    hw = get_hardware(hardware)
    counts = np.asarray(counts_SLGE)
    if counts.ndim != 4 or counts.shape[2:] != (cluster.num_ranks, dims.num_experts):
        raise ValueError(f"counts must be [steps, layers, G={cluster.num_ranks}, E={dims.num_experts}], "
                         f"got shape {counts.shape}")
    out = {}
    for m in methods:
        cb = None if progress is None else (lambda s, n, name=m.name: progress(name, s, n))
        out[m.name] = run_method(m, counts, cluster, dims, hw, budget_bytes, include_planning=include_planning,
                                 progress=cb)
    return {"hardware": dataclasses.asdict(hw), "budget_gib": budget_bytes / GIB if math.isfinite(budget_bytes)
            else None, "methods": out}
