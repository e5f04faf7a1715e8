"""The run machinery of `lrmoe reproduce` (and of the coming `lrmoe ablate`): a list of runs in, trained
run folders out, and nothing lost when it is stopped.

- :mod:`~lrmoe.runs.spec`: :class:`RunSpec` (a stable name, tags, the full training config) and
  the ``lrmoe train`` command that rebuilds a config;
- :mod:`~lrmoe.runs.folders`: what is already in the results folder (finished, unfinished, a run of
  another config, an unreadable summary), the manifest and the per-call record (wall time);
- :mod:`~lrmoe.runs.pool`: training the pending runs one after another or in a process pool; Ctrl-C
  or SIGTERM lets every worker checkpoint at its step, and a rerun resumes;
- :mod:`~lrmoe.runs.torchrun`: one ``torchrun`` launch per run (expert-parallel presets).

Every run trains in its own folder (``<out>/<name>/``) under the folder's lock
(:func:`lrmoe.run_folder.run_folder_lock`, taken by training), so two callers never train the
same run."""
from .folders import Survey, record_call, survey, write_manifest
from .pool import STOP_GRACE_S, Outcome, prepare_data, run_all, train_one
from .spec import RunSpec, UsageError, select
from .torchrun import launch_each, missing_hardware, torchrun_command, train_flags

__all__ = ["STOP_GRACE_S", "Outcome", "RunSpec", "Survey", "UsageError", "launch_each", "missing_hardware", "prepare_data",
           "record_call", "run_all", "select", "survey", "torchrun_command", "train_flags",
           "train_one", "write_manifest"]
