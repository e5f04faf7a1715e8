"""Runs that need several processes (expert parallel): one ``torchrun`` launch per run.

From a shell the run machinery prints one command per pending run (the way to run them on
another machine) and runs them one after another when this machine has the GPUs."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from lrmoe.interrupts import wait_child
from lrmoe.train import TrainConfig

from .spec import RunSpec


def train_flags(config: dict | TrainConfig) -> list[str]:
    """`lrmoe train` flags that rebuild ``config`` (fields that differ from TrainConfig's defaults;
    ep, placement and warmup_steps always (the default warm-up depends on the steps); global_batch
    follows from micro_batch x grad_accum)."""
    cfg = (config if isinstance(config, TrainConfig) else TrainConfig.from_dict(config)).to_dict()
    default = TrainConfig().to_dict()
    args = []
    for name, v in cfg.items():
        if name == "global_batch" or (v == default[name] and name not in ("ep", "placement", "warmup_steps")):
            continue
        flag = "--" + name.replace("_", "-")
        if name in ("model_overrides", "ep_options"):
            one = "--model-override" if name == "model_overrides" else "--ep-option"
            for k, x in v.items():
                args += [one, f"{k}={json.dumps(x)}"]
        elif isinstance(v, bool):  # --fsdp / --no-fsdp
            args.append(flag if v else "--no-" + flag[2:])
        elif name == "sample_layers":
            args += [flag, *map(str, v)]
        else:
            args += [flag, "none" if v is None else str(v)]
    return args


def torchrun_command(run: RunSpec, run_dir, nproc: int) -> list[str]:
    """The command that trains ``run`` in ``run_dir`` with ``nproc`` processes on one node (with
    ``--record-trace run_dir/routing_trace.npz`` when the run records its routing)."""
    return ["torchrun", "--standalone", "--nproc-per-node", str(nproc), "-m", "lrmoe.cli", "train",
            "--out", str(run_dir), "--no-progress", *train_flags(run.train_config(run_dir))]


def missing_hardware(runs: list[RunSpec], nproc: int) -> str | None:
    """Why this machine cannot run ``nproc``-process launches of ``runs`` (None: it can)."""
    import torch

    devices = {r.train_config().device for r in runs}
    if any(d.startswith("cuda") for d in devices) or ("auto" in devices and torch.cuda.is_available()):
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n < nproc:
            return f"this machine has {n} CUDA GPU(s) and each run needs {nproc}"
    return None


def launch_each(runs: list[RunSpec], out, nproc: int) -> list[tuple[str, str]]:
    """Train each run with its own launch (``python -m torch.distributed.run``, the same as
    ``torchrun``), one after another; returns (run name, error) of each failed launch."""
    failures = []
    for r in runs:
        print(f"  {r.name}: launching", file=sys.stderr, flush=True)
        cmd = torchrun_command(r, Path(out) / r.name, nproc)
        # after Ctrl-C, torchrun stops its ranks (not killed at once: they would train on, orphaned)
        rc = wait_child(subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *cmd[1:]]))
        if rc:
            failures.append((r.name, f"torchrun exited with status {rc}"))
            print(f"  {r.name}: FAILED (torchrun exited with status {rc})", file=sys.stderr)
    return failures
