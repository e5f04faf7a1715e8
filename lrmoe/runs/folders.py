"""What a results folder already holds for a list of runs, and the files the run machinery writes
beside the run folders: ``manifest.json`` (what the folder is meant to hold) and the record of
the last call (e.g. ``reproduce.json``: wall time, failures).

The state of each run folder comes from :func:`lrmoe.run_folder.run_state`, the one function
that decides it for the run machinery and the figure makers alike."""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from lrmoe.files import CorruptFileError, read_json, write_json
from lrmoe.run_folder import DAMAGED, DONE, INTERRUPTED, NEW, RUNNING, RunState, run_state
from lrmoe.train import config_differences

from .spec import RunSpec


@dataclass
class Survey:
    """The state of each run's folder (``states``: :class:`lrmoe.run_folder.RunState`: new,
    running, interrupted, done or damaged, and why) and ``stale`` (a run of another config is
    there: the differences). A stale or damaged folder is neither reused nor overwritten, and a run
    that another process trains now is not started twice."""

    states: dict[str, RunState] = field(default_factory=dict)
    stale: dict[str, list[str]] = field(default_factory=dict)

    def _named(self, state: str) -> dict[str, str]:
        return {name: st.why for name, st in self.states.items() if st.state == state}

    @property
    def damaged(self) -> dict[str, str]:
        """Run name -> what is wrong with its folder (the file named)."""
        return self._named(DAMAGED)

    @property
    def running(self) -> dict[str, str]:
        """Run name -> which process trains it now."""
        return self._named(RUNNING)

    def done(self, runs: list[RunSpec]) -> list[RunSpec]:
        return [r for r in runs if self.states[r.name].state == DONE]

    def pending(self, runs: list[RunSpec]) -> list[RunSpec]:
        return [r for r in runs if self.states[r.name].state != DONE]

    def refusal(self, out, prog: str) -> list[str]:
        """Why ``prog`` must not train into ``out`` (one line per reason, then one per folder); []
        when no folder is stale, damaged or being trained by another process."""
        lines = []
        if self.stale:
            lines.append(f"{prog}: {len(self.stale)} run folder(s) under {out}/ hold runs of another config (a "
                         f"changed preset or grid, --data or kit version); move or delete them, or use --out:")
            lines += [f"  {name}: {'; '.join(diff)}" for name, diff in self.stale.items()]
        if self.damaged:
            lines.append(f"{prog}: {len(self.damaged)} run folder(s) under {out}/ are damaged (a file that cannot be "
                         f"read or is incomplete), so what they hold is unknown; repair, move or delete them, or use "
                         f"--out:")
            lines += [f"  {name}: {why}" for name, why in self.damaged.items()]
        if self.running:
            lines.append(f"{prog}: {len(self.running)} run(s) under {out}/ are being trained by another process; "
                         f"wait for it to finish or stop it, then rerun to resume:")
            lines += [f"  {name}: {why}" for name, why in self.running.items()]
        return lines

    def label(self, name: str) -> str:
        """The words a listing shows: damaged, stale, done, running, interrupted (resumable), ... or new."""
        st = self.states[name]
        if st.state != DAMAGED and name in self.stale:
            return "stale"
        return st.label

    def reasons(self, runs: list[RunSpec]) -> list[str]:
        """Why each pending run that is not new runs again (e.g. ``interrupted at step 100 of 200;
        resumes from its checkpoint``), one line per run."""
        return [f"  {r.name}: {self.states[r.name].label}: {self.states[r.name].why}" for r in runs
                if self.states[r.name].state == INTERRUPTED]

    def clean(self) -> list[Path]:
        """Remove what is safe to remove (:attr:`RunState.leftovers`: temporary files of interrupted
        writes; the lock file of a run that failed before its first step, and then its empty
        folder). Returns the paths removed; a file that cannot be removed is left as it is."""
        removed = []
        for st in self.states.values():
            for path in st.leftovers:
                try:
                    path.unlink()
                except OSError:
                    continue
                removed.append(path)
            if st.state == NEW and st.leftovers:
                try:
                    st.leftovers[0].parent.rmdir()  # only if nothing else appeared in it
                    removed.append(st.leftovers[0].parent)
                except OSError:
                    pass
        return removed


def survey(out, runs: list[RunSpec]) -> Survey:
    """The state of each run's folder under ``out`` (:func:`lrmoe.run_folder.run_state`), and
    which finished or started runs were trained with another config."""
    out, sv = Path(out), Survey()
    for r in runs:
        st = sv.states[r.name] = run_state(out / r.name)
        if st.summary and (diff := config_differences(st.summary.get("config", {}), r.config)):
            sv.stale[r.name] = diff
    return sv


def write_manifest(out, payload: dict) -> Path:
    """``<out>/manifest.json``: what the folder is meant to hold (the figure makers read it)."""
    return write_json(Path(out) / "manifest.json", payload)


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def record_call(path, fields: dict, wall_s: float, warn=_stderr) -> dict:
    """Write the record of this call to ``path``: ``fields``, ``wall_s_last_call`` and
    ``wall_s_total`` (the previous record's total plus this call). A previous record that cannot be
    read is never silently replaced: it is moved aside to ``<name>.corrupt``, ``warn`` is told
    which file and why, the total counts from this call, and ``wall_s_total_note`` (kept by later
    calls) says so. Returns the record."""
    path = Path(path)
    prev: dict = {}
    try:
        prev = read_json(path, missing={})
        if not isinstance(prev, dict) or not isinstance(prev.get("wall_s_total", 0.0), (int, float)):
            raise CorruptFileError(f"{path}: expected a JSON object with a numeric wall_s_total")
    except CorruptFileError as e:
        aside = _free_name(path.with_name(path.name + ".corrupt"))
        os.replace(path, aside)
        prev = {"wall_s_total_note": f"{path.name} of an earlier call could not be read ({e}); it is kept as "
                                     f"{aside.name}, and wall_s_total counts from the call after it"}
        warn(f"warning: {prev['wall_s_total_note']}")
    record = {**fields, "wall_s_last_call": wall_s, "wall_s_total": prev.get("wall_s_total", 0.0) + wall_s}
    if "wall_s_total_note" in prev:
        record["wall_s_total_note"] = prev["wall_s_total_note"]
    write_json(path, record)
    return record


def _free_name(path: Path) -> Path:
    """``path``, or ``path.1``, ``path.2``, ... : the first that does not exist."""
    n, cand = 0, path
    while cand.exists():
        n += 1
        cand = path.with_name(f"{path.name}.{n}")
    return cand
