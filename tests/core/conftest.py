"""Fixtures of the core tests: temporary registry entries, removed after the test."""
import pytest

from lrmoe.quota import register_quota_policy, unregister_quota_policy
from lrmoe.scorers import register_scorer, unregister_scorer


def _temporary(register, unregister):
    names = []

    def add(name, fn):
        register(name, fn)
        names.append(name)
        return fn

    yield add
    for name in names:
        unregister(name)


@pytest.fixture
def temporary_scorer():
    """``temporary_scorer(name, fn)`` registers a scorer for one test."""
    yield from _temporary(register_scorer, unregister_scorer)


@pytest.fixture
def temporary_quota_policy():
    """``temporary_quota_policy(name, fn)`` registers a quota policy for one test."""
    yield from _temporary(register_quota_policy, unregister_quota_policy)
