"""What a result was produced on: versions, hardware, threads, git revision (standard library;
torch and friends are imported only when :func:`environment` is called)."""
from __future__ import annotations

import os
import platform
import subprocess
from datetime import datetime, timezone
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]


def git_revision() -> str:
    """Env ``LRMOE_GIT_REV`` when set (a lent machine's copy of the working tree may carry a stale
    ``.git``: its first GPU check recorded the revision the session started from), else the
    checkout's short revision (+dirty when code outside results/ is modified)."""
    if os.environ.get("LRMOE_GIT_REV"):
        return os.environ["LRMOE_GIT_REV"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=_ROOT, capture_output=True, text=True, timeout=5)
        # Modified result files (e.g. the JSON a rerun is about to replace) do not make the code dirty.
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!results"],
                               cwd=_ROOT, capture_output=True, text=True, timeout=5).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def environment(device=None) -> dict:
    """Versions, hardware, threads and revision, for every results file (``device``: the
    ``torch.device`` the result ran on; default CPU)."""
    import torch

    device = torch.device("cpu") if device is None else torch.device(device)
    env = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "device": str(device),
        "git": git_revision(),
        # Allocator settings change CPU timings a lot (see docs/benchmarks.md): record them.
        "env": {k: v for k, v in os.environ.items() if k.startswith(("MALLOC_", "OMP_", "MKL_", "LD_PRELOAD"))},
        "cpu_count": os.cpu_count(),
    }
    model = cpu_model()
    if model:
        env["cpu_model"] = model
    for mod in ("triton", "transformers", "numpy", "datasets", "tokenizers"):
        try:
            env[mod] = __import__(mod).__version__
        except ImportError:
            pass
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
        env["gpu_count"] = torch.cuda.device_count()
    return env


def hardware_label(env: dict, distributed: dict | None = None) -> str:
    """A short human description of the hardware of a run (for tables and figure captions):
    ``env`` is a summary's ``environment``, ``distributed`` its ``distributed`` entry (torchrun
    runs: world size and EP group size)."""
    world = int((distributed or {}).get("world_size") or 1)
    ep = int((distributed or {}).get("ep") or 1)
    par = f", EP{ep}" if ep > 1 else ""
    if str(env.get("device", "cpu")).startswith("cuda"):
        return f"{world}x {env.get('gpu', 'GPU')}{par}"
    cpu = env.get("cpu_model") or env.get("cpu") or "CPU"
    cores = f"{env['cpu_count']} cores, " if env.get("cpu_count") else ""
    procs = f"{world} processes, " if world > 1 else ""
    return f"CPU ({cpu}), {cores}{procs}{env.get('threads', '?')} thread(s) per {'process' if world > 1 else 'run'}{par}"
