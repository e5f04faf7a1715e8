"""The host and the device: which reads of tensor values are free, and how host arrays reach the device.

On an accelerator every read of a tensor's values on the host (``.item()``, ``int(t)``, ``.tolist()``,
``.cpu()``, a boolean-mask index, ``nonzero``, a ``bincount``...) waits for the device's queue to
drain; so does a blocking copy of host memory to the device. The kit reads values on the host only
where that is free (CPU tensors: :func:`host_reads_free`) or where it is the point (the expert-parallel
demand the planner needs, once per MoE layer: :func:`intended_sync`).

:func:`emulate_accelerator` makes CPU tensors count as device tensors for :func:`host_reads_free`, so
that a CPU test runs the code paths an accelerator runs (tests/parallel/test_syncs.py counts the
synchronisations of those paths). :func:`upload` copies a host array to the device without a blocking
copy (pinned memory, ``non_blocking=True`` on CUDA)."""
from __future__ import annotations

import contextlib
import threading

import numpy as np
import torch

_state = threading.local()


@contextlib.contextmanager
def emulate_accelerator():
    """Inside, :func:`host_reads_free` is False for CPU tensors too (the accelerator's code paths run
    on the CPU: CPU-only value checks are skipped, as on CUDA outside anomaly mode)."""
    before = getattr(_state, "emulate", False)
    _state.emulate = True
    try:
        yield
    finally:
        _state.emulate = before


def emulating() -> bool:
    """Whether :func:`emulate_accelerator` is active in this thread."""
    return getattr(_state, "emulate", False)


def host_reads_free(t: torch.Tensor) -> bool:
    """Whether reading ``t``'s values on the host costs no device synchronisation: a CPU tensor
    outside :func:`emulate_accelerator`."""
    return t.device.type == "cpu" and not emulating()


def upload(host: np.ndarray, device: torch.device) -> torch.Tensor:
    """``host`` (a numpy array) as a tensor on ``device`` without a blocking copy: on CUDA through
    pinned memory with ``non_blocking=True`` (torch's caching host allocator keeps the pinned buffer
    until the copy has run); on the CPU the array's memory itself (no copy)."""
    t = torch.from_numpy(np.ascontiguousarray(host))
    device = torch.device(device)
    if device.type == "cpu":
        return t
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


@contextlib.contextmanager
def intended_sync():
    """Marks a synchronisation that is the point of the code inside (the expert-parallel demand read):
    ``torch.cuda.set_sync_debug_mode`` is lifted there, so that a step run under ``"error"`` fails on
    every other synchronisation only."""
    if not torch.cuda.is_available() or torch.cuda.get_sync_debug_mode() == 0:
        yield
        return
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(mode)
