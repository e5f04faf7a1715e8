"""lrmoe.registry.Registry: explicit built-ins, no silent replacement, clear errors."""
import pytest

from lrmoe.registry import Registry


def f(x):
    return x


def g(x):
    return -x


def test_builtins_are_there_without_any_import():
    r = Registry("thing", builtins={"a": f, "b": g})
    assert r.names() == ["a", "b"] and r.get("a") is f and "b" in r and "c" not in r


def test_registering_an_existing_name_raises_unless_override():
    r = Registry("thing", builtins={"a": f})
    with pytest.raises(ValueError, match=r"thing 'a' is already registered \(.*\.f\); pass override=True"):
        r.register("a", g)
    assert r.get("a") is f
    r.register("a", g, override=True)
    assert r.get("a") is g
    r.register("a", g)  # the same function again is not a conflict
    assert r.get("a") is g


def test_decorator_unregister_and_errors():
    r = Registry("scorer")

    @r.register("mine")
    def mine(x):
        return x

    assert r.get("mine") is mine
    r.unregister("mine")
    with pytest.raises(ValueError, match=r"unknown scorer 'mine'; registered: \[\]"):
        r.get("mine")
    with pytest.raises(ValueError, match="unknown scorer 'mine'"):
        r.unregister("mine")
    with pytest.raises(ValueError, match="non-empty string"):
        r.register("", f)
    with pytest.raises(ValueError, match="must be callable, got int"):
        r.register("x", 3)
    with pytest.raises(ValueError, match="unknown scorer 3"):
        r.get(3)
