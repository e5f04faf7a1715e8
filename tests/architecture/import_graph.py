"""The kit's import graph, built from the AST of every module (function-local imports and
``importlib`` / lazy-map module strings included), and the layer order it must follow.

The layer order is docs/architecture.md's picture as data: a module may import modules of its own
layer or of lower layers, never of a higher one, and the graph has no cycle."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("lrmoe", "baselines", "paper_figures", "ablations")

# bottom to top; a module belongs to the layer of its longest matching prefix.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("lrmoe.registry", "lrmoe.files", "lrmoe.environment", "lrmoe.run_folder", "lrmoe.stats",
              "lrmoe.recompute", "lrmoe.console", "lrmoe.interrupts")),
    ("planning", ("lrmoe.planning", "baselines")),
    ("sim", ("lrmoe.sim",)),
    ("kernels", ("lrmoe.kernels",)),
    ("selection", ("lrmoe.scorers", "lrmoe.quota", "lrmoe.policy")),
    ("experts", ("lrmoe.experts",)),
    ("modules", ("lrmoe.layer", "lrmoe.router")),
    ("api", ("lrmoe",)),  # the package facade: lazy names of the layers below
    ("parallel", ("lrmoe.parallel",)),
    ("train", ("lrmoe.data", "lrmoe.hf", "lrmoe.train")),
    ("runs", ("lrmoe.runs", "lrmoe.bench")),
    ("figures", ("paper_figures",)),
    ("experiments", ("lrmoe.reproduce", "lrmoe.ablate", "ablations", "lrmoe.sim.cli")),  # lrmoe.sim.cli: `lrmoe simulate`
    ("scripts", ("scripts",)),
    ("cli", ("lrmoe.cli",)),
]
# Modules that must import without torch (the planners and everything the simulator needs).
# ``lrmoe`` itself (the lazy facade) and every module under the other prefixes.
TORCH_FREE = ("lrmoe.registry", "lrmoe.files", "lrmoe.environment", "lrmoe.run_folder", "lrmoe.stats",
              "lrmoe.recompute", "lrmoe.planning", "baselines", "lrmoe.sim")


def torch_free_modules() -> list[str]:
    return ["lrmoe"] + sorted(m for m in module_files() if any(m == p or m.startswith(p + ".") for p in TORCH_FREE))


def module_files() -> dict[str, Path]:
    """module name -> file, for every module of the packages and every script."""
    out = {}
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")) if (ROOT / pkg).is_dir() else []:
            parts = list(f.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = f
    for f in sorted((ROOT / "scripts").glob("*.py")):
        out[f"scripts.{f.stem}"] = f
    return out


def layer_of(module: str) -> int:
    best, best_len = None, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best_len:
                best, best_len = i, len(p)
    if best is None:
        raise KeyError(f"module {module} belongs to no layer of tests/architecture/import_graph.py")
    return best


def _resolve(importer: str, is_package: bool, level: int, module: str | None) -> str:
    if level == 0:
        return module or ""
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


class Imports(ast.NodeVisitor):
    """Collects (target module, line, imported names) for every import of one module."""

    def __init__(self, name: str, is_package: bool, known: set[str]):
        self.name, self.is_package, self.known = name, is_package, known
        self.edges: list[tuple[str, int]] = []
        self.private: list[tuple[str, int]] = []
        self.aliases: dict[str, str] = {}  # local name -> the kit module (or module.name) it is bound to

    def _add(self, target: str, line: int):
        # the longest known module prefix of the target (``pkg.mod.attr`` -> ``pkg.mod``)
        parts = target.split(".")
        for n in range(len(parts), 0, -1):
            cand = ".".join(parts[:n])
            if cand in self.known:
                self.edges.append((cand, line))
                return

    def visit_Import(self, node):
        for a in node.names:
            self._add(a.name, node.lineno)
            if a.asname and a.name in self.known:
                self.aliases[a.asname] = a.name

    def visit_ImportFrom(self, node):
        base = _resolve(self.name, self.is_package, node.level, node.module)
        for a in node.names:
            full = f"{base}.{a.name}" if base else a.name
            if full in self.known:
                self._add(full, node.lineno)
                self.aliases[a.asname or a.name] = full
            else:
                self._add(base, node.lineno)
                if base.split(".")[0] in PACKAGES:
                    # a class or function of the kit: Name._private counts as crossing too
                    self.aliases[a.asname or a.name] = full
                    if a.name.startswith("_") and not a.name.startswith("__"):
                        self.private.append((full, node.lineno))

    def visit_Constant(self, node):
        # importlib.import_module("pkg.mod") and lazy maps {"Name": "pkg.mod"}: any dotted string that
        # names a module of the kit
        if isinstance(node.value, str) and "." in node.value and node.value in self.known:
            self.edges.append((node.value, node.lineno))

    def visit_Call(self, node):
        # importlib.import_module("pkg") / __import__("pkg"), dotted or not
        fn = node.func
        name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else None
        if name in ("import_module", "__import__", "find_spec") and node.args \
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            self._add(node.args[0].value, node.lineno)
        self.generic_visit(node)

    def visit_Attribute(self, node):
        # module._private or Name._private, where module / Name was bound by an import from the kit
        if isinstance(node.value, ast.Name) and node.value.id in self.aliases and node.attr.startswith("_") \
                and not node.attr.startswith("__"):
            self.private.append((f"{self.aliases[node.value.id]}.{node.attr}", node.lineno))
        self.generic_visit(node)

    def _sequence(self, node):
        # ["python", "-m", "pkg.mod", ...] starts a process; it does not import the module
        prev = None
        for el in node.elts:
            if not (isinstance(prev, ast.Constant) and prev.value == "-m"):
                self.visit(el)
            prev = el

    visit_List = visit_Tuple = _sequence


def ancestors(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:n]) for n in range(1, len(parts))]


def build_graph() -> tuple[dict[str, list[tuple[str, int]]], list[tuple[str, str, int]]]:
    """module -> [(imported module, line)], and every private name imported across modules."""
    files = module_files()
    known = set(files)
    graph, private = {}, []
    for name, f in files.items():
        v = Imports(name, f.name == "__init__.py", known)
        v.visit(ast.parse(f.read_text(), str(f)))
        graph[name] = [(t, ln) for t, ln in v.edges if t != name]
        private += [(name, what, ln) for what, ln in v.private]
    return graph, private


def with_package_inits(graph):
    """The graph plus the imports Python makes implicitly: importing ``a.b.c`` first runs the
    ``__init__`` of ``a`` and ``a.b`` (except the importer's own packages, already running). These
    edges can close a cycle (``a/__init__`` imports a module that imports ``a.x``), so the cycle
    check uses them; the layer check does not (a package facade sits above what it re-exports)."""
    out = {}
    for mod, edges in graph.items():
        mine = set(ancestors(mod))
        extra = [(a, ln) for t, ln in edges for a in ancestors(t) if a not in mine and a in graph]
        out[mod] = edges + extra
    return out


def find_cycles(graph: dict[str, list[tuple[str, int]]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w, _ in graph.get(v, []):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def upward_imports(graph) -> list[str]:
    out = []
    for mod, edges in sorted(graph.items()):
        for target, line in edges:
            if layer_of(target) > layer_of(mod):
                out.append(f"{mod} (layer {LAYERS[layer_of(mod)][0]}) imports {target} "
                           f"(layer {LAYERS[layer_of(target)][0]}) at line {line}")
    return out
