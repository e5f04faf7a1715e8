"""Progress for people and for logs: a tqdm bar on a terminal, plain lines elsewhere.

When the output is not a terminal (a log file, a pipe, CI), tqdm's carriage returns and escape
codes fill the file with redrawn bars; :func:`progress_bar` then returns a :class:`LineBar`, which
prints one plain line at every tenth of the total (and at the end) and nothing in between."""
from __future__ import annotations

import math
import sys
import time


def is_terminal(stream=None) -> bool:
    """Whether ``stream`` (default: stderr, where tqdm draws) is a terminal."""
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class LineBar:
    """The part of tqdm's interface the kit uses (update, set_postfix, set_postfix_str, n, write,
    refresh, close), printing ``desc: n/total unit (p %), elapsed, postfix`` as plain lines."""

    def __init__(self, total=None, initial: int = 0, desc: str = "", unit: str = "it", every: float = 0.1,
                 file=None, **_):
        self.total, self.n, self.desc, self.unit = total, initial, desc, unit
        self.file = file
        self.postfix = ""
        self._step = max(1, math.ceil((total or 10) * every))
        self._next = (initial // self._step + 1) * self._step
        self._printed = initial
        self._t0 = time.perf_counter()

    def _line(self) -> None:
        pct = f" ({100 * self.n / self.total:.0f} %)" if self.total else ""
        of = f"/{self.total}" if self.total else ""
        post = f", {self.postfix}" if self.postfix else ""
        print(f"{self.desc}: {self.n}{of} {self.unit}{pct}, {time.perf_counter() - self._t0:.0f} s{post}",
              file=self.file or sys.stderr, flush=True)
        self._printed = self.n
        self.postfix = ""  # printed once: a later line without new numbers does not repeat stale ones

    def update(self, k: int = 1) -> None:
        self.n += k
        if self.n >= self._next or (self.total and self.n >= self.total):
            self._line()
            self._next = (self.n // self._step + 1) * self._step

    def set_postfix(self, ordered_dict=None, refresh: bool = True, **kw) -> None:
        self.postfix = ", ".join(f"{k}={v}" for k, v in {**(ordered_dict or {}), **kw}.items())

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix = s

    def refresh(self) -> None:
        pass

    @staticmethod
    def write(s: str, file=None) -> None:
        print(s, file=file or sys.stdout, flush=True)

    def close(self) -> None:
        if self.n != self._printed:
            self._line()


def progress_bar(total=None, *, desc: str = "", unit: str = "it", initial: int = 0, disable: bool = False,
                 **tqdm_kw):
    """A tqdm bar on a terminal; a :class:`LineBar` when stderr is not one; a disabled tqdm bar
    (silent, but ``write`` still prints) when ``disable``."""
    from tqdm import tqdm

    if disable or is_terminal():
        return tqdm(total=total, desc=desc, unit=unit, initial=initial, disable=disable, **tqdm_kw)
    return LineBar(total=total, initial=initial, desc=desc, unit=unit)
