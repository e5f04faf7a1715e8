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


def rank_seed(seed: int, rank: int) -> int:
    """Seed of rank ``rank``'s random-scorer generator: ``seed`` on rank 0, a different one per rank
    (every rank seeding the same generator would give pairs at the same local position the same
    draw on every rank)."""
    import numpy as np

    return int(np.random.SeedSequence([int(seed), int(rank)]).generate_state(1, np.uint32)[0]) if rank else int(seed)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(ep: int | None = None, backend: str | None = None, timeout_s: float = 600.0) -> DistEnv:
    """Initialise torch.distributed from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR, MASTER_PORT), or as a single process when they are absent.

    backend: ``nccl`` when CUDA is available, else ``gloo`` (default). The device is
    ``cuda:LOCAL_RANK`` with NCCL (made the current device before the process group exists),
    else the CPU. When a process group already exists, its backend decides (``backend``, if
    given, must match it: ValueError otherwise). ``timeout_s``: collective timeout of the default
    group and of the EP / expert-data-parallel subgroups. With gloo a peer that dies or hangs
    then raises (:class:`lrmoe.parallel.runtime.EPCommunicationError`); with NCCL collectives do
    not block the host, and a timed-out collective is caught by the NCCL watchdog, which aborts
    the process (``TORCH_NCCL_ASYNC_ERROR_HANDLING``, default 3), so the run stops instead of
    hanging but no Python exception is raised, unless ``TORCH_NCCL_BLOCKING_WAIT=1`` (collectives
    then block the host and raise, at a throughput cost).
    ep: expert-parallel group size (default: every rank); must divide the world size."""
    if backend is not None and backend not in ("nccl", "gloo"):
        raise ValueError(f"backend must be 'nccl' or 'gloo', got {backend!r}")
    if dist.is_initialized():
        # The existing group decides: CUDA tensors on a gloo-only group, or CPU tensors on an
        # NCCL group, would fail (or silently take another path) in the first collective.
        existing = str(dist.get_backend()).lower()
        has = {b: b in existing for b in ("nccl", "gloo")}
        if backend is not None and not has[backend]:
            raise ValueError(f"a process group with backend {existing!r} already exists; init_distributed"
                             f"(backend={backend!r}) cannot change it (its collectives would get "
                             f"{'CUDA' if backend == 'nccl' else 'CPU'} tensors)")
        if backend is None:
            backend = "nccl" if has["nccl"] and torch.cuda.is_available() else "gloo"
    elif backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
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
        # device_id binds the NCCL group to this rank's GPU (barrier() and object collectives use
        # it instead of guessing a device).
        kw = {"device_id": device} if backend == "nccl" else {}
        if "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout, **kw)
        elif world == 1:
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1,
                                    timeout=timeout, **kw)
        else:
            raise RuntimeError(f"WORLD_SIZE={world} without MASTER_ADDR/MASTER_PORT: launch with torchrun")
    rank, world = dist.get_rank(), dist.get_world_size()
    ep = world if ep is None else ep
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1 or world % ep:
        raise ValueError(f"ep must be a positive divisor of the world size {world}, got {ep!r}")
    env = DistEnv(rank, world, local_rank, device, backend, ep)
    if ep < world:
        # Every rank creates every group, in the same order. new_group's own default timeout is the
        # backend's (NCCL 10 min, gloo 30 min), not the default group's: pass timeout_s on.
        for start in range(0, world, ep):
            g = dist.new_group(list(range(start, start + ep)), timeout=timeout)
            if start <= rank < start + ep:
                env.ep_group = g
        for pos in range(ep):
            g = dist.new_group(list(range(pos, world, ep)), timeout=timeout)
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
    group = _host_group(timeout_s)
    result = None
    for turn in range(turns):
        if local_rank // c == turn:
            result = fn()
        _host_wait(group, timeout_s)
    return result


def host_barrier(timeout_s: float = 3600.0) -> None:
    """A barrier of every rank for long host-side waits (one rank preparing data, writing a large
    checkpoint): a gloo group of its own, whose timeout is ``timeout_s``. Every rank of the default
    group must call it.

    ``dist.barrier()`` on the training group would wait under that group's collective timeout
    (``init_distributed(timeout_s=...)``, 10 minutes by default): gloo then raises, and with NCCL
    the watchdog aborts the waiting processes. The gloo group's barrier is a host-side wait that
    holds no GPU collective in flight."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    _host_wait(_host_group(timeout_s), timeout_s)


def _host_group(timeout_s: float):
    """The gloo group of every rank for host-side waits with timeout ``timeout_s``: one per timeout,
    created on first use (every rank calls the helpers above at the same points, so every rank
    creates the same groups in the same order) and destroyed by :func:`shutdown`."""
    group = _HOST_GROUPS.get(timeout_s)
    if group is None:
        group = _HOST_GROUPS[timeout_s] = dist.new_group(backend="gloo",
                                                         timeout=datetime.timedelta(seconds=timeout_s))
    return group


def _host_wait(group, timeout_s: float) -> None:
    """Barrier of a gloo group on the host: ``monitored_barrier`` (gloo only) exchanges CPU tensors, so it
    does not depend on the device the group may inherit from an NCCL default group's ``device_id``,
    and on a timeout it names the ranks that did not arrive."""
    dist.monitored_barrier(group=group, timeout=datetime.timedelta(seconds=timeout_s), wait_all_ranks=True)


_HOST_GROUPS: dict[float, object] = {}


def shutdown() -> None:
    """Destroy the process group (if any)."""
    _HOST_GROUPS.clear()
    if dist.is_initialized():
        dist.destroy_process_group()
