"""A named registry of functions (scorers, quota policies, placement policies)."""
from __future__ import annotations

from typing import Callable


class Registry:
    """``register(name, fn)`` (also a decorator), ``get(name)``, ``names()``.

    ``kind`` names the entries in error messages; ``loader`` (optional) is called before a lookup
    misses, to import built-in entries lazily."""

    def __init__(self, kind: str, loader: Callable[[], None] | None = None):
        self.kind, self._loader, self._fns = kind, loader, {}

    def register(self, name: str, fn: Callable | None = None):
        def _register(f: Callable) -> Callable:
            if not isinstance(name, str) or not name:
                raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")
            if not callable(f):
                raise ValueError(f"{self.kind} {name!r} must be callable, got {type(f).__name__}")
            self._fns[name] = f
            return f

        return _register(fn) if fn is not None else _register

    def names(self) -> list[str]:
        if self._loader is not None:
            self._loader()
        return sorted(self._fns)

    def get(self, name: str) -> Callable:
        if isinstance(name, str) and name not in self._fns and self._loader is not None:
            self._loader()
        if not isinstance(name, str) or name not in self._fns:
            raise ValueError(f"unknown {self.kind} {name!r}; registered: {sorted(self._fns)}")
        return self._fns[name]

    def __contains__(self, name: str) -> bool:
        return name in self.names()
