"""The files of one run folder, shared by training, the run machinery and the figure makers
(standard library only).

A run folder holds ``metrics.jsonl`` (one JSON record per logged step, appended),
``summary.json`` (status, config, environment, final numbers; rewritten atomically), its
checkpoints and ``.lrmoe.lock`` (held by the one process that trains it).

:func:`run_state` is the one place that decides what a run folder holds (new, running,
interrupted, done or damaged, and why): ``lrmoe reproduce`` (its dry run too) and every table
and figure maker read it, so they never disagree about a run."""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

from .files import CorruptFileError, read_json, read_jsonl

SUMMARY, METRICS, LOCK = "summary.json", "metrics.jsonl", ".lrmoe.lock"
CHECKPOINT = "checkpoint.pt"  # the main checkpoint file (lrmoe.train.checkpoint.MAIN)
TRACE = "routing_trace.npz"  # an expert-parallel run's routing trace (lrmoe.sim.trace format), which T3 replays
NEW, RUNNING, INTERRUPTED, DONE, DAMAGED = "new", "running", "interrupted", "done", "damaged"

__all__ = ["CHECKPOINT", "CorruptFileError", "DAMAGED", "DONE", "INTERRUPTED", "LOCK", "METRICS", "NEW", "RUNNING",
           "RunState", "SUMMARY", "TRACE", "lock_holder", "read_metrics", "read_summary", "run_folder_lock", "run_state",
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


# ----------------------------------------------------------------------------- what a folder holds


@dataclass(frozen=True)
class RunState:
    """What one run folder holds (:func:`run_state`).

    ``state`` is one of ``new`` (nothing of a run yet), ``running`` (a live process holds its
    lock), ``interrupted`` (it was started, nothing trains it now: a rerun resumes it), ``done``
    (finished, with a complete metrics file) and ``damaged`` (a file of it cannot be read or
    contradicts another: ``why`` names the file and says what is wrong). ``summary`` and ``rows``
    (the metrics of a finished run) are what was read, so a caller need not read them again;
    ``leftovers`` are files that are safe to remove while nothing trains the run: temporary files
    of interrupted atomic writes, and the lock file of a folder that holds nothing else (left by a
    run that failed before its first step; the folder is then empty once they are gone)."""

    state: str
    why: str = ""
    summary: dict | None = None
    rows: list | None = None
    resumable: bool = False  # interrupted: a checkpoint is there (else the run restarts at step 1)
    leftovers: tuple = ()

    @property
    def label(self) -> str:
        """The words a listing shows: ``done``, ``new``, ``running``, ``interrupted (resumable)``,
        ``interrupted (restarts)``, ``damaged``."""
        if self.state == INTERRUPTED:
            return f"interrupted ({'resumable' if self.resumable else 'restarts'})"
        return self.state


def lock_holder(run_dir) -> str | None:
    """Whether a live process trains ``run_dir`` now: its pid (as the lock file says, or ``?``)
    while the lock is held, else None (no lock file, a lock left by a dead process, or a system
    without ``fcntl``). Probes with a non-blocking lock that it releases at once."""
    try:
        import fcntl
    except ImportError:  # not POSIX: training takes no lock either
        return None
    try:
        fh = open(Path(run_dir) / LOCK)
    except OSError:
        return None
    with fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return fh.read().strip() or "?"
        fcntl.flock(fh, fcntl.LOCK_UN)
    return None


def _temporary_files(run_dir: Path) -> list[Path]:
    """Temporary files of interrupted atomic writes (``.<name>.<random>.tmp``)."""
    return sorted(p for p in run_dir.glob(".*.tmp") if p.is_file())


def run_state(run_dir) -> RunState:
    """What ``run_dir`` holds, and why (see :class:`RunState`). Never raises for what is in the
    folder: a file that cannot be read makes the run ``damaged``, with the file named.

    A finished run (``summary.json`` says done) counts as done only if its ``metrics.jsonl``
    decodes (:func:`read_metrics`) and holds one row for every step 1..steps; otherwise it is
    damaged (an empty or missing file, a garbage line, a torn last row, missing steps). A run
    whose summary says running while no live process holds its lock is interrupted."""
    d = Path(run_dir)
    if not d.is_dir():
        return RunState(NEW) if not d.exists() else RunState(DAMAGED, f"{d}: not a folder")
    pid = lock_holder(d)
    try:
        summary = read_summary(d)
    except CorruptFileError as e:
        return RunState(RUNNING, f"pid {pid}") if pid else RunState(DAMAGED, str(e))
    if pid:
        return RunState(RUNNING, f"pid {pid}", summary)
    tmp = tuple(_temporary_files(d))  # no process writes here now: safe to remove
    has_ckpt = (d / CHECKPOINT).exists()
    if summary is None:
        if has_ckpt or any(p.name != LOCK and p not in tmp for p in d.iterdir()):
            return RunState(INTERRUPTED, f"stopped before it wrote its first {SUMMARY}", None, resumable=has_ckpt,
                            leftovers=tmp)
        left = tuple(p for p in (d / LOCK, *tmp) if p.exists())
        return RunState(NEW, "a run that failed before its first step left its lock file" if left else "", None,
                        leftovers=left)
    status = summary.get("status")
    if status == "running":
        done, steps = summary.get("steps_done"), summary.get("config", {}).get("steps", "?")
        where = f" at step {done} of {steps}" if done is not None else ""
        how = "resumes from its checkpoint" if has_ckpt else f"no {CHECKPOINT}: restarts at step 1"
        return RunState(INTERRUPTED, f"stopped{where}; {how}", summary, resumable=has_ckpt, leftovers=tmp)
    if status != "done":
        return RunState(DAMAGED, f"{d / SUMMARY}: unknown status {status!r} (expected 'running' or 'done')", summary)
    st = _finished(d, summary)
    return RunState(DONE, "", summary, st.rows, leftovers=tmp) if st.state == DONE else st


def _finished(d: Path, summary: dict) -> RunState:
    path = d / METRICS
    if not path.exists():
        return RunState(DAMAGED, f"{path}: missing, but {SUMMARY} says the run is done", summary)
    try:
        rows = read_metrics(path)
    except CorruptFileError as e:
        return RunState(DAMAGED, str(e), summary)
    raw = path.read_bytes()  # for what read_metrics forgives: a torn or undecodable last line
    steps = summary.get("config", {}).get("steps")
    if not rows:
        return RunState(DAMAGED, f"{path}: empty, but {SUMMARY} says the run is done"
                                 + (f" ({steps} steps)" if steps else ""), summary)
    if not all(isinstance(r, dict) for r in rows):
        bad = next(i for i, r in enumerate(rows) if not isinstance(r, dict))
        return RunState(DAMAGED, f"{path}: line {bad + 1} is not a JSON object", summary)
    if isinstance(steps, int):
        got = [r.get("step") for r in rows]
        if got != list(range(1, steps + 1)):
            have = set(got)
            missing = [s for s in range(1, steps + 1) if s not in have]
            extra = sorted(s for s in have if not (isinstance(s, int) and 1 <= s <= steps))
            what = (f"step(s) {_ranges(missing)} missing" if missing else
                    f"rows of steps outside 1..{steps} ({', '.join(map(str, extra[:5]))}{', ...' if len(extra) > 5 else ''})"
                    if extra else "steps out of order or repeated")
            torn = " (its last line is torn)" if missing == [steps] and raw[-1:] != b"\n" else ""
            return RunState(DAMAGED, f"{path}: {len(rows)} row(s) for a run of {steps} steps, {what}{torn}", summary)
    lines = raw.split(b"\n")
    if len(lines) - (lines[-1] == b"") > len(rows):
        # read_metrics drops an undecodable last line (a torn append of a run still writing); after
        # every row of a finished run (its summary is written after its last row) it is damage
        return RunState(DAMAGED, f"{path}: line {len(rows) + 1} (the last) is not valid JSON, but {SUMMARY} says "
                                 f"the run is done", summary)
    return RunState(DONE, "", summary, rows)


def _ranges(xs: list[int]) -> str:
    """``1-3, 7`` for [1, 2, 3, 7] (at most 5 spans shown)."""
    spans, start = [], None
    for i, x in enumerate(xs):
        if start is None:
            start = x
        if i + 1 == len(xs) or xs[i + 1] != x + 1:
            spans.append(f"{start}-{x}" if x != start else f"{x}")
            start = None
    return ", ".join(spans[:5]) + (f", ... ({len(spans) - 5} more)" if len(spans) > 5 else "")
