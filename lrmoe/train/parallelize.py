"""How a training run's config parallelises an unmodified model, in one place (torchtitan's ``parallelize``).

:func:`shard_experts` (on the host, before the model moves to its device: each rank keeps its block
of E/ep experts) and :func:`apply_scale` (on the device: activation checkpointing, then FSDP2 with
mixed precision and offload) are all the model-level changes of ``lrmoe train``; the distributed
runner (:mod:`lrmoe.train.ep`), the single-process one (:mod:`lrmoe.train.runner`) and the memory
estimate (:mod:`lrmoe.train.estimate`) call them, so the estimate runs what a run runs."""
from __future__ import annotations

import math

import torch

from ..hf import fsdp
from ..hf import parallel as ep_hf
from ..hf.checkpointing import checkpoint_layers


def budget_bytes(cfg) -> float:
    """The planner's per-layer memory budget of ``cfg`` in bytes (inf: unlimited)."""
    return math.inf if cfg.ep_budget_mib is None else float(cfg.ep_budget_mib) * 2 ** 20


def compute_bf16(cfg, device: torch.device) -> bool:
    """Whether the run computes in bf16 (``dtype`` bf16, or auto on CUDA)."""
    return cfg.dtype == "bf16" or (cfg.dtype == "auto" and device.type == "cuda")


def shard_experts(model, env, cfg, policy) -> list:
    """Keep this rank's block of every MoE layer's experts (``cfg.ep`` > 1; none otherwise); returns
    the layers' :class:`lrmoe.parallel.runtime.ExpertParallel` in layer order."""
    if env.ep_size <= 1:
        return []
    return ep_hf.parallelize_experts(model, env.ep_group, cfg.placement, budget_bytes(cfg), policy=policy,
                                     **cfg.ep_options)


def apply_scale(model, env, cfg, device: torch.device):
    """Activation checkpointing (``cfg.activation_checkpointing``) then FSDP2 (``cfg.fsdp``, with
    ``cfg.offload``) on a model already on ``device``, or still on the meta device (a checkpoint's:
    :func:`lrmoe.hf.loading.load_weights` then fills each rank's shards); returns it. (``env``: None
    without a process group, then FSDP is refused by the config's checks before this.)"""
    if cfg.activation_checkpointing:  # before FSDP: its hooks stay around each layer's call
        checkpoint_layers(model)
    if cfg.fsdp:
        fsdp.shard_model(model, env, param_dtype=torch.bfloat16 if compute_bf16(cfg, device) else None,
                         offload=cfg.offload)
    return model
