"""Data parallelism for everything but the experts: marking expert shards, broadcasting and
synchronising the dense gradients after ``loss.backward()``."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from . import fake

_EP_PARAM_ATTR = "_lrmoe_expert_parallel"


def is_expert_parallel_param(p: torch.Tensor) -> bool:
    """True for expert weights sharded by the EP runtime (their gradients are not data parallel)."""
    return bool(getattr(p, _EP_PARAM_ATTR, False))


def mark_expert_parallel(p: nn.Parameter) -> nn.Parameter:
    """Mark ``p`` as an expert shard of the EP runtime (:func:`is_expert_parallel_param`); returns ``p``."""
    setattr(p, _EP_PARAM_ATTR, True)
    return p


def _dense_params(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if not is_expert_parallel_param(p)]


@torch.no_grad()
def broadcast_dense_params(model: nn.Module, src: int = 0, group=None) -> None:
    """Make every non-expert parameter equal to rank ``src``'s (global rank) on all ranks of ``group``."""
    for p in _dense_params(model):
        dist.broadcast(p.data, src=src, group=group)


@torch.no_grad()
def finish_grad_sync(model: nn.Module, group=None, expert_dp_group=None, bucket_numel: int = 1 << 24) -> None:
    """Gradient sync after ``loss.backward()`` when every rank's loss is the mean over its own tokens.

    The objective is the mean of the ranks' losses: non-expert gradients are averaged over
    ``group`` (all data-parallel ranks); expert gradients (already summed over the EP group's
    tokens by the runtime) are summed over ``expert_dp_group`` (ranks holding the same experts in
    other EP groups; None when EP spans every rank) and divided by the number of ranks of ``group``.

    Dense gradients travel in flat buckets of at most ``bucket_numel`` elements per dtype (one
    all-reduce each; default 16 M elements, 64 MiB in fp32), not one copy of every dense gradient
    at once. Ranks first agree on which parameters have a gradient (one small all-reduce): a
    parameter with a gradient on some ranks only gets zeros on the others, so every rank's
    all-reduces have the same sizes (NCCL does not check, and would hang or mix up buckets)."""
    if isinstance(bucket_numel, bool) or not isinstance(bucket_numel, int) or bucket_numel < 1:
        raise ValueError(f"bucket_numel must be a positive int, got {bucket_numel!r}")
    world = dist.get_world_size(group)
    params = [p for p in model.parameters() if p.requires_grad]
    if world > 1 and params and not fake.is_fake(params[0]):  # (fake: a memory estimate, every rank alike)
        has = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=params[0].device)
        dist.all_reduce(has, op=dist.ReduceOp.MAX, group=group)
        for p, h in zip(params, has.tolist()):
            if h and p.grad is None:
                p.grad = torch.zeros_like(p)
    dense = [p.grad for p in _dense_params(model) if p.grad is not None]
    if dense and world > 1:
        for bucket in gradient_buckets(dense, bucket_numel):
            flat = torch.cat([g.reshape(-1) for g in bucket])
            dist.all_reduce(flat, group=group)
            flat.div_(world)
            off = 0
            for g in bucket:
                g.copy_(flat[off:off + g.numel()].view_as(g))
                off += g.numel()
    for p in model.parameters():
        if is_expert_parallel_param(p) and p.grad is not None:
            if expert_dp_group is not None and dist.get_world_size(expert_dp_group) > 1:
                dist.all_reduce(p.grad, group=expert_dp_group)
            p.grad.div_(world)


def gradient_buckets(grads: list[torch.Tensor], bucket_numel: int) -> list[list[torch.Tensor]]:
    """Consecutive gradients of one dtype and device, at most ``bucket_numel`` elements per bucket
    (a larger gradient is a bucket of its own); the same buckets on every rank."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for g in grads:
        if out and size + g.numel() <= bucket_numel and out[-1][0].dtype == g.dtype and out[-1][0].device == g.device:
            out[-1].append(g)
            size += g.numel()
        else:
            out.append([g])
            size = g.numel()
    return out
