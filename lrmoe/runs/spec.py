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


class UsageError(ValueError):
    """A bad argument of a command of the run machinery (``lrmoe reproduce``, ...): the message says
    what was wrong and what is accepted, and the command prints it as one line (exit status 2)."""


def select(runs: list[RunSpec], pattern: str | None) -> list[RunSpec]:
    """The runs whose name matches the regular expression ``pattern`` (all of them when None).
    A pattern that is not a regular expression, or that matches none of ``runs``, is a
    :class:`UsageError` (the second lists the names there are)."""
    if not pattern:
        return list(runs)
    try:
        rx = re.compile(pattern)
    except re.error as e:
        raise UsageError(f"--only {pattern!r} is not a regular expression ({e}); give one over the run names, "
                         f"e.g. 'qwen3-C20' or 'C[0-9]+-lrm-s0'") from None
    chosen = [r for r in runs if rx.search(r.name)]
    if not chosen and runs:
        raise UsageError(f"--only {pattern!r} matches none of the {len(runs)} runs; they are: "
                         + ", ".join(r.name for r in runs))
    return chosen
