"""Progress in a log is plain lines: no carriage returns or escape codes when stderr is not a terminal."""
import io
import sys

from lrmoe import console


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_plain_lines_when_not_a_terminal(monkeypatch):
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    assert not console.is_terminal()
    bar = console.progress_bar(total=20, desc="run", unit="step")
    assert isinstance(bar, console.LineBar)
    for i in range(20):
        bar.set_postfix({"loss": f"{1 / (i + 1):.4f}"}, refresh=False)
        bar.update(1)
    bar.close()
    lines = err.getvalue().splitlines()
    assert "\r" not in err.getvalue() and "\x1b" not in err.getvalue()
    assert len(lines) == 10  # one line per tenth of the run, none repeated at close
    assert lines[0].startswith("run: 2/20 step (10 %)") and lines[-1].startswith("run: 20/20 step (100 %)")
    assert lines[-1].endswith("loss=0.0500")


def test_resumed_bar_counts_from_its_start(monkeypatch):
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    bar = console.progress_bar(total=100, initial=95, desc="r", unit="step")
    for _ in range(3):
        bar.update(1)
    bar.close()  # 98 was not a tenth: close prints where it stopped
    assert err.getvalue().splitlines() == [err.getvalue().splitlines()[0]] and "98/100" in err.getvalue()


def test_tqdm_on_a_terminal_and_silent_when_disabled(monkeypatch):
    monkeypatch.setattr(sys, "stderr", _Tty())
    assert console.is_terminal()
    assert not isinstance(console.progress_bar(total=3, disable=True), console.LineBar)
    bar = console.progress_bar(total=3)
    assert type(bar).__name__ == "tqdm"
    bar.close()
