"""What a results folder already holds for a list of runs, and the files the run machinery writes
beside the run folders: ``manifest.json`` (what the folder is meant to hold) and the record of
the last call (e.g. ``reproduce.json``: wall time, failures)."""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from lrmoe.files import CorruptFileError, read_json, write_json
from lrmoe.run_folder import read_summary
from lrmoe.train import config_differences

from .spec import RunSpec


@dataclass
class Survey:
    """The state of each run's folder: ``status`` ("done", "running", ...; None for nothing yet),
    ``stale`` (a run of another config is there: the differences) and ``unreadable`` (its
    ``summary.json`` cannot be read: why). A stale or unreadable folder is neither reused nor
    overwritten."""

    status: dict[str, str | None] = field(default_factory=dict)
    stale: dict[str, list[str]] = field(default_factory=dict)
    unreadable: dict[str, str] = field(default_factory=dict)

    def done(self, runs: list[RunSpec]) -> list[RunSpec]:
        return [r for r in runs if self.status.get(r.name) == "done"]

    def pending(self, runs: list[RunSpec]) -> list[RunSpec]:
        return [r for r in runs if self.status.get(r.name) != "done"]

    def refusal(self, out, prog: str) -> list[str]:
        """Why ``prog`` must not train into ``out`` (one line per reason, then one per folder); []
        when no folder is stale or unreadable."""
        lines = []
        if self.stale:
            lines.append(f"{prog}: {len(self.stale)} run folder(s) under {out}/ hold runs of another config (a "
                         f"changed preset or grid, --data or kit version); move or delete them, or use --out:")
            lines += [f"  {name}: {'; '.join(diff)}" for name, diff in self.stale.items()]
        if self.unreadable:
            lines.append(f"{prog}: {len(self.unreadable)} run folder(s) under {out}/ have a summary.json that cannot "
                         f"be read, so whether they hold the run is unknown; repair, move or delete them, or use "
                         f"--out:")
            lines += [f"  {name}: {why}" for name, why in self.unreadable.items()]
        return lines

    def label(self, name: str) -> str:
        """One word for a listing: unreadable, stale, done, running, ... or new."""
        if name in self.unreadable:
            return "unreadable"
        return "stale" if name in self.stale else self.status.get(name) or "new"


def survey(out, runs: list[RunSpec]) -> Survey:
    out, sv = Path(out), Survey()
    for r in runs:
        try:
            s = read_summary(out / r.name)
        except CorruptFileError as e:
            sv.status[r.name], sv.unreadable[r.name] = None, str(e)
            continue
        sv.status[r.name] = s.get("status") if s else None
        if s and (diff := config_differences(s.get("config", {}), r.config)):
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
