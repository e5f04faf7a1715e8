"""Time spent inside the routed-experts functions of a step (``moe_fwd_s`` / ``moe_bwd_s``).

Forward: from entering to leaving each experts module (module hooks). Backward: from the moment
autograd starts the module's output node to the moment the experts function's own node has
produced its input gradients (node hooks). The experts node is found by identity: the node
whose autograd Function class is one of :func:`experts_functions` (the selective experts
function of :mod:`lrmoe.experts`, the expert-parallel one of :mod:`lrmoe.parallel.function` and the
virtual-EP one of :mod:`lrmoe.parallel.virtual`),
never by a class-name match. CPU: ``time.perf_counter``; CUDA: CUDA events, summed after the
step's synchronisation.
"""
from __future__ import annotations

import time

import torch

from ..experts import SelectiveExperts
from ..parallel.function import EPExperts
from ..parallel.virtual import VirtualEPExperts
from ..recompute import recomputing


def experts_functions() -> tuple[type, ...]:
    """The autograd Function classes whose nodes are "the experts' backward"."""
    return SelectiveExperts, EPExperts, VirtualEPExperts


def node_function(node) -> type | None:
    """The autograd Function class that created ``node`` (None for a built-in op's node)."""
    return getattr(type(node), "_forward_cls", None)


class MoETimer:
    """Time spent inside the routed-experts modules (forward and backward), see the module docstring.

    ``functions``: the autograd Function classes that count as the experts' backward (default
    :func:`experts_functions`)."""

    def __init__(self, modules, device: torch.device, functions: tuple[type, ...] | None = None):
        self.cuda = device.type == "cuda"
        self.functions = tuple(experts_functions() if functions is None else functions)
        self.enabled = False
        self.fwd = self.bwd = 0.0
        self._fwd_events, self._bwd_events = [], []
        self._handles = []
        for m in modules:
            self._handles.append(m.register_forward_pre_hook(self._pre))
            self._handles.append(m.register_forward_hook(self._post))
        self._starts = []

    def _mark(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def _pre(self, module, args):
        if self.enabled and not recomputing():  # activation checkpointing's recompute is not the layer's forward
            self._starts.append(self._mark())

    def experts_node(self, node):
        """The experts function's node at or right below ``node`` (the module's output node; a
        ``.to(dtype)`` after the experts function may add one copy node above it), else None."""
        for _ in range(2):
            if node is None:
                return None
            if node_function(node) in self.functions:
                return node
            node = node.next_functions[0][0] if node.next_functions else None
        return None

    def _post(self, module, args, out):
        if not self.enabled or not self._starts or recomputing():
            return
        start, end = self._starts.pop(), self._mark()
        self._add(self._fwd_events, "fwd", start, end)
        y = out[0] if isinstance(out, (tuple, list)) else out
        if not (isinstance(y, torch.Tensor) and y.grad_fn is not None):
            return
        outer = y.grad_fn
        inner = self.experts_node(outer)
        if inner is None:  # not an experts function of the kit: no backward time to attribute
            return
        box = {}

        def pre(grad_outputs):
            box["t0"] = self._mark()

        def post(grad_inputs, grad_outputs):
            if "t0" in box:
                self._add(self._bwd_events, "bwd", box.pop("t0"), self._mark())

        outer.register_prehook(pre)
        inner.register_hook(post)

    def _add(self, events, kind, start, end):
        if self.cuda:
            events.append((start, end))
        elif kind == "fwd":
            self.fwd += end - start
        else:
            self.bwd += end - start

    def collect(self) -> tuple[float, float]:
        """(forward seconds, backward seconds) since the last call; synchronises CUDA."""
        if self.cuda:
            torch.cuda.synchronize()
            self.fwd = sum(a.elapsed_time(b) for a, b in self._fwd_events) / 1e3
            self.bwd = sum(a.elapsed_time(b) for a, b in self._bwd_events) / 1e3
            self._fwd_events, self._bwd_events = [], []
        out = (self.fwd, self.bwd)
        self.fwd = self.bwd = 0.0
        self._starts = []
        return out

    def remove(self):
        for h in self._handles:
            h.remove()
