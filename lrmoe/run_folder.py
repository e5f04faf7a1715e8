"""The files of one run folder, shared by training, the run machinery and the figure makers
(standard library only).

A run folder holds ``config.json`` (what the run is), ``metrics.jsonl`` (one JSON record per
logged step, appended), ``summary.json`` (status, config, environment, final numbers; rewritten
atomically), its checkpoints and ``.lrmoe.lock`` (held by the one process that trains it)."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

from .files import CorruptFileError, read_json, read_jsonl

SUMMARY, METRICS, LOCK = "summary.json", "metrics.jsonl", ".lrmoe.lock"

__all__ = ["CorruptFileError", "LOCK", "METRICS", "SUMMARY", "read_metrics", "read_summary", "run_folder_lock",
           "run_status"]


def read_summary(run_dir) -> dict | None:
    """The run's summary; None if it has none yet; :class:`CorruptFileError` (naming the file) if
    it exists but cannot be decoded or is not a JSON object."""
    path = Path(run_dir) / SUMMARY
    s = read_json(path)
    if s is not None and not isinstance(s, dict):
        raise CorruptFileError(f"{path}: expected a JSON object, got {type(s).__name__}")
    return s


def run_status(run_dir) -> str | None:
    """"done", "running", ... or None (no summary) for a run folder; raises on a corrupt summary."""
    s = read_summary(run_dir)
    return s.get("status") if s else None


def read_metrics(path) -> list[dict]:
    """The per-step records of a metrics file (a run folder or the file itself); only a torn last
    line is dropped, any other bad line raises naming it (:func:`lrmoe.files.read_jsonl`)."""
    path = Path(path)
    return read_jsonl(path / METRICS if path.is_dir() else path)


@contextlib.contextmanager
def run_folder_lock(run_dir, enabled: bool = True):
    """One training process per run folder: a second one (e.g. a second `lrmoe reproduce` while the
    first one's workers still train) stops with a ValueError instead of training the same run.
    ``enabled=False`` (non-main ranks) and non-POSIX systems take no lock."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock
        fcntl = None
    if not enabled or fcntl is None:
        yield
        return
    run_dir = Path(run_dir)
    fh = open(run_dir / LOCK, "a+")
    try:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            raise ValueError(f"{run_dir} is being trained by another process (pid {fh.read().strip() or '?'}); "
                             "wait for it to finish or stop it, then rerun to resume") from None
        fh.seek(0)
        fh.truncate()
        fh.write(str(os.getpid()))
        fh.flush()
        yield
    finally:
        fh.close()  # releases the lock
