"""The planners' compiler: :func:`njit`, numba's ``njit`` with the options every planner loop uses.

``nogil=True`` (a caller may plan on a thread beside the GPU's work; planning from several threads at once
gives the plans of the same calls made one at a time: ``tests/planning/test_planners.py``) and ``cache=True`` (the
machine code is written once and reloaded by later processes). Where the cache lives is numba's
rule: ``__pycache__`` beside the source file when that folder is writable, else a per-user cache
folder (``~/.cache/numba`` style), or ``NUMBA_CACHE_DIR`` when set. Where none of them is writable
(a read-only install whose user has no writable cache folder) numba refuses ``cache=True`` when the
function is defined; :func:`njit` then compiles without a cache (in each new process, about 80 s for
every policy on 2 cores) and warns once, naming ``NUMBA_CACHE_DIR``. Numba keys a cached function
by its own source file only: after editing a compiled helper that another module's functions call
(``plan.heap_push``, say), delete the stale machine code (``find lrmoe baselines -name '*.nb[ic]' -delete``)
or the callers keep running the old helper. ``NUMBA_DISABLE_JIT=1`` runs
the same functions as plain Python (slow; useful to step through them in a debugger).

The compiled functions take and return numpy arrays and scalars only; the planners keep their
types (:class:`~lrmoe.planning.plan.Plan`) in Python around them. Each has a plain-Python
reference (``lrmoe.planning.reference`` or the uncompiled ``.py_func``) that tests compare with.
"""
from __future__ import annotations

try:
    import numba
except ImportError as exc:  # a broken install, not an optional feature
    raise ImportError("lrmoe's planners need numba (pip install numba; it is a dependency of the lrmoe "
                      "package, so `pip install -e .` brings it)") from exc

import warnings

__all__ = ["njit", "numba"]

_warned: list[bool] = []  # the no-cache warning, given once per process


def njit(fn=None, **options):
    """``numba.njit`` with ``nogil=True, cache=True`` unless given; usable bare or with options.
    Without a writable cache location the function is compiled uncached (module docstring)."""
    options.setdefault("nogil", True)
    options.setdefault("cache", True)
    if fn is None:
        return lambda f: _compile(f, options)
    return _compile(fn, options)


def _compile(fn, options: dict):
    try:
        return numba.njit(**options)(fn)
    except RuntimeError as exc:  # numba: "cannot cache function ...: no locator available for file ..."
        if not options.get("cache") or "cannot cache" not in str(exc):
            raise
        if not _warned:
            _warned.append(True)
            warnings.warn(f"numba cannot write its cache anywhere ({exc}); the planners compile in every "
                          f"process instead (about 80 s on 2 cores). Set NUMBA_CACHE_DIR to a writable folder "
                          f"to keep the machine code.", RuntimeWarning, stacklevel=3)
        return numba.njit(**{**options, "cache": False})(fn)
