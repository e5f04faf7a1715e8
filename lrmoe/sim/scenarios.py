"""Named simulation scenarios: the paper's setting (T4 memory, T5 backward latency, F3 throughput
under batch-size pressure) and the sweeps beyond it (F5: where LRMoE wins and where it does not).

A scenario fixes the model dimensions, the EP layout, the trace (a synthetic workload, or a trace
file given by the user), the hardware preset, the methods, the per-layer budget and, for sweeps,
the axis that varies. :func:`run_scenario` turns it into one JSON-able result; every number in it
is simulated (hardware model and trace named beside it).

The per-layer budget. The paper gives 80 GiB per GPU and does not say how much of it one MoE
layer's planner may use. The reading used here (an option, ``budget``): ``"fixed-1x"`` = the peak
memory fixed ownership's plans need at the scenario's own batch (1x pressure) on the same trace
(its worst (step, layer)), so at 1x every method fits without a fallback, and under k x pressure
the batch grows while the budget stays; a number is a budget in GiB; ``"none"`` is no budget. No
parameter is fitted to a paper number.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable

import numpy as np

from ..planning.memory import GIB
from ..planning.plan import Cluster, ModelDims
from ..planning.step import plan_layer
from .hardware import get_hardware
from .simulate import PAPER_METHODS, Method, simulate

#: The paper's models (docs/simulator.md, sources in ../shared/sim-sources.md): hidden, expert FFN,
#: experts, top-k, MoE layers.
MODELS = {"qwen3-30b-a3b": (2048, 768, 128, 8, 48), "glm-4.5-air": (4096, 1408, 128, 8, 45)}
PAPER_TOKENS_PER_RANK = 4 * 8192  # microbatch 4 x sequence 8,192 per GPU
PRESSURES = (1, 2, 5, 10, 20)


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    model: str = "qwen3-30b-a3b"
    ranks: int = 8
    ranks_per_domain: int = 8
    extra_slots: int = 4  # replica slots per rank beyond the E/G owned ones
    tokens_per_rank: int = PAPER_TOKENS_PER_RANK
    workload: str = "lognormal"
    workload_params: dict = dataclasses.field(default_factory=dict)
    steps: int = 8
    layers: int | None = None  # simulated MoE layers (None: the model's all); per-layer numbers are medians
    seed: int = 0
    hardware: str = "h100-sxm"
    budget: str | float = "fixed-1x"
    methods: tuple = PAPER_METHODS
    pressures: tuple = (1,)
    tables: tuple = ("T4", "T5")
    sweep: tuple = ()  # (field, values): one simulation per value (F5); drop ratio applies to lrmoe
    model_dims: tuple | None = None  # (hidden, intermediate, experts, top-k, MoE layers) instead of MODELS[model]

    def shape(self) -> tuple:
        """(hidden, expert FFN, experts, top-k, MoE layers) of the simulated model."""
        return tuple(self.model_dims) if self.model_dims is not None else MODELS[self.model]

    def dims(self) -> ModelDims:
        H, I, E, K, _ = self.shape()
        # bf16 weights and activations, fp32 gradients, optimizer state off the layer's budget
        return ModelDims(hidden=H, intermediate=I, num_experts=E, top_k=K, dtype_bytes=2, grad_bytes=4,
                         optimizer_bytes_per_param=0)

    def cluster(self) -> Cluster:
        E = self.shape()[2]
        per = self.ranks_per_domain
        return Cluster(num_ranks=self.ranks, slots_per_rank=E // self.ranks + self.extra_slots,
                       fast_domains=tuple(tuple(range(d, min(d + per, self.ranks))) for d in range(0, self.ranks, per)))

    def num_layers(self) -> int:
        return self.shape()[4] if self.layers is None else self.layers


def _paper(model: str, short: str) -> list[Scenario]:
    return [
        Scenario(f"paper-{short}", f"The paper's setting, {model}: EP8 on one 8-GPU NVLink node, 32,768 tokens "
                 f"per GPU, the four methods (LRMoE at C20): T4 memory and T5 backward latency", model=model),
        Scenario(f"pressure-{short}", f"F3, {model}: batch-size pressure 1x-20x at the 1x budget (fixed ownership's "
                 f"need), effective throughput per method", model=model, steps=3, layers=4, pressures=PRESSURES,
                 tables=("F3",)),
    ]


SCENARIOS: dict[str, Scenario] = {s.name: s for s in [
    *_paper("qwen3-30b-a3b", "qwen3"), *_paper("glm-4.5-air", "glm"),
    Scenario("sweep-skew", "F5: LRMoE against each baseline as routing skew grows (log-normal sigma 0-2)",
             steps=3, layers=4, tables=("F5",), sweep=("sigma", (0.0, 0.5, 1.0, 1.5, 2.0))),
    Scenario("sweep-budget", "F5: as the per-layer budget shrinks (GiB), log-normal sigma 1",
             steps=3, layers=4, tables=("F5",), sweep=("budget", (24.0, 16.0, 12.0, 9.0, 6.0))),
    Scenario("sweep-ep", "F5: as the EP size grows (8, 16, 64 GPUs in 8-GPU NVLink domains)",
             steps=2, layers=2, tables=("F5",), sweep=("ranks", (8, 16, 64))),
    Scenario("sweep-drop", "F5: LRMoE's drop ratio C0-C50 against the dropless baselines",
             steps=3, layers=4, tables=("F5",), sweep=("drop_ratio", (0.0, 0.1, 0.2, 0.3, 0.5))),
]}


def scenario_names() -> list[str]:
    return list(SCENARIOS)


def get_scenario(name: str) -> Scenario:
    if name not in SCENARIOS:
        raise ValueError(f"unknown scenario {name!r}; known: {scenario_names()}")
    return SCENARIOS[name]


def scenario_trace(sc: Scenario):
    """The scenario's synthetic trace at its own scale (``lrmoe.sim.workloads``)."""
    from .workloads import synthetic_trace  # noqa: PLC0415 (the workloads module is optional for trace files)

    E, K = sc.shape()[2], sc.shape()[3]
    return synthetic_trace(sc.workload, steps=sc.steps, layers=sc.num_layers(), num_ranks=sc.ranks, num_experts=E,
                           tokens_per_rank=sc.tokens_per_rank, top_k=K, seed=sc.seed, **sc.workload_params)


def check_trace_fits(sc: Scenario, trace) -> None:
    """ValueError, before any planning, when ``trace`` routes over other experts than ``sc`` simulates."""
    E, K = sc.shape()[2], sc.shape()[3]
    if trace.num_experts != E or trace.top_k != K:
        raise ValueError(f"the trace routes over {trace.num_experts} experts, top-{trace.top_k}; scenario {sc.name!r} "
                         f"simulates {E} experts, top-{K} ({sc.model}): replay the trace at its own model and "
                         f"ranks (lrmoe simulate --trace PATH --at-trace, or at_trace()), or record one from a "
                         f"model with {E} experts")


def at_trace(sc: Scenario, trace, dims: dict) -> Scenario:
    """``sc`` at the configuration the trace was recorded at: the model's routed experts ``dims``
    (``{"hidden", "intermediate", "num_experts", "top_k"}``, a trace meta's ``"dims"``), the trace's
    MoE layers, source ranks (one fast domain) and tokens per rank; the scenario's methods, budget
    reading, hardware, pressures and extra replica slots are kept."""
    missing = [k for k in ("hidden", "intermediate", "num_experts", "top_k") if k not in dims]
    if missing:
        raise ValueError(f"model dims lack {missing}")
    if (int(dims["num_experts"]), int(dims["top_k"])) != (trace.num_experts, trace.top_k):
        raise ValueError(f"the model dims say {dims['num_experts']} experts, top-{dims['top_k']}, but the trace "
                         f"routes over {trace.num_experts}, top-{trace.top_k}")
    G = trace.num_ranks
    if trace.num_experts % G:
        raise ValueError(f"the trace's {trace.num_experts} experts do not split over its {G} ranks")
    name = trace.meta.get("model", "trace")
    return dataclasses.replace(
        sc, name=f"{sc.name}@trace", model=f"trace of {name}", ranks=G, ranks_per_domain=G,
        tokens_per_rank=max(1, int(round(float(trace.meta["tokens_per_rank"])))), sweep=(),
        model_dims=(int(dims["hidden"]), int(dims["intermediate"]), trace.num_experts, trace.top_k, trace.layers),
        description=f"{sc.description} -- at the trace's own configuration ({name}: H {dims['hidden']}, I "
                    f"{dims['intermediate']}, E {trace.num_experts}, top-{trace.top_k}, {trace.layers} MoE layers, "
                    f"EP{G}, {trace.meta['tokens_per_rank']:g} tokens per rank)")


def budget_bytes_for(sc: Scenario, counts_SLGE: np.ndarray) -> float:
    """The per-layer budget of the scenario's reading (module docstring), in bytes."""
    if sc.budget == "none":
        return math.inf
    if sc.budget == "fixed-1x":
        dims, cl = sc.dims(), sc.cluster()
        return float(max(plan_layer("fixed", d, cl, dims, math.inf).memory.peak
                         for d in counts_SLGE.reshape(-1, *counts_SLGE.shape[2:])))
    if isinstance(sc.budget, (int, float)) and not isinstance(sc.budget, bool) and sc.budget > 0:
        return float(sc.budget) * GIB
    raise ValueError(f"scenario {sc.name!r}: budget must be 'fixed-1x', 'none' or a number of GiB > 0, "
                     f"got {sc.budget!r}")


def _pressured(counts_SLGE: np.ndarray, k: float) -> np.ndarray:
    return np.rint(counts_SLGE * k).astype(np.int64) if k != 1 else counts_SLGE


def run_scenario(sc: Scenario, trace=None, *, hardware=None, include_planning: bool = True,
                 progress: Callable[[str], None] | None = None) -> dict:
    """Simulate a scenario (module docstring): ``{"scenario", "hardware", "trace", "budget_gib",
    "methods": {name: {... , "throughput": {pressure: {"pairs_per_s", "relative"}}}}, "sweep"}``.
    ``hardware``: a preset name or :class:`lrmoe.sim.hardware.Hardware` (default: the scenario's).
    ``trace``: a :class:`lrmoe.sim.trace.Trace` to replay instead of the scenario's workload (scaled
    to the scenario's tokens per rank and regrouped to its ranks when they differ)."""
    hw = get_hardware(hardware or sc.hardware)
    say = progress or (lambda msg: None)
    t0 = time.perf_counter()
    if sc.sweep:
        return _run_sweep(sc, trace, hw, include_planning, say)
    if trace is None:
        trace = scenario_trace(sc)
    else:
        check_trace_fits(sc, trace)
        if trace.num_ranks != sc.ranks:
            trace = trace.regrouped(sc.ranks)
        trace = trace.scaled(sc.tokens_per_rank * sc.shape()[3])
    counts = trace.counts
    budget = budget_bytes_for(sc, counts)
    methods: dict = {}
    for k in sc.pressures:
        say(f"{sc.name}: pressure {k}x, {counts.shape[0]} steps x {counts.shape[1]} layers x {len(sc.methods)} methods")
        res = simulate(_pressured(counts, k), sc.methods, sc.cluster(), sc.dims(), hw, budget,
                       include_planning=include_planning,
                       progress=lambda name, s, n: say(f"  {name}: step {s}/{n}"))
        best = max(m["pairs_per_s"] for m in res["methods"].values()) or 1.0
        lrmoe = res["methods"].get("lrmoe", {}).get("pairs_per_s") or best
        lrmoe_np = res["methods"].get("lrmoe", {}).get("pairs_per_s_without_planning") or 1.0
        for name, m in res["methods"].items():
            entry = methods.setdefault(name, m)  # the first pressure's (1x) results, + throughput per pressure
            entry.setdefault("throughput", {})[f"{k:g}"] = {
                "pairs_per_s": m["pairs_per_s"], "relative": m["pairs_per_s"] / lrmoe,
                "relative_to_best": m["pairs_per_s"] / best, "fallbacks": m["fallbacks"], "oom": m["oom"],
                "useful_share": m["useful_share"],
                "pairs_per_s_without_planning": m["pairs_per_s_without_planning"],
                "relative_without_planning": m["pairs_per_s_without_planning"] / lrmoe_np,
                "kept_backward_share": m["pairs"]["kept_backward"] / m["pairs"]["routed"] if m["pairs"]["routed"] else None}
    return {"scenario": dataclasses.asdict(sc) | {"methods": [dataclasses.asdict(m) for m in sc.methods]},
            "hardware": dataclasses.asdict(hw), "trace": dict(trace.meta) | {"shape": list(counts.shape)},
            "budget_gib": budget / GIB if math.isfinite(budget) else None, "methods": methods,
            "elapsed_s": time.perf_counter() - t0, "simulated": True}


def _run_sweep(sc: Scenario, trace, hw, include_planning, say) -> dict:
    field, values = sc.sweep
    points = []
    for v in values:
        if field == "sigma":
            sub = dataclasses.replace(sc, sweep=(), workload="lognormal", workload_params={"sigma": v})
        elif field == "drop_ratio":
            sub = dataclasses.replace(sc, sweep=(), methods=tuple(
                dataclasses.replace(m, drop_ratio=v) if m.placement == "lrmoe" else m for m in sc.methods))
        elif field in ("budget", "ranks"):
            sub = dataclasses.replace(sc, sweep=(), **{field: v})
        else:
            raise ValueError(f"scenario {sc.name!r}: unknown sweep field {field!r}; accepted: sigma, drop_ratio, "
                             f"budget, ranks")
        say(f"{sc.name}: {field} = {v}")
        r = run_scenario(sub, trace, hardware=hw, include_planning=include_planning)
        points.append({"value": v, "budget_gib": r["budget_gib"], "trace": r["trace"], "methods": r["methods"]})
    first = points[0]
    return {"scenario": dataclasses.asdict(sc) | {"methods": [dataclasses.asdict(m) for m in sc.methods]},
            "hardware": dataclasses.asdict(hw), "trace": first["trace"], "budget_gib": first["budget_gib"],
            "methods": first["methods"], "sweep": {"field": field, "points": points}, "simulated": True}
