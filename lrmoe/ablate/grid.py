"""An ablation grid (``ablations/*.toml``): one question as a list of training runs, each paired
with its baseline, checked against the kit's real option sets before anything runs.

A grid file (docs/ablations.md has the full format)::

    [grid]
    question = "At which drop ratio do the scorers separate?"
    preset = "cpu"                       # training settings of a `lrmoe reproduce` preset
    metrics = ["dppl_final", "dloss_all"]
    cost = "measured: ..."

    [set]                                # options every run shares (TrainConfig fields)
    steps = 200

    [axes]                               # product axes
    family = ["qwen3"]
    seed = [0, 1, 2]
    scorer = ["lrm", "random"]
    drop_ratio = [0.2, 0.9]

    [[zip]]                              # zipped axes (lists of one length, varied together)
    mode = ["compact", "mask"]
    ...

    [baseline]                           # what makes a run's baseline (default: drop_ratio = 0)
    drop_ratio = 0.0

The runs are the product of ``[axes]`` and of every ``[[zip]]`` group. Each run's baseline is
the same run with the ``[baseline]`` options applied (so of the same family, seed and every other
training option) and, when the baseline drops nothing, with the selection-only options (scorer,
quota, mode, ...) at the preset's values: at drop ratio 0 they compute nothing different, so every
run of a family and seed shares one C0 run.

Axis names are ``family`` (the preset's model families) and the fields of
:class:`lrmoe.train.TrainConfig` (the training and :class:`lrmoe.BackwardPolicy` options); values
are checked by ``TrainConfig.validate`` (so against the registries as they are when the grid is
read: a scorer or quota policy registered by the user is accepted). A bad grid raises
:class:`GridError` naming the file and the entry."""
from __future__ import annotations

import dataclasses
import itertools
import math
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from lrmoe.reproduce.presets import PRESETS, Preset
from lrmoe.runs import RunSpec, UsageError
from lrmoe.train import TrainConfig

SECTIONS = ("grid", "set", "axes", "zip", "baseline")
GRID_KEYS = ("name", "question", "preset", "metrics", "cost", "jobs")
# set by the command, not by a grid (--data), or naming what a family already chooses
NOT_OPTIONS = {"data": "the data is the preset's (or --data)", "global_batch": "set micro_batch and grad_accum",
               "record_trace": "a routing trace is not an ablation option"}
# options that only say how pairs are selected: at drop ratio 0 nothing is selected, so a baseline
# that drops nothing takes the preset's values of these (one C0 run per family and seed)
SELECTION_ONLY = ("scorer", "quota", "mode", "policy_seed", "phi", "selection", "scorer_kwargs", "quota_kwargs")
# how a varied option shows in a run name (others: "<option><value>")
BARE_IN_NAME = ("scorer", "quota", "mode", "selection")


class GridError(UsageError):
    """A grid that cannot run; the message names the file and the entry and says what is accepted."""


@dataclass(frozen=True)
class Cell:
    """One run of a grid: its name, the name of its baseline run, and its coordinates (the value of
    every varied axis, seed and family included)."""

    name: str
    baseline: str
    coords: dict

    @property
    def is_baseline(self) -> bool:
        return self.name == self.baseline


@dataclass
class Grid:
    """A parsed grid. It has the attributes of a :class:`~lrmoe.reproduce.presets.Preset` that
    the run machinery reads (name, description, hardware, cost, launcher, nproc, jobs, data_file,
    ``runs()``, ``to_dict()``), so `lrmoe reproduce`'s driver runs it."""

    file: str
    name: str
    question: str
    preset: Preset
    metrics: list
    cost: str
    set: dict
    axes: dict  # product axes: name -> values
    zips: list  # list of {name: values} groups
    baseline_options: dict
    jobs: int
    specs: list = field(default_factory=list)  # RunSpec, baselines first
    cells: list = field(default_factory=list)  # Cell per spec

    # -- what the driver reads of a preset
    prog = "lrmoe ablate"
    kind = "grid"
    elsewhere = "run a grid of preset cpu (or smoke) here, e.g. ablations/drop_ratio.toml"

    def command(self) -> str:
        return f"lrmoe ablate {self.file}"

    @property
    def description(self) -> str:
        return f"ablation grid {self.file}: {self.question}"

    @property
    def hardware(self) -> str:
        return self.preset.hardware

    @property
    def launcher(self) -> str:
        return self.preset.launcher

    @property
    def nproc(self) -> int:
        return self.preset.nproc

    @property
    def data_file(self):
        return self.preset.data_file

    def runs(self) -> list[RunSpec]:
        return list(self.specs)

    def varied(self) -> list[str]:
        """The varied axes in grid order (product axes, then the zipped ones)."""
        return list(self.axes) + [k for z in self.zips for k in z]

    def run_line(self, r: RunSpec) -> str:
        """The dry run's line for a run: its varied options, steps, and its baseline."""
        cell = self.cell(r.name)
        opts = " ".join(f"{k}={v}" for k, v in cell.coords.items())
        return opts + f" steps={r.config['steps']}" + ("  (baseline)" if cell.is_baseline else
                                                       f"  vs {cell.baseline}")

    def cell(self, name: str) -> Cell:
        return next(c for c in self.cells if c.name == name)

    def to_dict(self) -> dict:
        return {"kind": "ablation grid", "name": self.name, "file": self.file, "question": self.question,
                "preset": self.preset.name, "metrics": list(self.metrics), "cost": self.cost, "set": self.set,
                "axes": self.axes, "zip": self.zips, "baseline": self.baseline_options, "jobs": self.jobs,
                "hardware": self.hardware, "launcher": self.launcher, "nproc": self.nproc,
                "cells": [dataclasses.asdict(c) for c in self.cells]}


def load_grid(path) -> Grid:
    """Read and check the grid file ``path`` (:class:`GridError` on anything wrong, naming it)."""
    path = Path(path)
    if path.is_dir() or not path.exists():
        what = "is a folder" if path.is_dir() else "does not exist"
        raise GridError(f"grid {str(path)!r} {what}; give a grid file (ablations/*.toml), e.g. "
                        f"ablations/scorers.toml")
    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise GridError(f"{path}: not a TOML file ({e})") from None
    return parse_grid(doc, str(path))


def parse_grid(doc: dict, file: str = "<grid>") -> Grid:
    """The grid of a decoded TOML document ``doc`` (``file`` names it in messages)."""
    def fail(msg):
        raise GridError(f"{file}: {msg}")

    unknown = sorted(set(doc) - set(SECTIONS))
    if unknown:
        fail(f"unknown section(s) {unknown}; a grid has [grid], [set], [axes], [[zip]] and [baseline]")
    for sec in ("grid", "set", "axes", "baseline"):
        if sec in doc and not isinstance(doc[sec], dict):
            fail(f"'{sec}' must be a table ([{sec}]), got {type(doc[sec]).__name__}")
    head = doc.get("grid")
    if head is None:
        fail("no [grid] table; it needs at least question = \"...\" and preset = \"cpu\" (or smoke, gpu1, paper)")
    bad = sorted(set(head) - set(GRID_KEYS))
    if bad:
        fail(f"[grid] {bad[0]!r} is not a grid setting; accepted: {', '.join(GRID_KEYS)}")
    question = head.get("question")
    if not isinstance(question, str) or not question.strip():
        fail("[grid] question must be a sentence saying what the grid asks")
    preset = head.get("preset")
    if preset not in PRESETS:
        fail(f"[grid] preset = {preset!r}: unknown preset; accepted: {', '.join(PRESETS)}")
    p = PRESETS[preset]
    name = head.get("name", Path(file).stem)
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
        fail(f"[grid] name = {name!r}: give letters, digits, '_', '.' or '-' (it names the results folder)")
    from .metrics import metric_names

    metrics = head.get("metrics", ["dppl_final", "dloss_all"])
    if not isinstance(metrics, list) or not metrics:
        fail(f"[grid] metrics must be a non-empty list; accepted: {', '.join(metric_names())}")
    for m in metrics:
        if m not in metric_names():
            fail(f"[grid] metrics: unknown metric {m!r}; accepted: {', '.join(metric_names())}")
    cost = head.get("cost", "")
    if not isinstance(cost, str):
        fail("[grid] cost must be a string (the expected cost, and where it was measured)")
    jobs = head.get("jobs", p.jobs)
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        fail(f"[grid] jobs = {jobs!r}: give a number of runs in parallel >= 1")

    fixed = doc.get("set", {})
    axes = doc.get("axes", {})
    zips = doc.get("zip", [])
    if isinstance(zips, dict):
        zips = [zips]
    if not isinstance(zips, list) or not all(isinstance(z, dict) for z in zips):
        fail("'zip' must be tables ([[zip]]), each of lists of one length")
    base_opts = doc.get("baseline", {"drop_ratio": 0.0})

    # every option named once, and a real option
    seen: dict[str, str] = {}
    entries = [("set", k) for k in fixed] + [("axes", k) for k in axes] + \
        [(f"zip {i + 1}", k) for i, z in enumerate(zips) for k in z]
    for where, key in entries:
        _check_option(fail, where, key, p)
        if key in seen:
            fail(f"[{where}] {key!r} is also given in [{seen[key]}]: an option is fixed, a product axis or a "
                 f"zipped axis, once")
        seen[key] = where
    for key in base_opts:
        _check_option(fail, "baseline", key, p)
        if key in ("family", "seed"):
            fail(f"[baseline] {key!r}: a run is paired with the baseline of its own {key}; the baseline sets "
                 f"options such as drop_ratio")
    if "family" in fixed and not isinstance(fixed["family"], str):
        fail("[set] family must be one family name")
    for where, group in [("axes", axes)] + [(f"zip {i + 1}", z) for i, z in enumerate(zips)]:
        for key, values in group.items():
            if not isinstance(values, list):
                fail(f"[{where}] {key} = {values!r}: an axis is a list of values (one value: put it in [set])")
            if not values:
                fail(f"[{where}] {key} = []: an empty axis makes the grid empty (the product has no run)")
            reprs = [repr(v) for v in values]
            dup = next((v for v in reprs if reprs.count(v) > 1), None)
            if dup is not None and where == "axes":  # (a zipped axis may repeat a value; its tuples may not)
                fail(f"[{where}] {key}: the value {dup} is listed twice")
        lengths = {k: len(v) for k, v in group.items()}
        if where.startswith("zip") and len(set(lengths.values())) > 1:
            fail(f"[[zip]] group {where[4:]}: zipped axes must be lists of one length, got "
                 + ", ".join(f"{k}: {n}" for k, n in lengths.items()))
        if where.startswith("zip"):
            rows = [repr(r) for r in zip(*group.values())]
            dup = next((r for r in rows if rows.count(r) > 1), None)
            if dup is not None:
                fail(f"[[zip]] group {where[4:]}: the combination {', '.join(group)} = {dup} is listed twice")
    for where, group in [(f"zip {i + 1}", z) for i, z in enumerate(zips)]:
        if not group:
            fail(f"[[zip]] group {where[4:]} is empty")

    base = _base_config(p, fixed)
    fam_default = fixed.get("family", p.families[0])
    families = axes.get("family") or next((z["family"] for z in zips if "family" in z), None) or [fam_default]
    for fam in families:
        if fam not in p.models:
            where = seen.get("family", "set")
            fail(f"[{where}] family {fam!r}: not a family of preset {p.name!r}; accepted: {', '.join(p.models)}")

    # each value alone (so a bad value is named by its axis), then each combination
    for where, group in [("axes", axes)] + [(f"zip {i + 1}", z) for i, z in enumerate(zips)]:
        for key, values in group.items():
            if key == "family":
                continue
            for v in values:
                _validate(fail, f"[{where}] {key} = {v!r}", _config(p, base, fam_default, {key: v}))
    combos = _combinations(axes, zips)
    g = Grid(file, name, question.strip(), p, list(metrics), cost, dict(fixed), dict(axes), [dict(z) for z in zips],
             dict(base_opts), jobs)
    specs: dict[str, RunSpec] = {}
    cells: dict[str, Cell] = {}
    origin: dict[str, str] = {}
    for combo in combos:
        label = " x ".join(f"{k}={v!r}" for k, v in combo.items()) or "the one run"
        fam = combo.get("family", fam_default)
        cfg = _config(p, base, fam, {k: v for k, v in combo.items() if k != "family"})
        _validate(fail, f"run {label}", cfg)
        if cfg.get("drop_ratio") == 0:  # selects nothing: the selection-only options at the preset's
            cfg = _baseline_config(p, base, cfg, {})
        bcfg = _baseline_config(p, base, cfg, base_opts)
        _validate(fail, f"[baseline] of run {label}", bcfg)
        if cfg == bcfg:  # the run is its own baseline (e.g. drop_ratio 0 on an axis)
            cfg = bcfg
        bcoords = {k: v for k, v in combo.items() if k not in base_opts
                   and not (bcfg.get("drop_ratio", 1) == 0 and k in SELECTION_ONLY)}
        for k in base_opts:
            if k in combo:
                bcoords[k] = bcfg[k]
        bname = _run_name(fam, bcfg, bcoords)
        name = bname if cfg == bcfg else _run_name(fam, cfg, combo)
        for nm, c, coords, what in ((bname, bcfg, bcoords, f"the baseline of run {label}"), (name, cfg, combo, f"run {label}")):
            if nm in specs:
                if specs[nm].config != c:
                    fail(f"{what} and {origin[nm]} get one run name {nm!r} but differ in "
                         + "; ".join(f"{k}: {specs[nm].config.get(k)!r} != {c.get(k)!r}"
                                     for k in sorted(set(c) | set(specs[nm].config))
                                     if c.get(k) != specs[nm].config.get(k)))
                continue
            specs[nm] = RunSpec(nm, fam, (name_tag(nm == bname),), c)
            cells[nm] = Cell(nm, bname, dict(coords, family=fam, seed=c["seed"]))
            origin[nm] = what
    order = sorted(specs, key=lambda n: not cells[n].is_baseline)  # baselines first: stable otherwise
    g.specs = [specs[n] for n in order]
    g.cells = [cells[n] for n in order]
    if not [c for c in g.cells if not c.is_baseline]:
        fail("every run of the grid is its own baseline (nothing to compare); vary an option the [baseline] "
             "table does not set, e.g. drop_ratio")
    return g


def name_tag(is_baseline: bool) -> str:
    return "baseline" if is_baseline else "variant"


def _check_option(fail, where: str, key: str, p: Preset) -> None:
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    if key == "family" and where != "baseline":
        return
    if key in NOT_OPTIONS:
        fail(f"[{where}] {key!r} cannot be set by a grid ({NOT_OPTIONS[key]})")
    if key in ("model",):
        fail(f"[{where}] 'model': a grid chooses models by family (the preset's models: "
             f"{', '.join(f'{f}={m}' for f, m in p.models.items())}); vary 'family', or model_overrides")
    if key in fields:
        return
    from lrmoe.policy import BackwardPolicy

    policy_fields = {f.name for f in dataclasses.fields(BackwardPolicy)}
    if key in policy_fields:
        fail(f"[{where}] {key!r} is an option of BackwardPolicy but not of training (lrmoe train / TrainConfig) "
             f"in this version of the kit, so a run cannot vary it")
    fail(f"[{where}] unknown option {key!r}; accepted: family and the training options "
         f"{', '.join(sorted(fields - set(NOT_OPTIONS) - {'model'}))}")


def _base_config(p: Preset, fixed: dict) -> dict:
    return dict(p.base, **{k: v for k, v in fixed.items() if k != "family"})


def _config(p: Preset, base: dict, family: str, opts: dict) -> dict:
    """A run's full TrainConfig dict: the preset's base and its family's settings, then the grid's."""
    cfg = dict(base, model=p.models[family], model_overrides=dict(p.model_overrides.get(family, {})),
               **p.family_config.get(family, {}))
    cfg.update(opts)
    try:
        return TrainConfig.from_dict(cfg).to_dict()  # every field, defaults filled (stable comparisons)
    except (TypeError, ValueError):
        return cfg  # _validate says what is wrong


def _baseline_config(p: Preset, base: dict, cfg: dict, base_opts: dict) -> dict:
    b = dict(cfg, **base_opts)
    if b.get("drop_ratio") == 0:  # nothing is selected: the selection-only options at the preset's values
        ref = TrainConfig.from_dict({k: v for k, v in base.items()}).to_dict() if _valid(base) else base
        for k in SELECTION_ONLY:
            if k in b and k not in base_opts:
                b[k] = ref.get(k, TrainConfig().to_dict().get(k))
    return b


def _valid(cfg: dict) -> bool:
    try:
        TrainConfig.from_dict(cfg)
    except (TypeError, ValueError):
        return False
    return True


def _validate(fail, what: str, cfg: dict) -> None:
    """TrainConfig's checks, but not of this machine (a GPU grid is checked on a CPU machine too;
    the driver says which hardware is missing before anything runs)."""
    try:
        TrainConfig.from_dict(dict(cfg, device="cpu") if "device" in cfg else cfg).validate()
    except (TypeError, ValueError) as e:
        fail(f"{what}: {e}")


def _combinations(axes: dict, zips: list) -> list[dict]:
    groups = [[{k: v} for v in vals] for k, vals in axes.items()]
    groups += [[dict(zip(z, vals)) for vals in zip(*z.values())] for z in zips]
    out = []
    for parts in itertools.product(*groups):
        combo = {}
        for part in parts:
            combo.update(part)
        out.append(combo)
    return out


def _level(drop) -> str:
    return f"C{round(drop * 100):02d}" if isinstance(drop, (int, float)) and math.isfinite(drop) else f"C{drop}"


def _run_name(family: str, cfg: dict, coords: dict) -> str:
    """``qwen3-C20-lrm-s0`` (as `lrmoe reproduce` names its runs), then every other varied option:
    ``qwen3-C50-lrm-proportional-s1``, ``qwen3-C50-lrm-phix-s0``, ``qwen3-C20-steps400-s0``."""
    parts = [family, _level(cfg["drop_ratio"])]
    if cfg["drop_ratio"] > 0:
        parts.append(str(cfg["scorer"]))
    for k, v in coords.items():
        if k in ("family", "seed", "drop_ratio", "scorer"):
            continue
        if cfg["drop_ratio"] == 0 and k in SELECTION_ONLY:
            continue
        text = _value_text(v)
        parts.append(text if k in BARE_IN_NAME else f"{k}{text}")
    return "-".join(parts + [f"s{cfg['seed']}"])


def _value_text(v) -> str:
    if isinstance(v, dict):
        v = "_".join(f"{k}{_value_text(x)}" for k, x in sorted(v.items()))
    return re.sub(r"[^A-Za-z0-9._+]", "_", str(v))
