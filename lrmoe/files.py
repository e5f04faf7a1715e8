"""Atomic file writes and tolerant-but-strict readers (standard library only).

Every file the kit writes goes through :func:`atomic_write`: the bytes go to a temporary file in
the same folder, are flushed and fsynced, and the temporary file is renamed over the target, so a
reader (or a run killed at any moment) sees the old file or the new one, never half of one. On any
failure the temporary file is removed and the error propagates.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import IO, Callable


def atomic_write(path, write: Callable[[IO[bytes]], None]) -> Path:
    """Call ``write(f)`` on a binary temporary file beside ``path``, fsync it, rename it over ``path``.

    ``write`` may be anything that writes to a file object (``torch.save(obj, f)``,
    ``fig.savefig(f, format=...)``, ``f.write(data)``). Parent folders are created."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        # mkstemp makes the file owner-only (0600); give it the mode a plain open() would (0666 & ~umask)
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_bytes(path, data: bytes) -> Path:
    return atomic_write(path, lambda f: f.write(data))


def write_text(path, text: str) -> Path:
    return write_bytes(path, text.encode())


def write_json(path, payload) -> Path:
    """Atomic JSON write (indent 2; values JSON cannot hold are written with ``str``)."""
    return write_text(path, json.dumps(payload, indent=2, default=str))


class CorruptFileError(ValueError):
    """A file exists but cannot be decoded; the message names the file (and the line)."""


def read_json(path, missing=None):
    """The decoded JSON of ``path``; ``missing`` if it does not exist; :class:`CorruptFileError`
    (naming the file) if it exists but cannot be read or decoded."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        return missing
    except (OSError, UnicodeDecodeError) as e:
        raise CorruptFileError(f"{path}: cannot be read ({e})") from e
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise CorruptFileError(f"{path}: not valid JSON ({e})") from e


def read_jsonl(path) -> list:
    """The records of a JSON-lines file ([] if it does not exist).

    Only a torn *last* line (what a process killed in the middle of an append leaves) is dropped;
    an undecodable line anywhere else raises :class:`CorruptFileError` naming the line, because
    dropping it (or everything after it) would silently lose records."""
    path = Path(path)
    try:
        lines = path.read_bytes().split(b"\n")
    except FileNotFoundError:
        return []
    if lines and lines[-1] == b"":
        lines.pop()  # the newline that ends the last record
    out = []
    for i, line in enumerate(lines):
        try:
            out.append(json.loads(line))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            if i == len(lines) - 1:
                break  # a torn last line
            raise CorruptFileError(f"{path}: line {i + 1} of {len(lines)} is not valid JSON ({e}); only a torn "
                                   f"last line may be dropped, so this file needs repair") from e
    return out

