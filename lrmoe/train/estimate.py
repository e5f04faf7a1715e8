"""A run's peak memory per GPU without a GPU: the real training step under fake tensors.

    lrmoe estimate-memory --preset paper --run qwen3-C20-lrm-s0        # rank 0 of the preset's 8
    lrmoe estimate-memory --model qwen3-30b-a3b --ep 8 --fsdp ... --world 8 --gpu-gib 80

:func:`estimate_memory` builds the run's model at full depth and applies the run's parallelism
(:mod:`lrmoe.train.parallelize`: EP sharding, activation checkpointing, FSDP2 with mixed precision)
as rank 0 of a fake process group of the run's world size (``torch.testing``'s ``FakeStore``,
backend ``fake``: collectives return at once, with no data), under ``FakeTensorMode`` (tensors with
shapes and no storage), then runs the run's training steps — micro-batches of its shape, the loss of
:mod:`lrmoe.train.loss`, the backward, gradient clipping and the AdamW step — under torch's memory
tracker (``FSDPMemTracker`` with FSDP, else ``MemTracker``), which reports the peak by category
(parameters, gradients, optimizer state, activations, temporaries, and FSDP's sharded/unsharded
parameters and gradients).

What it stands on, stated in its result:

* **Demand.** Fake routing has no values: every expert-parallel layer plans from a *stated* demand
  (:mod:`lrmoe.parallel.fake`): ``balanced`` (default: each source rank's pairs spread evenly over
  the experts), or one step of a simulator workload (:mod:`lrmoe.sim.workloads`, seed 0, its default
  parameters; ``hot_rank`` makes rank 0's own experts 4x as popular, the worst case for the rank
  estimated under fixed ownership), so the token buffers the plan sizes are those of that demand.
  The result also gives the planner's own token-buffer bytes of rank 0 in its largest MoE layer
  (``token_buffers_gib``: dispatch/combine, saved activations, backward buffers; these are counted
  by the tracker inside Activation and Temp).
* **Device.** This CPU build of torch cannot run fake CUDA tensors, so the step runs as on a CUDA
  rank (bf16 autocast, flex attention over packed documents, fused AdamW's state) but on fake CPU
  tensors; every byte the tracker counts is the GPU's, except what ``offload`` puts on the host:
  FSDP2's CPU offload cannot act without CUDA, so the offloaded state (the sharded fp32 parameters,
  their gradients and AdamW state of the offloaded modules) is counted by the tracker and then
  moved to the host column of the result.
* **Attention.** sdpa, not the flex attention of a CUDA run: flex attention cannot run under the
  memory tracker on CPU tensors (torch refuses its CPU backward, and eagerly it compiles itself,
  which a dispatch mode prevents). sdpa's fake kernel keeps no S x S scores either, but it counts
  the packed rows' 4-D boolean mask ([rows, 1, S, S] bytes per layer) and, for grouped-query
  attention, the keys and values repeated to every head, which flex avoids: an overestimate of at
  most those bytes in the layers alive at the peak.
* **Optimizer.** The run steps a fused AdamW (CUDA); the estimate traces AdamW's single-tensor
  implementation, which holds the same state and makes temporaries of one parameter at a time:
  traced over FSDP's DTensors, the fused and foreach kernels are counted with full-size (unsharded)
  temporaries, 3-4 times the state, which the GPU check is to confirm or refute (one step's
  ``torch.cuda.max_memory_allocated`` against this estimate).
* **Allocator.** The tracker counts tensor bytes; CUDA's caching allocator rounds each block and
  keeps freed blocks (fragmentation), and NCCL and the CUDA context take 1-3 GiB more. The
  verdict adds ``overhead_gib`` (default 3 GiB) to the counted peak.
"""
from __future__ import annotations

import math
import time

import torch

GIB = 2 ** 30
def demands() -> tuple[str, ...]:
    """The demands an estimate accepts: ``balanced`` (exactly even) and the simulator's workloads."""
    from ..sim.workloads import WORKLOADS

    return ("balanced", *(n for n in WORKLOADS.names() if n != "balanced"))


def demand_fn(name: str, top_k: int):
    """``fn(G, E, pairs)`` of a stated demand (:func:`demands`): balanced, or one step of the named
    workload (seed 0, default parameters; every source rank ``pairs / top_k`` tokens)."""
    import functools

    from ..parallel import fake

    if name == "balanced":
        return fake.balanced
    if name not in demands():
        raise ValueError(f"demand {name!r}: accepted {list(demands())}")
    from ..sim.workloads import synthetic_trace

    @functools.lru_cache(maxsize=8)
    def fn(G, E, pairs):
        return synthetic_trace(name, steps=1, layers=1, num_ranks=G, num_experts=E, tokens_per_rank=pairs // top_k,
                               top_k=top_k).counts[0, 0]

    return fn


def _fake_group(world: int):
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("estimate_memory needs a process without a process group (it makes a fake one)")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)


def _batch(cfg, rows: int, doc_len: int, vocab: int):
    """One micro-batch of rank 0: ``rows`` packed rows of ``cfg.seq_len`` tokens, documents of
    ``doc_len`` tokens (position ids restarting), every token labelled but each document's first."""
    S = cfg.seq_len
    ids = torch.randint(0, vocab, (rows, S))
    pos = (torch.arange(S) % doc_len).repeat(rows, 1)
    labels = ids.clone()
    labels[pos == 0] = -100
    return ids, pos, labels


def _moved_to_host(model, opt, offload: str) -> int:
    """Bytes FSDP2's CPU offload would keep on the host: the sharded parameters, gradients and
    AdamW state of the offloaded modules (the experts, or everything)."""
    from ..hf import fsdp as hf_fsdp
    from ..hf.parallel import ep_modules

    if offload == "none":
        return 0
    if offload == "experts":
        params = [p for m in ep_modules(model) for p in m.parameters()]
        if not params:  # no EP: the experts modules of every layer
            from .. import hf

            params = [p for m in hf.experts_modules(model) for p in m.parameters()]
    else:
        params = list(model.parameters())
    ids = {id(p) for p in params}
    n = 0
    for p in params:
        n += hf_fsdp.local_bytes(p) + (hf_fsdp.local_bytes(p.grad) if p.grad is not None else 0)
    for p, st in opt.state.items():
        if id(p) in ids:
            n += sum(hf_fsdp.local_bytes(v) for v in st.values() if isinstance(v, torch.Tensor))
    return n


def run_vocab(config: dict) -> int | None:
    """The embedding rows of a run's model when they are not the preset's: a run trained from scratch
    (no ``init_from``) with a ``bpe:N`` tokenizer has N (``lrmoe.train.loop``), unless its
    ``model_overrides`` set ``vocab_size``; None otherwise (the preset's or the checkpoint's)."""
    tok = str(config.get("tokenizer") or "")
    if config.get("init_from") or not tok.startswith("bpe:") or "vocab_size" in (config.get("model_overrides") or {}):
        return None
    return int(tok.split(":", 1)[1])


def estimate_memory(cfg, world: int, *, gpu_gib: float = 80.0, overhead_gib: float = 3.0, steps: int = 2,
                    doc_len: int | None = None, vocab: int | None = None, demand: str = "balanced",
                    model_vocab: int | None = None, progress=None) -> dict:
    """Peak memory per GPU of rank 0 of run ``cfg`` on ``world`` ranks (see the module docstring).

    ``doc_len``: tokens per packed document (default: 512, Alpaca's records are 100-700 tokens);
    ``vocab``: the tokenizer's size (default: the model's vocabulary); ``progress``: a callable
    taking a line; ``model_vocab``: the model's embedding rows when the run's tokenizer sets them
    (:func:`run_vocab`; default: the preset's). Returns a dict: the categories (GiB) at the peak, the peak, the verdict and the
    assumptions. Runs in this process and leaves no process group behind."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .. import hf
    from ..hf.attention import SDPA
    from ..kernels.host import emulate_accelerator
    from ..parallel.fake import stated_demand
    from ..parallel.launch import init_distributed, shutdown
    from .loss import causal_lm_loss
    from .parallelize import apply_scale, compute_bf16, shard_experts

    if demand not in demands():
        raise ValueError(f"demand {demand!r}: accepted {list(demands())}")
    if world < 1 or world % cfg.ep or cfg.micro_batch % world:
        raise ValueError(f"world {world} must be a multiple of ep ({cfg.ep}) that divides micro_batch "
                         f"({cfg.micro_batch})")
    if cfg.virtual_ep > 1:
        raise ValueError("virtual_ep runs on the CPU in one process; estimate-memory is for GPU runs")
    say = progress or (lambda line: None)
    t0 = time.perf_counter()
    rows = cfg.micro_batch // world
    doc_len = doc_len or min(512, cfg.seq_len)
    device = torch.device("cuda")  # the run's device: decides bf16 and the attention
    bf16 = compute_bf16(cfg, device)
    _fake_group(world)
    try:
        env = init_distributed(ep=cfg.ep if world > 1 else None)
        # emulate_accelerator: the CUDA rank's code paths (no CPU-only reads of routing values, which
        # fake tensors do not have; the single-process layer makes none on an accelerator)
        with FakeTensorMode(allow_non_fake_inputs=True), emulate_accelerator():
            say(f"building {cfg.model} ({cfg.model_overrides or 'preset dimensions'}) under fake tensors ...")
            policy = cfg.policy()
            overrides = dict(cfg.model_overrides) | ({"vocab_size": int(model_vocab)} if model_vocab else {})
            model = hf.build_model(cfg.model, policy=policy, seed=cfg.seed, **overrides)
            model.set_attn_implementation(SDPA)  # (a CUDA run's flex attention: see the module docstring)
            vocab = vocab or model.config.vocab_size
            n_params = sum(p.numel() for p in model.parameters())
            eps = shard_experts(model, env, cfg, policy)
            apply_scale(model, env, cfg, device)
            from .loop import param_groups  # the run's optimizer groups (weight decay)

            opt = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                    eps=cfg.eps, foreach=False)  # (see the module docstring: Optimizer)
            tracker = _tracker(model, opt)
            step_s = []
            stated = demand_fn(demand, int(model.config.num_experts_per_tok))
            with tracker, stated_demand(stated):
                for s in range(steps):
                    t = time.perf_counter()
                    opt.zero_grad(set_to_none=True)
                    for _ in range(cfg.grad_accum or 1):
                        tracker.reset_mod_stats()  # per-module stats per call (the peak is kept)
                        ids, pos, labels = _batch(cfg, rows, doc_len, vocab)
                        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                            loss_sum, _n = causal_lm_loss(model, ids, pos, labels)
                        (loss_sum / max(1, rows * cfg.seq_len) * world).backward()
                    _clip(model, env, cfg)
                    opt.step()
                    step_s.append(time.perf_counter() - t)
                    say(f"step {s + 1}/{steps}: {step_s[-1]:.1f} s")
            peak = tracker.get_tracker_snapshot("peak")
            token_bytes = _token_buffer_bytes(eps)
            host = _moved_to_host(model, opt, cfg.offload)
            held = _held(model, opt)
    finally:
        if dist.is_initialized():
            shutdown()
    dev_stats = max(peak.values(), key=lambda d: sum(v for k, v in d.items() if _name(k) == "Total"))
    cats = {_name(k): v / GIB for k, v in dev_stats.items() if _name(k) != "Total" and v}
    counted = next(v for k, v in dev_stats.items() if _name(k) == "Total") / GIB
    on_gpu = counted - host / GIB
    total = on_gpu + overhead_gib
    return {"model": cfg.model, "model_overrides": dict(cfg.model_overrides), "model_vocab": model_vocab,
            "parameters": n_params,
            "world": world, "ep": cfg.ep, "fsdp": cfg.fsdp, "offload": cfg.offload,
            "activation_checkpointing": cfg.activation_checkpointing, "bf16": bf16,
            "tokens_per_rank": rows * cfg.seq_len, "grad_accum": cfg.grad_accum or 1, "placement": cfg.placement,
            "drop_ratio": cfg.drop_ratio, "demand": demand, "doc_len": doc_len, "vocab": vocab,
            "categories_gib": cats, "token_buffers_gib": None if token_bytes is None else token_bytes / GIB,
            "held_after_step_gib": held, "counted_peak_gib": counted, "offloaded_to_host_gib": host / GIB,
            "overhead_gib": overhead_gib, "peak_gib": total, "gpu_gib": gpu_gib,
            "fits": total <= gpu_gib, "headroom_gib": gpu_gib - total, "moe_layers": len(eps) or len(hf.experts_modules(model)),
            "estimate_s": time.perf_counter() - t0, "step_s": step_s,
            "method": "the real training step of rank 0 under FakeTensorMode with a fake process group; torch's "
                      "memory tracker (lrmoe.train.estimate)"}


def _token_buffer_bytes(eps) -> int | None:
    """Rank 0's token buffers in its largest MoE layer by the planner's memory model (the last step's
    plans; a split layer's pieces run one after the other: its largest piece), None without EP."""
    sizes = []
    for ep in eps:
        plans = ep.last_plan if isinstance(ep.last_plan, list) else [ep.last_plan]
        sizes += [int(p.memory.tokens_G[0]) for p in plans if p is not None]
    return max(sizes) if sizes else None


def _name(category) -> str:
    """A tracker category's name ("Sharded Param", "OptState", "Temp", ...; "Total")."""
    return str(getattr(category, "value", category))


def _held(model, opt) -> dict:
    """GiB this rank holds after the steps, counted from the tensors: parameters, gradients, AdamW state."""
    from ..hf.fsdp import local_bytes

    params = list(model.parameters())
    state = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    return {"parameters": sum(local_bytes(p) for p in params) / GIB,
            "gradients": sum(local_bytes(p.grad) for p in params if p.grad is not None) / GIB,
            "optimizer_state": sum(local_bytes(v) for v in state) / GIB}


def _tracker(model, opt):
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        tracker = FSDPMemTracker(model, opt)
    else:
        tracker = MemTracker()
        tracker.track_external(model, opt)
    # higher-order operators (flex attention's) pass through its dispatch, which counts their outputs
    tracker.supports_higher_order_operators = True
    return tracker


def _clip(model, env, cfg) -> None:
    from ..hf import fsdp as hf_fsdp
    from ..hf import parallel as ep_hf

    clip = cfg.clip if cfg.clip > 0 else math.inf
    if cfg.fsdp:
        hf_fsdp.finish_expert_grads(model, env.ep_size)
        hf_fsdp.clip_grad_norm_(model, clip)
    else:
        ep_hf.finish_grad_sync(model, env.dp_group, env.expert_dp_group)
        ep_hf.clip_grad_norm_(model, clip, env.ep_group)


def table(res: dict) -> str:
    """The estimate as a short text table."""
    lines = [f"{res['model']} {res['model_overrides'] or ''}: rank 0 of {res['world']} (ep {res['ep']}, fsdp "
             f"{res['fsdp']}, offload {res['offload']}, activation checkpointing {res['activation_checkpointing']}, "
             f"{res['tokens_per_rank']} tokens x {res['grad_accum']} micro-batches per step, demand {res['demand']})",
             f"{'category':24} {'GiB':>8}"]
    for k, v in sorted(res["categories_gib"].items(), key=lambda kv: -kv[1]):
        lines.append(f"{k:24} {v:8.2f}")
    if res.get("token_buffers_gib") is not None:
        lines.append(f"{'(token buffers, 1 layer)':24} {res['token_buffers_gib']:8.2f}   the planner's model, "
                     f"inside Activation/Temp")
    lines += [f"{'counted peak':24} {res['counted_peak_gib']:8.2f}",
              f"{'- offloaded to the host':24} {res['offloaded_to_host_gib']:8.2f}",
              f"{'+ allocator/NCCL/context':24} {res['overhead_gib']:8.2f}",
              f"{'estimated peak per GPU':24} {res['peak_gib']:8.2f}   of {res['gpu_gib']:.0f} GiB: "
              f"{'fits' if res['fits'] else 'DOES NOT FIT'} ({res['headroom_gib']:+.1f} GiB)"]
    return "\n".join(lines)

