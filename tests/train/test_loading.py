"""Rank-local checkpoint loading (lrmoe.hf.loading): the meta model filled from the safetensors
files equals transformers' own ``from_pretrained`` (every parameter and buffer, ties, the forward),
for both families, from a bf16 checkpoint as the released ones are, from a sharded checkpoint
(index file), and with one EP rank's block of experts; a checkpoint that is not there is refused
with the download command; `lrmoe train --init-from` on 2 EP ranks equals the single process."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from lrmoe import hf
from lrmoe.hf import loading
from lrmoe.train import TrainConfig, read_metrics, train

from .test_ep import ROOT, TINY, launch_env, torchrun

PRESETS = ["qwen3-moe-tiny", "glm4-moe-tiny"]


def _saved(tmp_path, preset, dtype=torch.bfloat16, max_shard_size=None, **overrides) -> Path:
    model = hf.build_model(preset, seed=3, **overrides)
    # fresh values everywhere (the tiny presets initialise some tensors to constants)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        for name, b in model.named_buffers():
            if b.is_floating_point() and "rotary" not in name:
                b.copy_(torch.randn(b.shape, generator=g))
    folder = tmp_path / preset
    kw = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.to(dtype).save_pretrained(folder, **kw)
    return folder


def _reference(folder: Path):
    from transformers import AutoModelForCausalLM

    hf.register()
    return AutoModelForCausalLM.from_pretrained(folder, experts_implementation=hf.IMPLEMENTATION, dtype=torch.float32)


def _assert_same_model(a: nn.Module, b: nn.Module):
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for k in pa:
        assert pa[k].dtype == pb[k].dtype and torch.equal(pa[k], pb[k]), k
    ba, bb = dict(a.named_buffers()), dict(b.named_buffers())
    assert ba.keys() == bb.keys()
    for k in ba:
        assert torch.equal(ba[k], bb[k]), k
    assert (a.get_output_embeddings().weight is a.get_input_embeddings().weight) == \
        (b.get_output_embeddings().weight is b.get_input_embeddings().weight)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("sharded", [False, True], ids=["one-file", "index"])
def test_meta_then_load_equals_from_pretrained(tmp_path, preset, sharded):
    folder = _saved(tmp_path, preset, max_shard_size="50KB" if sharded else None)
    assert (folder / "model.safetensors.index.json").exists() == sharded
    ref = _reference(folder)
    model = loading.meta_model(loading.checkpoint_dir(str(folder)))
    assert loading.is_meta(model) and next(model.parameters()).is_meta
    stats = loading.load_weights(model, "cpu")
    assert not loading.is_meta(model)
    assert stats["bytes_read"] > 0
    _assert_same_model(model, ref)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)


def test_untied_embeddings_and_overrides(tmp_path):
    folder = _saved(tmp_path, "qwen3-moe-tiny", tie_word_embeddings=False)
    model = loading.meta_model(folder, num_hidden_layers=1)
    loading.load_weights(model, "cpu")
    assert model.config.num_hidden_layers == 1 and len(model.model.layers) == 1
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    from safetensors import safe_open

    with safe_open(folder / "model.safetensors", "pt") as f:
        assert torch.equal(model.lm_head.weight, f.get_tensor("lm_head.weight").float())


def test_one_rank_block_of_experts(tmp_path, monkeypatch):
    """A rank reads only its block: experts [r*E/G, (r+1)*E/G) of every layer, nothing else of them."""
    from lrmoe.parallel.runtime import ExpertParallel

    folder = _saved(tmp_path, "qwen3-moe-tiny")
    full = _reference(folder)
    for rank, G in ((0, 2), (1, 2), (3, 4)):
        model = loading.meta_model(folder)
        ep = ExpertParallel.__new__(ExpertParallel)  # no process group: just the block arithmetic
        ep.rank, ep.world_size, ep.num_experts = rank, G, model.config.num_experts
        ep.experts_per_rank = ep.num_experts // G
        for m in hf.experts_modules(model):
            m.lrmoe_ep = ep
            for name in ("gate_up_proj", "down_proj"):
                setattr(m, name, nn.Parameter(ep.shard(getattr(m, name))))
        loading.load_weights(model, "cpu")
        r = ep.local_experts
        for m, f in zip(hf.experts_modules(model), hf.experts_modules(full)):
            assert torch.equal(m.gate_up_proj, f.gate_up_proj[r.start:r.stop])
            assert torch.equal(m.down_proj, f.down_proj[r.start:r.stop])


def test_missing_tensor_and_missing_checkpoint_are_refused(tmp_path, monkeypatch):
    folder = _saved(tmp_path, "qwen3-moe-tiny")
    model = loading.meta_model(folder, num_hidden_layers=3)  # the file has 2 layers
    with pytest.raises(ValueError, match="lacks .* tensors the model needs"):
        loading.load_weights(model, "cpu")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="hf download nobody/not-downloaded"):
        loading.checkpoint_dir("nobody/not-downloaded")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no model.safetensors"):
        loading.checkpoint_dir(str(empty))


def test_train_refuses_a_checkpoint_not_downloaded_before_starting(tmp_path):
    env = dict(launch_env(tmp_path), HF_HUB_OFFLINE="1")
    p = subprocess.run([sys.executable, "-m", "lrmoe.cli", "train", "--out", str(tmp_path / "run"), "--model",
                        "qwen3-moe-tiny", "--init-from", "nobody/not-downloaded", "--data", str(TINY)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert "hf download nobody/not-downloaded" in p.stderr
    assert not (tmp_path / "run").exists()


RUN = dict(model="qwen3-moe-tiny", tokenizer="bpe:300", seq_len=64, micro_batch=4, grad_accum=1, steps=2, lr=3e-3,
           warmup_steps=1, heldout_fraction=0.1, eval_interval=2, eval_batches=1, checkpoint_interval=2)


def test_train_init_from_on_two_ep_ranks_equals_one_process(tmp_path):
    """`lrmoe train --init-from FOLDER`: single process and 2 EP ranks (each reading its experts) agree,
    also with FSDP (each rank reading only its shards of the meta-sharded model)."""
    if not TINY.exists():
        pytest.skip(f"offline Alpaca sample not found at {TINY} (set LRMOE_SHARED_DATA to the shared/data folder)")
    folder = _saved(tmp_path, "qwen3-moe-tiny", vocab_size=300)
    env = launch_env(tmp_path)
    cfg = dict(RUN, data=str(TINY), init_from=str(folder))
    with pytest.MonkeyPatch.context() as mp:
        for k in ("HF_HOME", "LRMOE_CACHE"):
            mp.setenv(k, env[k])
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            mp.delenv(k, raising=False)
        train(TrainConfig(**cfg, threads=1), tmp_path / "single", progress=False)
    la = [r["loss"] for r in read_metrics(tmp_path / "single") if "loss" in r]
    assert len(la) == RUN["steps"]
    for name, extra in (("ep2", {}), ("ep2-fsdp", {"fsdp": True})):
        torchrun(tmp_path / name, dict(cfg, ep=2, placement="fixed", **extra), env=env)
        lb = [r["loss"] for r in read_metrics(tmp_path / name) if "loss" in r]
        assert len(lb) == RUN["steps"]
        for x, y in zip(la, lb):
            assert abs(x - y) <= 1e-4 * abs(x), (name, la, lb)
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        assert summary["status"] == "done"


def test_host_memory_of_rank_local_loading(tmp_path):
    """Measured (scripts/loading_memory.py): rank 0 of 8 holds its fp32 tensors plus at most the
    checkpoint's size (the part of the files it maps), far below from_pretrained's full fp32 copy;
    with FSDP (sharded on the meta device first) it holds and reads only its shards of the dense part."""
    out = tmp_path / "mem.json"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "loading_memory.py"), "--layers", "2", "--experts", "32",
                    "--ranks", "8", "--json", str(out)], cwd=ROOT, check=True, capture_output=True, timeout=300,
                   env=dict(os.environ, OMP_NUM_THREADS="1"))
    res = json.loads(out.read_text())
    old, new, fsdp = (next(r for r in res["rows"] if r["mode"] == m)
                      for m in ("from_pretrained", "rank_local", "rank_local_fsdp"))
    assert old["kept_fp32_bytes"] == 2 * res["bf16_model_bytes"]
    assert new["kept_fp32_bytes"] < old["kept_fp32_bytes"] / 2  # dense + 1/8 of the experts
    assert new["transient_bytes"] <= res["bf16_model_bytes"]
    assert new["peak_bytes"] < old["peak_bytes"] / 3
    # with FSDP: 1/8 of the dense part too (its shards only ever read), so less kept and less read
    assert fsdp["kept_fp32_bytes"] < new["kept_fp32_bytes"] and fsdp["peak_bytes"] < new["peak_bytes"]
    assert fsdp["transient_bytes"] <= res["bf16_model_bytes"]


def _fsdp_loaded(folder: Path, preset: str, world: int, ep: int, rank: int):
    """Rank ``rank`` of a fake process group of ``world`` ranks (no other process: loading needs no
    collective): the meta model expert-sharded (ep > 1), FSDP2-sharded, then loaded."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from lrmoe.parallel.launch import init_distributed
    from lrmoe.train import parallelize

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    env = init_distributed(ep=ep)
    cfg = TrainConfig(model=preset, ep=ep, fsdp=True, **({"placement": "fixed"} if ep > 1 else {}))
    model = loading.meta_model(folder)
    parallelize.shard_experts(model, env, cfg, None)
    parallelize.apply_scale(model, env, cfg, torch.device("cpu"))
    assert all(p.is_meta for p in model.parameters())
    return model, loading.load_weights(model, "cpu")


@pytest.mark.parametrize("preset,world,ep,rank", [("qwen3-moe-tiny", 4, 2, 3), ("glm4-moe-tiny", 3, 1, 2),
                                                  ("qwen3-moe-tiny", 2, 2, 0)])
def test_fsdp_rank_reads_only_its_shards(tmp_path, preset, world, ep, rank):
    """FSDP (`lrmoe train --fsdp --init-from`): the model is sharded on the meta device first, and
    each parameter's local shard is then read from the files: equal to torch's own split of the
    from_pretrained tensor (``distribute_tensor``; experts: the EP block first), and the rank reads
    only its shards' bytes, never a full dense tensor."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, distribute_tensor

    from lrmoe.parallel.runtime import ExpertParallel

    folder = _saved(tmp_path, preset, tie_word_embeddings=False)
    ref = dict(_reference(folder).named_parameters())
    try:
        model, stats = _fsdp_loaded(folder, preset, world, ep, rank)
        local_bf16 = 0
        for name, p in model.named_parameters():
            assert isinstance(p, DTensor) and not p.to_local().is_meta, name
            full = ref[name].detach()
            owner = model.get_submodule(name.rsplit(".", 1)[0])
            block = getattr(owner, "lrmoe_ep", None)
            if isinstance(block, ExpertParallel):
                full = full[block.local_experts.start:block.local_experts.stop]
            want = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
            assert p.dtype == torch.float32 and torch.equal(p.to_local(), want), name
            local_bf16 += 2 * want.numel()
        buffers = sum(2 * b.numel() for n, b in model.named_buffers() if "rotary" not in n)
        assert stats["tensors"] == len(ref)
        assert stats["bytes_read"] <= local_bf16 + buffers
        total_bf16 = 2 * sum(t.numel() for t in ref.values())
        assert stats["bytes_read"] < total_bf16 / (world / 1.5)
    finally:
        dist.destroy_process_group()
