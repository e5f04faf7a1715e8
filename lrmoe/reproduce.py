"""`lrmoe reproduce --preset smoke|cpu|gpu1|paper`: run every experiment of a preset, then the figures.

A preset selects models, data, steps and hardware assumptions; its experiment list is data (a
list of :class:`RunSpec`, each with a stable run name). Results go to ``<out>/<run_name>/``
(default ``results/<preset>/``): ``metrics.jsonl``, ``summary.json``, ``checkpoint.pt`` per run,
plus ``manifest.json`` (the preset and its runs) and ``reproduce.json`` (wall time of the last
call). A run whose ``summary.json`` says ``done`` is skipped, so a killed ``reproduce`` resumes
(an unfinished run continues from its checkpoint); a finished run of another config (a changed
preset or ``--data``) is refused, not reused (exit status 2, the differences listed). Then ``lrmoe figures`` writes the tables and
figures into ``<out>/tables`` and ``<out>/figures``.

A torchrun preset (``paper``: 8 processes, ``--ep 8``) is launched one ``torchrun`` per run: from
a shell, ``reproduce`` prints the command of every pending run and runs them when the machine has
the GPUs (status 2 otherwise); under torchrun, the ranks train the runs in-process.

Experiments (paper.md):
  E1 convergence: drop 0 / 0.1 / 0.2 / 0.3 (C0-C30), LRM scorer, waterfill quotas -> T1, F2, F1.
  E2 scorer ablation at C20: lrm, grad_norm, abs_grad, random, on both families, several seeds,
     each seed paired with its own C0 run -> T2.
Runs shared by both (C0 and C20-lrm of seed 0) run once.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from .train.loop import TrainConfig, _read_json, config_differences, run_status

DROPS_E1 = (0.0, 0.1, 0.2, 0.3)
SCORERS_E2 = ("lrm", "grad_norm", "abs_grad", "random")
FAMILIES = ("qwen3", "glm4")


@dataclass(frozen=True)
class RunSpec:
    """One training run of a preset: a stable name, the experiments it serves, its full config."""

    name: str
    family: str
    experiments: tuple
    config: dict

    def train_config(self) -> TrainConfig:
        return TrainConfig.from_dict(self.config)


@dataclass
class Preset:
    name: str
    description: str
    models: dict  # family -> model preset name
    base: dict  # TrainConfig fields shared by every run
    data_file: str | None  # file under the shared data folder (None: $LRMOE_ALPACA or the hub)
    model_overrides: dict = field(default_factory=dict)  # family -> transformers config overrides
    family_config: dict = field(default_factory=dict)  # family -> TrainConfig field overrides
    e1_drops: tuple = DROPS_E1
    e1_seeds: tuple = (0,)
    e2_drop: float = 0.2
    e2_scorers: tuple = SCORERS_E2
    e2_seeds: tuple = (0, 1, 2)
    families: tuple = FAMILIES
    jobs: int = 1  # runs in parallel (CPU presets: one thread each)
    cost: str = ""  # expected cost, stated in docs/reproduce.md
    launcher: str = "local"  # "local" (runs in this process / a process pool) or "torchrun" (one launch per run)
    nproc: int = 1  # torchrun: processes per run (one node; one GPU each)
    hardware: str = ""

    def runs(self) -> list[RunSpec]:
        specs: dict[str, RunSpec] = {}

        def add(family, drop, scorer, seed, exp):
            name = f"{family}-C{round(drop * 100):02d}" + (f"-{scorer}" if drop > 0 else "") + f"-s{seed}"
            if name in specs:
                old = specs[name]
                specs[name] = dataclasses.replace(old, experiments=tuple(sorted({*old.experiments, exp})))
                return
            cfg = dict(self.base, model=self.models[family], drop_ratio=drop, scorer=scorer if drop > 0 else "lrm",
                       seed=seed, model_overrides=dict(self.model_overrides.get(family, {})),
                       **self.family_config.get(family, {}))
            specs[name] = RunSpec(name, family, (exp,), cfg)

        for fam in self.families:
            for seed in self.e1_seeds:
                for d in self.e1_drops:
                    add(fam, d, "lrm", seed, "E1")
            for seed in self.e2_seeds:
                add(fam, 0.0, "lrm", seed, "E2")
                for sc in self.e2_scorers:
                    add(fam, self.e2_drop, sc, seed, "E2")
        return list(specs.values())

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_SMOKE_BASE = dict(tokenizer="bpe:384", max_records=None, heldout_fraction=0.1, seq_len=64, micro_batch=4,
                   steps=30, lr=3e-3, warmup_steps=3, min_lr_ratio=0.1, weight_decay=0.01, clip=1.0,
                   eval_interval=12, eval_batches=2, log_interval=6, checkpoint_interval=12, threads=1,
                   device="cpu", sample_layers=[0, -1])
# cpu: a small Alpaca sample trained for many epochs, so the models approach memorisation as in
# the paper's regime (PPL ~1.015 after ~200 epochs). Sized to run the whole preset within
# 30 minutes on 2 cores (two runs in parallel, one thread each); see docs/reproduce.md.
_CPU_BASE = dict(tokenizer="bpe:1024", max_records=16, heldout_fraction=0.125, seq_len=256, micro_batch=8,
                 steps=200, lr=3e-3, warmup_steps=15, min_lr_ratio=0.1, weight_decay=0.01, clip=1.0,
                 eval_interval=50, eval_batches=None, log_interval=25, checkpoint_interval=100, threads=1,
                 device="cpu", sample_layers=[0, -1])
_GPU_BASE = dict(tokenizer="bpe:32768", max_records=None, heldout_fraction=0.01, seq_len=8192, micro_batch=1,
                 grad_accum=4, steps=1000, lr=1e-3, warmup_steps=50, min_lr_ratio=0.1, weight_decay=0.01,
                 clip=1.0, eval_interval=250, eval_batches=8, log_interval=10, checkpoint_interval=100,
                 device="cuda", dtype="auto", sample_layers=[0, -1])

PRESETS: dict[str, Preset] = {
    "smoke": Preset(
        "smoke", "CI end-to-end check: tiny Qwen3-MoE / GLM-4.5-style models, 100 Alpaca records, 30 steps",
        {"qwen3": "qwen3-moe-tiny", "glm4": "glm4-moe-tiny"}, _SMOKE_BASE, "alpaca/alpaca_tiny.json",
        e2_seeds=(0, 1), jobs=2, hardware="2 CPU cores",
        cost="measured: about 20-40 s on 2 CPU cores (24 runs)"),
    "cpu": Preset(
        "cpu", "CPU-scale reproduction: qwen3-moe-small / glm4-moe-small (16 experts, top-4) near memorisation "
               "of a 16-record Alpaca sample (alpaca_en_demo; 14 train / 2 held out), E1 + E2 with 3 seeds",
        {"qwen3": "qwen3-moe-small", "glm4": "glm4-moe-small"}, _CPU_BASE, "alpaca/alpaca_en_demo.json",
        e2_seeds=(0, 1, 2), jobs=2, hardware="2 CPU cores",
        cost="measured: see docs/reproduce.md (target <= 30 minutes on 2 CPU cores, 34 runs)"),
    "gpu1": Preset(
        "gpu1", "one Hopper GPU: the paper's Qwen3-30B-A3B and GLM-4.5-Air layer dimensions (128 experts, top-8) "
                "with fewer layers, bf16 autocast, full Alpaca, seq 8192",
        {"qwen3": "qwen3-30b-a3b", "glm4": "glm-4.5-air"}, _GPU_BASE, None,
        model_overrides={"qwen3": {"num_hidden_layers": 4}, "glm4": {"num_hidden_layers": 3}},
        e2_seeds=(0, 1, 2), jobs=1, hardware="1x NVIDIA H100/H200 (80+ GiB)",
        cost="estimated (not measured): ~1-2 s per step, 34 runs x 1,000 steps = 10-20 GPU-hours"),
    "paper": Preset(
        "paper", "the paper's setting: Qwen3-30B-A3B and GLM-4.5-Air (full depth), EP8 on 8 Hopper GPUs "
                 "(torchrun, LRMoE placement), seq 8192, micro-batch 4 per GPU, 10,000 steps",
        {"qwen3": "qwen3-30b-a3b", "glm4": "glm-4.5-air"},
        # micro_batch counts the rows of one forward over all ranks: 32 = 4 per GPU x 8 GPUs
        dict(_GPU_BASE, micro_batch=32, grad_accum=1, steps=10_000, warmup_steps=100, lr=1e-5,
             eval_interval=1000, checkpoint_interval=500, ep=8, placement="lrmoe"), None,
        # fine-tuning of the released checkpoints with their own tokenizers (the paper does not say
        # whether it starts from them; a PPL of 1.015 on Alpaca suggests so)
        family_config={"qwen3": {"init_from": "Qwen/Qwen3-30B-A3B", "tokenizer": "Qwen/Qwen3-30B-A3B"},
                       "glm4": {"init_from": "zai-org/GLM-4.5-Air", "tokenizer": "zai-org/GLM-4.5-Air"}},
        e2_seeds=(0, 1, 2), jobs=1, launcher="torchrun", nproc=8, hardware="8x NVIDIA Hopper (80 GiB), EP8",
        cost="estimated (not measured): the paper's 10,000-step runs; 34 runs at roughly 1-2 days each on 8 GPUs"),
}


def _default_out(preset: str) -> Path:
    return Path("results") / preset


def resolve_data(preset: Preset, data: str | None) -> tuple[str | None, str | None]:
    """(data source, None) or (None, reason to skip)."""
    if data:
        return data, None
    if os.environ.get("LRMOE_ALPACA"):
        return os.environ["LRMOE_ALPACA"], None
    if preset.data_file is None:
        return None, None  # the loader falls back to the hub id tatsu-lab/alpaca
    from .data import shared_data_dir

    path = shared_data_dir() / preset.data_file
    if not path.exists():
        return None, (f"preset {preset.name!r} needs {preset.data_file} from the shared data folder, not found at "
                      f"{path}; set LRMOE_SHARED_DATA to that folder, or give --data PATH (or LRMOE_ALPACA) "
                      f"with Alpaca records")
    return str(path), None


def plan(preset: str | Preset, out_dir=None, only: str | None = None, data: str | None = None) -> dict:
    """What `reproduce` would do: the runs, their directories and their current status."""
    p = PRESETS[preset] if isinstance(preset, str) else preset
    out = Path(out_dir) if out_dir is not None else _default_out(p.name)
    source, skip = resolve_data(p, data)
    all_runs = [dataclasses.replace(r, config=dict(r.config, data=source)) for r in p.runs()]
    runs = all_runs
    if only:
        rx = re.compile(only)
        runs = [r for r in runs if rx.search(r.name)]
    return {"preset": p, "out": out, "runs": runs, "all_runs": all_runs, "skip": skip,
            "status": {r.name: run_status(out / r.name) for r in runs},
            "stale": {r.name: d for r in runs if (d := _stale(out / r.name, r.config))}}


def _stale(run_dir: Path, config: dict) -> list[str]:
    """How the run already in ``run_dir`` differs from the preset's ``config`` ([] if it does not,
    or if there is none): such a run is neither reused nor overwritten."""
    s = _read_json(run_dir / "summary.json")
    return config_differences(s.get("config", {}), config) if s else []


def _run_one(spec: dict, out_dir: str, progress: bool) -> dict:
    """Worker entry (also used in-process): train one run; returns a short result."""
    cfg = TrainConfig.from_dict(spec["config"])
    if cfg.threads:
        import torch

        torch.set_num_threads(cfg.threads)
    from .train.loop import train

    t0 = time.perf_counter()
    s = train(cfg, out_dir, progress=progress)
    return {"name": spec["name"], "status": s["status"], "final": s.get("final", {}),
            "wall_s": time.perf_counter() - t0}


def _prepare_data(runs: list[RunSpec]) -> None:
    """Tokenise/pack each distinct data config once before the workers start."""
    from .train.loop import load_data

    seen = set()
    for r in runs:
        c = r.train_config()
        key = (c.data, c.tokenizer, c.seq_len, c.heldout_fraction, c.data_seed, c.max_records)
        if key not in seen:
            seen.add(key)
            load_data(c)


def train_flags(config: dict) -> list[str]:
    """`lrmoe train` flags that rebuild ``config`` (fields that differ from TrainConfig's defaults;
    ep and placement always; global_batch follows from micro_batch x grad_accum)."""
    cfg, default = TrainConfig.from_dict(config).to_dict(), TrainConfig().to_dict()
    args = []
    for name, v in cfg.items():
        if name == "global_batch" or (v == default[name] and name not in ("ep", "placement")):
            continue
        flag = "--" + name.replace("_", "-")
        if name in ("model_overrides", "ep_options"):
            one = "--model-override" if name == "model_overrides" else "--ep-option"
            for k, x in v.items():
                args += [one, f"{k}={json.dumps(x)}"]
        elif name == "sample_layers":
            args += [flag, *map(str, v)]
        else:
            args += [flag, "none" if v is None else str(v)]
    return args


def torchrun_command(run: RunSpec, run_dir, nproc: int) -> list[str]:
    """The command that trains ``run`` in ``run_dir`` with ``nproc`` processes on one node."""
    return ["torchrun", "--standalone", "--nproc-per-node", str(nproc), "-m", "lrmoe.cli", "train",
            "--out", str(run_dir), "--no-progress", *train_flags(run.config)]


STOP_GRACE_S = 120.0  # how long interrupted workers get to finish their step and checkpoint


def _missing_hardware(p: Preset, runs: list[RunSpec]) -> str | None:
    """Why this machine cannot run the preset's torchrun launches (None: it can)."""
    import torch

    devices = {r.train_config().device for r in runs}
    if any(d.startswith("cuda") for d in devices) or ("auto" in devices and torch.cuda.is_available()):
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n < p.nproc:
            return f"this machine has {n} CUDA GPU(s) and each run needs {p.nproc}"
    return None


def _launch_torchrun(p: Preset, out: Path, all_runs: list[RunSpec], runs: list[RunSpec], pending: list[RunSpec],
                     figures: bool) -> int:
    """Not under torchrun: print one torchrun command per pending run, then run them one after
    another (``python -m torch.distributed.run``, the same as ``torchrun``) when this machine has
    the GPUs; otherwise exit with status 2 (the commands are the way to run the preset elsewhere)."""
    import shlex
    import subprocess

    from .files import write_json

    cmds = [(r, torchrun_command(r, out / r.name, p.nproc)) for r in pending]
    if cmds:
        print(f"  {len(cmds)} torchrun launch(es), one per run (each resumes from its checkpoint):", file=sys.stderr)
    for _, c in cmds:
        print(shlex.join(c), flush=True)
    missing = _missing_hardware(p, pending)
    if missing:
        print(f"lrmoe reproduce: preset {p.name!r} trains every run with expert-parallel torchrun launches of "
              f"{p.nproc} processes ({p.hardware}); {missing}, so nothing was run. Run the commands above on such "
              f"a machine (from the repository root), or `lrmoe reproduce --preset {p.name}` there, which runs "
              f"them one after another and then the figures.", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "manifest.json", {"preset": p.to_dict(), "runs": [dataclasses.asdict(r) for r in all_runs]})
    t0, failures = time.perf_counter(), []
    for r, c in cmds:
        print(f"  {r.name}: launching", file=sys.stderr, flush=True)
        rc = subprocess.run([sys.executable, "-m", "torch.distributed.run", *c[1:]]).returncode
        if rc:
            failures.append((r.name, f"torchrun exited with status {rc}"))
            print(f"  {r.name}: FAILED (torchrun exited with status {rc})", file=sys.stderr)
    return _finish(p, out, runs, pending, failures, time.perf_counter() - t0, 1, None, figures)


def _finish(p, out, runs, pending, failures, wall, jobs, only, figures) -> int:
    """reproduce.json, then the figures; the exit code."""
    from .files import write_json

    prev = {}
    try:
        prev = json.loads((out / "reproduce.json").read_text())
    except (OSError, json.JSONDecodeError):
        pass
    write_json(out / "reproduce.json", {
        "preset": p.name, "runs": len(runs), "ran_now": len(pending), "failed": failures,
        "wall_s_last_call": wall, "wall_s_total": prev.get("wall_s_total", 0.0) + wall,
        "jobs": jobs, "only": only})
    print(f"preset {p.name}: {len(pending)} run(s) in {wall:.0f}s", file=sys.stderr)
    if figures:
        written = _paper_figures().make_all(out, out)
        print(f"figures and tables: {len(written)} files under {out}/tables and {out}/figures", file=sys.stderr)
    return 1 if failures else 0


def reproduce(preset: str | Preset, out_dir=None, only: str | None = None, dry_run: bool = False, data: str | None = None,
              jobs: int | None = None, figures: bool = True, progress: bool = True) -> int:
    """Run every pending run of ``preset`` (skipping finished ones), then the figures. Returns an exit code.

    A torchrun preset (``paper``) launched from a shell prints one ``torchrun`` command per pending
    run and runs them one after another when the machine has the GPUs (status 2 otherwise). Under
    torchrun (``torchrun ... -m lrmoe.cli reproduce ...``), every rank runs the pending runs in
    this process, one after another, over one process group; rank 0 writes the files."""
    from .files import write_json
    from .train.ep import world_size_from_env

    if isinstance(preset, str) and preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; accepted: {list(PRESETS)}")
    pl = plan(preset, out_dir, only, data)
    p, out, runs = pl["preset"], pl["out"], pl["runs"]
    done = [r for r in runs if pl["status"][r.name] == "done"]
    pending = [r for r in runs if pl["status"][r.name] != "done"]
    under_torchrun = world_size_from_env() > 1
    main = int(os.environ.get("RANK", "0")) == 0
    jobs = 1 if under_torchrun or p.launcher == "torchrun" else max(1, jobs or p.jobs)
    if main:
        print(f"preset {p.name}: {p.description}", file=sys.stderr)
        print(f"  hardware: {p.hardware}; cost: {p.cost}", file=sys.stderr)
        if runs:  # the settings every run shares (the full configs are in manifest.json)
            common = {k: v for k, v in runs[0].config.items() if all(r.config.get(k) == v for r in runs)}
            print(f"  data: {common.pop('data', 'per run')}; shared settings: "
                  + ", ".join(f"{k}={v}" for k, v in sorted(common.items())), file=sys.stderr)
        print(f"  {len(runs)} runs -> {out}/ ({len(done)} done, {len(pending)} to run, {jobs} in parallel)",
              file=sys.stderr)
    if dry_run:
        for r in runs:
            c = r.config
            status = "stale" if r.name in pl["stale"] else pl["status"][r.name] or "new"
            print(f"  {r.name:28s} {','.join(r.experiments):6s} {status:8s} "
                  f"model={c['model']} drop={c['drop_ratio']} scorer={c['scorer']} seed={c['seed']} "
                  f"steps={c['steps']}")
            if r.name in pl["stale"]:
                print(f"    its folder holds a run of another config ({'; '.join(pl['stale'][r.name])}): "
                      f"a real call stops with status 2", file=sys.stderr)
            if p.launcher == "torchrun":
                import shlex

                print("    " + shlex.join(torchrun_command(r, out / r.name, p.nproc)))
        if pl["skip"]:
            print(f"  note: {pl['skip']}", file=sys.stderr)
        return 0
    if pl["skip"]:
        print(f"lrmoe reproduce: skipped: {pl['skip']}", file=sys.stderr)
        return 0
    if pl["stale"]:
        if main:
            print(f"lrmoe reproduce: {len(pl['stale'])} run folder(s) under {out}/ hold runs of another config "
                  f"(a changed preset, --data or kit version); move or delete them, or use --out:", file=sys.stderr)
            for name, diff in pl["stale"].items():
                print(f"  {name}: {'; '.join(diff)}", file=sys.stderr)
        return 2
    if p.launcher == "torchrun" and not under_torchrun:
        return _launch_torchrun(p, out, pl["all_runs"], runs, pending, figures)
    if main:
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / "manifest.json", {"preset": p.to_dict(),
                                           "runs": [dataclasses.asdict(r) for r in pl["all_runs"]]})

    t0 = time.perf_counter()
    failures = []
    if pending:
        group = _init_group(pending) if under_torchrun else None  # one group for all runs of this process
        if not under_torchrun:
            _prepare_data(pending)  # (under torchrun, train prepares the data on one rank per node first)
        from tqdm import tqdm

        bar = tqdm(total=len(runs), initial=len(done), desc=f"reproduce {p.name}", unit="run",
                   disable=not (progress and main), dynamic_ncols=True)

        def report(res):
            fin = res.get("final", {})
            bar.update(1)
            if main:
                bar.write(f"  {res['name']}: {res['status']} in {res['wall_s']:.0f}s, "
                          f"final loss {fin['loss'] if fin.get('loss') is not None else float('nan'):.4f}, "
                          f"mean PPL (final 10%) {fin.get('mean_ppl_final_10pct') or float('nan'):.4f}")

        specs = [(dataclasses.asdict(r), str(out / r.name)) for r in pending]
        if jobs == 1:
            for spec, d in specs:
                try:
                    report(_run_one(spec, d, progress and main))
                except Exception as e:  # keep going: the tables say "not run" for it
                    if under_torchrun:
                        raise  # the other ranks cannot go on without this one
                    failures.append((spec["name"], repr(e)))
                    bar.write(f"  {spec['name']}: FAILED: {e!r}")
        else:
            import multiprocessing as mp
            from concurrent.futures import ProcessPoolExecutor, as_completed

            def on_term(signum, frame):  # SIGTERM to this process (e.g. a job scheduler): stop the workers too
                for child in mp.active_children():  # as Ctrl-C would: each checkpoints at its step boundary
                    os.kill(child.pid, signal.SIGINT)
                raise KeyboardInterrupt

            prev_term = signal.signal(signal.SIGTERM, on_term) if threading.current_thread() is threading.main_thread() \
                else None
            ex = ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn"))
            try:
                futs = {ex.submit(_run_one, spec, d, False): spec["name"] for spec, d in specs}
                for f in as_completed(futs):
                    try:
                        report(f.result())
                    except Exception as e:
                        failures.append((futs[f], repr(e)))
                        bar.write(f"  {futs[f]}: FAILED: {e!r}")
            except KeyboardInterrupt:
                # The workers got SIGINT too (Ctrl-C reaches the process group; SIGTERM is forwarded
                # above): each finishes its step and writes a checkpoint. Queued runs are cancelled;
                # a worker that has not exited after a grace period is terminated (it then resumes
                # from its last periodic checkpoint), so none keeps training orphaned.
                ex.shutdown(wait=False, cancel_futures=True)
                deadline = time.monotonic() + STOP_GRACE_S
                for child in mp.active_children():
                    child.join(max(0.0, deadline - time.monotonic()))
                for child in mp.active_children():
                    child.terminate()
                bar.close()
                print(f"lrmoe reproduce: interrupted; rerun the same command to resume ({out}/)", file=sys.stderr)
                return 130
            finally:
                ex.shutdown(wait=True)
                if prev_term is not None:
                    signal.signal(signal.SIGTERM, prev_term)
        bar.close()
        if group is not None:
            group()
    if not main:
        return 0
    return _finish(p, out, runs, pending, failures, time.perf_counter() - t0, jobs, only, figures)


def _init_group(runs: list[RunSpec]):
    """Under torchrun: the process group of every run of this process (a process group cannot be
    created again after it was destroyed); returns the function that destroys it."""
    from .parallel.launch import init_distributed, shutdown
    from .train.loop import resolve_device

    cuda = any(resolve_device(r.train_config().device).type == "cuda" for r in runs)
    init_distributed(backend="nccl" if cuda else "gloo")
    return shutdown


def _paper_figures():
    """Import paper_figures (a top-level package next to lrmoe), also from a source checkout whose
    installed copy predates the package."""
    import importlib

    try:
        return importlib.import_module("paper_figures")
    except ModuleNotFoundError as e:
        root = Path(__file__).resolve().parents[1]
        if e.name != "paper_figures" or not (root / "paper_figures" / "__init__.py").exists():
            raise
        sys.path.insert(0, str(root))
        return importlib.import_module("paper_figures")


def register_cli(sub) -> None:
    p = sub.add_parser("reproduce", help="run every experiment of a preset, then `lrmoe figures`",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="cpu", choices=list(PRESETS), help="smoke (CI), cpu (default), gpu1, paper")
    p.add_argument("--out", default=None, help="results folder (default: results/<preset>)")
    p.add_argument("--only", default=None, metavar="REGEX", help="only runs whose name matches (e.g. 'qwen3-C[0-9]+-lrm')")
    p.add_argument("--dry-run", action="store_true", help="list the runs and their status; run nothing")
    p.add_argument("--data", default=None, help="Alpaca source for every run (file, directory or hub id); "
                                                "default: the preset's shared sample, $LRMOE_ALPACA, or the hub")
    p.add_argument("--jobs", type=int, default=None, help="runs in parallel (default: the preset's)")
    p.add_argument("--no-figures", action="store_true", help="skip the figures/tables step")
    p.set_defaults(func=_cli)


def _cli(args) -> int:
    return reproduce(args.preset, args.out, args.only, args.dry_run, args.data, args.jobs,
                     figures=not args.no_figures)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m lrmoe.reproduce")
    register_cli(ap.add_subparsers(dest="command", required=True))
    a = ap.parse_args(["reproduce", *sys.argv[1:]])
    sys.exit(a.func(a))
