"""lrmoe.run_folder and lrmoe.environment: summaries, status, metrics, the run-folder lock, labels."""
import json
import subprocess
import sys
import textwrap

import pytest

from lrmoe.environment import environment, hardware_label
from lrmoe.run_folder import CorruptFileError, read_metrics, read_summary, run_folder_lock, run_status


def test_summary_and_status(tmp_path):
    assert read_summary(tmp_path) is None and run_status(tmp_path) is None
    (tmp_path / "summary.json").write_text(json.dumps({"status": "done"}))
    assert run_status(tmp_path) == "done"
    (tmp_path / "summary.json").write_text("[1]")
    with pytest.raises(CorruptFileError, match="expected a JSON object, got list"):
        read_summary(tmp_path)
    (tmp_path / "summary.json").write_text('{"status": ')
    with pytest.raises(CorruptFileError, match="summary.json: not valid JSON"):
        run_status(tmp_path)


def test_read_metrics_from_folder_or_file(tmp_path):
    rows = [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3')
    assert read_metrics(tmp_path) == rows == read_metrics(tmp_path / "metrics.jsonl")


def test_lock_refuses_a_second_process(tmp_path):
    with run_folder_lock(tmp_path):
        code = textwrap.dedent(f"""
            from lrmoe.run_folder import run_folder_lock
            try:
                with run_folder_lock({str(tmp_path)!r}):
                    print("acquired")
            except ValueError as e:
                print("refused:", e)
        """)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
        assert out.startswith("refused:") and "being trained by another process" in out
    with run_folder_lock(tmp_path, enabled=False):
        pass
    with run_folder_lock(tmp_path):  # released
        pass


def test_hardware_label():
    assert hardware_label({"device": "cuda:0", "gpu": "NVIDIA H200"}, {"world_size": 8, "ep": 8}) == "8x NVIDIA H200, EP8"
    assert hardware_label({"device": "cpu", "cpu_model": "Xeon", "cpu_count": 2, "threads": 1}) == \
        "CPU (Xeon), 2 cores, 1 thread(s) per run"
    env = environment()
    assert env["device"] == "cpu" and env["threads"] >= 1 and "torch" in env and env["git"]
    assert hardware_label(env).startswith("CPU (")


def test_one_training_process_per_run_folder(tmp_path):
    """A second process (e.g. a second `lrmoe reproduce` while orphaned workers still train) is refused."""
    with run_folder_lock(tmp_path, True):
        with pytest.raises(ValueError, match="being trained by another process"):
            with run_folder_lock(tmp_path, True):
                pass
        with run_folder_lock(tmp_path, False):  # only the main rank locks
            pass
    with run_folder_lock(tmp_path, True):  # released on exit
        pass
