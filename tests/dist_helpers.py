"""Helpers for tests that spawn gloo process groups (imported by the test files as ``dist_helpers``).

Every spawned group runs under a deadline, so a hang fails the test instead of blocking the suite.
"""
from __future__ import annotations

import os
import socket
import time

import pytest
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn, G: int, *args, deadline_s: float = 240) -> None:
    """Run ``fn(rank, G, port, *args)`` in G spawned processes; fail the test past ``deadline_s``."""
    ctx = mp.start_processes(fn, args=(G, free_port(), *args), nprocs=G, join=False, start_method="spawn")
    t0 = time.perf_counter()
    while not ctx.join(timeout=1):
        if time.perf_counter() - t0 > deadline_s:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"spawned group of {G} did not finish within {deadline_s} s (hang)")


def torchrun_env(rank: int, G: int, port: int) -> None:
    """The environment torchrun gives rank ``rank`` of ``G`` on one node (127.0.0.1:``port``)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(G), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(G),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
