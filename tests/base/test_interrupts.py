"""lrmoe.interrupts: which errors count as a Ctrl-C, and what a command says and returns after one."""
import signal

import pytest

from lrmoe.interrupts import EXIT_STATUS, caused_by_interrupt, run_command, signal_name
from lrmoe.train import Interrupted


def _numba_like():
    """What numba does with a Ctrl-C inside compiled code: a SystemError caused by it."""
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt as e:
        raise SystemError("<function> returned a result with an exception set") from e


def test_caused_by_interrupt_sees_through_a_cause_chain():
    assert caused_by_interrupt(KeyboardInterrupt())
    assert caused_by_interrupt(Interrupted(signal.SIGTERM))
    with pytest.raises(SystemError) as ei:
        _numba_like()
    assert caused_by_interrupt(ei.value)
    assert not caused_by_interrupt(ValueError("x"))
    assert not caused_by_interrupt(None)
    loop = RuntimeError("a")
    loop.__cause__ = RuntimeError("b")
    loop.__cause__.__cause__ = loop  # a cycle ends the walk
    assert not caused_by_interrupt(loop)


def test_signal_name():
    assert signal_name(KeyboardInterrupt()) == "Ctrl-C"
    assert signal_name(Interrupted(signal.SIGTERM)) == "SIGTERM"


def test_run_command_says_one_line_and_returns_130(capsys):
    assert run_command(lambda: 3, "lrmoe x", "rerun") == 3
    assert run_command(lambda: None, "lrmoe x", "rerun") == 0
    assert run_command(_numba_like, "lrmoe x", "rerun it") == EXIT_STATUS == 130
    assert capsys.readouterr().err == "lrmoe x: interrupted (Ctrl-C); rerun it\n"
    assert run_command(_numba_like, "lrmoe x", None) == 130  # a child whose parent says it
    assert capsys.readouterr().err == ""
    with pytest.raises(ValueError):  # anything else goes on as it was
        run_command(lambda: (_ for _ in ()).throw(ValueError("bad")), "lrmoe x", "rerun")
