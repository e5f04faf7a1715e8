"""FSDP2 over a transformers MoE model whose routed experts are expert parallel (torchtitan's layout).

    env = init_distributed(ep=8)                               # torchrun: W ranks, EP groups of 8
    ep_hf.parallelize_experts(model, env.ep_group, "lrmoe")    # experts: this rank's block of E/ep
    model.to(env.device)
    shard_model(model, env, param_dtype=torch.bfloat16)        # FSDP2: everything else sharded over W
    loss.backward(); clip_grad_norm_(model, 1.0); opt.step()    # no finish_grad_sync: FSDP reduces

Applied once, to the unmodified (EP-sharded) model, as torchtitan's ``parallelize`` does:

* every routed-experts module gets its own ``fully_shard`` over the **expert-data-parallel** mesh
  (the W/ep ranks that hold the same experts; size 1 when W = ep): its fp32 block is sharded over
  those replicas, gathered in the compute dtype for the forward and freed after it; the EP runtime
  reads the gathered weights as before. FSDP averages its gradient over the W/ep replicas, and the
  runtime has already summed the EP group's contributions of each rank's ``loss x W``:
  :func:`finish_expert_grads` divides by ep once per step (FSDP's own divide factor would need
  PREMUL_SUM, which gloo lacks), which gives the single-process gradient. Each expert's optimizer
  state lives on its owner (and its replicas' shards) only.
* every decoder layer, then the root (embeddings, final norm, lm_head), is ``fully_shard``-ed over
  all W ranks: dense parameters, their gradients and AdamW state are 1/W per rank.
* mixed precision the torch way: ``MixedPrecisionPolicy(param_dtype, reduce_dtype=fp32)``: fp32
  master weights and optimizer state, compute parameters in ``param_dtype``.
* ``offload``: ``experts`` or ``all``: those modules' sharded fp32 parameters, gradients and optimizer
  state stay on the host (``CPUOffloadPolicy``; the optimizer steps them on the CPU).

Parameters become DTensors; :func:`clip_grad_norm_` clips them by the global norm, and
:func:`restore_optimizer_state` wraps an optimizer's sharded state read from plain tensors (the
per-rank files of checkpoint sets written before torch.distributed.checkpoint) back into DTensors."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.tensor import DTensor

from . import integration as _hf
from .parallel import ep_modules

OFFLOAD = ("none", "experts", "all")


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of a transformers causal LM (``model.model.layers``)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no model.layers: shard_model supports transformers causal LMs "
                         f"(Qwen3-MoE, GLM-4-MoE)")
    return list(layers)


def shard_model(model: nn.Module, env, *, param_dtype: torch.dtype | None = None, offload: str = "none") -> nn.Module:
    """Apply FSDP2 to ``model`` (already expert parallel where ``env.ep_size > 1``, and on ``env.device``).

    ``env``: :class:`lrmoe.parallel.launch.DistEnv` (world size, EP size, device); ``param_dtype``:
    compute dtype of the gathered parameters (None: the parameters' own, fp32); ``offload``: none,
    experts or all (see the module docstring). Returns ``model`` (sharded in place)."""
    if offload not in OFFLOAD:
        raise ValueError(f"offload must be one of {list(OFFLOAD)}, got {offload!r}")
    world, ep = env.world_size, env.ep_size
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    cpu = CPUOffloadPolicy() if env.device.type == "cuda" else None  # on a CPU run the parameters are there already
    dense_offload = cpu if offload == "all" and cpu is not None else None
    expert_offload = cpu if offload in ("experts", "all") and cpu is not None else None
    kind = env.device.type
    experts = ep_modules(model) if ep > 1 else _hf.experts_modules(model)
    with unset_fake_temporarily():  # (a memory estimate runs this under FakeTensorMode: the meshes are real)
        mesh = init_device_mesh(kind, (world // ep, ep), mesh_dim_names=("edp", "ep")) if ep > 1 else None
        dp = init_device_mesh(kind, (world,), mesh_dim_names=("dp",))
    if ep > 1:
        for m in experts:
            kw = {"offload_policy": expert_offload} if expert_offload is not None else {}
            fully_shard(m, mesh=mesh["edp"], mp_policy=mp, **kw)
    layer_offload = dense_offload if ep > 1 else (expert_offload or dense_offload)
    kw = {"offload_policy": layer_offload} if layer_offload is not None else {}
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=dp, mp_policy=mp, **kw)
    kw = {"offload_policy": dense_offload} if dense_offload is not None else {}
    fully_shard(model, mesh=dp, mp_policy=mp, **kw)
    return model


@torch.no_grad()
def finish_expert_grads(model: nn.Module, ep_size: int) -> None:
    """Divide the expert-parallel experts' gradients by ``ep_size`` (see the module docstring); once per
    step, after the last backward."""
    if ep_size > 1:
        for m in ep_modules(model):
            for p in m.parameters():
                if p.grad is not None:
                    _local(p.grad).div_(ep_size)


def is_sharded(model: nn.Module) -> bool:
    """Whether :func:`shard_model` was applied (the parameters are DTensors)."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def local_bytes(t: torch.Tensor) -> int:
    """Bytes of this rank's part of ``t`` (its shard when a DTensor)."""
    t = _local(t)
    return t.numel() * t.element_size()


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip a sharded model's gradients by their global norm; returns the norm before clipping.

    Every element of every gradient lives on exactly one rank (dense: 1/W shards; experts: the EP
    block of a rank, sharded over its replicas), so the squared norm is the sum over all ranks of
    the local squares (one all-reduce)."""
    grads = [_local(p.grad) for p in model.parameters() if p.grad is not None]
    comm = torch.device("cuda", torch.cuda.current_device()) if "nccl" in str(dist.get_backend()).lower() \
        else torch.device("cpu")  # NCCL reduces CUDA tensors only (offloaded gradients are on the host)
    sq = torch.zeros((), dtype=torch.float64, device=comm)
    for g in grads:
        sq += (g.detach().double() ** 2).sum().to(comm)
    dist.all_reduce(sq)
    norm = sq.sqrt()
    coef = (float(max_norm) / (norm + 1e-6)).clamp(max=1.0)  # on the device: no host read
    for g in grads:
        g.mul_(coef.to(g.device))
    return norm.float().cpu()


def restore_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """After ``opt.load_state_dict`` of an optimizer state dict whose DTensor states were saved as their
    local shards (checkpoint sets of older versions): wrap each state tensor of
    a DTensor parameter back into a DTensor laid out as the parameter (its local shard, on its device)."""
    for group in opt.param_groups:
        for p in group["params"]:
            if not isinstance(p, DTensor):
                continue
            st = opt.state.get(p, {})
            for name, v in list(st.items()):
                if isinstance(v, torch.Tensor) and not isinstance(v, DTensor) and v.shape == p.to_local().shape \
                        and v.dim() > 0:
                    st[name] = DTensor.from_local(v.to(p.to_local().device), p.device_mesh, p.placements,
                                                  shape=p.shape, stride=p.stride())


def full_tensor(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` unsharded (an all-gather over its mesh when it is a DTensor; collective: every rank of the
    mesh calls it); an offloaded (host) shard is gathered through ``device`` (NCCL needs CUDA tensors)."""
    if not isinstance(t, DTensor):
        return t
    local = t.to_local()
    if local.device != device:
        t = DTensor.from_local(local.to(device), t.device_mesh, t.placements, shape=t.shape, stride=t.stride())
    return t.full_tensor()


def load_full_state_dict(model: nn.Module, state_dict: dict) -> None:
    """Load full (unsharded over FSDP's meshes) tensors into a sharded model: each rank keeps its shard
    (expert weights: this rank's EP block, see :func:`lrmoe.hf.parallel.shard_state_dict`)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, state_dict, options=StateDictOptions(full_state_dict=True, strict=True))
