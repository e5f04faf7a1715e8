"""A routing trace from a trained model's real routing on Alpaca text (the simulator's source 2).

A run folder of ``lrmoe train`` holds the model's weights (``checkpoint.pt``) and its config; the
model is rebuilt, loaded, and run forward (no gradients) on consecutive packed rows of the run's
own data. A forward pre-hook on every routed-experts module reads the router's top-k indices as
the experts receive them. The rows are split into ``num_ranks`` source ranks as the data-parallel
layout splits them (rank r holds rows ``[r * R, (r + 1) * R)`` of each step's ``num_ranks * R``
rows, R = ``rows_per_rank``), and each rank's pairs are counted per expert: one step of the trace
per forward, ``[steps, layers, ranks, experts]``. Padding tokens are routed and counted as the
runtime routes them.

    lrmoe simulate record-trace --run RUN_DIR --out trace.npz [--ranks 8] [--steps 64] [--split heldout]
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from .. import hf
from ..sim.trace import Trace
from . import checkpoint
from .config import TrainConfig


def load_run_model(run_dir: str | Path):
    """(model, config, train set, held-out set, checkpoint step) of a run folder's checkpoint."""
    from .runner import load_data

    run_dir = Path(run_dir)
    path = run_dir / checkpoint.MAIN
    if not path.exists():
        raise ValueError(f"{run_dir} has no {checkpoint.MAIN}; give the folder of an `lrmoe train` run with a checkpoint")
    ck = checkpoint.load(path)
    if not isinstance(ck, dict) or "model" not in ck or "config" not in ck:
        raise ValueError(f"{path} is not an lrmoe train checkpoint (no model or config entry)")
    cfg = TrainConfig(**{k: v for k, v in ck["config"].items() if k in TrainConfig.__dataclass_fields__})
    if cfg.init_from:
        raise ValueError(f"{run_dir} started from {cfg.init_from}; record-trace rebuilds preset models only")
    if cfg.ep > 1:
        raise ValueError(f"{run_dir} is an expert-parallel run (its checkpoint is sharded); record its routing with "
                         f"`lrmoe train --record-trace` instead")
    train_set, heldout, stats = load_data(cfg)
    model = hf.build_model(cfg.model, seed=cfg.seed, vocab_size=int(stats["vocab_size"]), **cfg.model_overrides)
    model.load_state_dict(ck["model"])
    model.eval()
    return model, cfg, train_set, heldout, int(ck.get("step", 0))


def routing_counts(model, input_ids_BS: torch.Tensor, num_ranks: int) -> np.ndarray:
    """[layers, ranks, experts] routed pairs of one forward over ``input_ids`` [B, S], B rows split
    into ``num_ranks`` contiguous slices (B divisible by num_ranks)."""
    mods = hf.experts_modules(model)
    if not mods:
        raise ValueError("the model has no routed-experts modules")
    E = int(mods[0].gate_up_proj.shape[0])
    B, S = input_ids_BS.shape
    if B % num_ranks:
        raise ValueError(f"{B} rows cannot be split into {num_ranks} ranks")
    seen: list[torch.Tensor] = []

    def grab(_mod, args, kwargs):
        idx = args[1] if len(args) > 1 else kwargs["top_k_index"]
        seen.append(idx.detach().reshape(B, S, -1))

    handles = [m.register_forward_pre_hook(grab, with_kwargs=True) for m in mods]
    try:
        with torch.no_grad():
            model(input_ids=input_ids_BS)
    finally:
        for h in handles:
            h.remove()
    if len(seen) != len(mods):
        raise RuntimeError(f"{len(seen)} of {len(mods)} experts modules saw this forward")
    out = np.zeros((len(mods), num_ranks, E), dtype=np.int64)
    per = B // num_ranks
    for layer, idx in enumerate(seen):
        for r in range(num_ranks):
            out[layer, r] = torch.bincount(idx[r * per:(r + 1) * per].reshape(-1), minlength=E).numpy()
    return out


def record_model_trace(run_dir: str | Path, *, num_ranks: int = 8, steps: int = 32, rows_per_rank: int = 1,
                       split: str = "train", progress: Callable[[int, int], None] | None = None) -> Trace:
    """The trace of ``steps`` forwards of the run's model (module docstring)."""
    for name, v in (("num_ranks", num_ranks), ("steps", steps), ("rows_per_rank", rows_per_rank)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    model, cfg, train_set, heldout, step = load_run_model(run_dir)
    data = train_set if split == "train" else heldout
    rows = num_ranks * rows_per_rank
    if len(data) < rows * steps:
        raise ValueError(f"the {split} set has {len(data)} packed rows; {steps} steps x {rows} rows need "
                         f"{rows * steps} (fewer --steps, --ranks or --rows-per-rank)")
    ids = data.tensors["input_ids"]
    counts = []
    for s in range(steps):
        counts.append(routing_counts(model, ids[s * rows:(s + 1) * rows], num_ranks))
        if progress is not None:
            progress(s + 1, steps)
    top_k = int(model.config.num_experts_per_tok)
    meta = {"source": "model", "top_k": top_k, "tokens_per_rank": rows_per_rank * int(ids.shape[1]),
            "model": cfg.model, "model_overrides": dict(cfg.model_overrides), "run": str(run_dir),
            "checkpoint_step": step, "data": str(cfg.data), "split": split, "rows_per_rank": rows_per_rank,
            "seq_len": int(ids.shape[1]), "generator": "lrmoe.train.model_trace/1",
            "dims": hf.integration.moe_dims(model.config),
            "train_config": json.loads(json.dumps({k: v for k, v in vars(cfg).items() if not k.startswith("_")},
                                                  default=str))}
    return Trace(np.stack(counts), meta)
