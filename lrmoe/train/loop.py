"""Training loop for the paper's convergence experiments (`lrmoe train`).

    from lrmoe.train import TrainConfig, train
    cfg = TrainConfig(model="qwen3-moe-small", data="alpaca_en_demo.json", drop_ratio=0.2, steps=400)
    summary = train(cfg, "results/my_run")

One process, one device; or, launched by torchrun, expert parallel (``ep`` ranks share the routed
experts, placed by ``placement``) and data parallel over the ranks, computing the same step on the
same global batch (lrmoe.train.ep; docs/expert_parallel.md, "Training with torchrun")::

    torchrun --nproc-per-node 8 -m lrmoe.cli train --out runs/x --ep 8 --placement lrmoe --micro-batch 32 ...

AdamW with linear warm-up and cosine decay to ``min_lr_ratio * lr``,
global-norm gradient clipping, gradient accumulation (``global_batch = micro_batch * grad_accum``
rows per optimizer step; under torchrun every micro-batch is split evenly over the ranks), bf16
autocast on GPU and fp32 on CPU (``dtype="auto"``).

Files written to ``out_dir`` (all atomically, so a killed run never leaves a torn file):

* ``metrics.jsonl``: one JSON object per optimizer step (schema in :data:`METRIC_KEYS`; eval
  steps add ``eval_loss``/``eval_ppl``; every step carries per-expert ``demand``/``quota``/``kept``
  of the sampled MoE layers). Each line is appended and flushed; on resume the file is cut back
  to the checkpoint's step, so it always equals the uninterrupted run's file (except timings).
* ``summary.json``: config, environment (versions, hardware, git revision), seed, data stats,
  model description, ``status`` ("running" or "done"), final metrics and timings.
* ``checkpoint.pt``: model, optimizer, LR scheduler, RNG states (torch, CUDA, python, numpy, the
  backward policy's generator) and the data-loader position. Written every
  ``checkpoint_interval`` steps, on ``stop_after``, on Ctrl-C (one process only: the step in flight
  finishes first, a second Ctrl-C stops at once without one) and at the end.
  Under torchrun it holds the full unsharded weights, and ``checkpoint.rank{r}.pt`` each rank's
  optimizer state, RNG states and placement-planner state.

Under torchrun, rank 0 writes these files; metrics are sums over all ranks (times: the slowest
rank) and EP rows add ``comm_bytes`` (bytes sent to other ranks per all-to-all kind, summed over
MoE layers, micro-batches and ranks) and ``comm_bytes_total``.

Exact resume: calling :func:`train` again on the same ``out_dir`` with the same config continues
from the checkpoint; the losses it logs are bit-identical to those of an uninterrupted run (same
device, same thread count).

Definitions (see docs/reproduce.md):

* ``loss``: mean next-token cross-entropy over the response tokens (labels != -100) of the whole
  optimizer step (all micro-batches; each micro-batch's summed loss is divided by the step's token
  count, so at drop ratio 0 accumulation is exactly a bigger micro-batch; with drops, quotas and
  selection apply per layer call, i.e. per micro-batch). ``ppl = exp(loss)`` is the per-token
  perplexity of the training stream, the quantity the paper averages over its final steps. A step
  whose rows hold no response token logs ``loss`` and ``ppl`` as null and is left out of the PPL means.
* ``moe_fwd_s``/``moe_bwd_s``: seconds spent *inside the routed-experts functions* of all MoE layers
  during the step (forward: from entering to leaving each experts module, i.e. dispatch/sort,
  quotas, grouped GEMMs, combine; backward: from the moment autograd starts the experts node to
  the moment it has produced its input gradients, i.e. router gradient, scoring, selection,
  compaction, grouped GEMMs, scatter). Router, attention, shared experts and the optimizer are
  excluded: this is the paper's "execution inside MoE layers". CPU: ``time.perf_counter``; CUDA:
  CUDA events, summed after the step's synchronisation.
* ``kept_fraction``: kept / routed pairs in the expert backward, mean over MoE layers (1.0 at C0).
* ``tokens_per_s``: non-padding input tokens of the step / wall time of the step.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import random
import re
import signal
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..run_folder import read_metrics, run_folder_lock

DTYPES = ("auto", "fp32", "bf16")
METRIC_KEYS = ("step", "epoch", "loss", "ppl", "lr", "grad_norm", "tokens", "label_tokens", "tokens_per_s",
               "step_time_s", "moe_fwd_s", "moe_bwd_s", "kept_fraction", "nonfinite", "layers", "elapsed_s")
# Fields that may differ between the run that wrote a checkpoint and the run that resumes it.
_RUNTIME_FIELDS = ("threads", "log_interval", "checkpoint_interval", "eval_interval", "load_concurrency")


@dataclass
class TrainConfig:
    """Everything that defines a training run (saved in summary.json and in the checkpoint)."""

    # model
    model: str = "qwen3-moe-tiny"
    model_overrides: dict = field(default_factory=dict)
    init_from: str | None = None
    # data
    data: str | None = None
    tokenizer: str = "bpe:1024"
    max_records: int | None = None
    heldout_fraction: float = 0.05
    data_seed: int = 0
    seq_len: int = 256
    # batch
    micro_batch: int = 4
    global_batch: int | None = None
    grad_accum: int | None = None
    # optimisation
    steps: int = 100
    lr: float = 1e-3
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    clip: float = 1.0
    # backward policy (lrmoe.policy.BackwardPolicy)
    drop_ratio: float = 0.0
    scorer: str = "lrm"
    quota: str = "waterfill"
    mode: str = "compact"
    policy_seed: int | None = None
    # run
    seed: int = 0
    device: str = "auto"
    dtype: str = "auto"
    threads: int | None = None
    eval_interval: int = 0
    eval_batches: int | None = None
    log_interval: int = 10
    sample_layers: list = field(default_factory=lambda: [0, -1])
    checkpoint_interval: int = 0
    # expert parallelism (torchrun; lrmoe.train.ep)
    ep: int = 1
    placement: str = "lrmoe"
    ep_budget_mib: float | None = None
    ep_options: dict = field(default_factory=dict)
    load_concurrency: int = 1

    _HELP = {
        "model": "model preset (lrmoe.hf.MODEL_PRESETS)",
        "model_overrides": "transformers config fields to override, KEY=VALUE (JSON values), e.g. num_hidden_layers=4",
        "init_from": "load initial weights from this checkpoint (local folder or hub id) instead of a random "
                     "initialisation of the preset; its vocabulary must cover the tokenizer's",
        "data": "Alpaca source: .json/.jsonl file, directory or hub id (default: $LRMOE_ALPACA, else tatsu-lab/alpaca)",
        "tokenizer": "'bpe:N' (trained on the training records), 'VOCAB.json,MERGES.txt' or a HF tokenizer dir",
        "max_records": "keep the first N records of the source (before the held-out split)",
        "heldout_fraction": "fraction of records held out for evaluation",
        "data_seed": "seed of the held-out split and of packing (fixed across runs so they share one stream)",
        "seq_len": "tokens per packed row",
        "micro_batch": "rows per forward/backward",
        "global_batch": "rows per optimizer step (default micro_batch * grad_accum)",
        "grad_accum": "micro-batches per optimizer step (default global_batch / micro_batch, else 1)",
        "steps": "optimizer steps",
        "lr": "peak learning rate",
        "warmup_steps": "linear warm-up steps (from lr/warmup to lr)",
        "min_lr_ratio": "cosine decay ends at min_lr_ratio * lr",
        "weight_decay": "AdamW weight decay (not applied to norms, biases and the router correction bias)",
        "clip": "global gradient-norm clip (0: off)",
        "drop_ratio": "fraction of routed pairs dropped from the expert backward (C20 = 0.2)",
        "scorer": "pair scorer: lrm, lrm_input, grad_norm, abs_grad, random",
        "quota": "quota policy: waterfill, proportional",
        "mode": "backward mode: compact (LRMoE), mask (zero-masked), full (no selection)",
        "policy_seed": "seed of the random scorer's generator (default: seed)",
        "seed": "seed of model initialisation and of the batch order",
        "device": "auto, cpu, cuda, cuda:N",
        "dtype": "auto (bf16 autocast on GPU, fp32 on CPU), fp32, bf16 (autocast)",
        "threads": "torch CPU threads (default: torch's choice)",
        "eval_interval": "evaluate on the held-out split every N steps (0: only after the last step)",
        "eval_batches": "held-out micro-batches per evaluation (default: the whole split)",
        "log_interval": "progress-bar refresh interval in steps (metrics.jsonl gets every step)",
        "sample_layers": "MoE-layer indices (negative from the end) whose per-expert demand/quota/kept are logged",
        "checkpoint_interval": "write checkpoint.pt every N steps (0: only at the end / on stop)",
        "ep": "expert-parallel group size: the routed experts of every MoE layer are sharded over ep ranks "
              "(launch with `torchrun --nproc-per-node N -m lrmoe.cli train ... --ep N`; 1: no expert "
              "parallelism, data parallel when launched with several processes)",
        "placement": "placement policy of the expert-parallel runtime (with ep > 1): fixed, symi, ultraep, "
                     "ultraep_greedy, lrmoe",
        "ep_budget_mib": "per-rank memory budget of each MoE layer for the placement planner, in MiB (default: unlimited)",
        "ep_options": "placement planner option KEY=VALUE (JSON values; repeatable), e.g. min_tokens=64, "
                      "capacity_factor=1.0, slots_per_rank=4, fallback=split",
        "load_concurrency": "with ep > 1: how many ranks of a node build or load the full model at the same "
                            "time before sharding its experts (each holds a full fp32 copy meanwhile, about "
                            "4 bytes x parameters; 0: all at once)",
    }

    def __post_init__(self):
        self.model_overrides = dict(self.model_overrides or {})
        self.ep_options = dict(self.ep_options or {})
        self.sample_layers = list(self.sample_layers)
        self._resolve_batch()

    def _resolve_batch(self):
        mb = self.micro_batch
        if not isinstance(mb, int) or mb < 1:
            raise ValueError(f"micro_batch must be an integer >= 1, got {mb!r}")
        gb, ga = self.global_batch, self.grad_accum
        if ga is not None and (not isinstance(ga, int) or ga < 1):
            raise ValueError(f"grad_accum must be an integer >= 1, got {ga!r}")
        if gb is not None and (not isinstance(gb, int) or gb < 1):
            raise ValueError(f"global_batch must be an integer >= 1, got {gb!r}")
        if gb is None:
            ga = ga or 1
            gb = mb * ga
        elif ga is None:
            if gb % mb:
                raise ValueError(f"global_batch ({gb}) must be a multiple of micro_batch ({mb})")
            ga = gb // mb
        elif gb != mb * ga:
            raise ValueError(f"global_batch ({gb}) must equal micro_batch ({mb}) * grad_accum ({ga})")
        self.global_batch, self.grad_accum = gb, ga

    def validate(self) -> "TrainConfig":
        """Check every field; raises ValueError saying what was wrong and what is accepted."""
        from ..hf import MODEL_PRESETS
        from ..policy import BackwardPolicy

        if self.model not in MODEL_PRESETS:
            raise ValueError(f"unknown model preset {self.model!r}; accepted: {sorted(MODEL_PRESETS)}")
        self._resolve_batch()

        def positive_int(name, minimum=1):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
                raise ValueError(f"{name} must be an integer >= {minimum}, got {v!r}")

        positive_int("seq_len", 2)
        if not isinstance(self.tokenizer, str) or not self.tokenizer:
            raise ValueError(f"tokenizer must be a non-empty string, got {self.tokenizer!r}")
        if self.tokenizer.startswith("bpe:") and not re.fullmatch(r"bpe:[1-9]\d*", self.tokenizer):
            raise ValueError(f"tokenizer {self.tokenizer!r}: a trained BPE is written 'bpe:N' with N a positive "
                             "integer (e.g. bpe:1024); also accepted: 'VOCAB.json,MERGES.txt' or a HF tokenizer dir")
        positive_int("steps")
        for name in ("warmup_steps", "eval_interval", "checkpoint_interval", "seed", "data_seed"):
            positive_int(name, 0)
        positive_int("log_interval")
        if self.warmup_steps > self.steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) must be <= steps ({self.steps})")
        if not (isinstance(self.lr, (int, float)) and self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be a finite number > 0, got {self.lr!r}")
        def number(name, lo, hi=math.inf, lo_open=False, hi_open=False, what=""):
            v = getattr(self, name)
            ok = (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                  and (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi))
            if not ok:
                rng = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open or hi == math.inf else ']'}"
                raise ValueError(f"{name} must be a finite number in {rng}{what}, got {v!r}")

        number("min_lr_ratio", 0, 1)
        number("weight_decay", 0)
        number("clip", 0, what=" (0 turns clipping off)")
        number("eps", 0, lo_open=True)
        for b in ("beta1", "beta2"):
            number(b, 0, 1, hi_open=True)
        number("heldout_fraction", 0, 1, hi_open=True)

        def optional_int(name):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be an integer >= 1 or None, got {v!r}")

        for name in ("max_records", "eval_batches", "threads"):
            optional_int(name)
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; accepted: {list(DTYPES)}")
        if self.device != "auto":
            try:
                dev = torch.device(self.device)
            except RuntimeError:
                raise ValueError(f"unknown device {self.device!r}; accepted: auto, cpu, cuda, cuda:N") from None
            if dev.type not in ("cpu", "cuda"):
                raise ValueError(f"unsupported device {self.device!r}; accepted: auto, cpu, cuda, cuda:N")
            if dev.type == "cuda" and not torch.cuda.is_available():
                raise ValueError(f"device {self.device!r} requested but CUDA is not available")
        if not isinstance(self.sample_layers, list) or not all(isinstance(i, int) for i in self.sample_layers):
            raise ValueError(f"sample_layers must be a list of integers, got {self.sample_layers!r}")
        if not isinstance(self.model_overrides, dict):
            raise ValueError(f"model_overrides must be a dict, got {self.model_overrides!r}")
        if self.model_overrides and self.init_from is None:
            from ..hf import model_config

            known = model_config(self.model).to_dict()
            known.update(known.get("rope_parameters") or {})  # rope_theta etc. live there in transformers 5
            unknown = sorted(k for k in self.model_overrides if k not in known)
            if unknown:  # transformers would store a misspelt field as an unused attribute
                raise ValueError(f"model_overrides {unknown} are not fields of the {self.model!r} config; "
                                 f"accepted: {sorted(known)}")
        if self.model_overrides.get("output_router_logits"):
            raise ValueError("model_overrides output_router_logits=True: lrmoe train does not add the router's "
                             "auxiliary loss (the runs train without it, docs/reproduce.md), so it would be ignored")
        self._validate_ep()
        self.policy()  # validates drop_ratio, scorer, quota, mode, policy seed
        if self.mode == "full" and self.drop_ratio > 0:
            raise ValueError(f"mode 'full' keeps every pair, so drop_ratio {self.drop_ratio} would not apply; "
                             "use mode 'compact' (or 'mask') to drop pairs, or drop_ratio 0")
        return self

    def _validate_ep(self):
        from ..planning.policies import placement_policies

        if isinstance(self.ep, bool) or not isinstance(self.ep, int) or self.ep < 1:
            raise ValueError(f"ep must be an integer >= 1, got {self.ep!r}")
        if self.placement not in placement_policies():
            raise ValueError(f"unknown placement {self.placement!r}; accepted: {sorted(placement_policies())}")
        if self.ep_budget_mib is not None and not (isinstance(self.ep_budget_mib, (int, float))
                                                   and self.ep_budget_mib > 0):
            raise ValueError(f"ep_budget_mib must be a number > 0 or None (unlimited), got {self.ep_budget_mib!r}")
        if not isinstance(self.ep_options, dict):
            raise ValueError(f"ep_options must be a dict, got {self.ep_options!r}")
        if isinstance(self.load_concurrency, bool) or not isinstance(self.load_concurrency, int) \
                or self.load_concurrency < 0:
            raise ValueError(f"load_concurrency must be an int >= 0 (0: all ranks at once), "
                             f"got {self.load_concurrency!r}")
        if self.ep == 1:
            ignored = [f for f, v, d in (("placement", self.placement, "lrmoe"), ("ep_budget_mib", self.ep_budget_mib, None),
                                         ("ep_options", self.ep_options, {})) if v != d]
            if ignored:
                raise ValueError(f"{', '.join(ignored)} {'applies' if len(ignored) == 1 else 'apply'} only to expert "
                                 "parallelism (ep > 1) and would be ignored with ep 1: set --ep N or leave "
                                 f"{'it' if len(ignored) == 1 else 'them'} at the default")
        if self.micro_batch % self.ep:
            raise ValueError(f"micro_batch ({self.micro_batch}) must be divisible by ep ({self.ep}): every "
                             f"micro-batch is split evenly over the ranks")

    def policy(self):
        from ..policy import BackwardPolicy

        seed = self.seed if self.policy_seed is None else self.policy_seed
        return BackwardPolicy(drop_ratio=self.drop_ratio, scorer=self.scorer, quota=self.quota, mode=self.mode,
                              seed=seed)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown TrainConfig fields {unknown}; accepted: {sorted(names)}")
        return cls(**d)


# ----------------------------------------------------------------------------- helpers


def resolve_device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(spec)


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier of ``cfg.lr`` for optimizer step ``step`` (0-based): linear warm-up, cosine decay."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    decay_steps = cfg.steps - cfg.warmup_steps - 1  # the last step (steps - 1) gets min_lr_ratio
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps) if decay_steps > 0 else 1.0
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class BatchStream:
    """Deterministic infinite stream of training rows: epoch e visits the rows in the order of
    ``randperm(N, seed=(seed, e))``; the state is the number of rows consumed so far."""

    def __init__(self, n_rows: int, seed: int, position: int = 0):
        if n_rows < 1:
            raise ValueError("the training split has no rows")
        self.n, self.seed, self.position = n_rows, seed, position
        self._perm_epoch, self._perm = -1, None

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm, self._perm_epoch = torch.randperm(self.n, generator=g), epoch
        return self._perm

    def next(self, k: int) -> torch.Tensor:
        rows = []
        for _ in range(k):
            epoch, i = divmod(self.position, self.n)
            rows.append(int(self._order(epoch)[i]))
            self.position += 1
        return torch.tensor(rows)

    @property
    def epoch(self) -> float:
        return self.position / self.n


_EXPERTS_NODES = ("SelectiveExperts", "EPExperts")  # autograd nodes of lrmoe.experts / lrmoe.parallel.runtime


class MoETimer:
    """Time spent inside the routed-experts modules (forward and backward), see the module docstring."""

    def __init__(self, modules, device: torch.device):
        self.cuda = device.type == "cuda"
        self.enabled = False
        self.fwd = self.bwd = 0.0
        self._fwd_events, self._bwd_events = [], []
        self._handles = []
        for m in modules:
            self._handles.append(m.register_forward_pre_hook(self._pre))
            self._handles.append(m.register_forward_hook(self._post))
        self._starts = []

    def _mark(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def _pre(self, module, args):
        if self.enabled:
            self._starts.append(self._mark())

    def _post(self, module, args, out):
        if not self.enabled or not self._starts:
            return
        start, end = self._starts.pop(), self._mark()
        self._add(self._fwd_events, "fwd", start, end)
        y = out[0] if isinstance(out, (tuple, list)) else out
        if not (isinstance(y, torch.Tensor) and y.grad_fn is not None):
            return
        outer = inner = y.grad_fn
        # `.to(dtype)` after the experts function may add a copy node: time from the outer node's
        # start to the experts node's end.
        for _ in range(2):
            if any(n in type(inner).__name__ for n in _EXPERTS_NODES) or not inner.next_functions:
                break
            inner = inner.next_functions[0][0] or inner
        box = {}

        def pre(grad_outputs):
            box["t0"] = self._mark()

        def post(grad_inputs, grad_outputs):
            if "t0" in box:
                self._add(self._bwd_events, "bwd", box.pop("t0"), self._mark())

        outer.register_prehook(pre)
        inner.register_hook(post)

    def _add(self, events, kind, start, end):
        if self.cuda:
            events.append((start, end))
        elif kind == "fwd":
            self.fwd += end - start
        else:
            self.bwd += end - start

    def collect(self) -> tuple[float, float]:
        """(forward seconds, backward seconds) since the last call; synchronises CUDA."""
        if self.cuda:
            torch.cuda.synchronize()
            self.fwd = sum(a.elapsed_time(b) for a, b in self._fwd_events) / 1e3
            self.bwd = sum(a.elapsed_time(b) for a, b in self._bwd_events) / 1e3
            self._fwd_events, self._bwd_events = [], []
        out = (self.fwd, self.bwd)
        self.fwd = self.bwd = 0.0
        self._starts = []
        return out

    def remove(self):
        for h in self._handles:
            h.remove()


def atomic_torch_save(obj, path: Path) -> None:
    from ..files import atomic_write

    atomic_write(path, lambda f: torch.save(obj, f))


def _rng_state(policy, device) -> dict:
    import numpy as np

    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    gen = policy.generator(device)
    if gen is not None:
        state["policy"] = gen.get_state()
    return state


def _set_rng_state(state: dict, policy, device) -> None:
    import numpy as np

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "policy" in state:
        policy.generator(device).set_state(state["policy"])


def _environment(device: torch.device) -> dict:
    from ..environment import environment

    env = environment(device)
    env["cpu_count"] = os.cpu_count()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                env["cpu_model"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    for mod in ("numpy", "datasets", "tokenizers"):
        try:
            env[mod] = __import__(mod).__version__
        except ImportError:
            pass
    if device.type == "cuda":
        env["cuda"] = torch.version.cuda
        env["gpu_count"] = torch.cuda.device_count()
    return env


def hardware_label(env: dict, distributed: dict | None = None) -> str:
    """A short human description of the hardware of a run (for tables and figure captions):
    ``env`` is a summary's ``environment``, ``distributed`` its ``distributed`` entry (torchrun
    runs: world size and EP group size)."""
    world = int((distributed or {}).get("world_size") or 1)
    ep = int((distributed or {}).get("ep") or 1)
    par = f", EP{ep}" if ep > 1 else ""
    if str(env.get("device", "cpu")).startswith("cuda"):
        return f"{world}x {env.get('gpu', 'GPU')}{par}"
    cpu = env.get("cpu_model") or env.get("cpu") or "CPU"
    cores = f"{env['cpu_count']} cores, " if env.get("cpu_count") else ""
    procs = f"{world} processes, " if world > 1 else ""
    return f"CPU ({cpu}), {cores}{procs}{env.get('threads', '?')} thread(s) per {'process' if world > 1 else 'run'}{par}"


def load_data(cfg: TrainConfig):
    """(train, heldout, stats) for ``cfg``, tokenised and packed once and cached under data/cache."""
    from ..data import load_prepared, prepare

    path = prepare(cfg.data, cfg.tokenizer, cfg.seq_len, cfg.heldout_fraction, cfg.data_seed, cfg.max_records)
    return load_prepared(path)


def _param_groups(model, weight_decay: float):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.dim() < 2 else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def run_status(out_dir) -> str | None:
    """"done", "running" or None (no summary) for a run directory."""
    s = _read_json(Path(out_dir) / "summary.json")
    return s.get("status") if s else None


def _comparable(d: dict) -> dict:
    """Config fields that define a run (runtime-only fields dropped; fields an older version of the
    kit did not write take their defaults)."""
    try:
        d = TrainConfig.from_dict(d).to_dict()
    except (TypeError, ValueError):
        pass
    return {k: v for k, v in d.items() if k not in _RUNTIME_FIELDS}


def config_differences(a: dict, b: dict) -> list[str]:
    """The fields in which two run configs differ (runtime-only fields aside), as "name: a != b".
    ``data`` differs only if the two sources are not local files (or folders) with the same
    content: a moved data folder still holds the same run."""
    ca, cb = _comparable(a), _comparable(b)
    out = [f"{k}: {ca.get(k)!r} != {cb.get(k)!r}" for k in sorted(set(ca) | set(cb))
           if k != "data" and ca.get(k) != cb.get(k)]
    da, db = ca.get("data"), cb.get("data")
    if da != db:
        from ..data import source_fingerprint

        fa = source_fingerprint(da) if da else None
        if fa is None or fa != (source_fingerprint(db) if db else None):
            out.append(f"data: {da!r} != {db!r}")
    return out


def _truncate_metrics(path: Path, last_step: int) -> None:
    keep = [r for r in read_metrics(path) if r.get("step", 0) <= last_step]
    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- training


@torch.no_grad()
def evaluate(model, heldout, cfg: TrainConfig, device, autocast, runner=None) -> dict:
    """Mean response-token cross-entropy and perplexity on the held-out split (with a distributed
    ``runner``: every rank evaluates its share of each micro-batch; sums over the ranks)."""
    runner = runner or LocalRunner  # its eval_rows/sum_eval are static
    n = len(heldout)
    if n == 0:
        return {}
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    starts = list(range(0, n, cfg.micro_batch))
    if cfg.eval_batches is not None:
        starts = starts[: cfg.eval_batches]
    for s in starts:
        idx = torch.arange(s, min(n, s + cfg.micro_batch))
        batch = {k: heldout.tensors[k][idx].to(device) for k in ("input_ids", "labels", "position_ids")}
        batch, counted = runner.eval_rows(batch)
        with autocast():
            # use_cache=False: with a cache, transformers builds a plain causal mask and packed
            # documents would attend to each other; without one the mask follows position_ids.
            logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        loss_sum, tokens = _token_loss(logits, batch["labels"])
        if counted:
            total += float(loss_sum)
            count += tokens
    total, count = runner.sum_eval(total, count)
    model.train(was_training)
    if count == 0:
        if runner.is_main:
            warnings.warn(f"evaluation found no response tokens in the {len(starts)} held-out micro-batch(es) "
                          f"evaluated (of {n} rows): no eval_loss this step; raise eval_batches or heldout_fraction",
                          stacklevel=2)
        return {}
    loss = total / count
    return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 700.0)), "eval_tokens": count}


def _token_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Summed next-token cross-entropy over labelled positions (labels are aligned with inputs)."""
    from ..data import IGNORE_INDEX

    shift_logits = logits[:, :-1].float()
    shift_labels = labels[:, 1:]
    loss_sum = torch.nn.functional.cross_entropy(shift_logits.reshape(-1, shift_logits.shape[-1]),
                                                 shift_labels.reshape(-1), ignore_index=IGNORE_INDEX,
                                                 reduction="sum")
    return loss_sum, int((shift_labels != IGNORE_INDEX).sum())


def _label_tokens(labels: torch.Tensor) -> int:
    from ..data import IGNORE_INDEX

    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def _summary_of_metrics(rows: list[dict], steps: int) -> dict:
    if not rows:
        return {}
    last = rows[-1]
    n_tail = max(1, math.ceil(0.1 * steps))
    tail = [r["ppl"] for r in rows if r["step"] > steps - n_tail and r["ppl"] is not None]
    ppls = [r["ppl"] for r in rows if r["ppl"] is not None]  # steps without response tokens have none
    evals = [r for r in rows if "eval_loss" in r]
    out = {"step": last["step"], "loss": last["loss"], "ppl": last["ppl"],
           "mean_ppl_final_10pct": sum(tail) / len(tail) if tail else None,
           "mean_ppl_all_steps": sum(ppls) / len(ppls) if ppls else None,
           "steps_without_loss": len(rows) - len(ppls),
           "kept_fraction_mean": sum(r["kept_fraction"] for r in rows) / len(rows),
           "nonfinite_total": sum(r.get("nonfinite", 0) for r in rows)}
    if evals:
        out.update(eval_loss=evals[-1]["eval_loss"], eval_ppl=evals[-1]["eval_ppl"], eval_step=evals[-1]["step"])
    return out


class LocalRunner:
    """One process, one device: the steps of :func:`train` that a distributed run does differently
    (:class:`lrmoe.train.ep.DistributedRunner` has the same methods)."""

    distributed = False
    is_main = True
    rank, world = 0, 1

    def __init__(self, cfg: TrainConfig):
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.device = resolve_device(cfg.device)

    @staticmethod
    def load_data(cfg):
        return load_data(cfg)

    @staticmethod
    def policy_for_rank(policy):
        return policy

    def build_model(self, make, policy):
        return make().to(self.device)

    def describe(self) -> dict:
        return {}

    def local_batches(self, batches):
        return batches

    def backward(self, loss):
        loss.backward()

    def reduce_step(self, loss_total, kept, layer_stats, nonfinite, comm):
        return loss_total, kept, layer_stats, nonfinite, {}

    def clip_(self, model, params, clip: float) -> float:
        if clip > 0:
            return float(torch.nn.utils.clip_grad_norm_(params, clip))
        return float(torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None]))

    def max_times(self, *times):
        return times

    @staticmethod
    def eval_rows(batch):
        return batch, True

    @staticmethod
    def sum_eval(total, count):
        return total, count

    def save_checkpoint(self, path: Path, common: dict, model, opt, rng_state: dict) -> None:
        atomic_torch_save({**common, "model": model.state_dict(), "optimizer": opt.state_dict(), "rng": rng_state},
                           path)

    def load_checkpoint(self, path: Path) -> dict:
        return torch.load(path, map_location="cpu", weights_only=False)

    def load_state(self, path: Path, ck: dict, model, opt, set_rng) -> None:
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        set_rng(ck["rng"])

    def barrier(self):
        pass

    def close(self):
        pass


def make_runner(cfg: TrainConfig):
    """:class:`LocalRunner`, or the distributed one when ``cfg.ep > 1`` or under torchrun."""
    from . import ep as train_ep

    return train_ep.DistributedRunner(cfg) if train_ep.wanted(cfg) else LocalRunner(cfg)


def train(cfg: TrainConfig, out_dir, progress: bool = True, stop_after: int | None = None) -> dict:
    """Train (or resume) the run ``cfg`` in ``out_dir``; returns the summary dict.

    ``stop_after``: stop (checkpoint, status "running") once this many optimizer steps are done,
    to be resumed by a later call. A finished run (status "done") is returned as is.

    Under torchrun (or with ``cfg.ep > 1``) every rank calls this with the same arguments: the
    experts are sharded over the EP group, each rank trains on its share of every batch and rank
    0 writes the files (lrmoe.train.ep, docs/expert_parallel.md).
    """
    cfg.validate()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    previous = _read_json(out / "summary.json")
    diff = config_differences(previous.get("config", {}), cfg.to_dict()) if previous is not None else []
    if diff:
        raise ValueError(f"{out} holds a different run (its summary.json has another config: {'; '.join(diff)}); "
                         "use a fresh output directory or delete that one")
    if previous is not None and previous.get("status") == "done":
        return previous
    runner = make_runner(cfg)
    try:
        with run_folder_lock(out, runner.is_main):
            return _train(cfg, out, runner, progress, stop_after)
    finally:
        runner.close()


def _train(cfg: TrainConfig, out: Path, runner, progress: bool, stop_after: int | None) -> dict:
    from ..files import write_json
    from .. import hf

    summary_path, metrics_path, ckpt_path = out / "summary.json", out / "metrics.jsonl", out / "checkpoint.pt"
    main = runner.is_main
    device = runner.device
    use_bf16 = cfg.dtype == "bf16" or (cfg.dtype == "auto" and device.type == "cuda")

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16)

    wall0 = time.perf_counter()
    train_set, heldout, data_stats = runner.load_data(cfg)
    if "source_fingerprint" not in data_stats:  # a file prepared before fingerprints were stored
        from ..data import source_fingerprint

        src = data_stats.get("config", {}).get("source")
        data_stats["source_fingerprint"] = source_fingerprint(src) if src else None
    vocab = int(data_stats["vocab_size"])
    policy = runner.policy_for_rank(cfg.policy())
    built = {}

    def make_model():
        if cfg.init_from:
            from transformers import AutoModelForCausalLM

            hf.register()
            built["overrides"] = dict(cfg.model_overrides)
            torch.manual_seed(cfg.seed)
            model = AutoModelForCausalLM.from_pretrained(cfg.init_from, experts_implementation=hf.IMPLEMENTATION,
                                                         dtype=torch.float32, **built["overrides"])
            hf.set_policy(model, policy)
            if model.config.vocab_size < vocab:
                raise ValueError(f"{cfg.init_from} has {model.config.vocab_size} token embeddings but the tokenizer "
                                 f"{cfg.tokenizer!r} has {vocab} tokens; use the checkpoint's tokenizer")
        else:
            built["overrides"] = {"vocab_size": vocab, **cfg.model_overrides}
            if built["overrides"]["vocab_size"] < vocab:
                raise ValueError(f"model_overrides vocab_size={built['overrides']['vocab_size']} is smaller than the "
                                 f"tokenizer {cfg.tokenizer!r} ({vocab} tokens); leave it out (it follows the tokenizer)")
            model = hf.build_model(cfg.model, policy=policy, seed=cfg.seed, **built["overrides"])
        mods = hf.experts_modules(model)  # counted before the experts are sharded
        # the family of what was built or loaded (an init_from checkpoint may not be the preset's)
        built["family"] = getattr(model.config, "model_type", None) or hf.MODEL_PRESETS[cfg.model].family
        built.update(parameters=sum(p.numel() for p in model.parameters()),
                     experts=int(mods[0].gate_up_proj.shape[0]) if mods else 0)
        return model

    # EP: experts sharded over the ranks (which build in turns of cfg.load_concurrency per node).
    model = runner.build_model(make_model, policy)
    overrides, n_parameters, n_experts = built["overrides"], built["parameters"], built["experts"]
    moe_modules = hf.experts_modules(model)
    model.train()
    n_moe = len(moe_modules)
    bad = [i for i in cfg.sample_layers if not -n_moe <= i < n_moe]
    if bad:
        raise ValueError(f"sample_layers {bad} out of range: the model has {n_moe} MoE layers "
                         f"(accepted: {-n_moe}..{n_moe - 1})")
    sampled = sorted({i % n_moe for i in cfg.sample_layers})

    opt = torch.optim.AdamW(_param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                            eps=cfg.eps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg))
    stream = BatchStream(len(train_set), cfg.seed)
    step = 0
    timings = {"train_s": 0.0, "eval_s": 0.0, "moe_fwd_s": 0.0, "moe_bwd_s": 0.0, "checkpoint_s": 0.0}
    resumed_from = []

    if ckpt_path.exists():
        ck = runner.load_checkpoint(ckpt_path)
        diff = config_differences(ck["config"], cfg.to_dict())
        if diff:
            raise ValueError(f"{ckpt_path} was written by a different config ({'; '.join(diff)}); "
                             "use a fresh output directory")
        was, now = ck.get("data_fingerprint"), data_stats.get("source_fingerprint")
        if was and now and was != now:  # e.g. $LRMOE_ALPACA pointing elsewhere, or a file edited in place
            raise ValueError(f"{ckpt_path} was trained on other data (content fingerprint {was[:12]}, now "
                             f"{now[:12]} from {data_stats.get('config', {}).get('source')!r}); resume with the "
                             "same data or use a fresh output directory")
        runner.load_state(ckpt_path, ck, model, opt, lambda state: _set_rng_state(state, policy, device))
        sched.load_state_dict(ck["scheduler"])
        stream.position = ck["data_position"]
        step = ck["step"]
        timings.update(ck.get("timings", {}))
        resumed_from = ck.get("resumed_from", []) + [step]
        del ck
        if main:
            _truncate_metrics(metrics_path, step)
    else:
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        if main:
            metrics_path.write_text("")

    base = {"config": cfg.to_dict(), "seed": cfg.seed, "environment": _environment(device),
            "data": {**{k: v for k, v in data_stats.items() if k != "config"},
                     "source": data_stats.get("config", {}).get("source")},  # resolved ($LRMOE_ALPACA too)
            "model": {"preset": cfg.model, "family": built["family"],
                      "parameters": n_parameters, "moe_layers": n_moe, "experts": n_experts,
                      "sampled_layers": sampled, "vocab_size": vocab, "overrides": overrides,
                      "autocast_bf16": use_bf16},
            "metrics_file": metrics_path.name, "resumed_from": resumed_from, **runner.describe()}

    def write_summary(status: str):
        if not main:
            return None
        rows = read_metrics(metrics_path)
        s = dict(base, status=status, steps_done=step, final=_summary_of_metrics(rows, cfg.steps),
                 timings=dict(timings, wall_s_this_process=time.perf_counter() - wall0))
        write_json(summary_path, s)
        return s

    def checkpoint():
        t0 = time.perf_counter()
        runner.save_checkpoint(ckpt_path, {"config": cfg.to_dict(), "step": step, "scheduler": sched.state_dict(),
                                           "data_position": stream.position, "timings": timings,
                                           "resumed_from": resumed_from,
                                           "data_fingerprint": data_stats.get("source_fingerprint")},
                               model, opt, _rng_state(policy, device))
        timings["checkpoint_s"] += time.perf_counter() - t0

    write_summary("running")
    timer = MoETimer(moe_modules, device)
    bar = None
    if progress and main:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, initial=step, desc=out.name, unit="step", dynamic_ncols=True,
                   disable=not progress)
    mf = open(metrics_path, "a") if main else None
    # Ctrl-C (one process, main thread): the step in flight finishes (its metrics row included),
    # then a checkpoint is written at that step boundary, so a resumed run equals an uninterrupted
    # one. A second Ctrl-C stops at once, without a checkpoint (the last one written stands).
    # A process that ignores SIGINT (started in the background, under nohup) keeps ignoring it.
    stop_requested, prev_sigint, at_boundary = [], None, False
    if (not runner.distributed and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN):
        def _on_sigint(signum, frame):
            stop_requested.append(signum)
            signal.signal(signal.SIGINT, prev_sigint)
            msg = "Ctrl-C: finishing this step, then writing a checkpoint (Ctrl-C again to stop at once)"
            if bar is not None:
                bar.write(msg)
            else:
                print(msg, file=sys.stderr, flush=True)

        prev_sigint = signal.signal(signal.SIGINT, _on_sigint)
    try:
        while step < cfg.steps:
            if stop_requested:
                at_boundary = True
                raise KeyboardInterrupt
            if stop_after is not None and step >= stop_after:
                break
            t0 = time.perf_counter()
            micro = [stream.next(cfg.micro_batch) for _ in range(cfg.grad_accum)]
            batches = [{k: train_set.tensors[k][idx] for k in ("input_ids", "labels", "position_ids")}
                       for idx in micro]
            n_label = sum(_label_tokens(b["labels"]) for b in batches)
            n_tokens = sum(int((train_set.tensors["doc_ids"][idx] >= 0).sum()) for idx in micro)
            opt.zero_grad(set_to_none=True)
            timer.enabled = True
            loss_total = 0.0
            kept = [[0, 0] for _ in range(n_moe)]
            layer_stats = {i: None for i in sampled}
            nonfinite = 0
            comm = {}
            for b in runner.local_batches(batches):  # EP: this rank's rows of every micro-batch
                b = {k: v.to(device, non_blocking=True) for k, v in b.items()}
                with autocast():
                    logits = model(input_ids=b["input_ids"], position_ids=b["position_ids"],
                                   use_cache=False).logits  # block-causal mask over packed documents
                loss_sum, _ = _token_loss(logits, b["labels"])
                loss = loss_sum / max(1, n_label)
                runner.backward(loss)
                loss_total += float(loss.detach())
                for li, rec in enumerate(hf.backward_records(model)):
                    if rec is None or not rec.filled:
                        continue
                    kept[li][0] += int(rec.kept.sum())
                    kept[li][1] += int(rec.demand.sum())
                    nonfinite += rec.nonfinite
                    for k, v in (getattr(rec, "comm_bytes", None) or {}).items():  # EP records only
                        comm[k] = comm.get(k, 0) + v
                    if li in layer_stats:
                        cur = {"demand": rec.demand.cpu(), "quota": rec.quota.cpu(), "kept": rec.kept.cpu()}
                        prev = layer_stats[li]
                        layer_stats[li] = cur if prev is None else {k: prev[k] + cur[k] for k in cur}
                del logits, loss, loss_sum
            timer.enabled = False
            # EP: sums over the ranks (the per-rank records hold this rank's pairs only)
            loss_total, kept, layer_stats, nonfinite, extra = runner.reduce_step(loss_total, kept, layer_stats,
                                                                                 nonfinite, comm)
            params = [p for g in opt.param_groups for p in g["params"]]
            grad_norm = runner.clip_(model, params, cfg.clip)  # EP: gradient sync, then the global norm
            lr = opt.param_groups[0]["lr"]
            opt.step()
            sched.step()
            fwd_s, bwd_s = timer.collect()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dt = time.perf_counter() - t0
            dt, fwd_s, bwd_s = runner.max_times(dt, fwd_s, bwd_s)  # EP: the slowest rank
            step += 1
            timings["train_s"] += dt
            timings["moe_fwd_s"] += fwd_s
            timings["moe_bwd_s"] += bwd_s
            fracs = [k / d for k, d in kept if d]
            # A step whose rows hold no response token has no loss: None, not 0 (PPL 1), and the
            # PPL averages leave it out (the optimizer still steps, on a zero gradient).
            row = {"step": step, "epoch": stream.epoch, "loss": loss_total if n_label else None,
                   "ppl": math.exp(min(loss_total, 700.0)) if n_label else None, "lr": lr, "grad_norm": grad_norm,
                   "tokens": n_tokens, "label_tokens": n_label, "tokens_per_s": n_tokens / dt,
                   "step_time_s": dt, "moe_fwd_s": fwd_s, "moe_bwd_s": bwd_s,
                   "kept_fraction": sum(fracs) / len(fracs) if fracs else 1.0, "nonfinite": nonfinite,
                   "layers": {str(i): {k: v.tolist() for k, v in s.items()}
                              for i, s in layer_stats.items() if s is not None}, **extra}
            if (cfg.eval_interval and step % cfg.eval_interval == 0) or step == cfg.steps:
                te = time.perf_counter()
                row.update(evaluate(model, heldout, cfg, device, autocast, runner))
                timings["eval_s"] += time.perf_counter() - te
            row["elapsed_s"] = timings["train_s"] + timings["eval_s"]
            if mf is not None:
                mf.write(json.dumps(row) + "\n")
                mf.flush()
            if bar is not None:
                bar.update(1)
                if step % cfg.log_interval == 0 or step == cfg.steps:
                    post = {"loss": f"{loss_total:.4f}" if n_label else "-", "kept": f"{row['kept_fraction']:.2f}",
                            "tok/s": f"{row['tokens_per_s']:.0f}"}
                    if "eval_loss" in row:
                        post["eval"] = f"{row['eval_loss']:.4f}"
                    bar.set_postfix(post)
            if cfg.checkpoint_interval and step % cfg.checkpoint_interval == 0 and step < cfg.steps:
                checkpoint()
                write_summary("running")
    except KeyboardInterrupt:
        # Only at a step boundary is the state consistent (mid-step, the data stream and the RNGs
        # have advanced but the step is not done); ranks interrupted at different points could not
        # run the checkpoint's collectives anyway.
        if at_boundary and not runner.distributed:
            checkpoint()
            write_summary("running")
        raise
    finally:
        if prev_sigint is not None:
            signal.signal(signal.SIGINT, prev_sigint)
        if mf is not None:
            mf.close()
        timer.remove()
        if bar is not None:
            bar.close()
    checkpoint()
    s = write_summary("done" if step >= cfg.steps else "running")
    runner.barrier()
    if main:
        return s
    # other ranks: rank 0's summary (a folder on a shared file system), else the essentials
    return _read_json(summary_path) or {"status": "done" if step >= cfg.steps else "running", "steps_done": step}


# ----------------------------------------------------------------------------- CLI


def _parse_override(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    k, v = text.split("=", 1)
    try:
        return k, json.loads(v)
    except json.JSONDecodeError:
        return k, v


def _optional(kind):
    def parse(text: str):
        return None if text.lower() in ("none", "null", "") else kind(text)

    parse.__name__ = kind.__name__
    return parse


_KINDS = {"int": int, "float": float, "str": str, "int | None": _optional(int), "str | None": _optional(str),
          "float | None": _optional(float)}


def add_config_arguments(p: argparse.ArgumentParser) -> None:
    """One flag per TrainConfig field (``--micro-batch``, ``--drop-ratio``, ...); unset flags are None."""
    defaults = TrainConfig()
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        help_ = TrainConfig._HELP.get(f.name, "") + f" (default: {getattr(defaults, f.name)})"
        if f.name == "model_overrides":
            p.add_argument("--model-override", dest="model_overrides", action="append", type=_parse_override,
                           metavar="KEY=VALUE", help=TrainConfig._HELP[f.name])
        elif f.name == "ep_options":
            p.add_argument("--ep-option", dest="ep_options", action="append", type=_parse_override,
                           metavar="KEY=VALUE", help=TrainConfig._HELP[f.name])
        elif f.name == "sample_layers":
            p.add_argument(flag, type=int, nargs="+", default=None, help=help_)
        else:
            p.add_argument(flag, type=_KINDS[str(f.type)], default=None, help=help_)


def config_from_args(args, base: dict | None = None) -> TrainConfig:
    """A TrainConfig from dataclass defaults, then ``base``/``--config`` JSON, then the flags given."""
    d = {}
    if base:
        d.update(base)
    if getattr(args, "config", None):
        d.update(json.loads(Path(args.config).read_text()))
    given = {}
    for f in dataclasses.fields(TrainConfig):
        v = getattr(args, f.name, None)
        if v is not None:
            given[f.name] = dict(v) if f.name in ("model_overrides", "ep_options") else v
    # The batch flags given decide; what they leave open is re-derived (a global batch from the
    # config is kept when only --micro-batch is given: accumulation adapts).
    if "grad_accum" in given and "global_batch" not in given:
        d.pop("global_batch", None)
    elif {"micro_batch", "global_batch"} & set(given) and "grad_accum" not in given:
        d.pop("grad_accum", None)
    d.update(given)
    return TrainConfig.from_dict(d)


def register_cli(sub) -> None:
    p = sub.add_parser("train", help="train one run (AdamW, cosine, accumulation, exact resume)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="run directory (metrics.jsonl, summary.json, checkpoint.pt); "
                                                "an existing run there is resumed")
    p.add_argument("--config", default=None, help="JSON file of TrainConfig fields (flags override it)")
    p.add_argument("--stop-after", type=int, default=None, help="stop after this many steps (resumable)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_config_arguments(p)
    p.set_defaults(func=_cli)


def _cli(args) -> int:
    try:
        cfg = config_from_args(args)
        cfg.validate()
        from .ep import check_launch

        check_launch(cfg)
    except (ValueError, OSError) as e:  # OSError: a --config file that cannot be read
        print(f"lrmoe train: {e}", file=sys.stderr)
        return 2
    main = int(os.environ.get("RANK", "0")) == 0  # under torchrun, rank 0 reports
    if main:
        print(json.dumps(cfg.to_dict()), file=sys.stderr)
    try:
        s = train(cfg, args.out, progress=not args.no_progress, stop_after=args.stop_after)
    except (ValueError, OSError) as e:  # bad data, tokenizer or output folder: say what, no traceback
        print(f"lrmoe train: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the loop wrote a checkpoint at a step boundary before re-raising
        print(f"lrmoe train: interrupted; rerun the same command to resume from {args.out}", file=sys.stderr)
        return 130
    if not main:
        return 0
    fin = s.get("final", {})
    print(f"{args.out}: status {s['status']}, step {s.get('steps_done')}, loss {fin.get('loss')}, "
          f"ppl {fin.get('ppl')}, eval_ppl {fin.get('eval_ppl')}")
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m lrmoe.train")
    register_cli(ap.add_subparsers(dest="command", required=True))
    a = ap.parse_args(["train", *sys.argv[1:]])
    sys.exit(a.func(a))
