"""`lrmoe estimate-memory` (lrmoe.train.estimate): the real step under fake tensors against the same step
with real tensors on the CPU (peak within 10 %), the state it counts against the tensors' own bytes,
the offload column, and the command's errors before any work."""
import json

import pytest
import torch

import lrmoe.hf as hf
from lrmoe.cli import main
from lrmoe.train.config import TrainConfig
from lrmoe.train.estimate import GIB, estimate_memory
from lrmoe.train.loop import param_groups
from lrmoe.train.loss import causal_lm_loss

TINY = dict(model="qwen3-moe-tiny", seq_len=128, micro_batch=4, grad_accum=2, device="cpu", dtype="fp32",
            drop_ratio=0.2, model_overrides={"vocab_size": 512})


def _real_worker(rank, G, port, out_dir, cfg_dict):
    """Rank ``rank`` of a real 2-process gloo run of the estimate's step (same parallelism, same loss,
    same optimizer), measured by torch's FSDPMemTracker on real CPU tensors."""
    import os
    import traceback

    from dist_helpers import torchrun_env

    res = {}
    try:
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        from lrmoe.hf import fsdp
        from lrmoe.parallel import launch
        from lrmoe.train.estimate import _batch
        from lrmoe.train.parallelize import apply_scale, shard_experts

        torch.set_num_threads(1)
        torchrun_env(rank, G, port)
        cfg = TrainConfig.from_dict(cfg_dict)
        env = launch.init_distributed(ep=cfg.ep, backend="gloo")
        torch.manual_seed(rank)
        policy = cfg.policy()
        model = hf.build_model(cfg.model, policy=policy, seed=cfg.seed, **dict(cfg.model_overrides))
        shard_experts(model, env, cfg, policy)
        apply_scale(model, env, cfg, torch.device("cpu"))
        opt = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, foreach=False)
        tracker = FSDPMemTracker(model, opt)
        rows = cfg.micro_batch // G
        with tracker:
            for _ in range(2):
                opt.zero_grad(set_to_none=True)
                for _ in range(cfg.grad_accum):
                    tracker.reset_mod_stats()
                    ids, pos, labels = _batch(cfg, rows, 64, model.config.vocab_size)
                    loss, n = causal_lm_loss(model, ids, pos, labels)
                    (loss / max(1, n) * G).backward()
                fsdp.finish_expert_grads(model, env.ep_size)
                fsdp.clip_grad_norm_(model, cfg.clip)
                opt.step()
        snap = tracker.get_tracker_snapshot("peak")
        res["peak"] = max(sum(v for k, v in d.items() if str(getattr(k, "value", k)) == "Total")
                          for d in snap.values()) / GIB
        launch.shutdown()
    except Exception:  # noqa: BLE001
        res["error"] = traceback.format_exc()
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    os._exit(0)


def test_estimate_matches_the_real_step_on_cpu(tmp_path):
    """The estimate of rank 0 against rank 0 of the same step run for real (2 gloo processes, EP 2,
    FSDP, LRMoE placement at C20): peaks within 10 %."""
    from dist_helpers import spawn

    cfg = TrainConfig(**dict(TINY, ep=2, fsdp=True, placement="lrmoe"))
    spawn(_real_worker, 2, str(tmp_path), cfg.to_dict(), deadline_s=240)
    real = torch.load(tmp_path / "rank0.pt", weights_only=False)
    assert "error" not in real, real["error"]
    est = estimate_memory(cfg, 2, doc_len=64)
    print(f"real {real['peak'] * 1024:.2f} MiB, estimated {est['counted_peak_gib'] * 1024:.2f} MiB")
    assert est["counted_peak_gib"] == pytest.approx(real["peak"], rel=0.10)
    assert est["fits"] and est["peak_gib"] == pytest.approx(est["counted_peak_gib"] + est["overhead_gib"])


def test_single_process_estimate_matches_the_real_step():
    """ep 1 (the gpu1 preset's runs): the single-process layer makes no host read of routing values on
    an accelerator, so its step runs under fake tensors too; its peak is the real step's within 10 %."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from lrmoe.train.estimate import _batch

    cfg = TrainConfig(**TINY)
    torch.manual_seed(0)
    model = hf.build_model(cfg.model, policy=cfg.policy(), seed=cfg.seed, **dict(cfg.model_overrides))
    opt = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, foreach=False)
    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            for _ in range(cfg.grad_accum):
                tracker.reset_mod_stats()
                ids, pos, labels = _batch(cfg, cfg.micro_batch, 64, model.config.vocab_size)
                loss, n = causal_lm_loss(model, ids, pos, labels)
                (loss / max(1, n)).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
            opt.step()
    real = max(sum(v for k, v in d.items() if str(getattr(k, "value", k)) == "Total")
               for d in tracker.get_tracker_snapshot("peak").values()) / GIB
    est = estimate_memory(cfg, 1, doc_len=64)
    assert est["ep"] == 1 and est["world"] == 1 and est["moe_layers"] == 2
    assert est["counted_peak_gib"] == pytest.approx(real, rel=0.10), (est["counted_peak_gib"], real)


def test_sharded_state_is_the_tensors_bytes_and_offload_moves_the_experts():
    """FSDP over 2 fake ranks with ep 2: this rank holds half the dense parameters and its 4 of 8 experts in
    fp32 (AdamW: two moments each); with offload=experts the experts' parameters, gradients and state
    are counted on the host."""
    model = hf.build_model("qwen3-moe-tiny", seed=0, vocab_size=512)
    experts = sum(p.numel() for m in hf.experts_modules(model) for p in m.parameters())
    dense = sum(p.numel() for p in model.parameters()) - experts
    base = dict(TINY, ep=2, fsdp=True, dtype="bf16", placement="lrmoe")
    res = estimate_memory(TrainConfig(**base), 2, doc_len=64)
    held = res["held_after_step_gib"]
    want = (dense / 2 + experts / 2) * 4 / GIB
    assert held["parameters"] == pytest.approx(want, rel=0.02)  # (FSDP pads odd dim-0 shards)
    assert held["optimizer_state"] == pytest.approx(2 * held["parameters"], rel=1e-3)  # (+ the step counters)
    assert {"Sharded Param", "OptState", "Activation"} <= set(res["categories_gib"])
    off = estimate_memory(TrainConfig(**dict(base, offload="experts")), 2, doc_len=64)
    assert off["offloaded_to_host_gib"] == pytest.approx(4 * (experts / 2) * 4 / GIB, rel=1e-3)  # p, g, 2 moments
    assert off["peak_gib"] == pytest.approx(off["counted_peak_gib"] - off["offloaded_to_host_gib"] + 3.0)


@pytest.mark.parametrize("argv,msg", [
    (["--preset", "paper"], "--preset and --run go together"),
    (["--preset", "nope", "--run", "x"], "unknown preset 'nope'"),
    (["--preset", "paper", "--run", "x"], "preset 'paper' has no run 'x'; accepted: glm4-C00-s0"),
    (["--model", "qwen3-moe-tiny", "--ep", "2", "--world", "3"], "world 3 must be a multiple of ep (2)"),
    (["--model", "qwen3-moe-tiny", "--trace-steps", "0"], "--trace-steps must be >= 1"),
    (["--model", "qwen3-moe-tiny", "--demand", "skewed"], "--demand 'skewed': accepted balanced, burst, hot_experts, hot_rank"),
])
def test_cli_errors_before_any_work(argv, msg, capsys):
    assert main(["estimate-memory", *argv]) == 2
    assert msg in capsys.readouterr().err


def test_cli_writes_the_table_and_json(tmp_path, capsys):
    out = tmp_path / "est.json"
    rc = main(["estimate-memory", "--model", "qwen3-moe-tiny", "--seq-len", "64", "--micro-batch", "2", "--ep", "2",
               "--device", "cpu", "--gpu-gib", "0.001", "--overhead-gib", "0", "--json", str(out)])
    assert rc == 3  # over a 1 MiB "GPU": the exit status says it does not fit
    text = capsys.readouterr().out
    assert "estimated peak per GPU" in text and "DOES NOT FIT" in text
    d = json.loads(out.read_text())
    assert d["world"] == 2 and d["fits"] is False and d["counted_peak_gib"] > 0.001


def test_a_run_from_scratch_has_its_tokenizers_embeddings():
    """A from-scratch run's model has the tokenizer's rows (lrmoe.train.loop), a fine-tune keeps the
    checkpoint's, an explicit vocab_size override wins; the gpu1 preset's runs get 32,768 rows."""
    from lrmoe.reproduce.presets import PRESETS
    from lrmoe.train.estimate import run_vocab

    assert run_vocab({"tokenizer": "bpe:32768"}) == 32768
    assert run_vocab({"tokenizer": "bpe:32768", "init_from": "Qwen/Qwen3-30B-A3B"}) is None
    assert run_vocab({"tokenizer": "bpe:32768", "model_overrides": {"vocab_size": 512}}) is None
    assert run_vocab({"tokenizer": "my_vocab.json,my_merges.txt"}) is None
    run = next(r for r in PRESETS["gpu1"].runs() if r.name == "qwen3-C20-lrm-s0")
    assert run_vocab(dict(run.config)) == 32768


def test_a_stated_skewed_demand_sizes_the_token_buffers():
    """--demand: one step of a simulator workload instead of the balanced split. Under fixed ownership
    hot_rank (rank 0's experts 4x as popular) gives rank 0 more received rows than balanced: larger
    token buffers by the planner's model, and a peak at least as large."""
    from lrmoe.train.estimate import demand_fn, demands

    assert demands()[0] == "balanced" and {"lognormal", "powerlaw", "hot_rank"} <= set(demands())
    d = demand_fn("hot_rank", 2)(4, 8, 2 * 96)
    assert d.shape == (4, 8) and (d.sum(1) == 2 * 96).all() and (d <= 96).all()
    assert d[:, :2].sum() > 2 * d[:, 2:4].sum()  # rank 0 owns experts 0-1 (8 experts over 4 ranks)
    cfg = TrainConfig(**dict(TINY, ep=2, placement="fixed"))
    even = estimate_memory(cfg, 2, doc_len=64)
    hot = estimate_memory(cfg, 2, doc_len=64, demand="hot_rank")
    assert even["demand"] == "balanced" and hot["demand"] == "hot_rank"
    assert hot["token_buffers_gib"] > 1.2 * even["token_buffers_gib"] > 0
    assert hot["counted_peak_gib"] >= even["counted_peak_gib"]
