"""One training run of a preset or an ablation grid: a stable name, tags, the full config."""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path

from lrmoe.run_folder import TRACE
from lrmoe.train import TrainConfig


@dataclass(frozen=True)
class RunSpec:
    """One training run: ``name`` is its folder under the results folder (stable across calls, so a
    rerun finds it), ``family`` and ``experiments`` tag it for the tables, ``config`` holds every
    :class:`~lrmoe.train.TrainConfig` field the run trains with. ``record_trace``: the run writes
    its routing trace to :data:`lrmoe.run_folder.TRACE` in its folder (``--record-trace``; an expert-parallel
    run only; a virtual-EP run writes it there anyway)."""

    name: str
    family: str
    experiments: tuple
    config: dict
    record_trace: bool = False

    def train_config(self, run_dir=None) -> TrainConfig:
        """The run's config; with ``run_dir`` and :attr:`record_trace`, recording to the folder's trace."""
        cfg = TrainConfig.from_dict(self.config)
        if self.record_trace and run_dir is not None:
            cfg = dataclasses.replace(cfg, record_trace=str(Path(run_dir) / TRACE))
        return cfg


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
