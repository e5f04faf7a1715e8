"""The paper's experiments as lists of runs (paper.md):

  E1 convergence: drop 0 / 0.1 / 0.2 / 0.3 (C0-C30), LRM scorer, waterfill quotas -> T1, F2, F1.
  E2 scorer ablation at C20: lrm, grad_norm, abs_grad, random, on both families, several seeds,
     each seed paired with its own C0 run -> T2.
  E3 time to target: every method (fixed ownership and UltraEP dropless, SYMI at capacity factor
     1.0 as in its paper, at 1.25 and dropless, LRMoE at C20) trained with its expert-parallel semantics (``virtual_ep`` ranks in one
     process, or ``ep`` ranks under torchrun), on models with the paper's 128 experts and top-8
     routing; each run records its routing trace -> T3, F4 (paper_figures.time_to_target).

Runs shared by both (C0 and C20-lrm of seed 0) run once, tagged with both experiments; so does an
E3 run whose config is an E1/E2 run's (the ``paper`` preset's LRMoE at C20, whose E1/E2 runs
already use the LRMoE placement at EP8: that run records its trace and is tagged E3)."""
from __future__ import annotations

import dataclasses

from lrmoe.runs import RunSpec
from lrmoe.train.config import config_differences

DROPS_E1 = (0.0, 0.1, 0.2, 0.3)
SCORERS_E2 = ("lrm", "grad_norm", "abs_grad", "random")
#: E3's methods: (name, placement, drop ratio, placement options). SYMI at its own setting (capacity
#: factor 1.0, which drops the pairs over capacity in forward) and, so that T3 does not compare LRMoE
#: with a crippled SYMI only, at 1.25 and dropless (``capacity_factor`` None); the other baselines are
#: dropless. The names match paper_figures.time_to_target.method_of.
METHODS_E3 = (("fixed", "fixed", 0.0, {}), ("symi", "symi", 0.0, {}),
              ("symi-cf125", "symi", 0.0, {"capacity_factor": 1.25}),
              ("symi-dropless", "symi", 0.0, {"capacity_factor": None}),
              ("ultraep", "ultraep", 0.0, {}), ("lrmoe", "lrmoe", 0.2, {}))
FAMILIES = ("qwen3", "glm4")


def run_name(family: str, drop: float, scorer: str, seed: int) -> str:
    """``qwen3-C00-s0``, ``glm4-C20-grad_norm-s1``: stable, so a rerun finds its folder."""
    return f"{family}-C{round(drop * 100):02d}" + (f"-{scorer}" if drop > 0 else "") + f"-s{seed}"


def e3_run_name(family: str, method: str, seed: int) -> str:
    """``qwen3-E3-symi-s0``, ``glm4-E3-symi-dropless-s1`` (a :data:`METHODS_E3` name)."""
    return f"{family}-E3-{method}-s{seed}"


def e3_runs(p) -> list[RunSpec]:
    """E3's runs of preset ``p`` (none when ``p.e3`` is empty): per family and seed, one run per
    method of :data:`METHODS_E3`, with ``p.e3``'s settings (``seeds``, ``model_overrides`` per
    family, ``config``: further TrainConfig fields such as ``virtual_ep`` or ``steps``,
    ``record_trace``: an expert-parallel (``ep``) run records its routing trace in its folder; a
    virtual-EP run does anyway)."""
    e3 = dict(p.e3 or {})
    if not e3:
        return []
    out = []
    for fam in p.families:
        for seed in e3.get("seeds", (0,)):
            for method, placement, drop, options in METHODS_E3:
                cfg = dict(p.base, model=p.models[fam], drop_ratio=drop, scorer="lrm", seed=seed, placement=placement,
                           model_overrides=dict(e3.get("model_overrides", {}).get(fam, {})),
                           **p.family_config.get(fam, {}), **e3.get("config", {}))
                if options:
                    cfg["ep_options"] = {**cfg.get("ep_options", {}), **options}
                out.append(RunSpec(e3_run_name(fam, method, seed), fam, ("E3",), cfg,
                                   record_trace=bool(e3.get("record_trace"))))
    return out


def preset_runs(p) -> list[RunSpec]:
    """Every run of preset ``p`` (a :class:`~lrmoe.reproduce.presets.Preset`): E1 then E2, per family, then E3."""
    specs: dict[str, RunSpec] = {}

    def add(family, drop, scorer, seed, exp):
        name = run_name(family, drop, scorer, seed)
        if name in specs:
            old = specs[name]
            specs[name] = dataclasses.replace(old, experiments=tuple(sorted({*old.experiments, exp})))
            return
        cfg = dict(p.base, model=p.models[family], drop_ratio=drop, scorer=scorer if drop > 0 else "lrm",
                   seed=seed, model_overrides=dict(p.model_overrides.get(family, {})),
                   **p.family_config.get(family, {}))
        specs[name] = RunSpec(name, family, (exp,), cfg)

    for fam in p.families:
        for seed in p.e1_seeds:
            for d in p.e1_drops:
                add(fam, d, "lrm", seed, "E1")
        for seed in p.e2_seeds:
            add(fam, 0.0, "lrm", seed, "E2")
            for sc in p.e2_scorers:
                add(fam, p.e2_drop, sc, seed, "E2")
    runs = list(specs.values())
    for e in e3_runs(p):  # an E3 run that trains exactly an E1/E2 run's config is that run, tagged E3 too
        same = next((i for i, r in enumerate(runs) if not config_differences(r.config, e.config)), None)
        if same is None:
            runs.append(e)
        else:
            r = runs[same]
            runs[same] = dataclasses.replace(r, experiments=tuple(sorted({*r.experiments, "E3"})),
                                             record_trace=r.record_trace or e.record_trace)
    return runs
