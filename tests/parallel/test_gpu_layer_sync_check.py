"""scripts/gpu_train_step.py's layer_sync_check (the MoE layer under set_sync_debug_mode("error") on the GPU)
run on the CPU as the script calls it: every case runs its warm-up and checked call, the expert-parallel one
on a one-rank gloo group that it creates and destroys. The CPU checks no sync (tests/parallel/test_syncs.py
counts them); this catches a broken case before the one GPU run does."""
import importlib.util
from pathlib import Path

import torch
import torch.distributed as dist

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_train_step.py"


def test_layer_sync_check_runs_every_case_on_cpu():
    spec = importlib.util.spec_from_file_location("gpu_train_step", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert not dist.is_initialized()
    out = mod.layer_sync_check(torch.device("cpu"))
    assert out == {"single c20 compact": "ok", "single c20 sample": "ok", "single c20 mask": "ok",
                   "expert-parallel lrmoe c20 (1 rank)": "ok"}
    assert not dist.is_initialized()  # its own group is destroyed
