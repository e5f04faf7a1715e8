"""Expert parallelism inside transformers MoE models (Qwen3-MoE, GLM-4.5), on torch.distributed.

    from lrmoe.parallel.launch import init_distributed
    from lrmoe.hf import parallel as ep_hf
    env = init_distributed()                                  # torchrun env, gloo/NCCL, timeout
    model = lrmoe.hf.build_model("qwen3-moe-small", seed=0).to(env.device)   # same seed everywhere
    ep_hf.parallelize_experts(model, env.ep_group, "lrmoe", policy=BackwardPolicy(drop_ratio=0.2))
    loss = model(**my_shard_of_the_batch).loss; loss.backward()
    ep_hf.finish_grad_sync(model, env.dp_group, env.expert_dp_group)   # dense: data parallel
    ep_hf.clip_grad_norm_(model, 1.0, env.ep_group); opt.step()

:func:`parallelize_experts` keeps, in every routed-experts module, only this rank's block of
E/G experts (``gate_up_proj [E/G, 2I, H]``, ``down_proj [E/G, H, I]``, rank r owns experts
``[r*E/G, (r+1)*E/G)``) and overrides the module's forward with the expert-parallel function
(:func:`lrmoe.parallel.runtime.ep_experts`); routers, attention, shared experts and embeddings
stay replicated and are trained data parallel. The per-layer :class:`BackwardPolicy` is read
from the same attribute as ``lrmoe.hf`` (``lrmoe.hf.set_policy`` works), and each backward fills
the record returned by ``lrmoe.hf.backward_records`` (this rank's view, plus ``comm_bytes``
and ``plan``).
"""
from __future__ import annotations

import math
import types
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from . import integration as _hf
from ..policy import BackwardPolicy, BackwardRecord
from ..parallel.grad_sync import (broadcast_dense_params, finish_grad_sync, is_expert_parallel_param,
                                  mark_expert_parallel)
from ..parallel.runtime import ExpertParallel, ep_experts

__all__ = ["parallelize_experts", "ep_modules", "clip_grad_norm_", "finish_grad_sync", "broadcast_dense_params",
           "full_state_dict", "load_full_state_dict", "shard_state_dict", "is_expert_parallel_param"]

_EP_ATTR = "lrmoe_ep"


def ep_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                       top_k_weights: torch.Tensor) -> torch.Tensor:
    """Forward of a parallelized transformers experts module: hidden [T, H] -> [T, H]."""
    policy = getattr(self, _hf.POLICY_ATTR, None) or BackwardPolicy()
    record = None
    if torch.is_grad_enabled():
        ref = weakref.ref(self)
        record = BackwardRecord(on_fill=lambda r: (m := ref()) is not None and setattr(m, _hf.RECORD_ATTR, r))
    y = ep_experts(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj,
                   getattr(self, _EP_ATTR), policy, record, _hf.activation_of(self))
    return y.to(hidden_states.dtype)


def ep_modules(model: nn.Module) -> list[nn.Module]:
    """The parallelized experts modules of a model, in layer order."""
    return [m for m in model.modules() if isinstance(getattr(m, _EP_ATTR, None), ExpertParallel)]


def parallelize_experts(model: nn.Module, group=None, placement: str = "fixed", budget_bytes: float = math.inf, *,
                        policy: BackwardPolicy | list[BackwardPolicy] | None = None, slots_per_rank: int | None = None,
                        fast_domains=None, **options) -> list[ExpertParallel]:
    """Shard every routed-experts module of ``model`` over the EP ``group`` and swap its forward.

    Call it on every rank with the same (identically initialised or loaded) model. placement,
    budget_bytes, slots_per_rank, fast_domains and ``options`` (planner options) are those of
    :class:`ExpertParallel`, one instance per MoE layer (returned, in layer order). ``policy``:
    optional BackwardPolicy (or one per layer) set with ``lrmoe.hf.set_policy``."""
    mods = _hf.experts_modules(model)
    if not mods:
        raise ValueError(f"{type(model).__name__} has no routed-experts modules (gate_up_proj [E, 2I, H])")
    eps = []
    for m in mods:
        if isinstance(getattr(m, _EP_ATTR, None), ExpertParallel):
            raise ValueError(f"{type(m).__name__} is already expert parallel")
        _hf.check_supported(m)
        E = int(m.gate_up_proj.shape[0])
        ep = ExpertParallel(E, group, placement, budget_bytes=budget_bytes, slots_per_rank=slots_per_rank,
                            fast_domains=fast_domains, **options)
        for name in ("gate_up_proj", "down_proj"):
            full = getattr(m, name)
            setattr(m, name, mark_expert_parallel(nn.Parameter(ep.shard(full), requires_grad=full.requires_grad)))
        setattr(m, _EP_ATTR, ep)
        m.forward = types.MethodType(ep_experts_forward, m)
        eps.append(ep)
    if policy is not None:
        _hf.set_policy(model, policy)
    return eps


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float, ep_group=None) -> torch.Tensor:
    """Clip by the global gradient norm of the whole (sharded) model; returns the norm before clipping.

    Call after :func:`finish_grad_sync`: dense gradients are then equal on every rank (counted
    once), expert gradients differ per EP rank (their squared norms are summed over ``ep_group``)."""
    dense = [p.grad for p in model.parameters() if p.grad is not None and not is_expert_parallel_param(p)]
    expert = [p.grad for p in model.parameters() if p.grad is not None and is_expert_parallel_param(p)]
    # The all-reduced tensor must be on the model's device even on a rank without gradients (NCCL
    # takes CUDA tensors only): the first gradient's device, else the first parameter's.
    ref_device = next((g.device for g in dense + expert),
                      next((p.device for p in model.parameters()), torch.device("cpu")))
    sq = lambda gs: sum((g.detach().double() ** 2).sum() for g in gs) if gs else torch.zeros((), dtype=torch.float64, device=ref_device)  # noqa: E731
    expert_sq = sq(expert).reshape(1).to(ref_device)
    if dist.get_world_size(ep_group) > 1:
        dist.all_reduce(expert_sq, group=ep_group)
    norm = (sq(dense) + expert_sq[0]).sqrt()
    if is_fake(norm):  # a memory estimate: the scaling's bytes, no value to read
        for g in dense + expert:
            g.mul_(norm.to(g.dtype))
        return norm.float()
    coef = float(max_norm) / (float(norm) + 1e-6)
    if coef < 1.0:
        for g in dense + expert:
            g.mul_(coef)
    return norm.float()


def full_state_dict(model: nn.Module) -> dict:
    """``model.state_dict()`` with every sharded expert weight all-gathered to its full [E, ...]
    size (a collective over each layer's EP group; every rank gets the full dict)."""
    sd = model.state_dict()
    for mname, m in model.named_modules():
        ep = getattr(m, _EP_ATTR, None)
        if not isinstance(ep, ExpertParallel):
            continue
        for pname in ("gate_up_proj", "down_proj"):
            key = f"{mname}.{pname}" if mname else pname
            local = sd[key].contiguous()
            parts = [torch.empty_like(local) for _ in range(ep.world_size)]
            dist.all_gather(parts, local, group=ep.group)
            sd[key] = torch.cat(parts)
    return sd


def shard_state_dict(model: nn.Module, state_dict: dict) -> dict:
    """A full (unsharded) state dict cut to a parallelized model: each expert weight to this rank's block."""
    sd = dict(state_dict)
    for mname, m in model.named_modules():
        ep = getattr(m, _EP_ATTR, None)
        if isinstance(ep, ExpertParallel):
            for pname in ("gate_up_proj", "down_proj"):
                key = f"{mname}.{pname}" if mname else pname
                sd[key] = ep.shard(sd[key])
    return sd


def load_full_state_dict(model: nn.Module, state_dict: dict, strict: bool = True):
    """Load a full (unsharded) state dict into a parallelized model: each rank takes its block."""
    return model.load_state_dict(shard_state_dict(model, state_dict), strict=strict)
