"""Whether the running forward is activation checkpointing's recompute (pure Python, no torch).

Activation checkpointing (:mod:`lrmoe.hf.checkpointing`) runs a decoder layer's forward a second
time in the backward, to rebuild the tensors it did not keep. That second forward must compute the
same values and must not act again: the expert-parallel runtime reuses the layer's plan (no second
planning, no planner state advanced, no collective of the demand), and the timers and records of
the kit ignore it. The flag is per thread (the recompute runs in the thread that runs the backward).

    with recompute():          # entered by torch.utils.checkpoint's context_fn for the recompute
        assert recomputing()
"""
from __future__ import annotations

import threading
from contextlib import contextmanager

_flag = threading.local()


def recomputing() -> bool:
    """True inside activation checkpointing's recompute of a forward (this thread)."""
    return getattr(_flag, "depth", 0) > 0


@contextmanager
def recompute():
    """Mark the enclosed forward as a recompute (re-entrant)."""
    _flag.depth = getattr(_flag, "depth", 0) + 1
    try:
        yield
    finally:
        _flag.depth -= 1
