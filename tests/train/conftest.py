"""Fixtures of the training-layer tests: isolated caches, the offline Alpaca sample."""
import pytest

from .helpers import TINY


@pytest.fixture(autouse=True)
def _isolated_caches(tmp_path_factory, monkeypatch):
    base = tmp_path_factory.getbasetemp()
    monkeypatch.setenv("HF_HOME", str(base / "hf"))
    monkeypatch.setenv("LRMOE_CACHE", str(base / "lrmoe_cache"))
    monkeypatch.delenv("HF_DATASETS_CACHE", raising=False)


@pytest.fixture(scope="module")
def data_path():
    if not TINY.exists():
        pytest.skip(f"offline Alpaca sample not found at {TINY} (set LRMOE_SHARED_DATA to the shared/data folder)")
    return str(TINY)
