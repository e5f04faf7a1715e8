"""The gradient-fidelity probe as a step of `lrmoe reproduce` (cheap next to the runs): after the
runs and before the figures, ``lrmoe ablate probe --run <out>/<run> --out <out>/probe`` on the
checkpoint of one of the preset's own runs (``Preset.probe["run"]``; cpu: ``qwen3-C00-s0``, the
C0 model after its 200 steps), with the preset's extra probe arguments (``Preset.probe["args"]``).
The report then shows Figure A1 and the probe's tables (:mod:`paper_figures.makers`, "A1").

The probe runs in its own process (``python -m lrmoe.ablate.probe``), so its thread count and its
worker processes do not touch the driver's, and the driver does not import the probe.

The probe is not repeated when ``<out>/probe/probe.json`` was made with the same arguments
(``meta["argv"]``) on the run as it is now (``meta["run_final"]``, the run's final metrics). A
finished run without its checkpoint (a committed reference) is trained again by the probe for one
(:mod:`lrmoe.train.retrain`)."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from lrmoe.files import CorruptFileError, read_json
from lrmoe.interrupts import wait_child
from lrmoe.run_folder import read_summary
from paper_figures.makers import PROBE_DIR as SUBDIR  # where the report's A1 maker reads it


def probe_argv(out, spec: dict) -> list[str]:
    """The probe's command line (after ``lrmoe ablate probe``) for results folder ``out``."""
    out = Path(out)
    return ["--run", str(out / spec["run"]), "--out", str(out / SUBDIR), "--no-progress", *spec.get("args", ())]


def up_to_date(out, spec: dict) -> bool:
    """``<out>/probe/probe.json`` was made by :func:`probe_argv`'s command on the run as it is now
    (the run's final metrics, ``meta["run_final"]``, are those of its summary.json). The checkpoint
    need not be there: a committed reference keeps the probe but not the checkpoint."""
    f = Path(out) / SUBDIR / "probe.json"
    if not f.is_file():
        return False
    try:
        meta = read_json(f).get("meta", {})
        summary = read_summary(Path(out) / spec["run"])
    except (CorruptFileError, AttributeError):
        return False
    return (summary is not None and meta.get("argv") == probe_argv(out, spec)
            and meta.get("run_final") is not None and meta.get("run_final") == summary.get("final"))


def probe_into(out, spec: dict) -> tuple[int, float]:
    """Run the probe into ``<out>/probe/``; returns (exit status, seconds). Its output (a refusal is
    one line on stderr) goes to this process's stdout and stderr. After Ctrl-C the probe stops
    quietly (:func:`lrmoe.interrupts.wait_child`) and the ``KeyboardInterrupt`` goes on."""
    t0 = time.perf_counter()
    rc = wait_child(subprocess.Popen([sys.executable, "-m", "lrmoe.ablate.probe", *probe_argv(out, spec)]))
    return rc, time.perf_counter() - t0
