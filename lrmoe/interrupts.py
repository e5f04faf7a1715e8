"""Ctrl-C in the kit's commands: one line, exit status 130, no traceback, nothing finished lost.

A terminal sends SIGINT to the whole foreground process group: the command and every worker
process get it at once. The parent decides what stops and how; its workers leave SIGINT alone
(:func:`ignore_sigint`, installed before a SIGINT can reach them: :func:`blocked_in_children`),
so none prints a traceback of its own or stops half-way through something the parent waits for.
Compiled code can turn the ``KeyboardInterrupt`` into another exception (numba reports it as a
``SystemError`` "returned a result with an exception set"): :func:`caused_by_interrupt` sees
through that. :func:`run_command` is the commands' last line of defence, :func:`wait_child` the
way to wait for a child process that got the Ctrl-C too."""
from __future__ import annotations

import signal
import subprocess
import sys
from contextlib import contextmanager

EXIT_STATUS = 130  # the shell's 128 + SIGINT


def caused_by_interrupt(e: BaseException | None) -> bool:
    """``e`` is a ``KeyboardInterrupt`` (Ctrl-C, or a stop signal turned into one), or was raised
    because of one (its ``__cause__`` chain holds one)."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, KeyboardInterrupt):
            return True
        seen.add(id(e))
        e = e.__cause__
    return False


def signal_name(e: BaseException | None) -> str:
    """What stopped the command: ``"Ctrl-C"``, or the name of the signal a stop carries
    (``lrmoe.train.Interrupted`` has ``signum``: SIGTERM from a job scheduler)."""
    while e is not None and not isinstance(e, KeyboardInterrupt):
        e = e.__cause__
    signum = getattr(e, "signum", signal.SIGINT)
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


def run_command(func, prog: str, after: str | None) -> int:
    """``func()`` as an exit status; after Ctrl-C (anywhere in it): ``<prog>: interrupted (Ctrl-C);
    <after>`` on stderr and :data:`EXIT_STATUS`, no traceback (``after=None``: no line, for a child
    process whose parent says it)."""
    try:
        return int(func() or 0)
    except BaseException as e:
        if not caused_by_interrupt(e):
            raise
        if after is not None:
            print(f"{prog}: interrupted ({signal_name(e)}); {after}", file=sys.stderr, flush=True)
        return EXIT_STATUS


def ignore_sigint() -> None:
    """A worker process's first act (a pool's ``initializer``): ignore SIGINT from now on, the
    parent decides, then let through what :func:`blocked_in_children` held back (a SIGINT that
    came meanwhile is dropped)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    unblock(signal.SIGINT)


@contextmanager
def blocked_in_children(*signums: int):
    """Child processes started inside (from this thread: a process pool's workers are started by
    its first ``submit`` calls) begin with ``signums`` (default SIGINT) blocked, until their
    initializer handles them and calls :func:`unblock`: a spawned worker imports for seconds
    before it runs its initializer, and a Ctrl-C then would end it with a traceback. In this
    process they are held back only while inside, then delivered."""
    signums = signums or (signal.SIGINT,)
    if not hasattr(signal, "pthread_sigmask"):  # (not POSIX)
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, signums)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def unblock(*signums: int) -> None:
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, signums)


def wait_child(proc: subprocess.Popen, grace_s: float = 60.0) -> int:
    """``proc``'s exit status. After Ctrl-C here, ``proc`` (in this process group) got it too and
    is given the time to stop by itself; if it still runs after 2 s (the SIGINT was sent to this
    process only), it gets a SIGINT, and after ``grace_s`` more (or a second Ctrl-C) it is killed;
    then the ``KeyboardInterrupt`` goes on. Unlike ``subprocess.call``, which kills the child a
    quarter of a second after Ctrl-C, whatever the child was finishing, and leaves its own child
    processes running."""
    try:
        return proc.wait()
    except KeyboardInterrupt:
        for wait_s, then in ((2.0, signal.SIGINT), (grace_s, signal.SIGKILL)):
            try:
                proc.wait(timeout=wait_s)
                break
            except (subprocess.TimeoutExpired, KeyboardInterrupt):
                proc.send_signal(then)
        proc.wait()
        raise
