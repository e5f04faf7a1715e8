"""torchrun helpers: process group from the environment, device per LOCAL_RANK, EP/DP groups.

    torchrun --nproc-per-node 4 -m lrmoe.cli train ... --ep 4 --placement lrmoe
    env = init_distributed(ep=4)       # in the program
    ...
    shutdown()

World = ep x dp ranks. EP groups are blocks of ``ep`` consecutive ranks (one node's GPUs first),
so each EP group holds every expert once; the expert-data-parallel group of a rank holds the
ranks with the same position in the other EP groups (they own the same experts). Non-expert
parameters are data parallel over the whole world. With ``ep == world`` (the usual case) the EP
group is the default group and the expert-data-parallel group is None.
"""
from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    ep_size: int
    ep_group: object = None  # None: the default group
    expert_dp_group: object = None  # None: no replication of experts across EP groups
    dp_group: object = None  # non-expert parameters: data parallel over every rank (default group)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(ep: int | None = None, backend: str | None = None, timeout_s: float = 600.0) -> DistEnv:
    """Initialise torch.distributed from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR, MASTER_PORT), or as a single process when they are absent.

    backend: ``nccl`` when CUDA is available, else ``gloo`` (default). The device is
    ``cuda:LOCAL_RANK`` with NCCL, else the CPU. ``timeout_s``: collective timeout; a peer that
    dies or hangs then raises (:class:`lrmoe.parallel.runtime.EPCommunicationError`) instead of
    hanging forever (with NCCL, set TORCH_NCCL_ASYNC_ERROR_HANDLING=1, torchrun's default).
    ep: expert-parallel group size (default: every rank); must divide the world size."""
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend must be 'nccl' or 'gloo', got {backend!r}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend 'nccl' needs CUDA GPUs; use 'gloo' on CPU")
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if backend == "nccl":
        if local_rank >= torch.cuda.device_count():
            raise ValueError(f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} GPUs are visible "
                             "(NCCL needs one GPU per rank)")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    timeout = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        if "MASTER_ADDR" in os.environ:
            kw = {"device_id": device} if backend == "nccl" else {}
            dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout, **kw)
        elif world == 1:
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1,
                                    timeout=timeout)
        else:
            raise RuntimeError(f"WORLD_SIZE={world} without MASTER_ADDR/MASTER_PORT: launch with torchrun")
    rank, world = dist.get_rank(), dist.get_world_size()
    ep = world if ep is None else ep
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1 or world % ep:
        raise ValueError(f"ep must be a positive divisor of the world size {world}, got {ep!r}")
    env = DistEnv(rank, world, local_rank, device, backend, ep)
    if ep < world:
        for start in range(0, world, ep):  # every rank creates every group, in the same order
            g = dist.new_group(list(range(start, start + ep)))
            if start <= rank < start + ep:
                env.ep_group = g
        for pos in range(ep):
            g = dist.new_group(list(range(pos, world, ep)))
            if rank % ep == pos:
                env.expert_dp_group = g
    return env


def in_turns(fn, concurrency: int = 1, *, timeout_s: float = 3600.0):
    """Call ``fn()`` on every rank, at most ``concurrency`` ranks of a node at a time; returns its result.

    For work with a large transient host-memory peak, such as building or loading the full model
    before its experts are sharded (4 bytes x parameters in fp32 per rank: about 122 GB for
    Qwen3-30B-A3B, so eight ranks of a node at once would need about 1 TB). Ranks with local rank
    in ``[i*c, (i+1)*c)`` take turn ``i``; nodes run their turns side by side. Every rank of the
    default group must call it. ``concurrency`` 0 (or >= the ranks per node) runs everyone at once.
    The turns are separated by barriers of a gloo group whose timeout is ``timeout_s`` (a turn
    may take much longer than the collective timeout of the training group)."""
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 0:
        raise ValueError(f"concurrency must be an int >= 0 (0: all ranks at once), got {concurrency!r}")
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return fn()
    local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    c = local_world if concurrency == 0 else min(concurrency, local_world)
    turns = -(-local_world // c)
    if turns == 1:
        return fn()
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    result = None
    try:
        for turn in range(turns):
            if local_rank // c == turn:
                result = fn()
            dist.barrier(group=group)
    finally:
        dist.destroy_process_group(group)
    return result


def shutdown() -> None:
    """Destroy the process group (if any)."""
    if dist.is_initialized():
        dist.destroy_process_group()
