"""The package's layering holds: no import cycle, no import against the layer order, no private
name used across modules, and the planners (and what the simulator needs) import without torch."""
import subprocess
import sys
import textwrap

import import_graph as ig
import pytest


@pytest.fixture(scope="module")
def graph():
    return ig.build_graph()


def test_every_module_has_a_layer(graph):
    g, _ = graph
    assert len(g) > 40
    missing = []
    for m in g:
        try:
            ig.layer_of(m)
        except KeyError as e:
            missing.append(str(e))
    assert not missing, "\n".join(missing)


def test_no_import_cycle(graph):
    cycles = ig.find_cycles(ig.with_package_inits(graph[0]))
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_no_import_against_the_layer_order(graph):
    up = ig.upward_imports(graph[0])
    assert not up, "imports against the layer order (tests/architecture/import_graph.py LAYERS):\n" + "\n".join(up)


def test_no_private_name_crosses_modules(graph):
    private = graph[1]
    assert not private, "\n".join(f"{mod} uses {name} (line {ln})" for mod, name, ln in private)


def test_the_checks_detect_what_they_forbid():
    """The graph checks can fail: a synthetic cycle, an upward import and a private import are found."""
    g = {"lrmoe.kernels.a": [("lrmoe.kernels.b", 1)], "lrmoe.kernels.b": [("lrmoe.kernels.a", 2)],
         "lrmoe.planning.x": [("lrmoe.experts", 3)]}
    assert ig.find_cycles(g) == [["lrmoe.kernels.a", "lrmoe.kernels.b"]]
    # a package init that imports a module which imports a sibling through the package
    g2 = {"lrmoe.planning": [("baselines.symi", 1)], "baselines.symi": [("lrmoe.planning.plan", 2)],
          "lrmoe.planning.plan": [], "lrmoe": [], "baselines": []}
    assert ig.find_cycles(g2) == []
    assert ig.find_cycles(ig.with_package_inits(g2)) == [["baselines.symi", "lrmoe.planning"]]
    assert ig.upward_imports(g) == ["lrmoe.planning.x (layer planning) imports lrmoe.experts (layer experts) at line 3"]
    known = {"lrmoe", "lrmoe.train", "lrmoe.train.loop", "lrmoe.kernels", "lrmoe.kernels.routing"}
    v = ig.Imports("lrmoe.train.ep", False, known)
    v.visit(ig.ast.parse(textwrap.dedent("""
        from .loop import _secret, public
        from .loop import Config
        import lrmoe.kernels.routing as R
        def f():
            import importlib
            importlib.import_module("lrmoe.kernels")
            __import__("lrmoe")
            return R._private_helper, Config._HELP, Config.__name__
        CMD = ["python", "-m", "lrmoe.kernels"]
    """)))
    assert sorted(v.edges) == [("lrmoe", 8), ("lrmoe.kernels", 7), ("lrmoe.kernels", 7), ("lrmoe.kernels.routing", 4),
                               ("lrmoe.train.loop", 2), ("lrmoe.train.loop", 2), ("lrmoe.train.loop", 3)]
    assert v.private == [("lrmoe.train.loop._secret", 2), ("lrmoe.kernels.routing._private_helper", 9),
                         ("lrmoe.train.loop.Config._HELP", 9)]


def test_planners_import_without_torch():
    """Every planner module (and the base layer the simulator uses) imports in a fresh interpreter
    where torch cannot be imported at all, and leaves torch unloaded."""
    mods = ig.torch_free_modules()
    assert "lrmoe.planning.policies" in mods and "baselines.ultraep" in mods
    code = textwrap.dedent(f"""
        import importlib, importlib.abc, sys
        class NoTorch(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.split(".")[0] in ("torch", "triton", "transformers"):
                    raise ImportError(f"{{name}} is blocked in this test")
        sys.meta_path.insert(0, NoTorch())
        for m in {mods!r}:
            importlib.import_module(m)
        import lrmoe.planning.policies as P
        assert set(P.placement_policies()) >= {{"fixed", "symi", "ultraep", "ultraep_greedy", "lrmoe"}}
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "triton", "transformers"))
        assert not loaded, loaded
        print("ok", len({mods!r}))
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=ig.ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stdout + r.stderr
