"""Training the pending runs: one after another in this process, or ``jobs`` at a time in a pool
of spawned worker processes, with a progress bar and one line per finished run.

Stopping (Ctrl-C, or SIGTERM from a job scheduler): every run in training finishes its step,
writes a checkpoint and stops; queued runs are not started; :func:`run_all` returns with
``interrupted`` set, and the same call resumes every run later. SIGTERM does so whatever the
inherited disposition of SIGINT (a background job starts with SIGINT ignored, and keeps ignoring
it): in this process it reaches the training loop's stop request directly
(:func:`lrmoe.train.loop.request_stop`), and the parent forwards it to the workers as SIGTERM. A
second SIGTERM stops at once, without a checkpoint. A worker that has not stopped after
:data:`STOP_GRACE_S` is terminated (it then resumes from its last periodic checkpoint), so none
keeps training orphaned. A run that fails is reported and the others go on."""
from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from lrmoe.train import Interrupted
from lrmoe.train.loop import request_stop

from .spec import RunSpec

STOP_GRACE_S = 120.0  # how long interrupted workers get to finish their step and checkpoint


@dataclass
class Outcome:
    """What :func:`run_all` did: (run name, error) of each failed run, whether it was stopped, and
    its wall time."""

    failures: list[tuple[str, str]] = field(default_factory=list)
    interrupted: bool = False
    wall_s: float = 0.0


def train_one(spec: dict, out_dir: str, progress: bool) -> dict:
    """Worker entry (also used in-process): train one run (a :class:`RunSpec` as a dict) in
    ``out_dir``; returns its name, status, final numbers and wall time."""
    cfg = RunSpec(**spec).train_config(out_dir)
    if cfg.threads:
        import torch

        torch.set_num_threads(cfg.threads)
    from lrmoe.train import train

    t0 = time.perf_counter()
    try:
        s = train(cfg, out_dir, progress=progress)
    except KeyboardInterrupt as e:  # stopped at a step boundary (checkpoint written): a plain, picklable one
        raise KeyboardInterrupt(str(e)) from None
    return {"name": spec["name"], "status": s["status"], "final": s.get("final", {}),
            "wall_s": time.perf_counter() - t0}


_WORKER_STOPPED = False  # in a pool worker: a run of this process was stopped by Ctrl-C or SIGTERM


def _pool_train(spec: dict, out_dir: str) -> dict:
    """Pool worker entry: :func:`train_one`, except that once a run of this worker was stopped by
    a signal, the runs queued behind it are not started (the executor hands a worker its next
    queued run before the parent can cancel it, and that run would train unsignalled until the
    grace period ends)."""
    global _WORKER_STOPPED
    if _WORKER_STOPPED:
        raise KeyboardInterrupt("not started: the pool is stopping")
    try:
        return train_one(spec, out_dir, False)
    except KeyboardInterrupt:
        _WORKER_STOPPED = True
        raise


def prepare_data(runs: list[RunSpec], progress: bool = True) -> None:
    """Tokenise and pack each distinct data config once, before any worker starts (``progress``: its
    progress bars)."""
    from lrmoe.train import load_data

    seen = set()
    for r in runs:
        c = r.train_config()
        key = (c.data, c.tokenizer, c.seq_len, c.heldout_fraction, c.data_seed, c.max_records)
        if key not in seen:
            seen.add(key)
            load_data(c, progress)


def run_all(runs: list[RunSpec], out, jobs: int = 1, *, progress: bool = True, main: bool = True,
            under_torchrun: bool = False, desc: str = "runs", done: int = 0, prepare: bool = True) -> Outcome:
    """Train ``runs`` into ``<out>/<name>/`` (each resumes from its checkpoint), ``jobs`` at a time.

    ``done`` runs finished before count on the progress bar; ``prepare=False``: the caller ran
    :func:`prepare_data` already (to report bad data before it writes anything); ``main`` is False on the ranks of a
    torchrun launch that do not report. Under torchrun every rank trains the runs here, one after
    another, over one process group (a failure there is raised: the other ranks cannot go on)."""
    out, outcome, t0 = Path(out), Outcome(), time.perf_counter()
    if not runs:
        return outcome
    group = _init_group(runs) if under_torchrun else None  # one group for all runs of this process
    if prepare and not under_torchrun:
        prepare_data(runs, progress and main)  # (under torchrun, train prepares the data on one rank per node first)
    from lrmoe.console import progress_bar

    bar = progress_bar(total=len(runs) + done, initial=done, desc=desc, unit="run", disable=not (progress and main),
                       dynamic_ncols=True)

    def report(res):
        fin = res.get("final", {})
        bar.update(1)
        if main:
            bar.write(f"  {res['name']}: {res['status']} in {res['wall_s']:.0f}s, "
                      f"final loss {fin['loss'] if fin.get('loss') is not None else float('nan'):.4f}, "
                      f"mean PPL (final 10%) {fin.get('mean_ppl_final_10pct') or float('nan'):.4f}")

    def failed(name, e):
        outcome.failures.append((name, repr(e)))
        bar.write(f"  {name}: FAILED: {e!r}")

    specs = [(dataclasses.asdict(r), str(out / r.name)) for r in runs]
    try:
        if jobs == 1 or under_torchrun:
            with _sigterm_stops_the_run(enabled=not under_torchrun):  # (torchrun stops its ranks itself)
                for spec, d in specs:
                    try:
                        report(train_one(spec, d, progress and main))
                    except Exception as e:  # keep going: the tables say "not run" for it
                        if under_torchrun:
                            raise
                        failed(spec["name"], e)
        else:
            _run_pool(specs, jobs, report, failed)
    except KeyboardInterrupt:  # every run in training wrote a checkpoint at its step
        outcome.interrupted = True
    finally:
        bar.close()
        if group is not None:
            group()
    outcome.wall_s = time.perf_counter() - t0
    return outcome


def _run_pool(specs, jobs: int, report, failed) -> None:
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, as_completed

    def on_term(signum, frame):  # SIGTERM to this process: passed on to the workers as SIGTERM (not as
        for child in mp.active_children():  # SIGINT, which they ignore when this process was started ignoring it)
            os.kill(child.pid, signal.SIGTERM)
        raise Interrupted(signum)

    prev_term = signal.signal(signal.SIGTERM, on_term) if threading.current_thread() is threading.main_thread() \
        else None
    ex = ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn"))
    try:
        futs = {ex.submit(_pool_train, spec, d): spec["name"] for spec, d in specs}
        for f in as_completed(futs):
            try:
                report(f.result())
            except Exception as e:
                failed(futs[f], e)
    except KeyboardInterrupt:
        # The workers got the signal too (Ctrl-C reaches the process group; SIGTERM is forwarded
        # above): each finishes its step and writes a checkpoint. Queued runs are cancelled; a
        # worker that has not exited after the grace period is terminated.
        ex.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + STOP_GRACE_S
        for child in mp.active_children():
            child.join(max(0.0, deadline - time.monotonic()))
        for child in mp.active_children():
            child.terminate()
        raise
    finally:
        ex.shutdown(wait=True)
        if prev_term is not None:
            signal.signal(signal.SIGTERM, prev_term)


@contextmanager
def _sigterm_stops_the_run(enabled: bool = True):
    """In this process (main thread only): SIGTERM asks the run in training to finish its step and
    checkpoint, as Ctrl-C does but whatever SIGINT's disposition (it goes to the loop's stop request,
    not through a SIGINT that may be ignored); between runs, or on a second SIGTERM, it stops at
    once (:class:`Interrupted`)."""
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_term(signum, frame):
        if not request_stop(signum):
            raise Interrupted(signum)

    prev = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, prev)


def _init_group(runs: list[RunSpec]):
    """Under torchrun: the process group of every run of this process (a process group cannot be
    created again after it was destroyed); returns the function that destroys it."""
    from lrmoe.parallel.launch import init_distributed, shutdown
    from lrmoe.train import resolve_device

    cuda = any(resolve_device(r.train_config().device).type == "cuda" for r in runs)
    init_distributed(backend="nccl" if cuda else "gloo")
    return shutdown
