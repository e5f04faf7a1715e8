"""`lrmoe reproduce --preset smoke|cpu|gpu1|paper`: run every experiment of a preset, then the figures.

A preset (:mod:`~lrmoe.reproduce.presets`) selects models, data, steps and hardware assumptions;
its experiment list (:mod:`~lrmoe.reproduce.experiments`: E1 convergence, E2 scorer ablation) is
a list of :class:`~lrmoe.runs.RunSpec`, each with a stable run name. Results go to
``<out>/<run_name>/`` (default ``results/<preset>/``): ``metrics.jsonl``, ``summary.json``,
``checkpoint.pt`` per run, plus ``manifest.json`` (the preset and its runs) and
``reproduce.json`` (wall time of the last call and in total). A run whose ``summary.json`` says
``done`` is skipped, so a killed ``reproduce`` resumes (an unfinished run continues from its
checkpoint); a finished run of another config (a changed preset or ``--data``) or a run folder
whose summary cannot be read is refused, not reused (exit status 2, the differences listed).
Then ``lrmoe figures`` writes the tables and figures into ``<out>/tables`` and ``<out>/figures``.

A torchrun preset (``paper``: 8 processes, ``--ep 8``) is launched one ``torchrun`` per run: from
a shell, ``reproduce`` prints the command of every pending run and runs them when the machine has
the GPUs (status 2 otherwise); under torchrun, the ranks train the runs in-process.

The machinery (run folders, staleness, the worker pool, Ctrl-C/SIGTERM, resume) is
:mod:`lrmoe.runs` (meant to serve the coming `lrmoe ablate` too); :mod:`~lrmoe.reproduce.driver` is what is
specific to the paper's presets.
"""
from lrmoe.runs import RunSpec, torchrun_command, train_flags

from .cli import register_cli
from .driver import plan, reproduce
from .experiments import DROPS_E1, FAMILIES, SCORERS_E2
from .presets import PRESETS, Preset, resolve_data

__all__ = ["DROPS_E1", "FAMILIES", "PRESETS", "Preset", "RunSpec", "SCORERS_E2", "plan", "register_cli", "reproduce",
           "resolve_data", "torchrun_command", "train_flags"]
