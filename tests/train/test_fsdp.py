"""`lrmoe train --fsdp`: FSDP2 over the dense parameters (and the experts' data-parallel replicas) with
the EP runtime, on gloo CPU processes launched by torchrun (qwen3-moe-tiny, the tiny Alpaca sample).

The runs' losses, gradient norms and evaluation equal the single-process run's (the tolerances of
tests/train/test_ep.py) on 2 processes (ep 2: every expert on one rank) and on 4 (ep 2, two
expert-data-parallel replicas: FSDP shards each expert block over them); a run stopped after 2
steps and resumed on 4 processes equals the uninterrupted one exactly; one process with --fsdp (a
one-rank group) equals the plain run."""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch

from lrmoe.data import shared_data_dir
from lrmoe.train import TrainConfig, read_metrics, train

from .test_ep import launch_env, torchrun

TINY = shared_data_dir() / "alpaca" / "alpaca_tiny.json"
DEADLINE_S = 240
RUN = dict(model="qwen3-moe-tiny", tokenizer="bpe:300", seq_len=64, micro_batch=4, grad_accum=2, steps=4, lr=3e-3,
           warmup_steps=1, heldout_fraction=0.1, eval_interval=2, eval_batches=2, checkpoint_interval=2,
           load_concurrency=0)  # a tiny model: the ranks build it at once, not in turns (a runtime field)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    if not TINY.exists():
        pytest.skip(f"offline Alpaca sample not found at {TINY} (set LRMOE_SHARED_DATA to the shared/data folder)")
    base = tmp_path_factory.mktemp("train_fsdp")
    env = launch_env(base)
    data = {"data": str(TINY)}
    walls = {}
    with pytest.MonkeyPatch.context() as mp:
        for k in ("HF_HOME", "LRMOE_CACHE"):
            mp.setenv(k, env[k])
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            mp.delenv(k, raising=False)
        t0 = time.perf_counter()
        train(TrainConfig(**RUN, **data, threads=1), base / "single", progress=False)  # also prepares the data
        walls["single"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        train(TrainConfig(**RUN, **data, threads=1, fsdp=True), base / "one_rank", progress=False)
        walls["one_rank"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        train(TrainConfig(**RUN, **data, threads=1, dtype="bf16"), base / "single_bf16", progress=False)
        walls["single_bf16"] = time.perf_counter() - t0
    cfg = dict(RUN, **data, ep=2, placement="fixed", fsdp=True)
    symi = dict(RUN, **data, ep=2, placement="symi", drop_ratio=0.2)
    for name, nproc, c, extra in (("ep2", 2, cfg, ()), ("ep2_edp2", 4, cfg, ()),
                                  # stopped after 2 steps and resumed on 4 ranks, the experts offloaded
                                  # (CPUOffloadPolicy, as the paper preset runs): each expert block's
                                  # AdamW state is sharded over its 2 replicas and kept on the host, the
                                  # hardest case to restore; compared with ep2_edp2 (not offloaded)
                                  ("resumed", 4, dict(cfg, offload="experts"), ("--stop-after", "2")),
                                  ("resumed", 4, dict(cfg, offload="experts"), ()),
                                  ("ep2_bf16", 2, dict(cfg, dtype="bf16"), ()),
                                  ("symi", 2, dict(symi, record_trace=str(base / "symi.npz")), ()),
                                  ("symi_fsdp_ac", 2, dict(symi, fsdp=True, activation_checkpointing=True,
                                                           record_trace=str(base / "symi_fsdp_ac.npz")), ())):
        t0 = time.perf_counter()
        torchrun(base / name, c, *extra, env=env, nproc=nproc, deadline_s=DEADLINE_S)
        walls[name] = walls.get(name, 0.0) + time.perf_counter() - t0
    print("wall seconds:", {k: round(v, 1) for k, v in walls.items()})
    yield base
    shutil.rmtree(base, ignore_errors=True)


def metrics(d: Path) -> list[dict]:
    return read_metrics(d / "metrics.jsonl")


@pytest.mark.parametrize("name", ["ep2", "ep2_edp2", "one_rank"])
def test_fsdp_matches_the_single_process_run(runs, name):
    single, run = metrics(runs / "single"), metrics(runs / name)
    assert [r["step"] for r in run] == [1, 2, 3, 4]
    for a, b in zip(single, run):
        assert abs(a["loss"] - b["loss"]) < 1e-5, (name, a["step"], a["loss"], b["loss"])
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
        assert b.get("eval_loss", 0.0) == pytest.approx(a.get("eval_loss", 0.0), abs=1e-5)
        assert b["layers"] == a["layers"]
    s = json.loads((runs / name / "summary.json").read_text())
    assert s["status"] == "done" and s["config"]["fsdp"] is True
    assert s["distributed"]["fsdp"] is True and s["distributed"]["world_size"] == {"ep2": 2, "ep2_edp2": 4,
                                                                                    "one_rank": 1}[name]


def test_offloaded_experts_train_as_the_plain_fsdp_run(runs):
    """--offload experts (FSDP2's CPUOffloadPolicy on every routed-experts module: their fp32 master
    weights, gradients and AdamW state on the host, as the paper preset runs) on 4 ranks, stopped
    after 2 steps and resumed: on CPU the host is the device, so the run equals the plain --fsdp
    one (ep2_edp2) bit for bit (test_fsdp_resume_reproduces_the_uninterrupted_run); the policy's
    code path (sharding, the optimizer over offloaded shards, the DCP checkpoint and its restore)
    runs for real."""
    s = json.loads((runs / "resumed" / "summary.json").read_text())
    assert s["distributed"]["offload"] == "experts" and s["config"]["offload"] == "experts"
    assert json.loads((runs / "ep2_edp2" / "summary.json").read_text())["distributed"]["offload"] != "experts"
    ck = torch.load(runs / "resumed" / "checkpoint.pt", map_location="cpu", weights_only=False)
    assert (runs / "resumed" / ck["dcp"]).is_dir()


def test_bf16_compute_with_fp32_master_weights_under_fsdp(runs):
    """--dtype bf16 with --fsdp on 2 ranks (FSDP2's MixedPrecisionPolicy: bf16 compute parameters,
    fp32 reduction) follows the single-process bf16 run (autocast over fp32 parameters) to bf16's
    rounding, and what it checkpoints is fp32: the master weights and both AdamW moments."""
    from torch.distributed.checkpoint import FileSystemReader

    single, run = metrics(runs / "single_bf16"), metrics(runs / "ep2_bf16")
    assert [r["step"] for r in run] == [1, 2, 3, 4]
    for a, b in zip(single, run):
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-3), (a["step"], a["loss"], b["loss"])
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=2e-2)
    fp32 = metrics(runs / "single")
    assert any(a["loss"] != b["loss"] for a, b in zip(single, fp32))  # bf16 really computed in bf16
    s = json.loads((runs / "ep2_bf16" / "summary.json").read_text())
    assert s["config"]["dtype"] == "bf16" and s["distributed"]["fsdp"] is True
    ck = torch.load(runs / "ep2_bf16" / "checkpoint.pt", map_location="cpu", weights_only=False)
    meta = FileSystemReader(str(runs / "ep2_bf16" / ck["dcp"])).read_metadata().state_dict_metadata
    params = {k: m for k, m in meta.items() if k.startswith("model.") and hasattr(m, "properties")}
    moments = {k: m for k, m in meta.items() if k.startswith("optim.state.") and k.endswith(("exp_avg", "exp_avg_sq"))}
    assert params and moments and any("experts" in k for k in params) and any("embed_tokens" in k for k in moments)
    assert {m.properties.dtype for m in params.values()} == {m.properties.dtype for m in moments.values()} \
        == {torch.float32}


def test_activation_checkpointing_reuses_the_plan_on_ep_ranks(runs):
    """SYMI at C20 on 2 ranks, with FSDP and activation checkpointing against without either: the
    recompute plans nothing (the same plans, so SYMI's popularity advanced once per forward), keeps the
    same pairs and sends the same bytes (the recompute's all-to-alls are not counted again)."""
    plain, ac = metrics(runs / "symi"), metrics(runs / "symi_fsdp_ac")
    assert [r["step"] for r in ac] == [1, 2, 3, 4]
    for a, b in zip(plain, ac):
        assert abs(a["loss"] - b["loss"]) < 1e-5 and b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
        assert b["plans"] == a["plans"] and b["layers"] == a["layers"] and b["comm_bytes"] == a["comm_bytes"]
        assert b["kept_fraction"] == a["kept_fraction"] < 0.9  # SYMI's forward drops and C20: a real selection
    s = json.loads((runs / "symi_fsdp_ac" / "summary.json").read_text())
    assert s["distributed"]["activation_checkpointing"] is True and s["config"]["activation_checkpointing"] is True
    # the routing traces: one row per micro-batch forward and layer in both (the recompute records
    # nothing: 4 steps x 2 micro-batches, 2 MoE layers), equal
    from lrmoe.sim.trace import load_trace

    a, b = load_trace(runs / "symi.npz"), load_trace(runs / "symi_fsdp_ac.npz")
    assert a.counts.shape[:2] == b.counts.shape[:2] == (RUN["steps"] * RUN["grad_accum"], 2)
    assert (a.counts == b.counts).all() and a.counts.sum() > 0


def test_fsdp_resume_reproduces_the_uninterrupted_run(runs):
    """The 4-rank run stopped after 2 steps and resumed (its experts offloaded) equals the
    uninterrupted one (not offloaded) exactly."""
    full, resumed = metrics(runs / "ep2_edp2"), metrics(runs / "resumed")
    for key in ("loss", "grad_norm", "lr", "epoch", "layers", "eval_loss", "comm_bytes"):
        assert [r.get(key) for r in full] == [r.get(key) for r in resumed], key
    assert json.loads((runs / "resumed" / "summary.json").read_text())["resumed_from"] == [2]


def test_fsdp_checkpoint_is_a_dcp_folder_of_every_ranks_shards(runs):
    """The set's weights and AdamW state are in checkpoint.step4.dcp/ (torch.distributed.checkpoint):
    every rank wrote its file, each EP block of experts under its own name (4 of the 8 experts, sharded
    over the 2 replicas by FSDP), the dense tensors at their full size; older steps' folders are gone."""
    from torch.distributed.checkpoint import FileSystemReader

    run = runs / "ep2_edp2"
    ck = torch.load(run / "checkpoint.pt", map_location="cpu", weights_only=False)
    assert "model" not in ck and ck["dcp"] == "checkpoint.step4.dcp" and ck["model_config"]["model_type"] == "qwen3_moe"
    assert sorted(p.name for p in run.glob("checkpoint.step*")) == [
        "checkpoint.step4.dcp", *(f"checkpoint.step4.rank{r}.pt" for r in range(4))]
    folder = run / ck["dcp"]
    assert len(list(folder.glob("*.distcp"))) == 4
    meta = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    blocks = sorted(k for k in meta if k.startswith("model.") and "experts.gate_up_proj" in k)
    assert blocks == [f"model.model.layers.{i}.mlp.experts.gate_up_proj@ep{r}of2" for i in (0, 1) for r in (0, 1)]
    assert all(meta[k].size[0] == 4 for k in blocks)
    assert meta["model.model.embed_tokens.weight"].size[0] >= 300
    assert any(k.startswith("optim.state.model.layers.0.mlp.experts.gate_up_proj@ep1of2.exp_avg") for k in meta)


def _exported(runs, name):
    from transformers import AutoModelForCausalLM

    from lrmoe import hf
    from lrmoe.train.export import export_hf

    out = runs / f"export-{name}"
    if not out.exists():
        export_hf(runs / name, out, dtype="fp32", max_shard_gib=0.0005)  # several shards and an index
    hf.register()
    return AutoModelForCausalLM.from_pretrained(out, experts_implementation=hf.IMPLEMENTATION, dtype=torch.float32)


def test_export_hf_of_a_sharded_checkpoint(runs):
    """lrmoe export-hf: the 4-rank FSDP set (experts sharded over 2 replicas), resumed or not, exports
    the same weights bit for bit; the 2-rank and single-process checkpoints export weights within the
    runs' agreement; all load with from_pretrained, also stock transformers' without the kit's experts
    (same weights and logits)."""
    assert (runs / "ep2" / "checkpoint.step4.dcp").is_dir()
    a, b, single = _exported(runs, "ep2"), _exported(runs, "resumed"), _exported(runs, "single")
    edp = _exported(runs, "ep2_edp2")
    assert (runs / "export-ep2" / "model.safetensors.index.json").exists()
    pa, pb, ps = dict(a.named_parameters()), dict(b.named_parameters()), dict(single.named_parameters())
    pe = dict(edp.named_parameters())
    assert pa.keys() == pb.keys() == ps.keys() == pe.keys()
    for k in pa:
        assert torch.equal(pe[k], pb[k]), k
        assert torch.allclose(pa[k], ps[k], atol=2e-3, rtol=0), (k, (pa[k] - ps[k]).abs().max())
        assert torch.allclose(pa[k], pe[k], atol=2e-3, rtol=0), (k, (pa[k] - pe[k]).abs().max())
    # a user without the kit: stock transformers (its own experts) loads the folder to the same model
    import json as _json

    from transformers import AutoModelForCausalLM

    cfg = _json.loads((runs / "export-ep2" / "config.json").read_text())
    assert "lrmoe" not in str(cfg.get("experts_implementation", "")), cfg.get("experts_implementation")
    stock = AutoModelForCausalLM.from_pretrained(runs / "export-ep2", dtype=torch.float32)
    assert all(torch.equal(p, pa[k]) for k, p in stock.named_parameters())
    ids = torch.randint(0, stock.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(stock(ids).logits, a(ids).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("over,msg", [
    (dict(offload="experts"), "offload='experts' needs fsdp"),
    (dict(fsdp=True, offload="gpu"), "offload must be one of none, experts, all"),
    (dict(fsdp="yes"), "fsdp must be true or false"),
    (dict(fsdp=True, virtual_ep=2, micro_batch=4), "fsdp shards over real ranks"),
])
def test_fsdp_config_errors(over, msg):
    with pytest.raises(ValueError, match=msg.replace("(", r"\(")):
        TrainConfig(**over)


def _chunked_loss_worker(rank, G, port, out_dir):
    import traceback

    from dist_helpers import torchrun_env

    res = {}
    try:
        import lrmoe.hf as hf
        from lrmoe import BackwardPolicy
        from lrmoe.hf import fsdp
        from lrmoe.hf import parallel as ep_hf
        from lrmoe.parallel import launch
        from lrmoe.train.loss import causal_lm_loss, token_loss

        torch.set_num_threads(1)
        torchrun_env(rank, G, port)
        env = launch.init_distributed(ep=2, backend="gloo")
        build = lambda: hf.build_model("qwen3-moe-tiny", vocab_size=61, seed=5, num_hidden_layers=2,  # noqa: E731
                                       policy=BackwardPolicy(0.0, mode="full"))
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, 61, (4, 12), generator=g)
        labels = ids.clone()
        labels[:, :3] = -100  # prompt tokens carry no label
        pos = torch.arange(12).repeat(4, 1)
        ref = build()
        loss_sum, n = token_loss(ref(input_ids=ids, position_ids=pos, use_cache=False).logits, labels)
        (loss_sum / n).backward()
        want = {k: p.grad.clone() for k, p in ref.named_parameters()}
        model = build()
        ep_hf.parallelize_experts(model, env.ep_group, "fixed")
        fsdp.shard_model(model, env)
        lo, hi = rank * 2, rank * 2 + 2
        part, n_local = causal_lm_loss(model, ids[lo:hi], pos[lo:hi], labels[lo:hi], chunk=5, plain_max=0)
        (part / n * G).backward()  # the trainer's scaling: FSDP averages over the G ranks
        fsdp.finish_expert_grads(model, env.ep_size)
        res["n_local"] = n_local
        got = {k: fsdp.full_tensor(p.grad, env.device) for k, p in model.named_parameters()}
        E = 8
        for k, v in got.items():
            w = want[k][rank * E // 2:(rank + 1) * E // 2] if "experts" in k else want[k]
            res.setdefault("max_err", {})[k] = float((v - w).abs().max())
        launch.shutdown()
    except Exception:  # noqa: BLE001
        res["error"] = traceback.format_exc()
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    os._exit(0)


def test_chunked_loss_under_fsdp_equals_the_plain_loss(tmp_path):
    """The chunked loss (decoder + output layer in chunks, recomputed in the backward) on 2 FSDP + EP
    ranks gives the single-process plain loss's gradients: the output layer and the embeddings are
    gathered for it (the loss runs inside the model's call) and their gradients reduced."""
    from dist_helpers import spawn

    spawn(_chunked_loss_worker, 2, str(tmp_path), deadline_s=180)
    for r in range(2):
        res = torch.load(tmp_path / f"rank{r}.pt", weights_only=False)
        assert "error" not in res, res["error"]
        assert res["n_local"] == 18  # 2 rows x (12 - 3 prompt positions)
        errs = res["max_err"]
        assert "model.embed_tokens.weight" in errs and len(errs) > 10  # (the tiny model ties lm_head to it)
        assert max(errs.values()) < 1e-5, sorted(errs.items(), key=lambda kv: -kv[1])[:3]
