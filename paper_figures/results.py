"""The results model of the tables and figures: the run folders of a results folder
(:class:`Results`, :class:`Run`), the paper's numbers (``paper_numbers.json``), and the few
helpers every maker shares.

What each run folder holds is decided by :func:`lrmoe.run_folder.run_state`, the function the
run machinery (``lrmoe reproduce``, its dry run) reads too. A damaged run folder (a summary.json
that cannot be read, a finished run whose metrics.jsonl is empty, has a garbage line or lacks
steps) is not silently dropped: :attr:`Results.damaged` names it and says why, and the tables,
the report and the `lrmoe figures` command repeat it."""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from lrmoe.environment import hardware_label
from lrmoe.files import read_json
from lrmoe.run_folder import CHECKPOINT, DAMAGED, DONE, LOCK, METRICS, SUMMARY, RunState, read_metrics, run_state

PAPER_NUMBERS = Path(__file__).with_name("paper_numbers.json")
FAMILY_NAMES = {"qwen3": "Qwen3-MoE", "glm4": "GLM-4.5-MoE"}
_FAMILY_OF = {"qwen3_moe": "qwen3", "glm4_moe": "glm4"}
NOT_RUN = "not run"
# config fields that do not change what a run computes (left out when saying how two runs differ)
RUNTIME_FIELDS = ("threads", "log_interval", "checkpoint_interval", "eval_interval", "load_concurrency", "data")


class AmbiguousRuns(ValueError):
    """Several runs of a results folder match one table cell; the message names them and says
    which config fields differ."""


class IncomparableRuns(AmbiguousRuns):
    """The runs of a table differ in more than the table's axes (e.g. 12 and 2 steps); the message
    says which fields differ, with the runs of each value."""


def paper_numbers() -> dict:
    return read_json(PAPER_NUMBERS)


def level_name(drop: float) -> str:
    return f"C{round(drop * 100)}"


def rows_per_step(config: dict):
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
    state: RunState | None = None  # run_state(dir); None: read when first asked

    @property
    def config(self) -> dict:
        return self.summary.get("config", {})

    @cached_property
    def status(self) -> RunState:
        return self.state if self.state is not None else run_state(self.dir)

    @property
    def done(self) -> bool:
        """Finished with a complete, readable metrics file (a damaged run is not done)."""
        return self.status.state == DONE

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
        if self.status.rows is not None:  # read (and checked) once by run_state
            return self.status.rows
        return read_metrics(self.dir)  # only a torn last line is dropped; any other bad line raises

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
    damaged: dict[str, str] = field(default_factory=dict)  # run folder name -> what is wrong (the file named)

    @classmethod
    def load(cls, results_dir) -> "Results":
        """The run folders under ``results_dir`` (every folder holding a run's file), each with its
        :func:`~lrmoe.run_folder.run_state`. A damaged one is listed in :attr:`damaged`; it stays
        in :attr:`runs` (not done) when its summary can be read."""
        d = Path(results_dir)
        manifest = read_json(d / "manifest.json")  # None without one; a corrupt one raises, naming it
        res = cls(d, {}, manifest)
        tags = {r["name"]: tuple(r.get("experiments", ())) for r in (manifest or {}).get("runs", [])}
        for run_dir in sorted(q for q in d.iterdir() if q.is_dir()):
            if not any((run_dir / f).exists() for f in (SUMMARY, METRICS, CHECKPOINT, LOCK)):
                continue  # tables/, figures/, ...
            name, st = run_dir.name, run_state(run_dir)
            if st.state == DAMAGED:
                res.damaged[name] = st.why
            if st.summary is not None:
                res.runs[name] = Run(name, run_dir, st.summary, tags.get(name, ()), st)
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
                f"{rows_per_step(base)} rows/step, {base.get('steps', '?')} steps")

    def e3_scale(self) -> str | None:
        """One line describing E3's runs (other models, steps and ranks than E1/E2), or None without any."""
        e3 = [r for r in self.runs.values() if "E3" in r.experiments]
        if not e3:
            return None
        c = e3[0].config
        models = sorted({f"{r.config.get('model')}" + "".join(f" {k}={v}" for k, v in
                                                            (r.config.get("model_overrides") or {}).items())
                         for r in e3})
        ranks = (f"{c['virtual_ep']} virtual EP ranks in one process" if c.get("virtual_ep", 1) > 1 else
                 f"EP{c['ep']} under torchrun" if c.get("ep", 1) > 1 else "one process")
        methods = sorted({r.config.get("placement") for r in e3 if r.config.get("placement")})
        seeds = sorted({r.config.get("seed") for r in e3})
        return (f"{'; '.join(models)}; {c.get('steps', '?')} steps, {ranks}; methods {', '.join(methods)}; "
                f"seeds {', '.join(str(s) for s in seeds)}")

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
            if r.experiments == ("E3",):  # E3's runs (time to target, other models) fill no T1/T2 cell
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
            raise AmbiguousRuns(f"{self.dir}: {len(found)} runs match the cell {family} {level_name(drop)} "
                                f"scorer={scorer} seed={seed}: {', '.join(r.name for r in found)}; they differ in "
                                f"{differences([r.config for r in found])}; keep one there (move the others "
                                f"elsewhere), or give the folder a manifest.json that lists the runs of the tables")
        return found[0] if found else None


def grouped_differences(runs: list[Run], ignore=()) -> list[str]:
    """``steps: 12 (a, b) / 2 (c)`` for every config field (other than ``ignore`` and the runtime
    fields) in which ``runs`` differ."""
    keys = sorted({k for r in runs for k in r.config} - set(RUNTIME_FIELDS) - set(ignore))
    out = []
    for k in keys:
        by: dict[str, list[str]] = {}
        for r in runs:
            by.setdefault(repr(r.config.get(k)), []).append(r.name)
        if len(by) > 1:
            out.append(f"{k}: " + " / ".join(f"{v} ({', '.join(names)})" for v, names in by.items()))
    return out


def differences(configs: list[dict]) -> str:
    """The config fields in which runs differ (``steps: 12 / 2``), or what else tells them apart."""
    keys = sorted({k for c in configs for k in c} - set(RUNTIME_FIELDS))
    diff = [f"{k}: {' / '.join(repr(c.get(k)) for c in configs)}" for k in keys
            if any(c.get(k) != configs[0].get(k) for c in configs)]
    return "; ".join(diff) if diff else "no training field (only runtime fields, data path or folder name)"


def mean_std(xs: list[float]) -> tuple[float | None, float | None]:
    if not xs:
        return None, None
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else None)
