"""Activation checkpointing per decoder layer (torch's non-reentrant ``torch.utils.checkpoint``).

:func:`checkpoint_layers` makes every decoder layer of a transformers causal LM keep only its input
in the forward; the backward runs the layer's forward again to rebuild the rest. The recompute runs
under :func:`lrmoe.recompute.recompute` (``context_fn``), so it selects the same pairs with the same
plan and advances no planner state, records no second plan, trace row or timer interval
(:mod:`lrmoe.parallel.runtime`, :mod:`lrmoe.train.timer`). torch checks that the recompute saves the
same tensors as the forward did (shapes, dtypes and count) and raises otherwise.

Apply it before FSDP (:func:`lrmoe.hf.fsdp.shard_model`): FSDP's hooks stay around the layer's call
and gather its parameters for the backward, which is where the recompute runs."""
from __future__ import annotations

import contextlib
import functools

from torch import nn
from torch.utils.checkpoint import checkpoint

from ..recompute import recompute

_ATTR = "lrmoe_checkpointed"


def _contexts():
    return contextlib.nullcontext(), recompute()


def _checkpointed(forward, *args, **kwargs):
    return checkpoint(forward, *args, use_reentrant=False, context_fn=_contexts, **kwargs)


def checkpoint_layers(model: nn.Module) -> int:
    """Checkpoint every decoder layer of ``model`` (``model.model.layers``); returns how many.
    A layer already checkpointed is refused (ValueError), so nothing runs twice."""
    from .fsdp import decoder_layers

    layers = decoder_layers(model)
    for layer in layers:
        if getattr(layer, _ATTR, False):
            raise ValueError(f"{type(layer).__name__} is already activation-checkpointed")
        layer.forward = functools.partial(_checkpointed, layer.forward)
        setattr(layer, _ATTR, True)
    return len(layers)


def is_checkpointed(model: nn.Module) -> bool:
    return any(getattr(m, _ATTR, False) for m in model.modules())
