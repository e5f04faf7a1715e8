"""Host memory of loading a checkpoint, measured: transformers' ``from_pretrained`` (the kit's path
before rank-local loading: every rank a full fp32 copy) against :mod:`lrmoe.hf.loading` (each rank
reads only what it keeps), on the CPU, one fresh process per measurement.

    python scripts/loading_memory.py --layers 4 --experts 64 --ranks 8 --json out.json

A Qwen3-MoE-style model (hidden 512, expert FFN 256, top-2, ``--experts`` experts, ``--layers``
layers) is saved in bf16 as the released checkpoints are; each child process loads it and reports
its peak resident memory (``VmHWM``, reset just before loading) above its resident memory then. ``rank_local``
loads the block of experts of rank 0 of ``--ranks`` EP ranks (the block arithmetic of
:class:`lrmoe.parallel.runtime.ExpertParallel`, without a process group) and the whole dense part
onto the CPU; ``rank_local_fsdp`` is rank 0 of a fake process group of ``--ranks`` ranks with EP over
all of them and FSDP2 (``lrmoe train --fsdp --init-from``: sharded on the meta device, then only its
shards read), so it keeps its experts and 1/ranks of the dense part. Each peak is that rank's fp32
tensors plus what loading needed beside them (``transient``); on a GPU the tensors go to the device
and the host keeps only the transient part (one checkpoint tensor or shard at a time, plus the
files' page cache, which the kernel reclaims)."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024  # kB
    raise RuntimeError(f"/proc/self/status has no {field}")


def _baseline() -> int:
    """This process's resident memory now, after resetting its peak (VmHWM) to it (Linux)."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_bytes("VmRSS")


def _peak_above(base: int) -> int:
    return _status_bytes("VmHWM") - base


def _local(p):
    return p.to_local() if hasattr(p, "to_local") else p


def _child(mode: str, folder: str, ranks: int) -> dict:
    import torch
    from torch import nn

    from lrmoe import hf
    from lrmoe.hf import loading

    hf.register()
    torch.ones(1)  # torch's own allocations before the baseline
    if mode == "from_pretrained":
        from transformers import AutoModelForCausalLM, AutoConfig

        AutoConfig.from_pretrained(folder)
        base = _baseline()
        model = AutoModelForCausalLM.from_pretrained(folder, experts_implementation=hf.IMPLEMENTATION,
                                                     dtype=torch.float32)
    elif mode == "rank_local_fsdp":
        import torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore

        from lrmoe.parallel.launch import init_distributed
        from lrmoe.train import parallelize
        from lrmoe.train.config import TrainConfig

        # rank 0 of a fake process group of `ranks` ranks (loading makes no collective): EP over all
        # of them and FSDP2, as `lrmoe train --ep N --fsdp --init-from` builds it
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=ranks)
        env = init_distributed(ep=ranks)
        cfg = TrainConfig(model="qwen3-moe-tiny", ep=ranks, fsdp=True, micro_batch=ranks,
                          **({"placement": "fixed"} if ranks > 1 else {}))
        model = loading.meta_model(Path(folder))
        parallelize.shard_experts(model, env, cfg, None)
        parallelize.apply_scale(model, env, cfg, torch.device("cpu"))
        base = _baseline()
        loading.load_weights(model, "cpu")
    else:
        from lrmoe.parallel.runtime import ExpertParallel

        model = loading.meta_model(Path(folder))
        if ranks > 1:
            ep = ExpertParallel.__new__(ExpertParallel)
            ep.rank, ep.world_size, ep.num_experts = 0, ranks, model.config.num_experts
            ep.experts_per_rank = ep.num_experts // ranks
            for m in hf.experts_modules(model):
                m.lrmoe_ep = ep
                for name in ("gate_up_proj", "down_proj"):
                    setattr(m, name, nn.Parameter(ep.shard(getattr(m, name))))
        base = _baseline()
        loading.load_weights(model, "cpu")
    peak = _peak_above(base)
    kept = sum(_local(p).numel() * p.element_size() for p in model.parameters())
    return {"mode": mode, "peak_bytes": peak, "kept_fp32_bytes": kept, "transient_bytes": peak - kept}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--ranks", type=int, default=8, help="EP ranks whose rank 0 the rank-local load plays")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--child", nargs=3, metavar=("MODE", "FOLDER", "RANKS"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(_child(a.child[0], a.child[1], int(a.child[2]))))
        return 0
    import torch

    from lrmoe import hf

    with tempfile.TemporaryDirectory() as tmp:
        model = hf.build_model("qwen3-moe-tiny", seed=0, hidden_size=512, moe_intermediate_size=256,
                               intermediate_size=1024, num_hidden_layers=a.layers, num_experts=a.experts,
                               num_experts_per_tok=2, vocab_size=8192, tie_word_embeddings=False)
        n = sum(p.numel() for p in model.parameters())
        model.to(torch.bfloat16).save_pretrained(tmp)
        del model
        rows = []
        for mode in ("from_pretrained", "rank_local", "rank_local_fsdp"):
            out = subprocess.run([sys.executable, __file__, "--child", mode, tmp, str(a.ranks)], check=True,
                                 capture_output=True, text=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
    res = {"parameters": n, "bf16_model_bytes": 2 * n, "ranks": a.ranks, "rows": rows,
           "measured": "on this machine's CPU: VmHWM (peak resident memory, reset before loading) above VmRSS then"}
    mib = lambda b: f"{b / 2**20:8.1f} MiB"  # noqa: E731
    print(f"model: {n / 1e6:.1f} M parameters, bf16 checkpoint {mib(2 * n)}; rank-local: rank 0 of {a.ranks}")
    for r in rows:
        print(f"  {r['mode']:16s} peak {mib(r['peak_bytes'])}  kept fp32 {mib(r['kept_fp32_bytes'])}  "
              f"transient {mib(r['transient_bytes'])}")
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
