"""The expert-parallel runtime's collectives: error wrapping, uneven all-to-all, the demand
all-gather with its configuration header check.

Every function takes the layer's :class:`lrmoe.parallel.runtime.ExpertParallel` (``ep``: its
``group``, ``rank``, ``world_size``, ``placement`` and ``sizes_checked``)."""
from __future__ import annotations

import math
import zlib

import numpy as np
import torch
import torch.distributed as dist

from ..kernels.host import intended_sync, upload


class EPCommunicationError(RuntimeError):
    """A collective of the expert-parallel runtime failed (timeout, peer gone, backend error)."""


def crc(s: str) -> int:
    """A non-negative 31-bit checksum of ``s`` (header fields that are strings)."""
    return zlib.crc32(s.encode()) & 0x7FFFFFFF


def collective(ep, what: str, fn):
    try:
        return fn()
    except EPCommunicationError:
        raise
    except (RuntimeError, dist.DistError) as err:  # DistBackendError, gloo/NCCL timeouts, closed peers
        raise EPCommunicationError(
            f"expert-parallel {what} failed on rank {ep.rank} of {ep.world_size} (placement {ep.placement!r}): "
            f"{type(err).__name__}: {err}. Every rank of the EP group must call every expert-parallel layer "
            f"with the same configuration and run its backward; a peer may have crashed or timed out.") from err


def all_to_all(ep, x: torch.Tensor, out_splits, in_splits, what: str, comm: dict) -> torch.Tensor:
    """all_to_all_single with uneven splits; counts the bytes this rank sends to other ranks."""
    row = math.prod(x.shape[1:]) * x.element_size()
    comm[what] = comm.get(what, 0) + row * (sum(in_splits) - in_splits[ep.rank])
    if ep.world_size == 1:
        return x
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    collective(ep, f"all_to_all ({what})",
                lambda: dist.all_to_all_single(out, x.contiguous(), list(out_splits), list(in_splits), group=ep.group))
    return out


#: What each entry of the header gathered with the demand is (names for the error message).
HEADER_NAMES = ("num_experts", "hidden", "intermediate", "top_k", "experts_per_rank", "weight dtype",
                 "placement", "backward mode", "drop_ratio (1e-9)", "scorer", "quota policy", "slots_per_rank",
                 "quota/scorer options (crc)", "planner options, budget, fast domains, byte sizes (crc)",
                 "activation")


def check_headers(ep, rows: np.ndarray, h: int, readable: list | None = None) -> None:
    """ValueError on every rank when the gathered headers differ; ``readable`` (this rank's values
    behind the header's checksums) is then gathered too, on that error path only, so the message
    names the differing values rather than their checksums."""
    bad = [r for r in range(ep.world_size) if not np.array_equal(rows[r, :h], rows[0, :h])]
    if bad:
        shown = rows[:, :h].tolist()
        if readable is not None and ep.world_size > 1:  # every rank sees the mismatch: all take part
            gathered = [None] * ep.world_size
            collective(ep, "all_gather_object (differing configuration)",
                        lambda: dist.all_gather_object(gathered, list(readable), group=ep.group))
            shown = gathered
        diff = [f"{n}: rank 0 has {shown[0][j]!s}, rank {r} has {shown[r][j]!s}" for r in bad
                for j, n in enumerate(HEADER_NAMES) if rows[r, j] != rows[0, j]]
        raise ValueError(f"expert-parallel layer configured differently across ranks ({'; '.join(diff)})")


def gather_demand(ep, demand_E: torch.Tensor, header: list[int],
                   readable: list | None = None) -> np.ndarray:
    """all_gather of [header, demand] (the demand: any per-rank int64 vector, e.g. with extra
    entries after the counts); returns the gathered demands [G, len(demand)] as numpy, read on the
    host once (the layer's one synchronisation; a layer's first call reads its sizes first); raises
    ValueError on every rank if the headers differ.

    The message has len(header) + E entries. NCCL does not check that every rank sends as many
    bytes (gloo does): ranks with different E would hang or read garbage. So the first call of
    each layer first gathers the fixed-size header alone; E is fixed per layer after that."""
    dev = demand_E.device
    mine = torch.cat([upload(np.asarray(header, dtype=np.int64), dev), demand_E.to(torch.int64)])
    if ep.world_size == 1:
        with intended_sync():  # the layer's one host read: the planner needs the demand
            rows = mine[None].cpu().numpy()
    else:
        if not ep.sizes_checked:  # (a layer's first call only: one more host read)
            head = mine[:len(header)].contiguous()
            hparts = [torch.empty_like(head) for _ in range(ep.world_size)]
            collective(ep, "all_gather (demand) of the layer's sizes",
                        lambda: dist.all_gather(hparts, head, group=ep.group))
            with intended_sync():
                check_headers(ep, torch.stack(hparts).cpu().numpy(), len(header), readable)
            ep.sizes_checked = True
        parts = [torch.empty_like(mine) for _ in range(ep.world_size)]
        collective(ep, "all_gather (demand)", lambda: dist.all_gather(parts, mine, group=ep.group))
        with intended_sync():  # the layer's one host read: the planner needs the demand
            rows = torch.stack(parts).cpu().numpy()
    h = len(header)
    check_headers(ep, rows, h, readable)
    return rows[:, h:]

