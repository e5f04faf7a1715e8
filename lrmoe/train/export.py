"""`lrmoe export-hf`: a run's checkpoint as a Hugging Face model folder (safetensors shards, index, config).

    lrmoe export-hf --run results/paper-local/qwen3-C20-lrm-s0 --out exported/qwen3-C20 [--dtype bf16]

Reads the committed checkpoint of the run (``checkpoint.pt``: the single-process file with the full
weights, or a torchrun set whose weights are in its ``torch.distributed.checkpoint`` folder) on the
CPU without a process group, one tensor at a time: a tensor is read at its full size from every
rank's shards; an EP-sharded expert weight (``...gate_up_proj@ep{r}of{G}``) from its G blocks. The
routed experts are written in the per-expert layout transformers reads
(``mlp.experts.{e}.gate_proj/up_proj/down_proj.weight``), so the folder loads with
``AutoModelForCausalLM.from_pretrained`` (and with ``init_from``). Host memory: one full tensor plus
the shard being filled (``--max-shard-gib``)."""
from __future__ import annotations

import argparse
import json
import re
import sys
import warnings
from pathlib import Path

import torch

from ..files import atomic_write
from . import checkpoint

_EP_KEY = re.compile(r"^(?P<key>.+)@ep(?P<r>\d+)of(?P<g>\d+)$")
_EXPERTS = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<name>gate_up_proj|down_proj)$")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _dcp_tensors(folder: Path):
    """(model key, full tensor) of a DCP folder's model weights, one at a time."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    blocks: dict[str, dict[int, str]] = {}
    for fqn, md in meta.items():
        if not fqn.startswith("model.") or not isinstance(md, TensorStorageMetadata):
            continue
        key = fqn[len("model."):]
        m = _EP_KEY.match(key)
        if m is None:
            yield key, _read(folder, fqn, md)
        else:
            blocks.setdefault(m["key"], {})[int(m["r"])] = fqn
    for key, parts in blocks.items():
        yield key, torch.cat([_read(folder, parts[r], meta[parts[r]]) for r in sorted(parts)])


def _read(folder: Path, fqn: str, md) -> torch.Tensor:
    import torch.distributed.checkpoint as dcp

    t = torch.empty(tuple(md.size), dtype=md.properties.dtype)
    with warnings.catch_warnings():  # "torch.distributed is disabled ... load in a single process": as meant
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({fqn: t}, checkpoint_id=str(folder), no_dist=True)
    return t


def _hf_tensors(key: str, t: torch.Tensor):
    """The checkpoint tensors of one model tensor: a routed-experts weight becomes per-expert keys."""
    m = _EXPERTS.match(key)
    if m is None:
        yield key, t
        return
    for e in range(t.shape[0]):
        if m["name"] == "gate_up_proj":
            half = t.shape[1] // 2
            yield f"{m['prefix']}.{e}.gate_proj.weight", t[e, :half]
            yield f"{m['prefix']}.{e}.up_proj.weight", t[e, half:]
        else:
            yield f"{m['prefix']}.{e}.down_proj.weight", t[e]


def export_hf(run_dir, out_dir, dtype: str = "bf16", max_shard_gib: float = 5.0, progress=None) -> dict:
    """Write the run's committed weights to ``out_dir`` as a Hugging Face folder; returns a summary."""
    from safetensors.torch import save_file

    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: accepted {sorted(DTYPES)}")
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    main = run_dir / checkpoint.MAIN
    if not main.exists():
        raise ValueError(f"{run_dir} has no {checkpoint.MAIN}: not a run folder, or no checkpoint written yet "
                         f"(checkpoints are written every checkpoint_interval steps and at the end)")
    ck = checkpoint.load(main, mmap=True)
    config = ck.get("model_config")
    if config is None:
        raise ValueError(f"{main} does not record the model's config (written by an older version of the kit); "
                         f"export it with transformers from a model built with the run's config")
    if "dcp" in ck:
        tensors = _dcp_tensors(run_dir / ck["dcp"])
    else:
        tensors = iter(ck["model"].items())
    tied = bool(config.get("tie_word_embeddings"))
    out_dir.mkdir(parents=True, exist_ok=True)
    limit = int(max_shard_gib * 2 ** 30)
    shards, current, size, weight_map, total = [], {}, 0, {}, 0
    say = progress or (lambda line: None)

    def flush():
        nonlocal current, size
        if current:
            name = f"model-{len(shards) + 1:05d}.safetensors"
            save_file(current, str(out_dir / name), metadata={"format": "pt"})
            shards.append(name)
            weight_map.update({k: name for k in current})
            say(f"wrote {name} ({size / 2**30:.2f} GiB)")
            current, size = {}, 0

    for key, t in tensors:
        if tied and key == "lm_head.weight":
            continue
        for k, part in _hf_tensors(key, t):
            part = part.to(DTYPES[dtype]).contiguous().clone()
            n = part.numel() * part.element_size()
            if size and size + n > limit:
                flush()
            current[k], size, total = part, size + n, total + n
    flush()
    # single-shard names as transformers writes them; an index either way when there are several
    if len(shards) == 1:
        (out_dir / shards[0]).rename(out_dir / "model.safetensors")
    else:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        text = json.dumps(index, indent=2).encode()
        atomic_write(out_dir / "model.safetensors.index.json", lambda f: f.write(text))
    config = {k: v for k, v in config.items() if k not in ("experts_implementation", "_experts_implementation")}
    config["dtype"] = {"bf16": "bfloat16", "fp32": "float32"}[dtype]
    text = json.dumps(config, indent=2, default=str).encode()
    atomic_write(out_dir / "config.json", lambda f: f.write(text))
    return {"run": str(run_dir), "out": str(out_dir), "step": ck.get("step"), "shards": max(1, len(shards)),
            "bytes": total, "dtype": dtype}


def register_cli(sub) -> None:
    p = sub.add_parser("export-hf", help="a run's checkpoint as a Hugging Face model folder",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, type=Path, help="the run folder (with checkpoint.pt)")
    p.add_argument("--out", required=True, type=Path, help="the folder to write (config.json, *.safetensors)")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="dtype of the written weights "
                                                                          "(default bf16, as released checkpoints)")
    p.add_argument("--max-shard-gib", type=float, default=5.0, help="size of one safetensors file (default 5)")
    p.set_defaults(func=_cli)


def _cli(args) -> int:
    try:
        res = export_hf(args.run, args.out, args.dtype, args.max_shard_gib,
                        progress=lambda line: print(line, file=sys.stderr, flush=True))
    except (ValueError, OSError) as e:
        print(f"lrmoe export-hf: {e}", file=sys.stderr)
        return 2
    print(f"{res['out']}: step {res['step']} of {res['run']}, {res['bytes'] / 2**30:.2f} GiB in {res['shards']} "
          f"file(s), {res['dtype']}")
    return 0
