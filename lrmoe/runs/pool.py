"""Training the pending runs: one after another in this process, or ``jobs`` at a time in a pool
of spawned worker processes, with a progress bar and one line per finished run.

Stopping (Ctrl-C, or SIGTERM from a job scheduler): every run in training finishes its step,
writes a checkpoint and stops; queued runs are not started; :func:`run_all` returns with
``interrupted`` set, and the same call resumes every run later. A second Ctrl-C (or SIGTERM) stops
at once, without a checkpoint. In this process the signal reaches the training loop (SIGTERM
through its stop request, :func:`lrmoe.train.loop.request_stop`, whatever the inherited
disposition of SIGINT: a background job starts with SIGINT ignored, and keeps ignoring it). The
pool's workers ignore SIGINT (a Ctrl-C reaches the whole process group; a worker that is starting
or between runs would end with a traceback): the parent decides, and passes the stop on as
SIGTERM, which a worker's run answers as above, quietly (the parent says it once for all). A
worker that has not stopped after :data:`STOP_GRACE_S` is terminated (it then resumes from its last
periodic checkpoint), so none keeps training orphaned. A run that fails is reported and the others
go on."""
from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from lrmoe.interrupts import blocked_in_children, caused_by_interrupt, ignore_sigint, signal_name, unblock
from lrmoe.train import Interrupted
from lrmoe.train.loop import request_stop

from .spec import RunSpec

STOP_GRACE_S = 120.0  # how long interrupted workers get to finish their step and checkpoint


@dataclass
class Outcome:
    """What :func:`run_all` did: (run name, error) of each failed run, whether it was stopped (and
    by what: ``"Ctrl-C"``, ``"SIGTERM"``), and its wall time."""

    failures: list[tuple[str, str]] = field(default_factory=list)
    interrupted: bool = False
    stopped_by: str = ""
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


_WORKER_STOPPED = False  # in a pool worker: the parent stopped the pool (Ctrl-C or SIGTERM)
_IN_RUN = False  # in a pool worker: a run is in hand (being set up, trained or finished)


def _worker_start() -> None:
    """Pool worker initializer: SIGINT is ignored (the parent decides), SIGTERM is the parent's
    stop (:func:`_worker_on_term`). Both were blocked since the parent started this process
    (:func:`lrmoe.interrupts.blocked_in_children`); one that came meanwhile is handled now."""
    signal.signal(signal.SIGTERM, _worker_on_term)
    ignore_sigint()  # (unblocks SIGINT)
    unblock(signal.SIGTERM)


def _worker_on_term(signum, frame) -> None:
    """In a pool worker, the parent's stop: the run in training finishes its step and checkpoints
    (the training loop leaves this handler in place and is asked through :func:`request_stop`;
    what it would say goes nowhere, the parent says it once for all workers); a run being set up
    or finished, or a second SIGTERM, stops at once; between runs the worker takes no other."""
    global _WORKER_STOPPED
    _WORKER_STOPPED = True
    with contextlib.redirect_stderr(io.StringIO()):
        asked = request_stop(signum)
    if not asked and _IN_RUN:
        raise Interrupted(signum)


def _pool_train(spec: dict, out_dir: str) -> dict:
    """Pool worker entry: :func:`train_one`, except that once the pool is stopping, the runs queued
    behind are not started (the executor hands a worker its next queued run before the parent can
    cancel it, and that run would train unsignalled until the grace period ends)."""
    global _WORKER_STOPPED, _IN_RUN
    _IN_RUN = True
    try:
        if _WORKER_STOPPED:
            raise KeyboardInterrupt("not started: the pool is stopping")
        return train_one(spec, out_dir, False)
    except BaseException as e:
        if caused_by_interrupt(e):
            _WORKER_STOPPED = True
        raise
    finally:
        _IN_RUN = False


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
                        if under_torchrun or caused_by_interrupt(e):  # (numba turns a Ctrl-C into a SystemError)
                            raise
                        failed(spec["name"], e)
        else:
            _run_pool(specs, jobs, report, failed, bar.write)
    except BaseException as e:  # a stop: every run in training wrote a checkpoint at its step
        if not caused_by_interrupt(e):
            raise
        outcome.interrupted, outcome.stopped_by = True, signal_name(e)
    finally:
        bar.close()
        if group is not None:
            group()
    outcome.wall_s = time.perf_counter() - t0
    return outcome


def _run_pool(specs, jobs: int, report, failed, say=None) -> None:
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, as_completed

    say = say or (lambda msg: print(msg, file=sys.stderr, flush=True))

    def pass_on() -> None:  # the stop, to every worker, as SIGTERM (they ignore SIGINT)
        for child in mp.active_children():
            os.kill(child.pid, signal.SIGTERM)

    def on_term(signum, frame):  # SIGTERM to this process
        pass_on()
        raise Interrupted(signum)

    prev_term = signal.signal(signal.SIGTERM, on_term) if threading.current_thread() is threading.main_thread() \
        else None
    ex = ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn"), initializer=_worker_start)
    try:
        with blocked_in_children(signal.SIGINT, signal.SIGTERM):  # until _worker_start handles them
            futs = {ex.submit(_pool_train, spec, d): spec["name"] for spec, d in specs}
        for f in as_completed(futs):
            try:
                report(f.result())
            except Exception as e:
                failed(futs[f], e)
    except KeyboardInterrupt as e:
        # Each worker finishes its step and writes a checkpoint; queued runs are cancelled; a
        # worker that has not exited after the grace period is terminated.
        if not isinstance(e, Interrupted):  # Ctrl-C (on_term passed SIGTERM on already)
            pass_on()
        name = signal_name(e)
        say(f"{name}: the runs in training finish this step, then write a checkpoint ({name} again to stop at once)")
        ex.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + STOP_GRACE_S
        while True:
            try:
                for child in mp.active_children():
                    child.join(max(0.0, deadline - time.monotonic()))
                break
            except KeyboardInterrupt as again:  # a second stop: the workers stop at once, without a checkpoint
                if not isinstance(again, Interrupted):
                    pass_on()
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
