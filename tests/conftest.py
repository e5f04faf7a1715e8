"""Test-session set-up. Runs before any test module imports lrmoe."""
import os
import random
import sys
from pathlib import Path

import pytest
import torch

# The shared test helpers (oracle.py, dist_helpers.py) live in tests/; the tests in its subfolders
# (one per layer of the package) import them by name.
sys.path.insert(0, str(Path(__file__).parent))

# Triton kernels run on CPU tensors under the interpreter; it must be switched on before any
# kernel is defined (i.e. before lrmoe.kernels.triton_* is imported). On a CUDA machine the
# real compiler is used.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(min(2, torch.get_num_threads()))


# ----------------------------------------------------------------------------- the planners' compile
# A fresh clone has no numba cache: tests/warm_planners.py compiles the planners in the background
# while the test folders that plan nothing run first; the first test of any other folder waits for
# it (so two EP ranks do not both compile the same functions at once). LRMOE_WARM_PLANNERS=0: off.
PLANNER_FREE = ("architecture", "base", "cli", "kernels", "ablate")  # checked: they compile no planner
_warm: dict = {}


def _folder(item) -> str:
    try:
        return Path(str(item.fspath)).resolve().relative_to(Path(__file__).parent.resolve()).parts[0]
    except ValueError:
        return ""


def pytest_sessionstart(session):
    if os.environ.get("LRMOE_WARM_PLANNERS", "1") == "0":
        return
    import subprocess

    _warm["proc"] = subprocess.Popen([sys.executable, str(Path(__file__).parent / "warm_planners.py")],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _wait_for_warm_up() -> None:
    proc = _warm.pop("proc", None)
    if proc is None:
        return
    try:
        _, err = proc.communicate(timeout=900)
    except Exception:  # noqa: BLE001 - a stuck warm-up: the tests compile what they need themselves
        proc.kill()
        return
    if proc.returncode != 0:
        import warnings

        warnings.warn(f"tests/warm_planners.py failed (exit {proc.returncode}); the tests compile the planners "
                      f"themselves:\n{err[-2000:]}")


def pytest_runtest_setup(item):
    if "proc" in _warm and _folder(item) not in PLANNER_FREE:
        _wait_for_warm_up()


def pytest_sessionfinish(session, exitstatus):
    proc = _warm.pop("proc", None)
    if proc is not None and proc.poll() is None:
        proc.kill()


def pytest_collection_modifyitems(config, items):
    # the folders that plan nothing first (in their order), beside the planners' warm-up
    items.sort(key=lambda item: _folder(item) not in PLANNER_FREE)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none on this machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def rng_seed(request):
    """Seeds torch's global RNG per test from the test id: inputs are fresh for every test (and
    every parametrisation) yet a failure reproduces exactly on rerun."""
    import zlib

    seed = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(seed)
    random.seed(seed)
    return seed


@pytest.fixture
def isolated_caches(tmp_path, monkeypatch):
    """Hugging Face and kit caches in the test's own folder; no Alpaca location from the caller's
    environment (tests that prepare data use it with ``pytest.mark.usefixtures``)."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("LRMOE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("HF_DATASETS_CACHE", raising=False)
    monkeypatch.delenv("LRMOE_ALPACA", raising=False)
