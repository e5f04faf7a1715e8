"""The `lrmoe` command: every subcommand's --help exits 0 and describes it; a wrong subcommand or
option exits 2 with a message, not a traceback."""
import re
import subprocess
import sys

import pytest

from lrmoe.cli import main


def _exit_code(argv) -> int:
    with pytest.raises(SystemExit) as e:
        main(argv)
    return e.value.code


def _subcommands(capsys) -> list[str]:
    assert _exit_code(["--help"]) == 0
    out = capsys.readouterr().out
    return re.search(r"usage: lrmoe \[-h\]\s+\{([a-z,-]+)\}", out).group(1).split(",")


def test_top_level_help_lists_the_subcommands(capsys):
    names = _subcommands(capsys)
    assert {"train", "reproduce", "figures", "bench"} <= set(names)


def test_every_subcommand_has_help(capsys):
    for name in _subcommands(capsys):
        assert _exit_code([name, "--help"]) == 0, name
        out = capsys.readouterr().out
        assert out.startswith(f"usage: lrmoe {name}"), (name, out[:200])


def test_bench_layer_help(capsys):
    assert _exit_code(["bench", "layer", "--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: lrmoe bench layer")


@pytest.mark.parametrize("argv,message", [
    (["reproduce", "--preset", "nosuch"], "argument --preset: invalid choice: 'nosuch'"),
    (["figures", "--no-such-option"], "unrecognized arguments: --no-such-option"),
    (["bench", "nosuch"], "argument target: invalid choice: 'nosuch'"),
])
def test_a_wrong_option_exits_2_with_a_message(argv, message, capsys):
    assert _exit_code(argv) == 2
    assert message in capsys.readouterr().err


def test_an_unknown_subcommand_exits_2_with_a_message_not_a_traceback():
    r = subprocess.run([sys.executable, "-m", "lrmoe.cli", "nosuch"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    assert "invalid choice: 'nosuch'" in r.stderr and "Traceback" not in r.stderr


def test_python_m_lrmoe_reproduce_is_the_same_command():
    r = subprocess.run([sys.executable, "-m", "lrmoe.reproduce", "--help"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert "--preset" in r.stdout and "--dry-run" in r.stdout
