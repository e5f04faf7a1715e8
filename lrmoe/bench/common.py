"""Shared benchmark plumbing: timing, result checks, Markdown tables (files: :mod:`lrmoe.files`;
environment: :mod:`lrmoe.environment`)."""
from __future__ import annotations

import statistics
import time

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


def require_positive(ap, args, *names: str) -> None:
    """``ap.error`` for the first of ``args``' integer options ``names`` (attribute names) below 1."""
    for name in names:
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")


def median(xs) -> float:
    return statistics.median(xs) if xs else float("nan")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| in float32: how far a result is from its reference (the benchmarks
    check every timed result with it first); inf when ``a`` holds a NaN/Inf that ``b`` does not."""
    a, b = a.float(), b.float()
    if not torch.isfinite(a).all() and torch.isfinite(b).all():
        return float("inf")
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) if b.numel() else 0.0


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
