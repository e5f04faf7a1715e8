"""A named registry of functions (scorers, quota policies, placement policies, figure makers).

Built-in entries are passed explicitly when the registry is made, so what a name means never
depends on which modules happen to have been imported. Users add their own with ``register``;
registering a name that exists raises unless ``override=True``."""
from __future__ import annotations

from typing import Callable


class Registry:
    """``register(name, fn, *, override=False)`` (also a decorator), ``get(name)``, ``names()``.

    ``kind`` names the entries in error messages; ``builtins`` maps names to the built-in entries."""

    def __init__(self, kind: str, builtins: dict[str, Callable] | None = None):
        self.kind, self._fns = kind, {}
        for name, fn in (builtins or {}).items():
            self.register(name, fn)

    def register(self, name: str, fn: Callable | None = None, *, override: bool = False):
        def _register(f: Callable) -> Callable:
            if not isinstance(name, str) or not name:
                raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")
            if not callable(f):
                raise ValueError(f"{self.kind} {name!r} must be callable, got {type(f).__name__}")
            if name in self._fns and not override and self._fns[name] is not f:
                raise ValueError(f"{self.kind} {name!r} is already registered ({_describe(self._fns[name])}); "
                                 f"pass override=True to replace it")
            self._fns[name] = f
            return f

        return _register(fn) if fn is not None else _register

    def unregister(self, name: str) -> None:
        """Remove a user entry (tests and notebooks that register temporary entries)."""
        if name not in self._fns:
            raise ValueError(f"unknown {self.kind} {name!r}; registered: {self.names()}")
        del self._fns[name]

    def names(self) -> list[str]:
        return sorted(self._fns)

    def get(self, name: str) -> Callable:
        if not isinstance(name, str) or name not in self._fns:
            raise ValueError(f"unknown {self.kind} {name!r}; registered: {self.names()}")
        return self._fns[name]

    def __contains__(self, name: str) -> bool:
        return name in self._fns


def _describe(fn) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
