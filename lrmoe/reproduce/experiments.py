"""The paper's experiments as lists of runs (paper.md):

  E1 convergence: drop 0 / 0.1 / 0.2 / 0.3 (C0-C30), LRM scorer, waterfill quotas -> T1, F2, F1.
  E2 scorer ablation at C20: lrm, grad_norm, abs_grad, random, on both families, several seeds,
     each seed paired with its own C0 run -> T2.

Runs shared by both (C0 and C20-lrm of seed 0) run once, tagged with both experiments."""
from __future__ import annotations

import dataclasses

from lrmoe.runs import RunSpec

DROPS_E1 = (0.0, 0.1, 0.2, 0.3)
SCORERS_E2 = ("lrm", "grad_norm", "abs_grad", "random")
FAMILIES = ("qwen3", "glm4")


def run_name(family: str, drop: float, scorer: str, seed: int) -> str:
    """``qwen3-C00-s0``, ``glm4-C20-grad_norm-s1``: stable, so a rerun finds its folder."""
    return f"{family}-C{round(drop * 100):02d}" + (f"-{scorer}" if drop > 0 else "") + f"-s{seed}"


def preset_runs(p) -> list[RunSpec]:
    """Every run of preset ``p`` (a :class:`~lrmoe.reproduce.presets.Preset`): E1 then E2, per family."""
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
    return list(specs.values())
