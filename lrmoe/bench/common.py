"""Shared benchmark plumbing: timing, environment description, JSON output."""
from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> float:
    """Wall seconds of ``fn()`` with device synchronisation on both sides."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def median(xs) -> float:
    return statistics.median(xs) if xs else float("nan")


def git_revision() -> str:
    """The checkout's short revision (+dirty when code outside results/ is modified); without a git
    checkout (e.g. a copied working tree on a lent machine), env ``LRMOE_GIT_REV`` if set."""
    if os.environ.get("LRMOE_GIT_REV") and not (Path(__file__).resolve().parents[2] / ".git").exists():
        return os.environ["LRMOE_GIT_REV"]
    try:
        root = Path(__file__).resolve().parents[2]
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5)
        # Modified result files (e.g. the JSON a rerun is about to replace) do not make the code dirty.
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!results"],
                               cwd=root, capture_output=True, text=True, timeout=5).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def environment(device: torch.device) -> dict:
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
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    return env


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| in float32: how far a result is from its reference (the benchmarks
    check every timed result with it first); inf when ``a`` holds a NaN/Inf that ``b`` does not."""
    a, b = a.float(), b.float()
    if not torch.isfinite(a).all() and torch.isfinite(b).all():
        return float("inf")
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) if b.numel() else 0.0


def write_json(path: Path, payload: dict) -> Path:
    """Atomic write (a killed run never leaves a half-written file)."""
    return write_text(path, json.dumps(payload, indent=2, default=str))


def write_text(path: Path, text: str) -> Path:
    """Atomic write of a text file: a temporary file beside it, then a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(path)
    return path


def markdown_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """columns: (key, header, format spec)."""
    head = "| " + " | ".join(h for _, h, _ in columns) + " |"
    sep = "|" + "|".join("---" for _ in columns) + "|"
    body = []
    for r in rows:
        cells = []
        for key, _, fmt in columns:
            v = r.get(key)
            cells.append("" if v is None else (format(v, fmt) if fmt else str(v)))
        body.append("| " + " | ".join(cells) + " |")
    return "\n".join([head, sep, *body])
