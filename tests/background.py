"""Work a test session runs beside the tests, one command at a time, on the core the tests leave idle.

Most tests run in the single pytest process, so on a 2-core machine one core is idle for much of
the session. ``tests/conftest.py`` starts a :class:`Background` at the start of the session: it
first compiles the planners (``tests/warm_planners.py``; the tests that plan wait for it), then runs
long self-contained commands whose output a test module reads (the sm_90 Triton compile check),
each in a folder of its own. A module that uses a job's output runs last, so the job has usually
finished when it is needed; a module run without a background (``LRMOE_WARM_PLANNERS=0``, or a
job that was not registered) runs the same command itself. Nothing here changes what a test
checks: the command and its checks are the same, only where and when it runs differs.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


TRITON_CHECK_MODULE = "kernels/test_triton_compile.py"  # the module that reads the check's output


def triton_check_argv(out: Path, jobs: int) -> list[str]:
    """``scripts/check_triton_compile.py`` as tests/kernels/test_triton_compile.py runs it."""
    return [sys.executable, str(ROOT / "scripts" / "check_triton_compile.py"), "--quick", "--dtype", "bf16",
            "--check-binder", "--arch", "90", "--jobs", str(jobs), "--out", str(out)]


def triton_check_env(out: Path) -> dict:
    """Its environment: the real compiler (not the interpreter), a fresh Triton cache under ``out``."""
    return {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(out / "cache")}


@dataclass
class Job:
    argv: list[str]
    env: dict
    out: Path
    timeout_s: float
    done: threading.Event = field(default_factory=threading.Event)
    result: subprocess.CompletedProcess | None = None


class Background:
    """The planners' warm-up, then the registered jobs in order, on a thread of the session."""

    def __init__(self, warm_argv: list[str]):
        self.warm_argv = warm_argv
        self.warm_done = threading.Event()
        self.registered = threading.Event()  # every job is added (after the collection)
        self.jobs: dict[str, Job] = {}
        self.root = Path(tempfile.mkdtemp(prefix="lrmoe-tests-background-"))
        self._proc: subprocess.Popen | None = None
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="lrmoe-tests-background", daemon=True)

    def add(self, name: str, argv_of_out, env: dict, timeout_s: float) -> None:
        """Register a job (before :meth:`close_registration`): ``argv_of_out(folder)`` is its command,
        writing into a folder of its own."""
        out = self.root / name
        out.mkdir()
        self.jobs[name] = Job(argv_of_out(out), env, out, timeout_s)

    def start(self) -> None:
        self._thread.start()

    def _call(self, argv, env, timeout_s) -> subprocess.CompletedProcess:
        self._proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True)
        try:
            out, err = self._proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            out, err = self._proc.communicate()
            err += f"\n(killed after {timeout_s} s)"
        return subprocess.CompletedProcess(argv, self._proc.returncode, out, err)

    def _run(self) -> None:
        try:
            warm = self._call(self.warm_argv, None, 900)
            if warm.returncode != 0 and not self._stop:
                warnings.warn(f"tests/warm_planners.py failed (exit {warm.returncode}); the tests compile the "
                              f"planners themselves:\n{warm.stderr[-2000:]}")
        finally:
            self.warm_done.set()
        self.registered.wait()
        for job in self.jobs.values():
            if not self._stop:
                job.result = self._call(job.argv, job.env, job.timeout_s)
            job.done.set()

    def close_registration(self) -> None:
        """No more jobs: the thread runs the registered ones once the warm-up is done."""
        self.registered.set()

    def wait_for_warm_up(self) -> None:
        self.warm_done.wait()

    def result(self, name: str) -> tuple[subprocess.CompletedProcess, Path] | None:
        """A job's finished command and its folder (waiting for it), or None when it was not registered."""
        job = self.jobs.get(name)
        if job is None:
            return None
        job.done.wait()
        return (job.result, job.out) if job.result is not None else None

    def stop(self) -> None:
        self._stop = True
        self.registered.set()
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
        self._thread.join(timeout=30)
        shutil.rmtree(self.root, ignore_errors=True)


KEY = pytest.StashKey[Background]()
