"""A counter of device->host synchronisations for CPU tests (imported by the tests as ``sync_counter``).

On the CPU nothing waits, so the counter reads the code *as if the tensors lived on an accelerator*:
it counts every operation that would make the host wait for the device there, whatever the device
here. :class:`SyncCounter` is a ``TorchDispatchMode`` (the aten ops) plus patched ``torch.Tensor``
methods and constructors (the host reads and blocking copies that never reach the dispatcher on the
CPU), and it runs the code under :func:`lrmoe.kernels.host.emulate_accelerator` (the accelerator's
code paths: no CPU-only value checks).

Counted (each event with the kit's innermost frame, so a failure says where):

* aten ops that read values on the host or size an output by them: ``_local_scalar_dense``
  (``.item()``, ``int(t)``, ``bool(t)``, ``if t:``), ``is_nonzero``, ``equal``, ``nonzero`` (not
  ``nonzero_static``), ``masked_select``, every ``unique`` variant, ``index`` / ``index_put`` with a
  boolean mask, every ``bincount`` (CUDA's reads the maximum on the host even with ``minlength``),
  ``repeat_interleave`` without ``output_size``, ``segment_reduce`` without ``unsafe=True``;
* copies to the host: ``Tensor.cpu()``, ``Tensor.to(<cpu>)`` without ``non_blocking=True``, and
  reads of a tensor's values that did not come from such a copy: ``Tensor.tolist()``,
  ``Tensor.numpy()``, ``numpy.asarray(t)``;
* blocking copies from the host: ``torch.tensor`` / ``torch.as_tensor`` of host data (not a tensor)
  with an explicit device.
"""
from __future__ import annotations

import traceback
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lrmoe.kernels.host import emulate_accelerator

aten = torch.ops.aten

ALWAYS = {aten._local_scalar_dense, aten.is_nonzero, aten.equal, aten.nonzero, aten.masked_select, aten.bincount,
          aten.unique_dim, aten.unique_consecutive, aten.unique_dim_consecutive, aten._unique, aten._unique2}
INDEXING = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}


def where() -> str:
    """The innermost frame of the kit (lrmoe/) in the current stack, else the innermost outside this file."""
    stack = traceback.extract_stack()[:-2]
    for f in reversed(stack):
        path = f.filename.replace("\\", "/")
        if "/lrmoe/" in path:
            return f"lrmoe/{path.split('/lrmoe/', 1)[1]}:{f.lineno} {f.name}"
    for f in reversed(stack):
        if not f.filename.endswith("sync_counter.py"):
            return f"{f.filename}:{f.lineno} {f.name}"
    return "?"


def _bool_index(indices) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


def sync_op(func, args, kwargs) -> str | None:
    """The name of the synchronisation ``func(*args, **kwargs)`` makes on an accelerator, or None."""
    packet = func.overloadpacket
    if packet in ALWAYS:
        return packet.__name__
    if packet in INDEXING and _bool_index(args[1] if len(args) > 1 else kwargs.get("indices")):
        return f"{packet.__name__} (boolean mask)"
    if packet is aten.repeat_interleave and kwargs.get("output_size") is None:
        return "repeat_interleave (no output_size)"
    if packet is aten.segment_reduce and not kwargs.get("unsafe", False):
        return "segment_reduce (unsafe=False)"
    return None


def _is_cpu(d) -> bool:
    return (isinstance(d, str) and d.split(":")[0] == "cpu") or (isinstance(d, torch.device) and d.type == "cpu")


class SyncCounter(TorchDispatchMode):
    """``with SyncCounter() as c: ...`` then ``c.events`` (list of (what, where)) and ``c.count``."""

    def __init__(self):
        super().__init__()
        self.events: list[tuple[str, str]] = []
        self._host: dict[int, weakref.ref] = {}  # id -> tensor: copies on the host (reading them is free)
        self._saved = {}

    def is_host(self, t) -> bool:
        ref = self._host.get(id(t))
        return ref is not None and ref() is t

    def mark_host(self, t) -> None:
        self._host[id(t)] = weakref.ref(t)

    @property
    def count(self) -> int:
        return len(self.events)

    def by_kind(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for what, _ in self.events:
            out[what] = out.get(what, 0) + 1
        return out

    def note(self, what: str) -> None:
        self.events.append((what, where()))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = sync_op(func, args, kwargs)
        if name is not None:
            self.note(f"aten.{name}")
        return func(*args, **kwargs)

    # ------------------------------------------------------------------ patched methods
    def _patch(self):
        T = torch.Tensor
        counter = self
        orig = {k: getattr(T, k) for k in ("cpu", "to", "tolist", "numpy")}
        orig_tensor, orig_as_tensor = torch.tensor, torch.as_tensor
        self._saved = {"T": orig, "tensor": orig_tensor, "as_tensor": orig_as_tensor}

        def cpu(t, *a, **k):
            out = orig["cpu"](t, *a, **k)
            if not k.get("non_blocking", False):
                counter.note("Tensor.cpu()")
            counter.mark_host(out)
            return out

        def to(t, *a, **k):
            out = orig["to"](t, *a, **k)
            dev = k.get("device", next((x for x in a if isinstance(x, (str, torch.device))), None))
            nb = k.get("non_blocking", any(x is True for x in a if isinstance(x, bool)))
            if _is_cpu(dev):
                if not nb and not counter.is_host(t):
                    counter.note("Tensor.to(cpu)")
                counter.mark_host(out)
            return out

        def reader(name):
            def read(t, *a, **k):
                if not counter.is_host(t):
                    counter.note(f"Tensor.{name}()")
                return orig[name](t, *a, **k)
            return read

        def constructor(name, fn):
            def make(data, *a, **k):
                if k.get("device") is not None and not isinstance(data, torch.Tensor):
                    counter.note(f"torch.{name}(host data, device=...)")
                return fn(data, *a, **k)
            return make

        T.cpu, T.to = cpu, to
        for name in ("tolist", "numpy"):  # (numpy.asarray(t) calls t.numpy())
            setattr(T, name, reader(name))
        torch.tensor, torch.as_tensor = constructor("tensor", orig_tensor), constructor("as_tensor", orig_as_tensor)

    def _unpatch(self):
        for k, v in self._saved["T"].items():
            setattr(torch.Tensor, k, v)
        torch.tensor, torch.as_tensor = self._saved["tensor"], self._saved["as_tensor"]

    def __enter__(self):
        self._emulate = emulate_accelerator()
        self._emulate.__enter__()
        self._patch()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._unpatch()
            self._emulate.__exit__(*exc)

    def report(self) -> str:
        return "\n".join(f"  {what} at {at}" for what, at in self.events) or "  (none)"
