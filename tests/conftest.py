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


def pytest_collection_modifyitems(config, items):
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
