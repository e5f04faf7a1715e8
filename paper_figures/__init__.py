"""Tables and figures of the paper, regenerated from results files only.

    from paper_figures import make_all
    make_all("results/cpu", "results/cpu")   # -> tables/*.md|.tex, figures/*.png|.pdf, report.md

Inputs are the run folders written by ``lrmoe train`` / ``lrmoe reproduce`` (``summary.json``,
``metrics.jsonl``, optionally the preset's ``manifest.json``) and ``paper_numbers.json`` (every
number of the paper's "Reported results"). Nothing else is read, and nothing is made up: a cell
whose runs are missing or unfinished says "not run".

Makers live in a registry (:func:`register`): ``T1``/``T2`` in :mod:`paper_figures.tables`,
``F1``/``F2`` in :mod:`paper_figures.figures`. T3-T5, F3 and F4 are registered without a maker
("not yet produced"); the issues that produce their measurements add a module to this package
that calls ``register("T3", ..., fn=...)`` and ``make_all`` picks it up (every module of the
package is imported).
"""
from __future__ import annotations

import importlib
import json
import math
import pkgutil
import statistics
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Callable

from lrmoe.files import write_text
from lrmoe.files import read_jsonl as read_metrics  # only a torn last line is dropped

PAPER_NUMBERS = Path(__file__).with_name("paper_numbers.json")
FAMILY_NAMES = {"qwen3": "Qwen3-MoE", "glm4": "GLM-4.5-MoE"}
_FAMILY_OF = {"qwen3_moe": "qwen3", "glm4_moe": "glm4"}
NOT_RUN = "not run"


def paper_numbers() -> dict:
    return json.loads(PAPER_NUMBERS.read_text())


def level_name(drop: float) -> str:
    return f"C{round(drop * 100)}"


# ----------------------------------------------------------------------------- results


def _rows_per_step(config: dict):
    """Rows per optimizer step of a run config (global_batch, else micro_batch x grad_accum)."""
    if config.get("global_batch"):
        return config["global_batch"]
    if "micro_batch" in config:
        return config["micro_batch"] * (config.get("grad_accum") or 1)
    return "?"


@dataclass
class Run:
    name: str
    dir: Path
    summary: dict
    experiments: tuple = ()

    @property
    def config(self) -> dict:
        return self.summary.get("config", {})

    @property
    def done(self) -> bool:
        return self.summary.get("status") == "done"

    @property
    def family(self) -> str:
        fam = self.summary.get("model", {}).get("family", "")
        return _FAMILY_OF.get(fam, fam or "?")

    @property
    def drop(self) -> float:
        return float(self.config.get("drop_ratio", 0.0))

    @property
    def scorer(self) -> str:
        return self.config.get("scorer", "lrm") if self.drop > 0 else "none"

    @property
    def seed(self) -> int:
        return int(self.config.get("seed", 0))

    @cached_property
    def rows(self) -> list[dict]:
        return read_metrics(self.dir / "metrics.jsonl")

    def ppl_window_mean(self, fraction: float = 0.1) -> float | None:
        """Mean per-step training PPL over the final ``fraction`` of the run's steps."""
        steps = int(self.config.get("steps", 0))
        if not self.done or not self.rows or steps <= 0:
            return None
        n = max(1, math.ceil(fraction * steps))
        tail = [r["ppl"] for r in self.rows if r["step"] > steps - n and r.get("ppl") is not None]
        return sum(tail) / len(tail) if tail else None

    def ppl_by_step(self) -> dict[int, float]:
        """PPL per step (steps without response tokens, logged with ppl None, left out)."""
        return {r["step"]: r["ppl"] for r in self.rows if r.get("ppl") is not None}


@dataclass
class Results:
    """Every run under a results folder, plus the preset's manifest when there is one."""

    dir: Path
    runs: dict[str, Run] = field(default_factory=dict)
    manifest: dict | None = None

    @classmethod
    def load(cls, results_dir) -> "Results":
        d = Path(results_dir)
        manifest = None
        if (d / "manifest.json").exists():
            manifest = json.loads((d / "manifest.json").read_text())
        res = cls(d, {}, manifest)
        tags = {r["name"]: tuple(r.get("experiments", ())) for r in (manifest or {}).get("runs", [])}
        for s in sorted(d.glob("*/summary.json")):
            try:
                summary = json.loads(s.read_text())
            except json.JSONDecodeError:
                continue
            name = s.parent.name
            res.runs[name] = Run(name, s.parent, summary, tags.get(name, ()))
        return res

    # -- preset facts
    @property
    def preset(self) -> dict:
        return (self.manifest or {}).get("preset", {})

    @property
    def preset_name(self) -> str:
        return self.preset.get("name") or self.dir.name

    def expected(self, experiment: str) -> list[dict]:
        """Run specs of an experiment according to the manifest ([] without one)."""
        return [r for r in (self.manifest or {}).get("runs", []) if experiment in r.get("experiments", ())]

    def families(self) -> list[str]:
        fams = list(self.preset.get("families", []))
        for r in self.runs.values():
            if r.family not in fams:
                fams.append(r.family)
        return fams

    def model_of(self, family: str) -> str:
        models = self.preset.get("models", {})
        if family in models:
            return models[family]
        for r in self.runs.values():
            if r.family == family:
                return r.config.get("model", "?")
        return "?"

    def seeds(self, key: str, default=(0,)) -> list[int]:
        return list(self.preset.get(key, default))

    def hardware(self) -> str:
        from lrmoe.environment import hardware_label

        labels = sorted({hardware_label(r.summary.get("environment", {}), r.summary.get("distributed"))
                         for r in self.runs.values() if r.done})
        return "; ".join(labels) if labels else "no finished runs"

    def scale(self) -> str:
        """One line describing what was trained (models, data, steps)."""
        base = self.preset.get("base") or (next(iter(self.runs.values())).config if self.runs else {})
        models = ", ".join(self.model_of(f) for f in self.families())
        rec = base.get("max_records")
        data = next((r.summary.get("data", {}) for r in self.runs.values() if r.summary.get("data")), {})
        recs = f"{data.get('train_records', rec or '?')} training records" if data else f"{rec or 'all'} records"
        return (f"{models}; {recs} of Alpaca, seq {base.get('seq_len', '?')}, "
                f"{_rows_per_step(base)} rows/step, {base.get('steps', '?')} steps")

    def find(self, family: str, drop: float, scorer: str | None, seed: int) -> Run | None:
        """The run of ``family`` at drop ratio ``drop`` with ``scorer`` and ``seed``, in the tables'
        setting (compact mode, waterfill quotas). With a manifest only the preset's runs count
        (other runs written into the folder, e.g. an ablation with ``--quota proportional``, never
        replace them); several matches raise a ValueError naming them."""
        named = {r["name"] for r in (self.manifest or {}).get("runs", [])}
        found = []
        for r in self.runs.values():
            if named and r.name not in named:
                continue
            if r.family != family or abs(r.drop - drop) > 1e-9 or r.seed != seed:
                continue
            if drop > 0 and scorer is not None and r.config.get("scorer") != scorer:
                continue
            if drop > 0 and (r.config.get("mode", "compact") != "compact"
                             or r.config.get("quota", "waterfill") != "waterfill"):
                continue
            found.append(r)
        if len(found) > 1:
            raise ValueError(f"{self.dir}: several runs match {family} {level_name(drop)} scorer={scorer} seed={seed}: "
                             f"{[r.name for r in found]}; keep one (or give the folder a manifest.json)")
        return found[0] if found else None


def mean_std(xs: list[float]) -> tuple[float | None, float | None]:
    if not xs:
        return None, None
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else None)


# ----------------------------------------------------------------------------- registry


@dataclass
class Maker:
    key: str
    kind: str  # "table" or "figure"
    title: str
    fn: Callable | None = None  # fn(results, paper, out_dir) -> list[Path]
    needs: str = ""  # what must land before it can be produced


MAKERS: dict[str, Maker] = {}


def register(key: str, kind: str, title: str, fn: Callable | None = None, needs: str = ""):
    """Register (or replace) the maker of a table/figure; usable as a decorator when fn is None."""
    if kind not in ("table", "figure"):
        raise ValueError(f"kind must be 'table' or 'figure', got {kind!r}")

    def _set(f):
        MAKERS[key] = Maker(key, kind, title, f, needs)
        return f

    if fn is None and not needs:
        return _set
    MAKERS[key] = Maker(key, kind, title, fn, needs)
    return fn


register("T3", "table", "Time to a fixed loss target (cumulative MoE-layer time) per method and model",
         needs="expert-parallel training runs of every method on GPUs (the runtime and baselines exist: `lrmoe train --ep N --placement ...`; no preset runs them yet)")
register("T4", "table", "Memory breakdown per method (expert placement + replicas + token buffers)",
         needs="a table maker over the memory model (`lrmoe.planning.memory`, `scripts/bench_ep.py` reports it per plan) at the paper's shapes; not written yet")
register("T5", "table", "Backward execution latency per MoE layer",
         needs="the layer benchmark at the paper's shapes on a GPU (`scripts/gpu_check.sh`)")
register("F3", "figure", "Effective throughput vs batch-size pressure (1x-20x) per method",
         needs="the cluster simulator (not written yet) or EP runs at batch-size pressure on GPUs")
register("F4", "figure", "Loss vs cumulative MoE-layer time per method",
         needs="expert-parallel training runs of every method on GPUs (no preset runs them yet)")


def _load_makers() -> None:
    for mod in pkgutil.iter_modules(__path__):
        if mod.name != "cli":
            importlib.import_module(f"{__name__}.{mod.name}")


def _paper_line(key: str, paper: dict) -> str:
    """The paper's numbers that belong to a table/figure (entries whose ``belongs_to`` lists it)."""
    found = {name: {k: v for k, v in p.items() if k not in ("title", "belongs_to")}
             for name, p in paper.items() if isinstance(p, dict) and key in p.get("belongs_to", ())}
    if len(found) == 1:
        found = next(iter(found.values()))
    return json.dumps(found, separators=(", ", ": "))


_KIND_ORDER = {"table": 0, "figure": 1}


def make_all(results_dir, out_dir=None, only: list[str] | None = None) -> list[Path]:
    """Write every registered table/figure (or those in ``only``) and ``report.md``; returns the files."""
    _load_makers()
    res = Results.load(results_dir)
    out = Path(out_dir) if out_dir is not None else Path(results_dir)
    paper = paper_numbers()
    written, status = [], {}
    for key in sorted(MAKERS, key=lambda k: (_KIND_ORDER[MAKERS[k].kind], k)):
        m = MAKERS[key]
        if only and key not in only:
            continue
        if m.fn is None:
            status[key] = ("not yet produced", [])
            continue
        files = m.fn(res, paper, out)
        written += files
        status[key] = ("written", files)
    report = [f"# Reproduced tables and figures: preset `{res.preset_name}`", "",
              f"- scale: {res.scale()}", f"- hardware: {res.hardware()}",
              f"- runs: {sum(r.done for r in res.runs.values())} finished of {len(res.runs)} found"
              + (f" ({len((res.manifest or {}).get('runs', []))} in the preset)" if res.manifest else ""),
              "- every value below is **measured** by this kit from the run files unless labelled **paper**", ""]
    for key in sorted(status, key=lambda k: (_KIND_ORDER[MAKERS[k].kind], k)):
        m = MAKERS[key]
        state, files = status[key]
        report.append(f"## {key}: {m.title}")
        report.append("")
        if state == "written":
            for f in files:
                rel = f.relative_to(out) if f.is_relative_to(out) else f
                if f.suffix == ".md":
                    report += [f.read_text().strip(), ""]
                elif f.suffix == ".png":
                    report += [f"![{key}]({rel.as_posix()})", ""]
        else:
            report += [f"Not yet produced: needs {m.needs}.", "",
                       f"Paper ({m.kind}): `{_paper_line(key, paper)}`", ""]
    path = write_text(out / "report.md", "\n".join(report).rstrip() + "\n")
    return written + [path]
