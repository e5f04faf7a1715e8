"""`lrmoe reproduce`: a preset's runs (:mod:`~lrmoe.reproduce.presets`), checked against what the
results folder holds, trained by the run machinery (:mod:`lrmoe.runs`), then the figures."""
from __future__ import annotations

import dataclasses
import os
import shlex
import sys
import time
from pathlib import Path

from lrmoe.files import CorruptFileError, read_json
from lrmoe.interrupts import EXIT_STATUS, caused_by_interrupt, signal_name
from lrmoe.run_folder import INTERRUPTED
from lrmoe.runs import RunSpec, UsageError, pool, record_call, run_all, select, survey, torchrun, write_manifest
from lrmoe.train.ep import world_size_from_env

from . import memory_check
from .presets import PRESETS, Preset, resolve_data
from .progress import StepProgress, machine, machine_line


def default_out(preset: str) -> Path:
    """Where a call writes by default: ``results/<preset>-local/`` (git-ignored), never the
    committed reference ``results/<preset>/`` (:func:`default_reference`)."""
    return Path("results") / f"{preset}-local"


def default_reference(preset: str) -> Path:
    """The committed results of a preset (``results/<preset>/``) that a rerun is compared with."""
    return Path("results") / preset


def plan(preset: str | Preset, out_dir=None, only: str | None = None, data: str | None = None) -> dict:
    """What `reproduce` would do: the preset, its results folder, the runs selected by ``only`` (a
    regular expression over run names), every run of the preset (``all_runs``), a reason to skip
    (missing data) and the state of each selected run's folder (``survey``: a
    :class:`lrmoe.runs.Survey`; ``states``, ``stale`` and ``damaged`` from it). A bad preset,
    results folder or ``only`` is a :class:`lrmoe.runs.UsageError`."""
    if isinstance(preset, str) and preset not in PRESETS:
        raise UsageError(f"unknown preset {preset!r}; accepted: {', '.join(PRESETS)}")
    p = PRESETS[preset] if isinstance(preset, str) else preset
    out = Path(out_dir) if out_dir is not None else default_out(p.name)
    check_out(out)
    source, skip = resolve_data(p, data)
    all_runs = [dataclasses.replace(r, config=dict(r.config, data=source)) for r in p.runs()]
    runs = select(all_runs, only)
    sv = survey(out, runs)
    return {"preset": p, "out": out, "runs": runs, "all_runs": all_runs, "skip": skip, "survey": sv,
            "states": sv.states, "stale": sv.stale, "damaged": sv.damaged}


def check_out(out: Path) -> None:
    """A results folder (or a path where one can be made): a :class:`UsageError` if ``out`` or one
    of its parents is a file."""
    for q in (out, *out.parents):
        if q.exists():
            if not q.is_dir():
                what = "is a file" if q == out else f"is inside {q}, which is a file"
                raise UsageError(f"--out {str(out)!r} {what}, not a folder; give a folder (it is created if "
                                 f"missing; default results/<preset>)")
            return


def check_jobs(jobs: int | None) -> None:
    if jobs is not None and (isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1):
        raise UsageError(f"--jobs {jobs}: give a number of runs in parallel >= 1 (default: the preset's)")


def reproduce(preset: str | Preset, out_dir=None, only: str | None = None, dry_run: bool = False, data: str | None = None,
              jobs: int | None = None, figures: bool = True, progress: bool = True, reference=None,
              simulate: bool = True) -> int:
    """Run every pending run of ``preset`` (skipping finished ones), then the figures. Returns an
    exit code: 0, 1 (a run failed), 2 (a run folder of another config, a damaged one or one that
    another process trains, a preset whose hardware this machine lacks, or no data for the runs:
    checked before anything is written or fetched), 130 (stopped by Ctrl-C or SIGTERM in any step, one line
    says what it was doing and what is kept; rerun to resume). Bad arguments (preset, ``out_dir``,
    ``only``, ``jobs``) raise :class:`lrmoe.runs.UsageError`.

    A torchrun preset (``paper``) launched from a shell prints one ``torchrun`` command per pending
    run and runs them one after another when the machine has the GPUs. Under torchrun
    (``torchrun ... -m lrmoe.cli reproduce ...``), every rank runs the pending runs in this
    process, one after another, over one process group; rank 0 writes the files.

    With ``figures`` and ``simulate``, the cluster simulator's paper-scale scenarios run first
    (:mod:`~lrmoe.reproduce.simulate`: T4, T5, F3, F5 into ``<out>/sim/``, simulated), so the
    report has them beside the measured tables. With ``figures``, the tables are then compared cell by cell with ``reference`` (a results
    folder; default the committed ``results/<preset>/`` when it has a manifest; ``"none"`` or a
    reference that is the output folder itself: no comparison) and with the paper
    (:mod:`~lrmoe.reproduce.compare`: ``compare.md`` and ``compare.json`` in the output folder,
    the Markdown printed last on stdout).

    ``preset`` may be any object with a :class:`Preset`'s attributes and methods (`lrmoe ablate`
    passes an ablation grid, :class:`lrmoe.ablate.grid.Grid`); ``figures`` may be a function
    ``figures(out, runs) -> exit code`` that makes the tables instead (no comparison then)."""
    check_jobs(jobs)
    pl = plan(preset, out_dir, only, data)
    ref = _reference(pl["preset"], pl["out"], reference)
    p, out, runs, sv = pl["preset"], pl["out"], pl["runs"], pl["survey"]
    done, pending = sv.done(runs), sv.pending(runs)
    under_torchrun = world_size_from_env() > 1
    main = int(os.environ.get("RANK", "0")) == 0
    jobs = 1 if under_torchrun or p.launcher == "torchrun" else jobs or p.jobs
    missing = _missing_hardware(p, pending) if not under_torchrun else None
    if main:
        _describe(p, out, runs, len(done), len(pending), jobs)
    if dry_run:
        _list_runs(p, out, runs, sv, pl["skip"], missing)
        return 0
    if pl["skip"]:  # no data: nothing can run, and a script must not read that as success
        print(f"{p.prog}: nothing was run: {pl['skip']}", file=sys.stderr)
        return 2
    refusal = sv.refusal(out, p.prog)
    if refusal:
        if main:
            print("\n".join(refusal), file=sys.stderr)
        return 2
    if main and sv.reasons(pending):  # why a started run runs again (it resumes, or restarts)
        print("\n".join([f"{p.prog}: started runs that run again:", *sv.reasons(pending)]), file=sys.stderr)
    stage = _Stage()  # what the call is doing, for the line it prints when it is stopped
    try:
        if p.launcher == "torchrun" and not under_torchrun:
            return _launch_torchrun(p, out, pl["all_runs"], runs, pending, figures, ref, simulate, stage)
        if missing:  # checked before any file is written or any data is fetched
            print(f"{p.prog}: {p.kind} {p.name!r} needs {p.hardware}, but {missing}, so nothing was run; run it on "
                  f"such a machine, or {p.elsewhere}", file=sys.stderr)
            return 2
        if pending and not under_torchrun and any(r.config.get("device") == "cuda" for r in pending):
            refusal = _preflight(p, out, pending)  # a local GPU preset (gpu1): the same checks as torchrun's
            if refusal:
                print(refusal, file=sys.stderr)
                return 2
        t0, at_start = time.perf_counter(), machine()
        if pending and not under_torchrun:  # tokenise and pack once; bad data is said before anything is written
            stage.now = "preparing the runs' data"
            try:
                pool.prepare_data(pending, progress and main)
            except (ValueError, OSError) as e:
                print(f"{p.prog}: the runs' data cannot be prepared, so nothing was run: {e}", file=sys.stderr)
                return 2
        if main:
            _clean(sv, p.prog)
            out.mkdir(parents=True, exist_ok=True)
            write_manifest(out, _manifest(p, pl["all_runs"], at_start if pending else _trained_on(out)))
            print(f"  machine: {machine_line(at_start)}", file=sys.stderr)
        # workers train without a bar of their own: one bar of their steps, read from their metrics files
        steps_bar = StepProgress(out, [(r.name, int(r.config["steps"])) for r in pending],
                                 enabled=progress and main and jobs > 1 and not under_torchrun)
        stage.now = "training"
        with steps_bar:
            res = run_all(pending, out, jobs, progress=progress, main=main, under_torchrun=under_torchrun,
                          desc=f"{p.prog.split()[-1]} {p.name}", done=len(done), prepare=False)
        if main and res.failures:  # a run that failed before its first step leaves only its lock file
            _clean(survey(out, [r for r in pending if r.name in {n for n, _ in res.failures}]), p.prog)
        if res.interrupted:
            if main:
                _say_interrupted(p, out, runs, stage.now, res.stopped_by)
            return EXIT_STATUS
        if not main:
            return 0
        return _finish(p, out, runs, pending, res.failures, time.perf_counter() - t0, jobs, only, figures, at_start,
                       ref, simulate, stage)
    except BaseException as e:  # Ctrl-C, or an error it caused (numba: a SystemError), in any step
        if not caused_by_interrupt(e):
            raise
        if main:
            _say_interrupted(p, out, runs, stage.now, signal_name(e))
        return EXIT_STATUS


class _Stage:
    """What a call is doing now, for the line it prints when it is stopped."""

    now = "checking the runs"


def _say_interrupted(p, out: Path, runs: list[RunSpec], stage: str, by: str) -> None:
    """The one line of a stopped call: what it was doing, what is kept, how to go on."""
    sv = survey(out, runs)
    n_done = len(sv.done(runs))
    resumable = sum(1 for r in runs if sv.states[r.name].state == INTERRUPTED and sv.states[r.name].resumable)
    if n_done == len(runs):
        kept = f"the {len(runs)} run{'s' * (len(runs) != 1)}, finished (a rerun trains none)"
    else:
        kept = f"{n_done} of {len(runs)} runs finished" + (
            f", {resumable} stopped at a checkpoint (a rerun resumes from it)" if resumable else "")
    print(f"{p.prog}: interrupted; rerun the same command to resume ({out}/): {by} while {stage}; kept: {kept}",
          file=sys.stderr, flush=True)


def _reference(p: Preset, out: Path, reference) -> Path | None:
    """The results folder to compare with: ``reference`` (a folder; ``"none"``: none), else the
    committed ``results/<preset>/`` when it holds a manifest; None when it is the output folder."""
    if isinstance(reference, str) and reference.lower() == "none":
        return None
    if reference is None:
        ref = default_reference(p.name)
        if not (ref / "manifest.json").is_file():
            return None
    else:
        ref = Path(reference)
        if not ref.is_dir():
            what = "is not a folder" if ref.exists() else "does not exist"
            raise UsageError(f"--reference {str(reference)!r} {what}; give a results folder of the preset (default "
                             f"results/{p.name}), or 'none' for no comparison")
    if ref.resolve() == out.resolve():
        return None
    return ref


def _missing_hardware(p: Preset, pending: list[RunSpec]) -> str | None:
    """Why this machine cannot train the pending runs of a local preset (e.g. a CUDA preset on a
    CPU-only machine); None when it can (torchrun presets check per launch)."""
    if not pending or p.launcher == "torchrun":
        return None
    return torchrun.missing_hardware(pending, 1)


def _clean(sv, prog: str) -> None:
    removed = sv.clean()
    if removed:
        print(f"{prog}: removed {len(removed)} leftover(s) of failed or interrupted runs (lock files of "
              f"runs that failed before their first step, their empty folders, temporary files): "
              + ", ".join(str(q) for q in removed), file=sys.stderr)


def _trained_on(out: Path) -> dict | None:
    """The machine the manifest of ``out`` recorded when its runs were trained (None without one):
    a call that trains nothing keeps it."""
    try:
        old = read_json(out / "manifest.json", missing={})
    except CorruptFileError:
        return None
    return old.get("machine") if isinstance(old, dict) else None


def _manifest(p: Preset, all_runs: list[RunSpec], at_start: dict | None = None) -> dict:
    m = {"preset": p.to_dict(), "runs": [dataclasses.asdict(r) for r in all_runs]}
    if at_start is not None:  # the machine and its load when this call started
        m["machine"] = at_start
    return m


def _describe(p: Preset, out: Path, runs: list[RunSpec], n_done: int, n_pending: int, jobs: int) -> None:
    print(f"{p.kind} {p.name}: {p.description}", file=sys.stderr)
    print(f"  hardware: {p.hardware}; cost: {p.cost}", file=sys.stderr)
    if runs:  # the settings every run shares (the full configs are in manifest.json)
        common = {k: v for k, v in runs[0].config.items() if all(r.config.get(k) == v for r in runs)}
        data = common.pop("data", "per run") or "$LRMOE_ALPACA, else the hub (tatsu-lab/alpaca)"
        print(f"  data: {data}; shared settings: "
              + ", ".join(f"{k}={v}" for k, v in sorted(common.items())), file=sys.stderr)
    print(f"  {len(runs)} runs -> {out}/ ({n_done} done, {n_pending} to run, {jobs} in parallel)", file=sys.stderr)


def _list_runs(p: Preset, out: Path, runs: list[RunSpec], sv, skip: str | None, missing: str | None) -> None:
    """--dry-run: one line per run (stdout), what a real call would do about it or refuse (stderr)."""
    width = max([len(sv.label(r.name)) for r in runs] + [8])
    estimates = memory_check.stored(out) if p.launcher == "torchrun" else {}
    for r in runs:
        c, st = r.config, sv.states[r.name]
        print(f"  {r.name:28s} {','.join(r.experiments):8s} {sv.label(r.name):{width}s} "
              f"{p.run_line(r)}", flush=True)
        if r.name in sv.stale and st.state != "damaged":
            print(f"    its folder holds a run of another config ({'; '.join(sv.stale[r.name])}): "
                  f"a real call stops with status 2", file=sys.stderr)
        elif st.state in ("damaged", "running"):
            print(f"    {st.why}: a real call stops with status 2", file=sys.stderr)
        elif st.state == "interrupted":
            print(f"    {st.why}: a real call reruns it", file=sys.stderr)
        elif st.leftovers:
            print(f"    {st.why or 'temporary files of an interrupted write'}: a real call removes "
                  + ", ".join(q.name for q in st.leftovers), file=sys.stderr)
        if p.launcher == "torchrun":
            print("    " + shlex.join(torchrun.torchrun_command(r, out / r.name, p.nproc)))
            print("    " + memory_check.column(r, p.nproc, estimates))
    if missing:
        print(f"  note: {missing}: a real call stops with status 2 before it writes or fetches anything",
              file=sys.stderr)
    if skip:
        print(f"  note: {skip}: a real call stops with status 2 and runs nothing", file=sys.stderr)
    if p.launcher == "torchrun":
        for line in _checkpoints_missing(runs):
            print(f"  note:{line}: a real call stops with status 2 before launching", file=sys.stderr)


def _launch_torchrun(p: Preset, out: Path, all_runs: list[RunSpec], runs: list[RunSpec], pending: list[RunSpec],
                     figures: bool, ref: Path | None, simulate: bool, stage: _Stage) -> int:
    """Not under torchrun: print one torchrun command per pending run, then run them one after
    another when this machine has the GPUs; otherwise exit with status 2 (the commands are the way
    to run the preset elsewhere)."""
    if pending:
        print(f"  {len(pending)} torchrun launch(es), one per run (each resumes from its checkpoint):",
              file=sys.stderr)
    for r in pending:
        print(shlex.join(torchrun.torchrun_command(r, out / r.name, p.nproc)), flush=True)
    missing = torchrun.missing_hardware(pending, p.nproc)
    if missing:
        print(f"{p.prog}: {p.kind} {p.name!r} trains every run with expert-parallel torchrun launches of "
              f"{p.nproc} processes ({p.hardware}); {missing}, so nothing was run. Run the commands above on such "
              f"a machine (from the repository root), or `{p.command()}` there, which runs "
              f"them one after another and then the figures.", file=sys.stderr)
        return 2
    refusal = _preflight(p, out, pending)
    if refusal:
        print(refusal, file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    t0, at_start = time.perf_counter(), machine()
    write_manifest(out, _manifest(p, all_runs, at_start))
    stage.now = "training (torchrun launches)"
    failures = torchrun.launch_each(pending, out, p.nproc)
    return _finish(p, out, runs, pending, failures, time.perf_counter() - t0, 1, None, figures, at_start, ref, simulate,
                   stage)


def _checkpoints_missing(runs: list[RunSpec]) -> list[str]:
    """Why the runs' ``init_from`` checkpoints cannot be read here (one line each; empty: all can)."""
    from ..hf.loading import checkpoint_dir

    lines = []
    for name in sorted({r.config.get("init_from") for r in runs} - {None}):
        try:
            checkpoint_dir(name)
        except ValueError as e:
            lines.append(f"  {e}")
    return lines


def _preflight(p, out: Path, pending: list[RunSpec]) -> str | None:
    """Before the first launch on a GPU machine: every checkpoint is downloaded and every run fits
    the GPUs and the host by its memory estimate (:mod:`lrmoe.reproduce.memory_check`); the refusal
    text, or None."""
    lines = _checkpoints_missing(pending)
    if lines:
        return "\n".join([f"{p.prog}: checkpoints the runs start from are not here, so nothing was run:", *lines])
    mem = memory_check.machine_memory()
    if mem is None:
        return None
    lines = memory_check.check(pending, p.nproc, out, *mem, say=lambda line: print(f"  {line}", file=sys.stderr))
    if lines:
        return "\n".join([f"{p.prog}: runs estimated not to fit this machine ({mem[0] / 2**30:.0f} GiB per GPU, "
                          f"{mem[1] / 2**30:.0f} GiB host), so nothing was run (estimates: "
                          f"{out / memory_check.LOCAL}; docs/memory.md says what fits where):", *lines])
    return None


def _finish(p, out, runs, pending, failures, wall, jobs, only, figures, at_start, reference, simulate=True,
            stage: _Stage | None = None) -> int:
    """reproduce.json (with the machine and its load at the start and the end), then the
    simulated tables, the figures and the rerun check against the reference, the paper's values
    beside (printed last); the exit code. ``stage`` says which step runs."""
    stage = stage or _Stage()
    stage.now = "writing the call's record"
    at_end = machine()
    record_call(out / f"{p.prog.split()[-1]}.json", {p.kind: p.name, "runs": len(runs), "ran_now": len(pending),
                                         "failed": failures, "jobs": jobs, "only": only,
                                         "machine_at_start": at_start, "machine_at_end": at_end}, wall,
                warn=lambda msg: print(f"{p.prog}: {msg}", file=sys.stderr))
    print(f"{p.kind} {p.name}: {len(pending)} run(s) in {wall:.0f}s ({wall / 60:.1f} min, {jobs} in parallel) on "
          f"{machine_line(at_start)} at the start; load average {_load(at_end)} at the end", file=sys.stderr)
    if callable(figures):  # the caller's tables and figures (`lrmoe ablate`: the grid's aggregation)
        stage.now = "making the tables and figures"
        return max(int(figures(out, runs) or 0), 1 if failures else 0)
    step_failed = False  # the simulation or the probe (each says why on stderr)
    if figures and simulate:
        stage.now = "simulating the cluster"
        step_failed = _simulate(out)
    if figures and getattr(p, "probe", None):
        stage.now = "running the gradient-fidelity probe"
        step_failed = _probe(out, p.probe) or step_failed
    if figures:
        stage.now = "making the figures and tables"
        from paper_figures import make_all

        from paper_figures import AmbiguousRuns

        try:
            written = make_all(out, out, warn=lambda msg: print(f"{p.prog}: {msg}", file=sys.stderr))
        except (CorruptFileError, AmbiguousRuns) as e:  # a manifest that cannot be read, two runs of one cell
            print(f"{p.prog}: the figures were not made: {e}", file=sys.stderr)
            return 1
        print(f"figures and tables: {len(written)} files under {out}/tables and {out}/figures", file=sys.stderr)
        if reference is None:
            print(f"no comparison: no reference folder (--reference none, --out is the reference itself, or "
                  f"{default_reference(p.name)}/ holds no manifest.json)", file=sys.stderr)
        else:
            stage.now = "comparing with the reference"
            from .compare import compare, render_markdown, write_comparison

            try:
                result = compare(out, reference)
            except (CorruptFileError, AmbiguousRuns) as e:
                print(f"{p.prog}: no comparison with {reference}/: {e}", file=sys.stderr)
                return 1
            files = write_comparison(result, out)
            print(f"rerun check against {reference}/ (the paper's values beside, not judged): "
                  f"{', '.join(str(f) for f in files)}", file=sys.stderr)
            sys.stdout.write("\n" + render_markdown(result))
            sys.stdout.flush()
    return 1 if failures or step_failed else 0


def _simulate(out: Path) -> bool:
    """The simulator's scenarios into ``<out>/sim/``; True when it failed (said on stderr; the
    report then lists T4, T5, F3 and F5 as not produced)."""
    from .simulate import SUBDIR, simulate_into

    print(f"simulating the paper's cluster (T4, T5, F3, F5; `lrmoe simulate --scenario all`) into {out}/{SUBDIR}/ ...",
          file=sys.stderr, flush=True)
    rc, log, secs = simulate_into(out)
    if rc != 0:
        tail = "\n".join(log.strip().splitlines()[-3:])
        print(f"lrmoe reproduce: the simulation failed (status {rc}; {out}/{SUBDIR}/simulate.log):\n{tail}",
              file=sys.stderr)
        return True
    print(f"simulated in {secs:.0f}s: {out}/{SUBDIR}/<scenario>/ (simulation.json, tables, figures; "
          f"log: {out}/{SUBDIR}/simulate.log)", file=sys.stderr)
    return False


def _probe(out: Path, spec: dict) -> bool:
    """The gradient-fidelity probe into ``<out>/probe/`` (:mod:`~lrmoe.reproduce.probe`); True when it
    failed (said on stderr; the report then lists A1 as not produced)."""
    from lrmoe.run_folder import read_summary

    from .probe import SUBDIR, probe_argv, probe_into, up_to_date

    try:
        finished = (read_summary(out / spec["run"]) or {}).get("status") == "done"
    except CorruptFileError as e:
        print(f"no gradient-fidelity probe: {e}", file=sys.stderr)
        return True
    if not finished:
        print(f"no gradient-fidelity probe: {out / spec['run']} has not finished (run it first)", file=sys.stderr)
        return False
    if up_to_date(out, spec):
        print(f"gradient-fidelity probe: {out}/{SUBDIR}/probe.json is up to date", file=sys.stderr)
        return False
    print(f"gradient-fidelity probe of {spec['run']} into {out}/{SUBDIR}/ (`lrmoe ablate probe "
          f"{shlex.join(probe_argv(out, spec))}`; {spec.get('cost', 'a few minutes')}) ...",
          file=sys.stderr, flush=True)
    rc, secs = probe_into(out, spec)
    if rc != 0:
        print(f"lrmoe reproduce: the gradient-fidelity probe failed (status {rc})", file=sys.stderr)
        return True
    print(f"probed in {secs:.0f}s: {out}/{SUBDIR}/ (probe.json, probe.md, figures/figure_a1.png)", file=sys.stderr)
    return False


def _load(m: dict) -> str:
    load = m.get("load_average")
    return " / ".join(f"{x:.2f}" for x in load) + " (1 / 5 / 15 min)" if load else "unknown"
