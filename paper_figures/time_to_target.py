"""T3 (time to fixed loss targets per method) and F4 (loss against cumulative MoE-layer time), from E3.

E3 trains every method with its expert-parallel semantics (``lrmoe train --virtual-ep 8`` at cpu
scale, ``torchrun ... lrmoe train --ep 8 --record-trace`` in the ``paper`` preset;
:mod:`lrmoe.reproduce.experiments`); each run logs its per-step MoE-layer time and writes its
routing trace. Per model family and seed (each seed paired with its own C0 and SYMI runs; over the
seeds, means and 95 % t intervals, :func:`summarise`):

* **targets**: the training loss the fixed-ownership run (C0: dropless, full backward) reaches at
  :data:`TARGET_FRACTIONS` of its steps, read off its smoothed curve;
* **smoothed curve**: the trailing mean of the per-step training loss over
  ``max(3, ceil(SMOOTH_FRACTION * steps))`` steps (one step's loss is one batch's; the smoothing
  keeps a lucky batch from counting as reaching a target). A method reaches a target at the first
  step whose smoothed loss is at or below it;
* **time (a), measured**: the run's cumulative ``moe_fwd_s + moe_bwd_s`` to that step: for a
  virtual-EP run one CPU process executing the experts of all 8 virtual ranks (planning and
  layouts included), on the machine the run names, not a cluster's time; for a torchrun EP run
  (``paper``) the slowest rank's time on the GPUs, labelled "measured, 8 × GPU";
* **time (b), simulated**: the run's own routing trace, scaled to the paper's tokens per rank
  (:meth:`lrmoe.sim.trace.Trace.scaled`; regrouped to the paper's 8 ranks if need be), replayed
  step by step through the method's planner and the cost model (:func:`simulated_step_seconds`)
  with the paper's model dimensions and cluster (:mod:`lrmoe.sim.scenarios`, ``paper-qwen3`` /
  ``paper-glm``: EP8, one NVLink node, 32,768 tokens per GPU, the fixed-1x per-layer budget taken
  over the family's four traces) on the ``h100-sxm`` hardware model; the run's MoE layers stand for
  the paper model's (per-step time x paper layers / run layers). Planning is charged as the
  simulator charges it (median host time per plan, measured on this host), and left out in a
  second column (the planners are host Python: their time depends on the machine and its load).

Reductions are ``100 * (1 - time_method / time_symi)`` at the same target; where SYMI never reaches
a target, ``100 * (1 - time_method / time_symi_whole_run)`` is a lower bound (shown as "> x"). The simulated per-step
times are cached under ``<results>/sim/e3/<run>.json`` (keyed by the trace's checksum and the
settings), so tables are remade without replaying.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import statistics
import time
from pathlib import Path

import numpy as np

from lrmoe.stats import censored_median, estimate, fmt_p, holm
from lrmoe.environment import hardware_label
from lrmoe.files import read_json, write_json
from lrmoe.run_folder import TRACE

from .figures import pyplot, save_figure
from .results import FAMILY_NAMES, Results, Run
from .tables import md_table, tex_table, write_table

#: fractions of the fixed-ownership run's steps whose loss are the targets; the last one is late (the
#: paper's target, loss 0.02, is reached near the end of its runs)
TARGET_FRACTIONS = (0.5, 0.75, 0.9, 0.98)
SMOOTH_FRACTION = 0.05
METHOD_ORDER = ("fixed", "symi", "symi-cf125", "symi-dropless", "ultraep", "lrmoe")
METHOD_NAMES = {"fixed": "Fixed ownership (Megatron)", "symi": "SYMI (capacity 1.0)",
                "symi-cf125": "SYMI (capacity 1.25)", "symi-dropless": "SYMI (dropless)", "ultraep": "UltraEP",
                "lrmoe": "LRMoE (C20)"}
SYMI_VARIANTS = ("symi", "symi-cf125", "symi-dropless")
#: the methods LRMoE is compared with, pairwise per seed (:func:`lrmoe_against`)
BASELINES = ("fixed", *SYMI_VARIANTS, "ultraep")


def method_of(config: dict) -> str:
    """An E3 run's method name (:data:`METHOD_ORDER`) from its config: its placement, and for SYMI
    its capacity factor (``ep_options``; 1.0, SYMI's own, by default; None: dropless)."""
    placement = config.get("placement", "?")
    if placement != "symi":
        return placement
    cf = (config.get("ep_options") or {}).get("capacity_factor", 1.0)
    if cf is None:
        return "symi-dropless"
    return "symi" if float(cf) == 1.0 else f"symi-cf{round(float(cf) * 100)}"


def paper_method(name: str):
    """The simulator's :class:`lrmoe.sim.simulate.Method` for a method name (None: unknown)."""
    from lrmoe.sim.simulate import PAPER_METHODS

    base = {m.placement: m for m in PAPER_METHODS}
    if name in base:
        return base[name]
    if name == "symi-dropless":
        return dataclasses.replace(base["symi"], name=name, options={**base["symi"].options, "capacity_factor": None})
    if name.startswith("symi-cf") and name[7:].isdigit():
        return dataclasses.replace(base["symi"], name=name,
                                   options={**base["symi"].options, "capacity_factor": int(name[7:]) / 100})
    return None
SCENARIO_OF = {"qwen3": "paper-qwen3", "glm4": "paper-glm"}
HARDWARE = "h100-sxm"
CACHE_DIR = ("sim", "e3")


# ----------------------------------------------------------------------------- curves and targets
def smoothed(losses: list[float | None], window: int) -> list[float | None]:
    """Trailing mean over ``window`` steps (None where a window holds no loss)."""
    out = []
    for i in range(len(losses)):
        w = [x for x in losses[max(0, i - window + 1):i + 1] if x is not None]
        out.append(sum(w) / len(w) if w else None)
    return out


def window_of(steps: int) -> int:
    return max(3, math.ceil(SMOOTH_FRACTION * steps))


def first_reach(curve: list[float | None], target: float) -> int | None:
    """Index of the first entry at or below ``target`` (None: never)."""
    return next((i for i, x in enumerate(curve) if x is not None and x <= target), None)


def targets(c0_curve: list[float | None]) -> list[float]:
    """The smoothed C0 loss at :data:`TARGET_FRACTIONS` of its run (step ``ceil(f * steps)``)."""
    n = len(c0_curve)
    return [c0_curve[max(0, math.ceil(f * n) - 1)] for f in TARGET_FRACTIONS]


def e3_runs(res: Results) -> dict[str, dict[int, dict[str, Run]]]:
    """family -> seed -> method (:func:`method_of`) -> the finished E3 run (tagged E3 in the
    manifest, or, without one, any run with ``virtual_ep`` or ``ep`` > 1)."""
    out: dict[str, dict[int, dict[str, Run]]] = {}
    tagged = any("E3" in r.experiments for r in res.runs.values())
    fams = list(FAMILY_NAMES)  # qwen3, then glm4, then any other family
    for r in sorted(res.runs.values(), key=lambda r: (fams.index(r.family) if r.family in fams else len(fams),
                                                       r.family, r.seed, r.name)):
        is_e3 = "E3" in r.experiments if tagged else max(r.config.get("virtual_ep", 1), r.config.get("ep", 1)) > 1
        if is_e3 and r.done:
            out.setdefault(r.family, {}).setdefault(r.seed, {}).setdefault(method_of(r.config), r)
    return out


def measured_where(run: Run) -> str:
    """Where column (a) of a run was measured: ``8x NVIDIA H100 80GB HBM3, EP8`` for a torchrun
    EP run (the slowest rank's time), the CPU and "8 virtual EP ranks in one process" for a
    virtual-EP run."""
    label = hardware_label(run.summary.get("environment", {}), run.summary.get("distributed"))
    g = int(run.config.get("virtual_ep") or 1)
    return f"{label}; {g} virtual EP ranks in one process" if g > 1 else label


# ----------------------------------------------------------------------------- simulated time
def simulated_step_seconds(method, counts_SLGE: np.ndarray, cluster, dims, hw, budget_bytes: float, *,
                           include_planning: bool = True) -> dict:
    """Per trace step, the simulated MoE-layer seconds of ``method`` (a :class:`lrmoe.sim.simulate.Method`)
    summed over the trace's layers: the plans :func:`lrmoe.sim.simulate.run_method` makes (state
    carried per layer, split pieces planned and executed, ``oom`` plans not run) costed by
    :func:`lrmoe.sim.cost.layer_cost`; with ``include_planning`` every executed plan's forward is
    charged the median of the planner's host times, as run_method charges it. The total equals
    run_method's ``moe_seconds`` (tests/experiments/test_time_to_target.py)."""
    from lrmoe.planning.step import plan_layer
    from lrmoe.sim.cost import layer_cost
    from lrmoe.sim.simulate import even_pieces, host_layout_seconds

    S, L = counts_SLGE.shape[:2]
    kw = dict(options=method.options, selects=method.selects, drop_ratio=method.drop_ratio, quota=method.quota,
              quota_options=method.quota_options)
    states: list = [None] * L
    step_s, ran_per_step, plan_ms, layout_ms, oom = [], [], [], [], 0
    for s in range(S):
        total, ran = 0.0, 0
        for layer in range(L):
            d = counts_SLGE[s, layer]
            t0 = time.perf_counter()
            plan = plan_layer(method.placement, d, cluster, dims, budget_bytes, state=states[layer], **kw)
            states[layer] = plan.state
            pieces = [plan] if plan.num_splits == 1 else [
                plan_layer(method.placement, p, cluster, dims, budget_bytes, state=states[layer], piece=True, **kw)
                for p in even_pieces(d, plan.num_splits)]
            plan_ms.append((time.perf_counter() - t0) * 1e3)
            if plan.fallback == "oom":
                oom += 1
                continue
            ran += 1
            layout_ms.append(1e3 * sum(host_layout_seconds(p, selects=method.selects, compact=method.mode == "compact")
                                       for p in pieces))
            for p in pieces:
                c = layer_cost(p, cluster, dims, hw, selects=method.selects, compact=method.mode == "compact")
                total += c["forward_s"] + c["backward_s"]
        step_s.append(total)
        ran_per_step.append(ran)
    charge = statistics.median(plan_ms) / 1e3 if include_planning and plan_ms else 0.0
    layout = statistics.median(layout_ms) / 1e3 if include_planning and layout_ms else 0.0
    return {"step_s": [t + (charge + layout) * n for t, n in zip(step_s, ran_per_step)], "step_s_no_planning": step_s,
            "planning_s_per_plan": charge, "layout_s_per_plan": layout, "oom_plans": oom, "plans": S * L}


def _scenario(family: str):
    from lrmoe.sim.scenarios import get_scenario

    return get_scenario(SCENARIO_OF[family])


def _paper_trace(run: Run, sc):
    from lrmoe.sim.scenarios import MODELS
    from lrmoe.sim.trace import load_trace

    tr = load_trace(run.dir / TRACE)
    if tr.num_ranks != sc.ranks:
        tr = tr.regrouped(sc.ranks)
    return tr.scaled(sc.tokens_per_rank * MODELS[sc.model][3])


def simulate_family(res: Results, family: str, runs: dict[str, Run], say=None) -> dict[str, dict]:
    """method -> {"step_s": simulated seconds per optimizer step (paper depth), ...} for the
    family's E3 runs (cached under ``<results>/sim/e3/``)."""
    from lrmoe.sim.cost import COST_MODEL_VERSION
    from lrmoe.sim.hardware import get_hardware
    from lrmoe.sim.scenarios import MODELS, budget_bytes_for

    sc = _scenario(family)
    methods = {pl: m for pl in runs if (m := paper_method(pl)) is not None}
    traces = {pl: _paper_trace(r, sc) for pl, r in runs.items() if (r.dir / TRACE).exists()}
    if not traces:
        return {}
    budget = max(budget_bytes_for(sc, t.counts) for t in traces.values())
    hw = get_hardware(HARDWARE)
    cache = res.dir.joinpath(*CACHE_DIR)
    out = {}
    for pl, tr in traces.items():
        if pl not in methods:
            continue
        key = hashlib.sha256(tr.counts.tobytes()).hexdigest()
        settings = {"trace_sha256": key, "scenario": sc.name, "hardware": HARDWARE, "budget_bytes": budget,
                    "method": dataclasses.asdict(methods[pl]), "cost_model": COST_MODEL_VERSION}
        path = cache / f"{runs[pl].name}.json"
        old = read_json(path) if path.exists() else None
        if old is not None and old.get("settings") == settings:
            out[pl] = old
            continue
        if say:
            say(f"T3: simulating {runs[pl].name} at paper scale ({tr.steps} micro-batches x {tr.layers} layers)")
        sim = simulated_step_seconds(methods[pl], tr.counts, sc.cluster(), sc.dims(), hw, budget)
        ga = int(runs[pl].config.get("grad_accum") or 1)

        def per_step(key):  # the paper model's depth; an optimizer step's micro-batches summed
            per_micro = np.asarray(sim[key]) * MODELS[sc.model][4] / tr.layers
            return (per_micro.reshape(-1, ga).sum(1) if per_micro.size % ga == 0 else per_micro).tolist()

        entry = {"settings": settings, "step_s": per_step("step_s"), "step_s_no_planning": per_step("step_s_no_planning"),
                 "planning_s_per_plan": sim["planning_s_per_plan"], "layout_s_per_plan": sim["layout_s_per_plan"],
                 "oom_plans": sim["oom_plans"], "plans": sim["plans"], "trace_layers": tr.layers,
                 "paper_layers": MODELS[sc.model][4], "tokens_per_rank": sc.tokens_per_rank, "simulated": True}
        cache.mkdir(parents=True, exist_ok=True)
        write_json(path, entry)
        out[pl] = entry
    return out


# ----------------------------------------------------------------------------- data
KINDS = ("measured", "simulated", "simulated_no_planning")


def seed_data(res: Results, family: str, runs: dict[str, Run], say=None) -> dict | None:
    """One seed of a family (placement -> run): its targets (from its own fixed-ownership run), and
    per method the curve, steps and the three times to each target, and the reductions against the
    same seed's SYMI run. None without a fixed-ownership run."""
    c0 = runs.get("fixed")
    if c0 is None:
        return None
    sims = simulate_family(res, family, runs, say)
    win = window_of(len(c0.rows))
    tgs = targets(smoothed([r.get("loss") for r in c0.rows], win))
    methods = {}
    for pl in [p for p in METHOD_ORDER if p in runs] + sorted(set(runs) - set(METHOD_ORDER)):
        r = runs[pl]
        curve = smoothed([row.get("loss") for row in r.rows], win)
        measured = np.cumsum([row.get("moe_fwd_s", 0.0) + row.get("moe_bwd_s", 0.0) for row in r.rows]).tolist()
        sim = sims.get(pl)
        cum = {"measured": measured}
        for kind, key in (("simulated", "step_s"), ("simulated_no_planning", "step_s_no_planning")):
            ok = sim and len(sim.get(key, ())) == len(curve)
            cum[kind] = np.cumsum(sim[key]).tolist() if ok else None
        reach = []
        for t in tgs:
            i = first_reach(curve, t)
            reach.append({"step": None if i is None else i + 1,
                          **{f"{k}_s": None if i is None or v is None else v[i] for k, v in cum.items()}})
        methods[pl] = {"run": r.name, "curve": curve, "measured_cum_s": measured, "simulated_cum_s": cum["simulated"],
                       "simulated_no_planning_cum_s": cum["simulated_no_planning"], "reach": reach,
                       "measured_on": measured_where(r)}
    symi = methods.get("symi")
    for pl, m in methods.items():
        for j, rc in enumerate(m["reach"]):
            for kind in KINDS:
                v, bound = reduction(m, symi, j, kind) if symi else (None, False)
                rc[f"{kind}_vs_symi_pct"] = None if bound else v
                rc[f"{kind}_vs_symi_pct_at_least"] = v if bound else None
    return {"seed": c0.seed, "steps": len(c0.rows), "window": win, "targets": tgs, "methods": methods}


def reduction(m: dict, base: dict, j: int, kind: str) -> tuple[float | None, bool]:
    """How much less ``kind`` time method ``m`` needs than ``base`` to target ``j`` (both one seed's
    :func:`seed_data` entries), in %: ``(100 (1 − t_m / t_base), False)`` when both reach it;
    ``(100 (1 − t_m / base's whole run), True)``, a lower bound, when only ``m`` does (the baseline
    needs more than its whole run: censored); ``(None, False)`` when ``m`` never reaches it (or has
    no time of this kind)."""
    a = m["reach"][j].get(f"{kind}_s")
    if a is None:
        return None, False
    b = base["reach"][j].get(f"{kind}_s")
    if b is not None:
        return (100 * (1 - a / b), False) if b else (None, False)
    total = (base.get(f"{kind}_cum_s") or [None])[-1]
    if base["reach"][j]["step"] is None and total:
        return 100 * (1 - a / total), True
    return None, False


def summarise(seeds: list[dict]) -> dict[str, list[dict]]:
    """placement -> per target, over the seeds (each paired with its own C0 targets and SYMI run):
    ``n`` seeds with the method, ``reached`` of them; the steps and each kind's time to the target
    over the seeds that reached it, and the reduction against SYMI over the seeds where both have a
    time (or SYMI a whole run: a lower bound, counted in ``<kind>_vs_symi_bounds``), each an
    :func:`lrmoe.stats.estimate` (mean, 95 % t interval from 2 seeds, n)."""
    order = []
    for sd in seeds:
        order += [pl for pl in sd["methods"] if pl not in order]
    out = {}
    for pl in order:
        cells = []
        for j in range(len(seeds[0]["targets"])):
            rcs = [sd["methods"][pl]["reach"][j] for sd in seeds if pl in sd["methods"]]
            hit = [rc for rc in rcs if rc["step"] is not None]
            cell = {"n": len(rcs), "reached": len(hit), "steps": estimate([rc["step"] for rc in hit]).to_dict(),
                    "steps_median": censored_median([rc["step"] for rc in rcs])[0]}
            for kind in KINDS:
                cell[f"{kind}_s"] = estimate([rc[f"{kind}_s"] for rc in hit if rc[f"{kind}_s"] is not None]).to_dict()
                # every seed counts: one that never reached the target is censored (ranked last), never dropped
                untimed = any(rc["step"] is not None and rc[f"{kind}_s"] is None for rc in rcs)
                cell[f"{kind}_median_s"] = None if untimed else censored_median(
                    [None if rc["step"] is None else rc[f"{kind}_s"] for rc in rcs])[0]
                cell[f"{kind}_untimed"] = untimed
                exact = [rc[f"{kind}_vs_symi_pct"] for rc in rcs if rc[f"{kind}_vs_symi_pct"] is not None]
                bounds = [rc[f"{kind}_vs_symi_pct_at_least"] for rc in rcs
                          if rc.get(f"{kind}_vs_symi_pct_at_least") is not None]
                cell[f"{kind}_vs_symi_pct"] = estimate(exact + bounds).to_dict()
                cell[f"{kind}_vs_symi_bounds"] = len(bounds)
            cells.append(cell)
        out[pl] = cells
    return out


def t3_data(res: Results, say=None) -> list[dict]:
    """Per family: per seed its targets, and per method the curve, steps and both times to each
    target (:func:`seed_data`); over the seeds, :func:`summarise`."""
    out = []
    for family, by_seed in e3_runs(res).items():
        seeds = [sd for seed in sorted(by_seed) if (sd := seed_data(res, family, by_seed[seed], say)) is not None]
        if not seeds:
            continue
        c0 = by_seed[seeds[0]["seed"]]["fixed"]
        where = sorted({m["measured_on"] for sd in seeds for m in sd["methods"].values()})
        out.append({"family": family, "model": c0.config.get("model"), "overrides": c0.config.get("model_overrides"),
                    "virtual_ep": c0.config.get("virtual_ep"), "ep": c0.config.get("ep"),
                    "torchrun": int(c0.config.get("ep") or 1) > 1, "measured_on": where,
                    "seeds": seeds, "summary": summarise(seeds), "fractions": list(TARGET_FRACTIONS),
                    "scenario": SCENARIO_OF[family], "hardware_model": HARDWARE})
    for fam in out:
        fam["lrmoe_vs"] = lrmoe_against(fam)
        fam["steps_vs_lrmoe"] = steps_vs_lrmoe(fam)
    _holm(out)
    return out


def lrmoe_against(fam: dict) -> list[dict]:
    """LRMoE's paired reduction against every other method of the family (:data:`BASELINES` order),
    per target and time kind: per seed :func:`reduction` against the same seed's run of the baseline,
    then :func:`lrmoe.stats.estimate` over the seeds (``<kind>_pct``). Censoring as for the "vs SYMI"
    columns: a seed whose baseline never reaches the target enters as a lower bound (counted in
    ``<kind>_bounds``: the mean is then a lower bound, no test); a seed where LRMoE never reaches it
    is counted in ``<kind>_lrmoe_not_reached`` and has no value. ``<kind>_per_seed`` lists every
    paired seed: ``{"seed", "pct", "lower_bound"}``."""
    seeds = [sd for sd in fam["seeds"] if "lrmoe" in sd["methods"]]
    present = [b for b in BASELINES if any(b in sd["methods"] for sd in seeds)]
    present += sorted({b for sd in seeds for b in sd["methods"]} - set(present) - {"lrmoe"})
    out = []
    for j, frac in enumerate(fam["fractions"]):
        for b in present:
            pairs = [sd for sd in seeds if b in sd["methods"]]
            cell = {"fraction": frac, "baseline": b, "n": len(pairs)}
            for kind in KINDS:
                per_seed = []
                for sd in pairs:
                    v, bound = reduction(sd["methods"]["lrmoe"], sd["methods"][b], j, kind)
                    per_seed.append({"seed": sd["seed"], "pct": v, "lower_bound": bound})
                cell[f"{kind}_pct"] = estimate([x["pct"] for x in per_seed if x["pct"] is not None]).to_dict()
                cell[f"{kind}_bounds"] = sum(x["lower_bound"] for x in per_seed)
                cell[f"{kind}_lrmoe_not_reached"] = sum(sd["methods"]["lrmoe"]["reach"][j]["step"] is None for sd in pairs)
                cell[f"{kind}_per_seed"] = per_seed
            out.append(cell)
    return out


def _holm(data: list[dict]) -> None:
    """Holm's correction across the table's comparisons, one family of tests per time column (kind):
    every exact paired reduction (no lower bound) of a method against SYMI (the main table's "vs SYMI"
    columns) and of LRMoE against each baseline (:func:`lrmoe_against`) gets ``p_holm`` beside its
    t-test ``p``; LRMoE against SYMI, in both, is one comparison."""
    for kind in KINDS:
        ests = [c[f"{kind}_vs_symi_pct"] for fam in data for pl, cells in fam["summary"].items()
                if pl not in ("symi", "lrmoe") for c in cells if not c[f"{kind}_vs_symi_bounds"]]
        ests += [c[f"{kind}_pct"] for fam in data for c in fam["lrmoe_vs"] if not c[f"{kind}_bounds"]]
        for e, q in zip(ests, holm(e.get("p") for e in ests)):
            e["p_holm"] = q
            e["resolved_holm"] = q is not None and q < 0.05 and e["resolved"]
        for fam in data:  # the main table's LRMoE "vs SYMI" cells: the same comparison, the same estimate
            for c in fam["lrmoe_vs"]:
                if c["baseline"] == "symi" and "lrmoe" in fam["summary"]:
                    mine = fam["summary"]["lrmoe"][fam["fractions"].index(c["fraction"])]
                    assert sorted(mine[f"{kind}_vs_symi_pct"]["values"]) == sorted(c[f"{kind}_pct"]["values"])
                    mine[f"{kind}_vs_symi_pct"] = c[f"{kind}_pct"]


def steps_vs_lrmoe(fam: dict) -> list[dict]:
    """Whether SYMI needs fewer steps than LRMoE (the paper: 8,440 against 8,693 to loss 0.02): per
    target and SYMI variant, per seed the steps of both to the same target (a seed that never
    reaches it counts as more steps than any that does), and over the seeds how many had SYMI
    fewer / as many / more, with both censored medians."""
    out = []
    for j, frac in enumerate(fam["fractions"]):
        for v in [v for v in SYMI_VARIANTS if any(v in sd["methods"] for sd in fam["seeds"])]:
            pairs = [(sd["methods"][v]["reach"][j]["step"], sd["methods"]["lrmoe"]["reach"][j]["step"])
                     for sd in fam["seeds"] if v in sd["methods"] and "lrmoe" in sd["methods"]]
            if not pairs:
                continue
            inf = math.inf
            s = [(inf if a is None else a, inf if b is None else b) for a, b in pairs]
            out.append({"fraction": frac, "symi": v, "n": len(s), "symi_fewer": sum(a < b for a, b in s),
                        "equal": sum(a == b for a, b in s), "symi_more": sum(a > b for a, b in s),
                        "symi_median": censored_median([a for a, _ in pairs])[0],
                        "lrmoe_median": censored_median([b for _, b in pairs])[0]})
    return out


def _steps_table(data: list[dict]) -> list[str]:
    head = ["Model family", "Target (C0 at % of run)", "SYMI variant", "SYMI steps (median)", "LRMoE steps (median)",
            "seeds: SYMI fewer / equal / more"]
    rows = []
    for fam in data:
        for c in fam["steps_vs_lrmoe"]:
            med = [("not reached" if x is None else f"{x:.0f}") for x in (c["symi_median"], c["lrmoe_median"])]
            rows.append([FAMILY_NAMES.get(fam["family"], fam["family"]), f"{100 * c['fraction']:.0f} %",
                         METHOD_NAMES.get(c["symi"], c["symi"]), *med,
                         f"{c['symi_fewer']} / {c['equal']} / {c['symi_more']} of {c['n']}"])
    if not rows:
        return []
    said = []
    for fam in data:
        late = [c for c in fam["steps_vs_lrmoe"] if c["fraction"] == TARGET_FRACTIONS[-1]]
        fewer = [METHOD_NAMES[c["symi"]] for c in late if c["symi_fewer"] > c["symi_more"]]
        name = FAMILY_NAMES.get(fam["family"], fam["family"])
        said.append(f"{name}: SYMI needs fewer steps than LRMoE in more seeds than not for {', '.join(fewer)}" if fewer
                    else f"{name}: no SYMI variant needs fewer steps than LRMoE in more seeds than not")
    verdict = f"At the late target ({100 * TARGET_FRACTIONS[-1]:.0f} %): " + "; ".join(said) + "."
    return ["**Steps to each target: SYMI against LRMoE** (the paper: SYMI 8,440 steps, LRMoE 8,693 to loss 0.02 — "
            "SYMI fewer). Per seed, paired on the same targets; a seed that never reaches a target counts as more "
            "steps than any that does.", "", md_table(head, rows), "", verdict, ""]


# ----------------------------------------------------------------------------- T3
def _median(cell: dict, key: str, fmt: str, scale: float = 1.0) -> str:
    """The median over every seed, a seed that never reached the target censored (ranked last), and
    how many reached it when not all did (lrmoe.stats.censored_median)."""
    reached = f"reached {cell['reached']}/{cell['n']}"
    if not cell["reached"]:
        return f"not reached (0/{cell['n']})"
    if key != "steps_median" and cell.get(key.replace("_median_s", "_untimed")):
        return "—"  # reached, but this kind has no time (a run without a trace: nothing simulated)
    v = cell[key]
    if v is None:
        return f"median not reached ({reached})"
    v = format(v / scale, fmt)
    return v if cell["reached"] == cell["n"] else f"{v} ({reached})"


def _vs(cell: dict, kind: str, pl: str) -> str:
    """The reduction against SYMI over the seeds: mean [95 % interval], a lower bound where SYMI
    never reached the target in some seed ("> x"), or why there is none."""
    if pl == "symi":
        return "—"
    e, bounds = cell[f"{kind}_vs_symi_pct"], cell[f"{kind}_vs_symi_bounds"]
    if not e["n"]:
        return "not reached"
    notes = [] if not bounds else ["SYMI not reached" + (f" in {bounds}/{e['n']}" if e["n"] > 1 else "")]
    if e["n"] < cell["n"]:
        notes.append(f"{e['n']}/{cell['n']} seeds")
    note = f" ({'; '.join(notes)})" if notes else ""
    if bounds:
        return f"> {e['mean']:+.1f}{note}"
    ci = f" [{e['lo']:+.1f}, {e['hi']:+.1f}]" if e["lo"] is not None else ""
    holm_p = f"; Holm p {fmt_p(e['p_holm'])}" if e.get("p_holm") is not None else ""
    return f"{e['mean']:+.1f}{ci}{note}{holm_p}"


KIND_NAMES = {"simulated": "(b) simulated", "simulated_no_planning": "(b) without planning", "measured": "(a) measured"}


def _against(c: dict, kind: str) -> str:
    """One cell of the LRMoE-against-each-baseline table: the mean reduction [95 % interval] with its
    Holm p, or a lower bound ("> x") where the baseline never reached the target in some seed, with
    the seeds that are censored counted."""
    e, bounds, miss = c[f"{kind}_pct"], c[f"{kind}_bounds"], c[f"{kind}_lrmoe_not_reached"]
    notes = ([f"baseline not reached in {bounds}/{e['n']}"] if bounds else []) + (
        [f"LRMoE not reached in {miss}/{c['n']}"] if miss else [])
    note = f" ({'; '.join(notes)})" if notes else ""
    if not e["n"]:
        return f"no value{note}" if notes else "—"
    if bounds:
        return f"> {e['mean']:+.1f}{note}"
    ci = f" [{e['lo']:+.1f}, {e['hi']:+.1f}]" if e["lo"] is not None else ""
    holm_p = f"; Holm p {fmt_p(e['p_holm'])}" if e.get("p_holm") is not None else ""
    return f"{e['mean']:+.1f}{ci}{note}{holm_p}"


def against_summary(fam: dict, kind: str = "simulated") -> dict[str, dict]:
    """baseline -> what the LRMoE-against-baseline comparisons of one family say in one time column:
    ``tested`` (comparisons with a Holm p), ``faster`` / ``slower`` (LRMoE resolved faster / slower
    after Holm), ``exact`` (per-seed values where both reached the target), ``bounds`` (seed-targets
    where only LRMoE did: lower bounds) and ``lrmoe_not_reached`` (seed-targets where LRMoE did not)."""
    out: dict[str, dict] = {}
    for c in fam["lrmoe_vs"]:
        e = c[f"{kind}_pct"]
        o = out.setdefault(c["baseline"], {"tested": 0, "faster": 0, "slower": 0, "exact": [], "bounds": 0,
                                           "lrmoe_not_reached": 0})
        o["exact"] += [x["pct"] for x in c[f"{kind}_per_seed"] if x["pct"] is not None and not x["lower_bound"]]
        o["bounds"] += c[f"{kind}_bounds"]
        o["lrmoe_not_reached"] += c[f"{kind}_lrmoe_not_reached"]
        if e.get("p_holm") is not None:
            o["tested"] += 1
            o["faster"] += bool(e["resolved_holm"]) and e["mean"] > 0
            o["slower"] += bool(e["resolved_holm"]) and e["mean"] < 0
    return out


def _against_table(data: list[dict]) -> tuple[list[str], list[str], list[list[str]]]:
    """The LRMoE-against-each-baseline table: (Markdown lines, header, rows)."""
    bases = list(dict.fromkeys(c["baseline"] for fam in data for c in fam["lrmoe_vs"]))
    if not bases:
        return [], [], []
    head = ["Model family", "Target (C0 at % of run)", "Time", *[f"vs {METHOD_NAMES.get(b, b)} %" for b in bases]]
    rows = []
    for fam in data:
        cells = {(c["fraction"], c["baseline"]): c for c in fam["lrmoe_vs"]}
        for frac in fam["fractions"]:
            for kind in ("simulated", "simulated_no_planning", "measured"):
                rows.append([FAMILY_NAMES.get(fam["family"], fam["family"]), f"{100 * frac:.0f} %", KIND_NAMES[kind],
                             *[_against(cells[frac, b], kind) if (frac, b) in cells else "—" for b in bases]])
    said = []
    for fam in data:
        name = FAMILY_NAMES.get(fam["family"], fam["family"])
        parts = []
        for b, o in against_summary(fam).items():
            rng = (f"{min(o['exact']):+.1f} to {max(o['exact']):+.1f} % in the {len(o['exact'])} seed-targets both "
                   f"reach" if o["exact"] else "no seed-target both reach")
            parts.append(f"vs {METHOD_NAMES.get(b, b)}: {rng}; resolved after Holm faster in {o['faster']}, slower in "
                         f"{o['slower']} of {o['tested']} tested targets")
        said.append(f"- {name}: " + "; ".join(parts) + ".")
    md = ["**LRMoE against each baseline**: per seed 100 × (1 − LRMoE's time / the baseline's time) to the same "
          "target, against the same seed's run of the baseline (positive: LRMoE needs less time); over the seeds its "
          "mean and 95 % t interval and the t test's p after Holm's correction (the same family of tests per time "
          "column as the \"vs SYMI\" columns above; LRMoE against SYMI 1.0 is one comparison in both). A baseline "
          "that never reaches a target in a seed gives a lower bound from its whole run (\"> x\", no test); a seed "
          "where LRMoE never reaches it has no value and is counted.", "", md_table(head, rows), "",
          "In simulated time (with planning), per seed:", *said, ""]
    return md, head, rows


def _measured_line(fam: dict) -> str:
    where = "; ".join(fam["measured_on"])
    if fam["torchrun"]:
        return (f"*(a) measured, {fam['ep']} × GPU*: cumulative `moe_fwd_s + moe_bwd_s` of the torchrun EP run "
                f"({where}): per step the slowest rank's time inside the MoE layers (CUDA events).  ")
    return (f"*(a) measured*: cumulative `moe_fwd_s + moe_bwd_s` of the run ({where}): one CPU process executing "
            f"the experts of all {fam['virtual_ep']} virtual ranks; a single-process time, not a cluster's.  ")


def make_t3(res: Results, paper: dict, out: Path, say=None) -> list[Path] | None:
    data = t3_data(res, say)
    if not data:
        return None
    p = paper["T3"]
    head = ["Model family", "Target (C0 at % of run)", "Method", "Steps", "(a) measured, s", "(a) vs SYMI %",
            "(b) simulated, min", "(b) vs SYMI %", "(b) without planning, min", "vs SYMI %"]
    rows = []
    for fam in data:
        for j, frac in enumerate(fam["fractions"]):
            tgs = [sd["targets"][j] for sd in fam["seeds"]]
            tg = f"{tgs[0]:.4f}" if len(tgs) == 1 else f"{min(tgs):.4f}–{max(tgs):.4f}"
            for pl, cells in fam["summary"].items():
                c = cells[j]
                rows.append([FAMILY_NAMES.get(fam["family"], fam["family"]), f"{tg} ({100 * frac:.0f} %)",
                             METHOD_NAMES.get(pl, pl), _median(c, "steps_median", ".0f"),
                             _median(c, "measured_median_s", ".2f"),
                             _vs(c, "measured", pl), _median(c, "simulated_median_s", ".3f", 60),
                             _vs(c, "simulated", pl), _median(c, "simulated_no_planning_median_s", ".3f", 60),
                             _vs(c, "simulated_no_planning", pl)])
    q = p["qwen3_to_loss_0.02"]
    paper_line = (f"LRMoE needs {p['reduction_vs_symi_pct_range'][0]}–{p['reduction_vs_symi_pct_range'][1]} % less "
                  f"cumulative MoE-layer time than SYMI to fixed loss targets (Qwen3 "
                  f"{' / '.join(str(x) for x in p['reduction_vs_symi_pct']['qwen3'])} %, GLM "
                  f"{p['reduction_vs_symi_pct']['glm4']} %); Qwen3-30B-A3B to loss {q['loss_target']}: SYMI "
                  f"{q['SYMI']['minutes']} min over {q['SYMI']['steps']:,} steps, LRMoE {q['LRMoE']['minutes']} min over "
                  f"{q['LRMoE']['steps']:,} steps (8× Hopper, EP8)")
    against_md, against_head, against_rows = _against_table(data)
    first = data[0]
    models = "; ".join(f"{FAMILY_NAMES.get(d['family'], d['family'])}: `{d['model']}` with {d['overrides']}"
                       for d in data)
    seeds = sorted({sd["seed"] for d in data for sd in d["seeds"]})
    par = (f"EP{first['ep']} under torchrun (`lrmoe train --ep {first['ep']}`)" if first["torchrun"] else
           f"{first['virtual_ep']} virtual EP ranks in one process (`lrmoe train --virtual-ep`)")
    md = ["**T3. Time to a fixed loss target: steps and cumulative MoE-layer time per method**", "",
          f"*Trained* (this kit, E3): preset `{res.preset_name}`; {models}; {first['seeds'][0]['steps']} steps, "
          f"{par}, seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))}.  ",
          f"*Targets*: per seed, its fixed-ownership run's (C0: dropless, full backward) training loss at "
          f"{', '.join(f'{100 * f:.0f} %' for f in TARGET_FRACTIONS)} of its steps (the range over seeds is shown), "
          f"trailing mean over {first['seeds'][0]['window']} steps; a method reaches a target at the first step its "
          f"trailing mean is at or below it.  ",
          *[_measured_line(d) for d in data[:1] + [d for d in data[1:] if d["measured_on"] != first["measured_on"]]],
          f"*(b) simulated*: the run's own routing trace scaled to 32,768 tokens per rank, replayed through the "
          f"method's planner and the cost model on the `{HARDWARE}` hardware model with the paper's model "
          f"dimensions and EP8 cluster (scenarios `paper-qwen3` / `paper-glm`); per-step time of the run's MoE layers "
          f"× the paper model's MoE layers / the run's; with every plan charged the median host time of its planner "
          f"(measured here), and without.  ",
          f"*Over seeds* (lrmoe.stats, docs/statistics.md): every seed counts. Steps and times are medians over "
          f"all n seeds with a seed that never reached the target censored (ranked after every seed that did; "
          f"\"reached k/n\"; \"median not reached\" when the median falls on such a seed), never means over "
          f"the seeds that reached it. *vs SYMI* is 100 × (1 − time / SYMI's time) per seed against the same "
          f"seed's SYMI run (a paired difference), then its mean and 95 % Student t interval over the seeds "
          f"(uncorrected) and the t test's p after Holm's correction across this table's comparisons (with SYMI "
          f"here, and LRMoE's with each baseline below) of the same time column; where SYMI never reaches a target, that seed's value is a lower bound from "
          f"SYMI's whole run, and so is the mean (\"> x\"; no test).  ",
          f"*Paper*: {paper_line}.", "", md_table(head, rows), "",
          "What this can and cannot claim: the steps come from real training with each method's semantics (forward "
          "drops, backward quotas) at the preset's scale; the simulated minutes combine those steps with the run's "
          "routing replayed at the paper's scale, whose skew at a preset's few tokens per rank carries more sampling "
          "noise than the paper's 32,768. Only column (a) of the `paper` preset's torchrun runs is a cluster's "
          "measurement.", "", *against_md, *_steps_table(data)]
    write_json(out / "tables" / "T3_time_to_target.json", {"families": data, "paper": p})
    cap = f"T3: time to fixed loss targets per method. Trained: preset {res.preset_name}. Paper: {paper_line}."
    tex = tex_table(cap, "tab:t3", head, rows)
    if against_rows:
        tex += "\n" + tex_table("T3 (continued): LRMoE's time reduction against each baseline, % (mean [95 % t "
                                "interval] over seeds; Holm p).", "tab:t3-lrmoe", against_head, against_rows)
    return write_table(out, "T3_time_to_target", md, tex) + [
        out / "tables" / "T3_time_to_target.json"]


# ----------------------------------------------------------------------------- F4
def make_f4(res: Results, paper: dict, out: Path, say=None) -> list[Path] | None:
    """Per family, loss against cumulative MoE-layer time, (a) measured and (b) simulated: every
    seed's curve (the first seed drawn bold), each seed's C0 targets' mean marked."""
    data = t3_data(res, say)
    if not data:
        return None
    plt, sns = pyplot()
    fig, axes = plt.subplots(len(data), 2, figsize=(12, 4.0 * len(data)), squeeze=False)
    colors = dict(zip(METHOD_ORDER, sns.color_palette("deep", len(METHOD_ORDER))))
    for row, fam in zip(axes, data):
        for ax, kind, unit, scale in ((row[0], "measured_cum_s", "s", 1.0), (row[1], "simulated_cum_s", "s", 1.0)):
            for k, sd in enumerate(fam["seeds"]):
                for pl, m in sd["methods"].items():
                    if m[kind] is None:
                        continue
                    ax.plot(np.asarray(m[kind]) / scale, m["curve"], label=METHOD_NAMES.get(pl, pl) if k == 0 else None,
                            color=colors.get(pl), lw=1.4 if k == 0 else 0.8, alpha=1.0 if k == 0 else 0.45)
            placed = []  # labels of targets closer than 4 % of the axis to the last one share its line
            lo, hi = ax.get_ylim()
            for j, frac in enumerate(fam["fractions"]):
                tg = statistics.fmean(sd["targets"][j] for sd in fam["seeds"])
                ax.axhline(tg, color="0.4", ls="--", lw=0.8)
                if placed and abs(placed[-1][0] - tg) < 0.04 * (hi - lo):
                    placed[-1][1].append(f"{100 * frac:.0f}")
                else:
                    placed.append((tg, [f"{100 * frac:.0f}"]))
            for tg, fr in placed:
                ax.text(ax.get_xlim()[1], tg, f" {' / '.join(fr)} %", va="center", fontsize=7)
            name = FAMILY_NAMES.get(fam["family"], fam["family"])
            if kind == "measured_cum_s":
                what = (f"(a) measured, {fam['ep']} × GPU" if fam["torchrun"]
                        else f"(a) measured: 1 CPU process, {fam['virtual_ep']} virtual ranks")
            else:
                what = f"(b) simulated: {HARDWARE}, paper dims, trace scaled"
            n = len(fam["seeds"])
            ax.set_title(f"{name}\n{what}" + (f"\n{n} seeds, seed {fam['seeds'][0]['seed']} bold" if n > 1 else "")
                         + "; dashed: targets (fixed's loss at % of its run)", fontsize=8.5)
            ax.set_xlabel(f"cumulative MoE-layer time ({unit})")
            ax.set_ylabel(f"training loss (trailing mean, {fam['seeds'][0]['window']} steps)")
    handles = {}
    for ax in axes.ravel():
        handles.update(zip(*ax.get_legend_handles_labels()[::-1]))
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=len(handles), fontsize=8,
               bbox_to_anchor=(0.5, -0.02))
    fig.tight_layout(rect=(0, 0.04, 1, 1), w_pad=6.0)
    files = save_figure(fig, out, "F4_loss_vs_moe_time")
    plt.close(fig)
    return files
