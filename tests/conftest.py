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
import background  # noqa: E402 - tests/ on the path first

# Triton kernels run on CPU tensors under the interpreter; it must be switched on before any
# kernel is defined (i.e. before lrmoe.kernels.triton_* is imported). On a CUDA machine the
# real compiler is used.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(min(2, torch.get_num_threads()))


# ----------------------------------------------------------------------------- beside the tests
# A fresh clone has no numba cache: tests/warm_planners.py compiles the planners in the background
# while the test folders that plan nothing run first; the first test of any other folder waits for
# it (so two EP ranks do not both compile the same functions at once). Then the same background
# (tests/background.py) runs the sm_90 Triton compile check, whose module runs last.
# LRMOE_WARM_PLANNERS=0: no background (each module does its own work).
PLANNER_FREE = ("architecture", "base", "cli", "kernels", "ablate")  # checked: they compile no planner
LAST = (background.TRITON_CHECK_MODULE,)  # modules that read a background job's output
_state: dict = {}


def _folder(item) -> str:
    parts = _parts(item)
    return parts[0] if parts else ""


def _parts(item) -> tuple:
    try:
        return Path(str(item.fspath)).resolve().relative_to(Path(__file__).parent.resolve()).parts
    except ValueError:
        return ()


def pytest_sessionstart(session):
    if os.environ.get("LRMOE_WARM_PLANNERS", "1") == "0":
        return
    bg = background.Background([sys.executable, str(Path(__file__).parent / "warm_planners.py")])
    bg.start()
    session.config.stash[background.KEY] = _state["bg"] = bg


def pytest_collection_finish(session):
    """The background's jobs: those whose module is among the tests that will run."""
    bg = _state.get("bg")
    if bg is None:
        return
    modules = {"/".join(_parts(item)[:2]) for item in session.items}
    if background.TRITON_CHECK_MODULE in modules:
        bg.add("triton_sm90", lambda out: background.triton_check_argv(out, jobs=1),
               background.triton_check_env(bg.root / "triton_sm90"), timeout_s=600)
    bg.close_registration()


def pytest_runtest_setup(item):
    bg = _state.get("bg")
    if bg is not None and _folder(item) not in PLANNER_FREE:
        bg.wait_for_warm_up()


def pytest_sessionfinish(session, exitstatus):
    bg = _state.pop("bg", None)
    if bg is not None:
        bg.stop()


def pytest_collection_modifyitems(config, items):
    # the folders that plan nothing first (in their order), beside the planners' warm-up; the modules
    # that read a background job's output last
    items.sort(key=lambda item: ("/".join(_parts(item)[:2]) in LAST, _folder(item) not in PLANNER_FREE))
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
