"""torchrun helpers: ``in_turns`` (ranks of a node build the full model in turns), on real gloo groups."""
from __future__ import annotations

import datetime
import json
import os
import socket
import time

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from lrmoe.parallel.launch import in_turns

WORLD = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, out_dir: str, cases: list) -> None:
    os.environ["RANK"] = str(rank)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                                timeout=datetime.timedelta(seconds=60))
        log = {}
        for name, local_world, concurrency in cases:
            os.environ["LOCAL_WORLD_SIZE"] = str(local_world)
            os.environ["LOCAL_RANK"] = str(rank % local_world)

            def fn():
                start = time.monotonic()
                time.sleep(0.3)  # long enough that a turn that did not wait would overlap
                return {"start": start, "end": time.monotonic(), "rank": rank}

            log[name] = in_turns(fn, concurrency)
            dist.barrier()
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(log, f)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


CASES = [("one-node-c1", 4, 1), ("one-node-c2", 4, 2), ("two-nodes-c1", 2, 1), ("all-at-once", 4, 0)]


@pytest.fixture(scope="module")
def turns_log(tmp_path_factory):
    out = tmp_path_factory.mktemp("turns")
    mp.start_processes(_worker, args=(_free_port(), str(out), CASES), nprocs=WORLD, start_method="spawn")
    logs = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    return {name: [logs[r][name] for r in range(WORLD)] for name, _, _ in CASES}


def _turn_order(entries, turn_of):
    """Every call of turn i ends before any call of turn i + 1 starts."""
    turns = sorted({turn_of(e["rank"]) for e in entries})
    for a, b in zip(turns, turns[1:]):
        end_a = max(e["end"] for e in entries if turn_of(e["rank"]) == a)
        start_b = min(e["start"] for e in entries if turn_of(e["rank"]) == b)
        assert end_a <= start_b, f"turn {b} started before turn {a} ended"
    return turns


def test_every_rank_gets_its_own_result(turns_log):
    for name, entries in turns_log.items():
        assert [e["rank"] for e in entries] == list(range(WORLD)), name


def test_one_rank_at_a_time_per_node(turns_log):
    assert _turn_order(turns_log["one-node-c1"], lambda r: r) == [0, 1, 2, 3]


def test_concurrency_two_makes_two_turns(turns_log):
    assert _turn_order(turns_log["one-node-c2"], lambda r: r // 2) == [0, 1]


def test_nodes_take_their_turns_side_by_side(turns_log):
    # two "nodes" of two ranks (local rank = rank % 2): ranks 0 and 2 first, then 1 and 3
    assert _turn_order(turns_log["two-nodes-c1"], lambda r: r % 2) == [0, 1]


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_bad_concurrency(bad):
    with pytest.raises(ValueError, match="concurrency must be an int >= 0"):
        in_turns(lambda: None, bad)


def test_single_process_just_calls():
    assert in_turns(lambda: 7, 1) == 7
