"""The makers of the paper's tables and figures, listed explicitly.

``T1``/``T2`` come from :mod:`paper_figures.tables`, ``F1``/``F2`` from :mod:`paper_figures.figures`.
T3-T5, F3 and F4 are listed without a maker (:attr:`Maker.needs` says what they wait for); the
change that produces their measurements passes its maker here, or a user calls
``register("T3", "table", title, fn, override=True)``. Registering a key that exists raises
unless ``override=True``, so what a key makes never depends on which modules were imported."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from . import figures, tables, time_to_target

KINDS = ("table", "figure")
SIM_DIR = "sim"  # <results>/sim/<scenario>/: `lrmoe simulate --scenario all --out <results>/sim`
PROBE_DIR = "probe"  # <results>/probe/: `lrmoe ablate probe --out <results>/probe` (lrmoe.reproduce.probe)
_SIM_NEEDS = ("the cluster simulator's scenarios in <results>/sim/ (`lrmoe simulate --scenario all --out "
              "<results>/sim`; `lrmoe reproduce` runs it)")


def simulated(key: str) -> Callable:
    """The maker of a simulated table/figure: the tables (``.md``) and figures (``.png``) that
    `lrmoe simulate` wrote for ``key`` under ``<results>/sim/<scenario>/`` (every number in them
    labelled simulated, with its hardware model and trace); None when there are none yet."""

    def fn(res, paper, out):
        d = res.dir / SIM_DIR
        files = sorted(d.glob(f"*/tables/{key}_*.md")) + sorted(d.glob(f"*/figures/{key}_*.png"))
        return files or None

    fn.__name__ = f"simulated_{key}"
    return fn


def probed(res, paper, out):
    """Figure A1 and the probe's tables as `lrmoe ablate probe` wrote them into ``<results>/probe/``
    (:mod:`paper_figures.probe`); None when the probe has not been run into the folder."""
    d = res.dir / PROBE_DIR
    files = [f for f in (d / "probe.md", d / "figures" / "figure_a1.png") if f.is_file()]
    return files or None


@dataclass(frozen=True)
class Maker:
    key: str
    kind: str  # "table" or "figure"
    title: str
    fn: Callable | None = None  # fn(results, paper, out_dir) -> list[Path] (None: nothing yet); None: not yet produced
    needs: str = ""  # what must land before it can be produced


BUILTIN = (
    Maker("T1", "table", "Convergence by drop level (C0-C30)", tables.make_t1),
    Maker("T2", "table", "Scorer ablation (mean ΔPPL vs C0 over seeds)", tables.make_t2),
    Maker("T3", "table", "Time to a fixed loss target (cumulative MoE-layer time) per method and model",
          time_to_target.make_t3, needs="E3's runs (every method with its EP semantics; `lrmoe reproduce --preset cpu` "
                                        "trains them with --virtual-ep 8)"),
    Maker("T4", "table", "Memory breakdown per method (expert placement + replicas + token buffers), simulated",
          simulated("T4"), needs=_SIM_NEEDS),
    Maker("T5", "table", "Backward execution latency per MoE layer, simulated", simulated("T5"), needs=_SIM_NEEDS),
    Maker("F1", "figure", "Per-expert demand vs backward quota vs kept (one layer, one step, real routing)",
          figures.make_f1),
    Maker("F2", "figure", "Loss curves C0-C30 per model family", figures.make_f2),
    Maker("F3", "figure", "Effective throughput vs batch-size pressure (1x-20x) per method, simulated",
          simulated("F3"), needs=_SIM_NEEDS),
    Maker("F4", "figure", "Loss vs cumulative MoE-layer time per method", time_to_target.make_f4,
          needs="E3's runs (every method with its EP semantics; `lrmoe reproduce --preset cpu` trains them)"),
    Maker("F5", "figure", "LRMoE against each baseline as skew, budget, EP size and drop ratio vary, simulated",
          simulated("F5"), needs=_SIM_NEEDS),
    Maker("A1", "figure", "Gradient fidelity: relative error of the expert weight gradients against the full "
                          "backward, per scorer, φ and selection rule (the probe; not in the paper)", probed,
          needs="the gradient-fidelity probe in <results>/probe/ (`lrmoe ablate probe --run <results>/qwen3-C00-s0 "
                "--out <results>/probe`; `lrmoe reproduce --preset cpu` runs it)"),
)
MAKERS: dict[str, Maker] = {m.key: m for m in BUILTIN}


def register(key: str, kind: str, title: str, fn: Callable | None = None, needs: str = "", *,
             override: bool = False):
    """Add the maker of a table or figure (``fn(results, paper, out_dir) -> list[Path]``), or list
    one without a maker (``needs``: what it waits for). A key that exists raises a ValueError
    unless ``override=True``. With neither ``fn`` nor ``needs`` it returns a decorator."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if not isinstance(key, str) or not key:
        raise ValueError(f"a maker's key must be a non-empty string, got {key!r}")
    if fn is not None and not callable(fn):
        raise ValueError(f"maker {key!r}: fn must be callable, got {type(fn).__name__}")

    def _set(f):
        if key in MAKERS and not override:
            raise ValueError(f"maker {key!r} is already registered ({MAKERS[key].title!r}); pass override=True "
                             f"to replace it")
        MAKERS[key] = Maker(key, kind, title, f, needs)
        return f

    if fn is None and not needs:
        return _set
    _set(fn)
    return fn


def unregister(key: str) -> None:
    """Remove a maker (tests and notebooks that register temporary ones)."""
    if key not in MAKERS:
        raise ValueError(f"unknown maker {key!r}; registered: {sorted(MAKERS)}")
    del MAKERS[key]


def ordered(only: list[str] | None = None) -> list[Maker]:
    """The makers in report order (tables, then figures; by key), those in ``only`` if given."""
    ms = [m for m in MAKERS.values() if not only or m.key in only]
    return sorted(ms, key=lambda m: (KINDS.index(m.kind), m.key))
