"""Per-step progress of runs trained in worker processes, and the machine a call ran on.

The pool's workers train without their own progress bar (several bars from several processes
would overwrite each other), so :class:`StepProgress` watches the run folders instead: every few
seconds it reads the last row of each pending run's ``metrics.jsonl`` (one row per optimizer step,
flushed as it is written) and shows one bar of the steps of all runs, with the step of every run
in training (``qwen3-C10-lrm-s0 75/200``). It only reads files, so it cannot disturb a run.

:func:`machine` says what the call ran on and how loaded it was (CPU model, cores,
``os.getloadavg()``), for the manifest, ``reproduce.json`` and the time printed at the end."""
from __future__ import annotations

import json
import os
import threading
from datetime import datetime, timezone
from pathlib import Path

from lrmoe.environment import cpu_model

_TAIL_BYTES = 1 << 16  # a metrics row with its sampled layers is a few kB


def machine() -> dict:
    """CPU model, core count, load average (1, 5, 15 min) and the time, now."""
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:  # not available on this platform
        load = None
    return {"cpu_model": cpu_model() or "unknown CPU", "cpu_count": os.cpu_count(), "load_average": load,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def machine_line(m: dict) -> str:
    """``AMD EPYC, 2 cores, load average 1.52 / 1.20 / 0.80 (1 / 5 / 15 min)``."""
    load = m.get("load_average")
    txt = f"{m.get('cpu_model', 'unknown CPU')}, {m.get('cpu_count', '?')} cores"
    if load:
        txt += f", load average {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} (1 / 5 / 15 min)"
    return txt


def last_step(metrics: Path) -> int:
    """The step of the last complete row of a ``metrics.jsonl`` (0 when there is none yet)."""
    try:
        with open(metrics, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - _TAIL_BYTES))
            tail = f.read()
    except OSError:
        return 0
    for line in reversed(tail.split(b"\n")[1:] if size > _TAIL_BYTES else tail.split(b"\n")):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue  # empty, torn (being written) or cut by the tail window
    return 0


class StepProgress:
    """A background thread showing the steps of ``runs`` (``(name, steps)`` pairs) trained into
    ``out``. ``with StepProgress(out, runs): ...``; disabled when ``enabled`` is False."""

    def __init__(self, out, runs: list[tuple[str, int]], enabled: bool = True, interval_s: float = 5.0):
        from lrmoe.console import is_terminal

        # a bar redrawn every few seconds is for a terminal; in a log the pool's per-run lines say it
        self.out, self.runs, self.interval_s = Path(out), list(runs), interval_s
        self.enabled = enabled and bool(runs) and is_terminal()
        self._stop = threading.Event()
        self._thread = None
        self.bar = None

    def poll(self) -> tuple[int, list[str]]:
        """(steps done over all runs, ``name step/steps`` of each run in training)."""
        total, active = 0, []
        for name, steps in self.runs:
            s = min(last_step(self.out / name / "metrics.jsonl"), steps)
            total += s
            if 0 < s < steps:
                active.append(f"{name} {s}/{steps}")
        return total, active

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._refresh()

    def _refresh(self) -> None:
        done, active = self.poll()
        self.bar.n = done
        self.bar.set_postfix_str(", ".join(active) or ("all finished" if done == self.bar.total else "waiting"),
                                refresh=False)
        self.bar.refresh()

    def __enter__(self):
        if self.enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=sum(s for _, s in self.runs), desc="steps", unit="step", dynamic_ncols=True,
                            position=1, leave=False)
            self._refresh()
            self._thread = threading.Thread(target=self._loop, name="lrmoe-step-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self.bar.close()
        return False
