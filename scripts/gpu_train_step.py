#!/usr/bin/env python
"""Training steps of one `lrmoe reproduce` preset run on this device: peak memory and host syncs.

The run's own config (default: the ``gpu1`` preset's Qwen3 C20 run: Qwen3-30B-A3B layer dimensions,
4 layers, seq 8192, micro-batch 1 x 4 accumulated, bf16 autocast, Triton experts) is built by the
real trainer (:class:`lrmoe.train.loop.Trainer`) and stepped:

1. a first step (Triton autotuning and allocator warm-up included);
2. ``--steps`` steps with ``torch.cuda.reset_peak_memory_stats`` before each: the peak of the
   steady steps (``torch.cuda.max_memory_allocated``), beside the bytes of the parameters, their
   gradients and AdamW's state counted from the tensors;
3. one step under ``torch.cuda.set_sync_debug_mode("warn")``: every device->host synchronisation
   torch reports, attributed to the innermost frame of this kit or of transformers (syncs raised in
   the backward are re-raised by autograd at ``loss.backward()``, so they are counted but not placed),
   and divided by the MoE layer calls of the step.

4. the MoE layer alone under ``set_sync_debug_mode("error")`` (:func:`layer_sync_check`).

The JSON names the ``lrmoe estimate-memory`` command that estimates this very step (its vocabulary
included); run it on any CPU and compare its counted peak with ``peak_allocated_gib``.

    python scripts/gpu_train_step.py --data records.json --out DIR [--preset gpu1] [--run qwen3-C20-lrm-s0]

Writes ``DIR/gpu_train_step.json`` and prints a short table. On CPU (no CUDA) it refuses unless
``--allow-cpu`` (the plumbing check: tiny model, memory and sync figures are then ``None``)."""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a checkout without installing

import torch  # noqa: E402

GIB = 2 ** 30


def run_config(preset: str, run: str, data: str, overrides: dict):
    """The TrainConfig of run ``run`` of preset ``preset``, reading ``data``."""
    from lrmoe.reproduce.presets import PRESETS
    from lrmoe.train.config import TrainConfig

    if preset not in PRESETS:
        raise SystemExit(f"unknown preset {preset!r}; accepted: {sorted(PRESETS)}")
    runs = {r.name: r for r in PRESETS[preset].runs()}
    if run not in runs:
        raise SystemExit(f"preset {preset!r} has no run {run!r}; accepted: {sorted(runs)}")
    cfg = dict(runs[run].config, data=data, checkpoint_interval=0, eval_interval=0, **overrides)
    return TrainConfig.from_dict(cfg)


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def state_bytes(trainer) -> dict:
    params = [p for p in trainer.model.parameters()]
    grads = [p.grad for p in params if p.grad is not None]
    opt = [v for s in trainer.opt.state.values() for v in s.values()]
    return {"parameters_gib": tensor_bytes(params) / GIB, "gradients_gib": tensor_bytes(grads) / GIB,
            "optimizer_state_gib": tensor_bytes(opt) / GIB}


def innermost(stack) -> str:
    """The innermost frame of this kit or of transformers ("file:line function"), else the innermost."""
    for f in reversed(stack):
        path = f.filename.replace("\\", "/")
        for key in ("/lrmoe/", "/transformers/"):
            if key in path:
                return f"{key.strip('/')}/{path.split(key, 1)[1]}:{f.lineno} {f.name}"
    f = stack[-1]
    return f"{f.filename}:{f.lineno} {f.name}"


def count_syncs(fn) -> Counter:
    """Run ``fn`` under ``torch.cuda.set_sync_debug_mode("warn")``; count each reported sync by where it
    was raised (the backward's, re-raised by autograd after it, land at the backward call)."""
    where: Counter = Counter()

    def hook(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            where[innermost(traceback.extract_stack()[:-1])] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = hook
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return where


def layer_sync_check(dev) -> dict:
    """One forward + backward of the MoE layer under ``torch.cuda.set_sync_debug_mode("error")``, after
    a warm-up call: the single-process layer at C20 (compact top-quota, sampled selection, mask) must
    make no host synchronisation, and the expert-parallel layer (a one-rank NCCL group, LRMoE placement
    at C20) only its one read of the demand, which the runtime marks as intended
    (``lrmoe.kernels.host.intended_sync``). Each case: "ok" or where the first other sync happened.
    On a CPU ``dev`` (a gloo group) the same cases run with no sync check, the plumbing alone
    (tests/parallel/test_gpu_layer_sync_check.py); tests/parallel/test_syncs.py counts the CPU's syncs
    with a dispatch mode."""
    import torch.distributed as dist

    from lrmoe import BackwardPolicy, LRMoELayer
    from lrmoe.parallel.runtime import ExpertParallel, ExpertParallelExperts

    H, I, E, K, T = 512, 256, 16, 4, 1024
    cuda = dev.type == "cuda"
    out: dict = {}

    def checked(name, run):
        run()  # warm-up: Triton compiles and autotunes, caches fill
        if cuda:
            torch.cuda.synchronize(dev)
            torch.cuda.set_sync_debug_mode("error")
        try:
            run()
            out[name] = "ok"
        except RuntimeError as e:
            out[name] = f"sync at {innermost(traceback.extract_tb(e.__traceback__))}: {str(e)[:160]}"
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode(0)
                torch.cuda.synchronize(dev)

    for name, pol in (("single c20 compact", BackwardPolicy(drop_ratio=0.2)),
                      ("single c20 sample", BackwardPolicy(drop_ratio=0.2, selection="sample", seed=0)),
                      ("single c20 mask", BackwardPolicy(drop_ratio=0.2, mode="mask"))):
        layer = LRMoELayer(H, I, E, K, policy=pol).to(dev, torch.bfloat16)
        x = torch.randn(4, T // 4, H, device=dev, dtype=torch.bfloat16, requires_grad=True)
        checked(name, lambda: layer(x).float().pow(2).mean().backward())
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1,
                                device_id=dev if cuda else None)
    try:
        gu = torch.randn(E, 2 * I, H, device=dev) / H ** 0.5
        dn = torch.randn(E, H, I, device=dev) / I ** 0.5
        m = ExpertParallelExperts.from_full(gu, dn, ExpertParallel(E, None, "lrmoe"), BackwardPolicy(drop_ratio=0.2))
        x = torch.randn(T, H, device=dev, requires_grad=True)
        idx = torch.stack([torch.randperm(E, device=dev)[:K] for _ in range(T)])
        w = torch.rand(T, K, device=dev)
        checked("expert-parallel lrmoe c20 (1 rank)", lambda: m(x, idx, w).pow(2).mean().backward())
    finally:
        if own_group:
            dist.destroy_process_group()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="Alpaca-style JSON records")
    ap.add_argument("--out", type=Path, required=True, help="folder for gpu_train_step.json and the run folder")
    ap.add_argument("--preset", default="gpu1")
    ap.add_argument("--run", default="qwen3-C20-lrm-s0", help="a run name of the preset (lrmoe reproduce --dry-run)")
    ap.add_argument("--steps", type=int, default=2, help="steady steps measured after the first (default 2)")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=JSON",
                    help="override a TrainConfig field, e.g. --set 'model_overrides={\"num_hidden_layers\": 2}'")
    ap.add_argument("--allow-cpu", action="store_true", help="run without CUDA (plumbing check only)")
    ap.add_argument("--no-layer-sync-check", dest="layer_sync_check", action="store_false",
                    help="skip step 4, the MoE layer alone under sync 'error' mode (it plans: numba's planners)")
    a = ap.parse_args(argv)
    if a.steps < 1:
        ap.error(f"--steps must be >= 1, got {a.steps}")
    overrides = {}
    for s in a.set:
        k, sep, v = s.partition("=")
        if not sep:
            ap.error(f"--set takes FIELD=JSON, got {s!r}")
        try:
            overrides[k] = json.loads(v)
        except json.JSONDecodeError:
            overrides[k] = v
    cuda = torch.cuda.is_available()
    if not cuda and not a.allow_cpu:
        ap.error("no CUDA device here; --allow-cpu runs the plumbing on CPU")
    if not cuda:
        overrides.setdefault("device", "cpu")

    from lrmoe.train.loop import Trainer, make_runner
    from lrmoe.train.timer import MoETimer

    a.out.mkdir(parents=True, exist_ok=True)
    cfg = run_config(a.preset, a.run, a.data, overrides)
    cfg.validate()
    res = {"preset": a.preset, "run": a.run, "config": cfg.to_dict(), "device": None, "complete": False}
    path = a.out / "gpu_train_step.json"

    def save():
        path.write_text(json.dumps(res, indent=1, default=str))

    t0 = time.perf_counter()
    trainer = Trainer(cfg, a.out / "run", make_runner(cfg), progress=False)
    # the estimate of this very step (its tokenizer's vocabulary), computed offline on any CPU: the
    # estimator runs a fake-tensor step of the full model, too long for this step's time limit
    flags = [f"--model-override {k}={v}" for k, v in {**cfg.model_overrides, "vocab_size": trainer.vocab}.items()]
    flags += ["--fsdp"] * bool(cfg.fsdp) + ["--activation-checkpointing"] * bool(cfg.activation_checkpointing)
    res["estimate"] = {"command": f"lrmoe estimate-memory --preset {a.preset} --run {a.run} {' '.join(flags)}",
                       "vocab_size": trainer.vocab, "compare": "counted_peak_gib against peak_allocated_gib "
                                                               "(docs/memory.md)"}
    dev = trainer.device
    res.update(device=torch.cuda.get_device_name(dev) if cuda else "cpu", build_s=time.perf_counter() - t0,
               moe_layers=trainer.n_moe, parameters=trainer.base["model"]["parameters"])
    timer = MoETimer(trainer.moe_modules, dev)
    steps = []

    def one(label):
        if cuda:
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        t = time.perf_counter()
        row = trainer.step(timer)
        if cuda:
            torch.cuda.synchronize(dev)
        rec = {"step": label, "wall_s": time.perf_counter() - t, "loss": row["loss"], "tokens": row["tokens"],
               "kept_fraction": row["kept_fraction"], "moe_fwd_s": row["moe_fwd_s"], "moe_bwd_s": row["moe_bwd_s"],
               "max_allocated_gib": torch.cuda.max_memory_allocated(dev) / GIB if cuda else None,
               "max_reserved_gib": torch.cuda.max_memory_reserved(dev) / GIB if cuda else None}
        steps.append(rec)
        res["steps"] = steps
        save()
        print(f"step {label}: {rec['wall_s']:.2f} s, loss {rec['loss']}, peak allocated "
              f"{rec['max_allocated_gib'] and round(rec['max_allocated_gib'], 2)} GiB", flush=True)

    one("first")
    for i in range(a.steps):
        one(f"steady{i + 1}")
    res["state"] = state_bytes(trainer)
    steady = [s["max_allocated_gib"] for s in steps[1:] if s["max_allocated_gib"] is not None]
    res["peak_allocated_gib"] = max(steady) if steady else None
    save()
    if cuda:
        where = count_syncs(lambda: trainer.step(timer))
        layer_calls = trainer.n_moe * (cfg.grad_accum or 1)
        total = sum(where.values())
        res["syncs"] = {"total": total, "moe_layer_calls": layer_calls, "per_moe_layer_call": total / layer_calls,
                        "by_place": dict(where.most_common())}
        print(f"host syncs in one step: {total} ({total / layer_calls:.1f} per MoE layer call, "
              f"{layer_calls} calls)")
        for place, n in where.most_common(12):
            print(f"  {n:5d}  {place}")
        save()
    if cuda and a.layer_sync_check:
        try:
            res["sync_error_mode"] = layer_sync_check(dev)
        except Exception as e:  # noqa: BLE001 - reported, the step's other results stand
            res["sync_error_mode"] = {"error": f"{type(e).__name__}: {e}"[:400]}
        print(f"MoE layer under set_sync_debug_mode('error'): {res['sync_error_mode']}")
    timer.remove()
    res["complete"] = True
    save()
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
