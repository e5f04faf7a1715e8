"""A finished run folder without its checkpoint gets it back by training the run again.

The committed reference results (``results/cpu``, ``results/ablations/*``) keep each run's
``metrics.jsonl`` and ``summary.json`` but not its ``checkpoint.pt`` (git-ignored: megabytes per
run). Whatever needs the trained weights of such a run (the gradient-fidelity probe) calls
:func:`restore_checkpoint`: the run's config is trained again in ``<run>/.retrain/``, its checkpoint
is moved into the run folder, and the retrained final metrics are compared with the folder's. Training
is deterministic for one config on one machine, so they agree there; where they do not (another
machine, another torch), the folder's ``summary.json`` and ``metrics.jsonl`` are replaced by the
retrained ones so that they describe the checkpoint beside them, and the previous files are kept as
``summary.json.previous`` / ``metrics.jsonl.previous`` (nothing is lost)."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from ..run_folder import CHECKPOINT, METRICS, SUMMARY, read_summary
from .config import TrainConfig

RETRAIN = ".retrain"
PREVIOUS = ".previous"
# keys of ``summary["final"]`` that are timings or counts of this process, not results
_NOT_RESULTS = ("wall_s", "time_s")


def restore_checkpoint(cfg: TrainConfig, run, progress: bool = False) -> dict:
    """Give the finished run folder ``run`` (trained with ``cfg``) its checkpoint back (module doc).

    Returns ``{"restored": bool, "same": bool | None, "differences": [...]}``: ``restored`` False
    when the folder already has its checkpoint (nothing done); ``same`` whether the retrained final
    metrics equal the folder's; ``differences`` the keys that differ (``old -> new``). A folder
    that holds no finished run of ``cfg`` is refused with a ValueError."""
    from .config import config_differences
    from .loop import train

    run = Path(run)
    if (run / CHECKPOINT).is_file():
        return {"restored": False, "same": None, "differences": []}
    summary = read_summary(run)
    if summary is None or summary.get("status") != "done":
        raise ValueError(f"{run}: not a finished run (no summary.json with status 'done'); train it instead")
    diff = config_differences(summary.get("config", {}), cfg.to_dict())
    if diff:
        raise ValueError(f"{run} holds another run ({'; '.join(diff)})")
    tmp = run / RETRAIN
    new = train(cfg, tmp, progress=progress)
    os.replace(tmp / CHECKPOINT, run / CHECKPOINT)
    differences = _differences(summary.get("final", {}), new.get("final", {}))
    if differences:
        for name in (SUMMARY, METRICS):
            if (run / name).exists():
                os.replace(run / name, run / (name + PREVIOUS))
            os.replace(tmp / name, run / name)
    shutil.rmtree(tmp)
    return {"restored": True, "same": not differences, "differences": differences}


def _differences(old: dict, new: dict) -> list[str]:
    keys = sorted(k for k in set(old) | set(new) if not any(t in k for t in _NOT_RESULTS))
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys if old.get(k) != new.get(k)]
