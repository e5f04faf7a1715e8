"""Rank-local loading of a Hugging Face checkpoint: each rank materialises only what it keeps.

    path = checkpoint_dir("Qwen/Qwen3-30B-A3B")     # a local folder or the hub cache; never downloads
    model = meta_model(path, num_hidden_layers=4)   # transformers' model on the meta device: no memory
    parallelize_experts(model, group, ...)          # keeps this rank's block of experts (still meta)
    load_weights(model, device)                     # each kept tensor read from the safetensors shards

:func:`load_weights` reads, for every parameter and persistent buffer the (sharded) model still
has, the checkpoint tensors it is made of, in the dtype the file stores, and writes them into a
tensor of the model's dtype on ``device``: a routed-experts module's ``gate_up_proj [E_r, 2I, H]``
is this rank's experts' ``gate_proj`` and ``up_proj`` concatenated, its ``down_proj [E_r, H, I]``
their ``down_proj`` (the per-expert layout transformers writes), so a rank never reads the other
ranks' experts. The host holds one checkpoint tensor at a time (bf16 in the released checkpoints)
besides the files' memory map; a model on the CPU is of course in host memory. Non-persistent
buffers (rotary frequencies) are computed again by building their module from its config.

Under FSDP2 (``lrmoe train --fsdp``) the order is torchtitan's: the meta model is expert-sharded, then
``fully_shard``-ed (still on the meta device), then :func:`load_weights` gives every module its storage
(``to_empty``: FSDP2 keeps an offloaded module's shards on the host) and copies into each parameter
only this rank's rows of dim 0 (FSDP2's ``Shard(0)``, ``torch.chunk``'s split), read from the files
as slices: no rank ever holds a full dense tensor or another rank's shard, on the device or the host.

:func:`checkpoint_dir` refuses a hub id that is not downloaded, with the command that fetches it,
so that a run fails before any rank waits on another (``lrmoe train`` and ``lrmoe reproduce`` check
every run's checkpoint first). Only the per-expert key layout of Qwen3-MoE and GLM-4.5 (and any
checkpoint whose keys are the model's own) is understood; anything else is refused by name.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from torch import nn

from .integration import IMPLEMENTATION, register

__all__ = ["checkpoint_dir", "meta_model", "load_weights", "is_meta", "CHECKPOINT_ATTR"]

CHECKPOINT_ATTR = "lrmoe_checkpoint"  # set on a meta model: the folder load_weights reads
_EXPERTS = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<name>gate_up_proj|down_proj)$")


def checkpoint_dir(name_or_path: str) -> Path:
    """The folder of a checkpoint: ``name_or_path`` itself if it is a folder, else the hub cache's
    snapshot of that model id. ValueError (with the download command) when it is neither, or when
    the folder has no safetensors weights."""
    p = Path(name_or_path).expanduser()
    if p.is_dir():
        folder = p
    else:
        from huggingface_hub import constants, snapshot_download

        try:
            folder = Path(snapshot_download(str(name_or_path), local_files_only=True,
                                            allow_patterns=["*.json", "*.safetensors"]))
        except Exception as exc:  # LocalEntryNotFoundError, a malformed id, ...
            raise ValueError(f"checkpoint {name_or_path!r} is not a local folder and is not in the Hugging Face "
                             f"cache ({constants.HF_HUB_CACHE}); download it first with `hf download "
                             f"{name_or_path}` (the same folder on every node), or set init_from to a local "
                             f"folder ({type(exc).__name__})") from None
    if not (folder / "model.safetensors").exists() and not (folder / "model.safetensors.index.json").exists():
        raise ValueError(f"checkpoint folder {folder} has no model.safetensors or model.safetensors.index.json "
                         f"(only safetensors checkpoints are loaded; an interrupted download leaves this: "
                         f"run `hf download {name_or_path}` again)")
    if not (folder / "config.json").exists():
        raise ValueError(f"checkpoint folder {folder} has no config.json")
    return folder


def _file_of_key(folder: Path) -> dict[str, Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {k: folder / f for k, f in weight_map.items()}
    from safetensors import safe_open

    with safe_open(folder / "model.safetensors", "pt") as f:
        return {k: folder / "model.safetensors" for k in f.keys()}


def meta_model(folder: Path, dtype: torch.dtype = torch.float32, **overrides) -> nn.Module:
    """The checkpoint's transformers model (``config.json`` with ``overrides``) on the meta device,
    with lrmoe's experts implementation, marked for :func:`load_weights`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    register()
    config = AutoConfig.from_pretrained(folder, **overrides)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, experts_implementation=IMPLEMENTATION, dtype=dtype)
    setattr(model, CHECKPOINT_ATTR, str(folder))
    return model


def is_meta(model: nn.Module) -> bool:
    """Whether ``model`` waits for :func:`load_weights` (built by :func:`meta_model`)."""
    return getattr(model, CHECKPOINT_ATTR, None) is not None


def _expert_block(module: nn.Module, name: str, local: int) -> range:
    """The global expert indices of a routed-experts module's ``local`` rows (its EP shard, or all)."""
    from ..parallel.runtime import ExpertParallel

    ep = getattr(module, "lrmoe_ep", None)
    if isinstance(ep, ExpertParallel):
        block = ep.local_experts
        if len(block) != local:
            raise ValueError(f"{name}: {local} experts held but the EP shard names {len(block)}")
        return block
    return range(local)


class _Reader:
    """Reads checkpoint tensors by key, keeping one safetensors file open at a time."""

    def __init__(self, files: dict[str, Path]):
        self.files, self._open, self._path, self.bytes_read = files, None, None, 0

    def _file(self, key: str):
        from safetensors import safe_open

        path = self.files.get(key)
        if path is None:
            raise KeyError(key)
        if path != self._path:
            self.close()
            self._open, self._path = safe_open(path, "pt").__enter__(), path
        return self._open

    def get(self, key: str, rows: range | None = None) -> torch.Tensor:
        """The tensor ``key``, or only its ``rows`` of dim 0 (read as a slice: the rest is never read)."""
        f = self._file(key)
        t = f.get_tensor(key) if rows is None else f.get_slice(key)[rows.start:rows.stop]
        self.bytes_read += t.numel() * t.element_size()
        return t

    def shape(self, key: str) -> tuple:
        """The shape of the tensor ``key`` (from the file's header)."""
        return tuple(self._file(key).get_slice(key).get_shape())

    def close(self):
        if self._open is not None:
            self._open.__exit__(None, None, None)
        self._open = self._path = None


def _read(reader: _Reader, name: str, module: nn.Module, shape, device, dtype, rows: range | None = None,
          out: torch.Tensor | None = None) -> torch.Tensor:
    """The model's tensor ``name`` (of ``shape``) built from the checkpoint on ``device``; with ``rows``,
    only those rows of its dim 0 (an FSDP shard), written into ``out`` when given."""
    rows = range(shape[0]) if rows is None and len(shape) else rows
    local = tuple(shape) if rows is None else (len(rows), *shape[1:])
    if out is None:
        out = torch.empty(local, device=device, dtype=dtype)
    elif tuple(out.shape) != local:
        raise ValueError(f"{name}: this rank's shard has shape {tuple(out.shape)}, rows {rows.start}:{rows.stop} "
                         f"of {tuple(shape)} have {local}")
    m = _EXPERTS.match(name)
    if m is not None and name not in reader.files:  # per-expert keys: experts.{e}.{gate,up,down}_proj.weight
        prefix = m["prefix"]
        block = _expert_block(module, name, shape[0])
        for i, e in enumerate(block[rows.start:rows.stop]):
            if m["name"] == "gate_up_proj":
                gate = reader.get(f"{prefix}.{e}.gate_proj.weight")
                half = gate.shape[0]
                out[i, :half].copy_(gate)
                out[i, half:].copy_(reader.get(f"{prefix}.{e}.up_proj.weight"))
            else:
                out[i].copy_(reader.get(f"{prefix}.{e}.down_proj.weight"))
        return out
    if m is not None:  # fused keys as the model names them, for all experts: this rank's rows
        block = _expert_block(module, name, shape[0])
        src = reader.get(name, range(block.start + rows.start, block.start + rows.stop))
    elif rows is None or rows == range(shape[0]):
        src = reader.get(name)
    else:  # an FSDP shard: its rows only, once the whole tensor's shape is checked
        full = reader.shape(name)
        if tuple(full) != tuple(shape):
            raise ValueError(f"checkpoint tensor {name} has shape {tuple(full)}, the model expects {tuple(shape)}")
        src = reader.get(name, rows)
    if tuple(src.shape) != local:
        raise ValueError(f"checkpoint tensor {name} has shape {tuple(src.shape)}, the model expects {tuple(shape)}")
    return out.copy_(src)


def _shard_rows(p: torch.Tensor, name: str) -> range | None:
    """The rows of dim 0 a DTensor parameter's local shard holds (FSDP2's ``Shard(0)`` over a 1-D mesh:
    ``torch.chunk``'s split), None for a plain tensor; anything else is refused by name."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(p, DTensor):
        return None
    mesh, placements = p.device_mesh, tuple(p.placements)
    if placements == (Replicate(),) * len(placements):
        return range(p.shape[0])
    if mesh.ndim != 1 or placements != (Shard(0),):
        raise ValueError(f"{name}: load_weights reads FSDP2's Shard(0) over a 1-D mesh, got {placements} over "
                         f"{mesh.ndim} dimensions")
    n, size, index = p.shape[0], mesh.size(), mesh.get_local_rank()
    step = -(-n // size)
    start = min(index * step, n)
    return range(start, min(start + step, n))


@torch.no_grad()
def load_weights(model: nn.Module, device: torch.device | str, dtype: torch.dtype | None = None) -> dict:
    """Materialise a :func:`meta_model` (sharded or not) on ``device`` from its checkpoint; returns
    ``{"bytes_read": ..., "tensors": ...}``. Parameters keep their identity-level marks (the EP
    runtime's) and ties; ``dtype`` (default: each parameter's own) is the dtype they get.

    A model ``fully_shard``-ed on the meta device (FSDP2, module docstring) is given its storage by
    ``to_empty`` and each parameter's local shard is filled in place (``dtype`` must then be None:
    FSDP2 fixed the dtypes when it sharded)."""
    from torch.distributed.tensor import DTensor

    folder = Path(getattr(model, CHECKPOINT_ATTR))
    reader = _Reader(_file_of_key(folder))
    device = torch.device(device)
    sharded = any(isinstance(p, DTensor) for p in model.parameters())
    if sharded:
        if dtype is not None:
            raise ValueError("load_weights into an FSDP2-sharded model keeps the parameters' dtypes (dtype=None)")
        model.to_empty(device=device)  # FSDP2's _apply: offloaded modules' shards move to the host
    done: dict[int, nn.Parameter] = {}  # tied parameters: one tensor
    missing = []
    try:
        for mname, module in model.named_modules():
            for pname, p in list(module._parameters.items()):
                if p is None:
                    continue
                if id(p) in done:
                    module._parameters[pname] = done[id(p)]
                    continue
                name = f"{mname}.{pname}" if mname else pname
                try:
                    if sharded:  # in place: FSDP2 holds these very tensors
                        local = p.to_local() if isinstance(p, DTensor) else p.data
                        _read(reader, name, module, p.shape, local.device, local.dtype, _shard_rows(p, name), local)
                        done[id(p)] = p
                        continue
                    t = _read(reader, name, module, p.shape, device, dtype or p.dtype)
                except KeyError:
                    missing.append(name)
                    continue
                new = nn.Parameter(t, requires_grad=p.requires_grad)
                new.__dict__.update(p.__dict__)  # marks such as the EP runtime's
                module._parameters[pname] = done[id(p)] = new
            for bname, b in list(module._buffers.items()):
                if b is None or bname in module._non_persistent_buffers_set:
                    continue
                name = f"{mname}.{bname}" if mname else bname
                try:
                    module._buffers[bname] = _read(reader, name, module, b.shape, device, b.dtype)
                except KeyError:
                    missing.append(name)
    finally:
        reader.close()
    if missing:
        raise ValueError(f"checkpoint {folder} lacks {len(missing)} tensors the model needs, e.g. {missing[:5]} "
                         f"(is it a checkpoint of this model type, {type(model).__name__}?)")
    _rebuild_non_persistent(model, device)
    if not sharded and getattr(model.config, "tie_word_embeddings", False) and hasattr(model, "tie_weights"):
        model.tie_weights()
    delattr(model, CHECKPOINT_ATTR)
    return {"bytes_read": reader.bytes_read, "tensors": len(done)}


def _rebuild_non_persistent(model: nn.Module, device) -> None:
    """Compute every non-persistent buffer again (rotary frequencies) by building its module anew
    from its config on the CPU (their values are never in a checkpoint)."""
    for mname, module in model.named_modules():
        names = [n for n in module._non_persistent_buffers_set if module._buffers.get(n) is not None]
        if not names:
            continue
        config = getattr(module, "config", None)
        if config is None:
            raise ValueError(f"{mname or type(model).__name__} ({type(module).__name__}) has non-persistent buffers "
                             f"{names} that cannot be rebuilt without a config; load this model with from_pretrained")
        with torch.device("cpu"):
            fresh = type(module)(config)
        for n in names:
            module._buffers[n] = fresh._buffers[n].to(device)
