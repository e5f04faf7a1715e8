"""What the expert-parallel runtime reads from the device when its tensors are fake.

A memory estimate runs the real training step under ``FakeTensorMode`` (``lrmoe estimate-memory``):
tensors have shapes and devices but no values, so the few places where the runtime reads values on
the host (the demand the planner needs, the indices' range check) get a *stated* demand instead,
given with :func:`stated_demand`; without one, the demand is balanced (each source rank's T x K pairs
spread evenly over the E experts). Everything the runtime sizes from the plan is then exact for
that demand."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

import numpy as np
import torch
from torch._subclasses.fake_tensor import is_fake as _torch_is_fake

# (source ranks G, experts E, pairs per source rank T*K) -> demand [G, E] (int64, rows summing to T*K)
DemandFn = Callable[[int, int, int], np.ndarray]
_stated: list[DemandFn] = []


def is_fake(t: torch.Tensor) -> bool:
    """Whether ``t`` is a fake tensor (no values to read)."""
    return _torch_is_fake(t)


def balanced(G: int, E: int, pairs: int) -> np.ndarray:
    """Each source rank's ``pairs`` spread evenly over the experts (the first ``pairs % E`` get one more)."""
    row = np.full(E, pairs // E, dtype=np.int64)
    row[: pairs % E] += 1
    return np.tile(row, (G, 1))


@contextmanager
def stated_demand(fn: DemandFn):
    """Use ``fn(G, E, pairs)`` for the demand of every fake expert-parallel call inside."""
    _stated.append(fn)
    try:
        yield
    finally:
        _stated.pop()


def demand(G: int, E: int, pairs: int) -> np.ndarray:
    """The stated demand [G, E] of a fake call (balanced without a statement), checked."""
    fn = _stated[-1] if _stated else balanced
    d = np.asarray(fn(G, E, pairs), dtype=np.int64)
    if d.shape != (G, E) or (d < 0).any() or (d.sum(axis=1) != pairs).any():
        raise ValueError(f"a stated demand must be a non-negative [{G}, {E}] integer array whose rows sum to the "
                         f"{pairs} pairs of each source rank; got shape {d.shape}, row sums {d.sum(axis=1)[:4]}")
    return d
