"""Where the planners' machine code lives (lrmoe.planning.jit): numba's on-disk cache is written once
and loaded by the next process; where no cache location is writable (a read-only install whose user
has no writable cache folder) the planners still import and run, compiled in the process, with one
warning naming NUMBA_CACHE_DIR. Each case runs in a fresh process (numba decides the cache location
when a function is defined, at import)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# one small compiled planner helper, called; what numba says of its cache
CALL = """
import json, warnings
import numpy as np
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from lrmoe.planning import policies  # every policy's module: every compiled function is defined
    from lrmoe.planning.plan import nonnegative_copy
out, low, _, _ = nonnegative_copy(np.arange(6, dtype=np.int64).reshape(2, 3) - 1)
print(json.dumps({"low": int(low), "sum": int(out.sum()), "hits": sum(nonnegative_copy.stats.cache_hits.values()),
                  "misses": sum(nonnegative_copy.stats.cache_misses.values()),
                  "cache": type(nonnegative_copy._cache).__name__,
                  "warnings": [str(w.message) for w in caught if "cannot write its cache" in str(w.message)]}))
"""

# every cache location numba tries refuses to be written (what a read-only install meets)
READ_ONLY = """
import numba.core.caching as caching

def refuse(self, *args):
    raise PermissionError("read-only file system")

caching._CacheLocator.ensure_cache_path = refuse
"""


def run(code: str, env: dict) -> dict:
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_")}
    return {**env, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])]), **extra}


def test_the_cache_is_written_once_and_loaded_by_the_next_process(tmp_path):
    """What docs/placement.md says of the cache (numba's behaviour, kept by lrmoe.planning.jit.njit)."""
    env = clean_env(NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    first = run(CALL, env)
    assert first["low"] == -1 and first["sum"] == 9  # the copy of [-1..4] and its minimum
    assert first["cache"] == "FunctionCache" and not first["warnings"]
    assert first["misses"] == 1 and first["hits"] == 0  # compiled here...
    written = sorted(p.suffix for p in (tmp_path / "numba").rglob("plan.nonnegative_copy-*"))
    assert ".nbi" in written and ".nbc" in written  # ...into NUMBA_CACHE_DIR
    second = run(CALL, env)
    assert second["hits"] == 1 and second["misses"] == 0  # loaded, not compiled again


def test_a_read_only_install_plans_without_a_cache_and_says_so(tmp_path):
    got = run(READ_ONLY + CALL, clean_env())
    assert got["low"] == -1 and got["sum"] == 9 and got["hits"] == 0  # compiled in the process...
    assert got["cache"] == "NullCache"  # ...with no cache
    assert len(got["warnings"]) == 1, got["warnings"]  # once, not once per function
    assert "NUMBA_CACHE_DIR" in got["warnings"][0]
