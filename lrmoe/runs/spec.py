"""One training run of a preset or an ablation grid: a stable name, tags, the full config."""
from __future__ import annotations

import re
from dataclasses import dataclass

from lrmoe.train import TrainConfig


@dataclass(frozen=True)
class RunSpec:
    """One training run: ``name`` is its folder under the results folder (stable across calls, so a
    rerun finds it), ``family`` and ``experiments`` tag it for the tables, ``config`` holds every
    :class:`~lrmoe.train.TrainConfig` field the run trains with."""

    name: str
    family: str
    experiments: tuple
    config: dict

    def train_config(self) -> TrainConfig:
        return TrainConfig.from_dict(self.config)


def select(runs: list[RunSpec], pattern: str | None) -> list[RunSpec]:
    """The runs whose name matches the regular expression ``pattern`` (all of them when None)."""
    if not pattern:
        return list(runs)
    rx = re.compile(pattern)
    return [r for r in runs if rx.search(r.name)]
