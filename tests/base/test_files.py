"""lrmoe.files: atomic writes (fsync, rename, no temporary file left on failure) and strict readers."""
import json
import os

import pytest

from lrmoe import files
from lrmoe.files import CorruptFileError, atomic_write, read_json, read_jsonl, write_json, write_text


def _leftovers(d):
    return sorted(p.name for p in d.iterdir() if p.name.endswith(".tmp"))


def test_write_and_read_back(tmp_path):
    p = write_json(tmp_path / "a" / "b.json", {"x": 1, "path": tmp_path})
    assert read_json(p) == {"x": 1, "path": str(tmp_path)}
    write_text(p, "[1, 2]")
    assert read_json(p) == [1, 2]
    assert _leftovers(p.parent) == []


def test_failed_write_keeps_the_old_file_and_removes_the_temporary(tmp_path):
    p = write_text(tmp_path / "x.txt", "old")

    def boom(f):
        f.write(b"half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_write(p, boom)
    assert p.read_text() == "old"
    assert _leftovers(tmp_path) == []


def test_interrupt_during_write_removes_the_temporary(tmp_path):
    def interrupted(f):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(tmp_path / "y.bin", interrupted)
    assert not (tmp_path / "y.bin").exists() and _leftovers(tmp_path) == []


def test_write_is_fsynced_before_the_rename(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(files.os, "fsync", lambda fd: (events.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(files.os, "replace", lambda a, b: (events.append("replace"), real_replace(a, b))[1])
    write_text(tmp_path / "z.txt", "data")
    assert events == ["fsync", "replace"]


def test_read_json_missing_and_corrupt(tmp_path):
    assert read_json(tmp_path / "none.json") is None
    assert read_json(tmp_path / "none.json", missing={}) == {}
    bad = tmp_path / "bad.json"
    bad.write_text('{"status": "do')
    with pytest.raises(CorruptFileError, match="bad.json: not valid JSON"):
        read_json(bad)
    bad.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(CorruptFileError, match="bad.json"):
        read_json(bad)
    bom = tmp_path / "bom.json"
    bom.write_bytes(b"\xef\xbb\xbf" + json.dumps({"a": 1}).encode())
    assert read_json(bom) == {"a": 1}


def _jsonl(path, rows, tail=b""):
    path.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in rows) + tail)
    return path


def test_read_jsonl_drops_only_a_torn_last_line(tmp_path):
    rows = [{"step": i} for i in range(1, 6)]
    p = _jsonl(tmp_path / "m.jsonl", rows)
    assert read_jsonl(p) == rows
    _jsonl(p, rows, tail=b'{"step": 6, "lo')
    assert read_jsonl(p) == rows
    assert read_jsonl(tmp_path / "missing.jsonl") == []


@pytest.mark.parametrize("where", [0, 2, 4])
def test_read_jsonl_refuses_a_bad_line_that_is_not_the_last(tmp_path, where):
    lines = [json.dumps({"step": i}).encode() for i in range(1, 7)]
    lines[where] = b'{"step": garbage'
    p = tmp_path / "m.jsonl"
    p.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(CorruptFileError, match=rf"m.jsonl: line {where + 1} of 6 is not valid JSON"):
        read_jsonl(p)


def test_written_files_get_the_mode_a_plain_open_gives(tmp_path):
    old = os.umask(0o022)
    try:
        p = write_text(tmp_path / "shared.json", "{}")
        plain = tmp_path / "plain.json"
        plain.write_text("{}")
    finally:
        os.umask(old)
    assert (p.stat().st_mode & 0o777) == (plain.stat().st_mode & 0o777) == 0o644
