"""What defines a training run: :class:`TrainConfig`, its validation, and how two run configs differ.

Values are checked when a config is constructed (types, ranges, the combinations that cannot
work); :meth:`TrainConfig.validate` adds the checks that depend on the machine and the installed
packages (the model preset's config fields, the device, the registered placement policies and
scorers). Errors say what was wrong and what is accepted."""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field

import torch

DTYPES = ("auto", "fp32", "bf16")
# Fields that may differ between two configs of the same run. (``threads`` may differ between two
# finished runs; a resume with another effective CPU thread count is refused by the checkpoint's
# own check, lrmoe.train.checkpoint.check_resume, because its losses would differ.)
RUNTIME_FIELDS = ("threads", "log_interval", "checkpoint_interval", "eval_interval", "load_concurrency", "record_trace")

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
    warmup_steps: int | None = None  # None: default_warmup(steps), set at construction
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
    phi: str = "h"
    selection: str = "top"
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
    record_trace: str | None = None
    virtual_ep: int = 1
    # scale (torchrun; lrmoe.hf.fsdp)
    fsdp: bool = False
    offload: str = "none"
    activation_checkpointing: bool = False

    FIELD_HELP = {
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
        "warmup_steps": "linear warm-up steps (from lr/warmup to lr; default: steps // 10, at most 10, so 10 "
                        "from 100 steps on and none below 10 steps)",
        "min_lr_ratio": "cosine decay ends at min_lr_ratio * lr",
        "weight_decay": "AdamW weight decay (not applied to norms, biases and the router correction bias)",
        "clip": "global gradient-norm clip (0: off)",
        "drop_ratio": "fraction of routed pairs dropped from the expert backward (C20 = 0.2)",
        "scorer": "pair scorer: lrm, lrm_input, grad_norm, abs_grad, random",
        "quota": "quota policy: waterfill, proportional",
        "mode": "backward mode: compact (LRMoE), mask (zero-masked), full (no selection)",
        "policy_seed": "seed of the random scorer's and the sampled selection's generator (default: seed)",
        "phi": "activation norm of the lrm score: h (down-projection input, the paper's), x (expert input), "
               "both (sum of both terms)",
        "selection": "how each expert's quota is filled: top (highest scores, the paper's rule) or sample "
                     "(unbiased: drawn with probability ~ sqrt(score), kept rows scaled by 1/probability)",
        "seed": "seed of model initialisation and of the batch order",
        "device": "auto, cpu, cuda, cuda:N",
        "dtype": "auto (bf16 autocast on GPU, fp32 on CPU), fp32, bf16 (autocast)",
        "threads": "torch CPU threads per process (default: 1 per rank on the CPU; on GPUs with offload, the "
                   "node's cores shared by its ranks, for AdamW's host step; else torch's choice)",
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
        "virtual_ep": "train in this one process exactly as `torchrun --nproc-per-node G ... --ep G` would: every "
                      "micro-batch split into G source ranks, the placement planner, forward drops and "
                      "per-(source, instance) backward quotas of the EP runtime (lrmoe.train.virtual_ep; 1: off)",
        "record_trace": "with ep > 1 or virtual_ep > 1: write the routing trace to PATH (lrmoe.sim.trace format, "
                        "docs/simulator.md): per micro-batch and MoE layer, the [ranks, experts] pair counts the "
                        "runtime all-gathers; written at every checkpoint and at the end, extended on resume (default: "
                        "none; a virtual-EP run writes routing_trace.npz in its run folder)",
        "fsdp": "shard the dense parameters (and the expert-data-parallel replicas of the experts) over the ranks "
                "with FSDP2, with mixed precision per dtype (bf16: bf16 compute parameters, fp32 master weights, "
                "gradient reduction and AdamW state); also a single process (a one-rank group) (lrmoe.hf.fsdp)",
        "offload": "with fsdp: keep the fp32 master weights, gradients and AdamW state of none, experts or all "
                   "parameters on the host (FSDP2 CPUOffloadPolicy; the optimizer steps them on the CPU)",
        "activation_checkpointing": "keep only each decoder layer's input in the forward and recompute the layer in "
                                    "the backward (torch.utils.checkpoint, non-reentrant; the recompute reuses the "
                                    "layer's plan and selects the same pairs) (lrmoe.hf.checkpointing)",
        "load_concurrency": "with ep > 1 and a randomly initialised model: how many ranks of a node build the "
                            "full model at the same time before sharding its experts (each holds a full fp32 "
                            "copy meanwhile, about 4 bytes x parameters; 0: all at once). A checkpoint "
                            "(init_from) is read rank-locally by all ranks at once, each only what it keeps",
    }

    def __post_init__(self):
        if self.warmup_steps is None and isinstance(self.steps, int) and not isinstance(self.steps, bool):
            self.warmup_steps = default_warmup(self.steps)
        self.model_overrides = dict(self.model_overrides or {})
        self.ep_options = dict(self.ep_options or {})
        self.sample_layers = list(self.sample_layers)
        self._check_values()

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

    def _check_values(self) -> None:
        """The checks that need nothing but the values (run at construction and by validate)."""
        self._resolve_batch()

        def integer(name, minimum=1):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
                raise ValueError(f"{name} must be an integer >= {minimum}, got {v!r}")

        def optional_int(name):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be an integer >= 1 or None, got {v!r}")

        def number(name, lo, hi=math.inf, lo_open=False, hi_open=False, what=""):
            v = getattr(self, name)
            ok = (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                  and (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi))
            if not ok:
                rng = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open or hi == math.inf else ']'}"
                raise ValueError(f"{name} must be a finite number in {rng}{what}, got {v!r}")

        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a model preset name, got {self.model!r}")
        integer("seq_len", 2)
        if not isinstance(self.tokenizer, str) or not self.tokenizer:
            raise ValueError(f"tokenizer must be a non-empty string, got {self.tokenizer!r}")
        if self.tokenizer.startswith("bpe:") and not re.fullmatch(r"bpe:[1-9]\d*", self.tokenizer):
            raise ValueError(f"tokenizer {self.tokenizer!r}: a trained BPE is written 'bpe:N' with N a positive "
                             "integer (e.g. bpe:1024); also accepted: 'VOCAB.json,MERGES.txt' or a HF tokenizer dir")
        integer("steps")
        for name in ("warmup_steps", "eval_interval", "checkpoint_interval", "seed", "data_seed"):
            integer(name, 0)
        integer("log_interval")
        if self.warmup_steps > self.steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) must be <= steps ({self.steps})")
        if not (isinstance(self.lr, (int, float)) and not isinstance(self.lr, bool) and self.lr > 0
                and math.isfinite(self.lr)):
            raise ValueError(f"lr must be a finite number > 0, got {self.lr!r}")
        number("min_lr_ratio", 0, 1)
        number("weight_decay", 0)
        number("clip", 0, what=" (0 turns clipping off)")
        number("eps", 0, lo_open=True)
        for b in ("beta1", "beta2"):
            number(b, 0, 1, hi_open=True)
        number("heldout_fraction", 0, 1, hi_open=True)
        for name in ("max_records", "eval_batches", "threads"):
            optional_int(name)
        if self.policy_seed is not None:
            integer("policy_seed", 0)
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; accepted: {list(DTYPES)}")
        if not isinstance(self.device, str) or not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"unknown device {self.device!r}; accepted: auto, cpu, cuda, cuda:N")
        if not isinstance(self.sample_layers, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in self.sample_layers):
            raise ValueError(f"sample_layers must be a list of integers, got {self.sample_layers!r}")
        if not isinstance(self.model_overrides, dict):
            raise ValueError(f"model_overrides must be a dict, got {self.model_overrides!r}")
        if self.model_overrides.get("output_router_logits"):
            raise ValueError("model_overrides output_router_logits=True: lrmoe train does not add the router's "
                             "auxiliary loss (the runs train without it, docs/reproduce.md), so it would be ignored")
        std = self.model_overrides.get("initializer_range")
        if std is not None and not (isinstance(std, (int, float)) and not isinstance(std, bool)
                                    and math.isfinite(std) and std >= 0):
            raise ValueError(f"model_overrides initializer_range (the std of the initial weights) must be a "
                             f"finite number >= 0, got {std!r}")
        if self.mode == "full" and isinstance(self.drop_ratio, (int, float)) and self.drop_ratio > 0:
            raise ValueError(f"mode 'full' keeps every pair, so drop_ratio {self.drop_ratio} would not apply; "
                             "use mode 'compact' (or 'mask') to drop pairs, or drop_ratio 0")
        self._check_ep_values()

    def _check_ep_values(self) -> None:
        if isinstance(self.ep, bool) or not isinstance(self.ep, int) or self.ep < 1:
            raise ValueError(f"ep must be an integer >= 1, got {self.ep!r}")
        if not isinstance(self.placement, str):
            raise ValueError(f"placement must be a placement policy name, got {self.placement!r}")
        if self.ep_budget_mib is not None and not (isinstance(self.ep_budget_mib, (int, float))
                                                   and not isinstance(self.ep_budget_mib, bool)
                                                   and self.ep_budget_mib > 0):
            raise ValueError(f"ep_budget_mib must be a number > 0 or None (unlimited), got {self.ep_budget_mib!r}")
        if not isinstance(self.ep_options, dict):
            raise ValueError(f"ep_options must be a dict, got {self.ep_options!r}")
        if isinstance(self.load_concurrency, bool) or not isinstance(self.load_concurrency, int) \
                or self.load_concurrency < 0:
            raise ValueError(f"load_concurrency must be an int >= 0 (0: all ranks at once), "
                             f"got {self.load_concurrency!r}")
        if self.record_trace is not None and (not isinstance(self.record_trace, str) or not self.record_trace):
            raise ValueError(f"record_trace must be a file path or None, got {self.record_trace!r}")
        if isinstance(self.virtual_ep, bool) or not isinstance(self.virtual_ep, int) or self.virtual_ep < 1:
            raise ValueError(f"virtual_ep must be an integer >= 1 (1: off), got {self.virtual_ep!r}")
        if not isinstance(self.fsdp, bool):
            raise ValueError(f"fsdp must be true or false, got {self.fsdp!r}")
        if self.offload not in ("none", "experts", "all"):
            raise ValueError(f"offload must be one of none, experts, all, got {self.offload!r}")
        if self.offload != "none" and not self.fsdp:
            raise ValueError(f"offload={self.offload!r} needs fsdp (FSDP2 keeps the offloaded state on the host): "
                             f"add --fsdp, or leave offload at 'none'")
        if not isinstance(self.activation_checkpointing, bool):
            raise ValueError(f"activation_checkpointing must be true or false, got {self.activation_checkpointing!r}")
        if self.activation_checkpointing and self.virtual_ep > 1:
            raise ValueError(f"activation_checkpointing is not supported with virtual_ep ({self.virtual_ep}), a "
                             f"one-process simulation of EP on the CPU: leave one of them off")
        if self.fsdp and self.virtual_ep > 1:
            raise ValueError(f"fsdp shards over real ranks; virtual_ep ({self.virtual_ep}) trains one process: "
                             f"use --ep {self.virtual_ep} under torchrun with --fsdp, or leave fsdp off")
        if self.virtual_ep > 1 and self.ep > 1:
            raise ValueError(f"virtual_ep ({self.virtual_ep}) and ep ({self.ep}) exclude each other: virtual_ep "
                             f"trains one process as G ranks, ep shards over torchrun's processes; set one")
        if self.virtual_ep > 1 and self.micro_batch % self.virtual_ep:
            raise ValueError(f"micro_batch ({self.micro_batch}) must be divisible by virtual_ep ({self.virtual_ep}): "
                             f"every micro-batch is split evenly over the virtual ranks, as over real ones")
        if self.ep == 1 and self.virtual_ep == 1:
            ignored = [f for f, v, d in (("placement", self.placement, "lrmoe"), ("ep_budget_mib", self.ep_budget_mib, None),
                                         ("ep_options", self.ep_options, {}), ("record_trace", self.record_trace, None))
                       if v != d]
            if ignored:
                raise ValueError(f"{', '.join(ignored)} {'applies' if len(ignored) == 1 else 'apply'} only to expert "
                                 "parallelism (ep > 1 or virtual_ep > 1) and would be ignored with ep 1: set --ep N "
                                 "(or --virtual-ep N) or leave "
                                 f"{'it' if len(ignored) == 1 else 'them'} at the default")
        if self.micro_batch % self.ep:
            raise ValueError(f"micro_batch ({self.micro_batch}) must be divisible by ep ({self.ep}): every "
                             f"micro-batch is split evenly over the ranks")

    def validate(self) -> "TrainConfig":
        """Every check: the values again (fields may have been changed since construction), then what
        depends on this machine and the registries; raises ValueError saying what was wrong and what
        is accepted."""
        from ..hf import MODEL_PRESETS, model_config
        from ..planning.policies import placement_policies

        if self.model not in MODEL_PRESETS:
            raise ValueError(f"unknown model preset {self.model!r}; accepted: {sorted(MODEL_PRESETS)}")
        self._check_values()
        if self.device != "auto":
            dev = torch.device(self.device)
            if dev.type == "cuda" and not torch.cuda.is_available():
                raise ValueError(f"device {self.device!r} requested but CUDA is not available")
        if self.model_overrides and self.init_from is None:
            known = model_config(self.model).to_dict()
            known.update(known.get("rope_parameters") or {})  # rope_theta etc. live there in transformers 5
            unknown = sorted(k for k in self.model_overrides if k not in known)
            if unknown:  # transformers would store a misspelt field as an unused attribute
                raise ValueError(f"model_overrides {unknown} are not fields of the {self.model!r} config; "
                                 f"accepted: {sorted(known)}")
        if self.placement not in placement_policies():
            raise ValueError(f"unknown placement {self.placement!r}; accepted: {sorted(placement_policies())}")
        self.policy()  # validates scorer, quota, mode, policy seed against their registries
        return self

    def policy(self):
        from ..policy import BackwardPolicy

        seed = self.seed if self.policy_seed is None else self.policy_seed
        return BackwardPolicy(drop_ratio=self.drop_ratio, scorer=self.scorer, quota=self.quota, mode=self.mode,
                              seed=seed, phi=self.phi, selection=self.selection)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown TrainConfig fields {unknown}; accepted: {sorted(names)}")
        return cls(**d)



def default_warmup(steps: int) -> int:
    """The warm-up of a run that does not set one: a tenth of its steps, at most 10 (the default
    before it depended on ``steps``), so it works for any step count."""
    return max(0, min(10, steps // 10))


def _comparable(d: dict) -> dict:
    """Config fields that define a run (runtime-only fields dropped; fields an older version of the
    kit did not write take their defaults)."""
    try:
        d = TrainConfig.from_dict(d).to_dict()
    except (TypeError, ValueError):
        pass
    return {k: v for k, v in d.items() if k not in RUNTIME_FIELDS}


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


def resolve_device(spec: str) -> torch.device:
    """The torch device of a ``device`` field ("auto": CUDA when available, else the CPU)."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(spec)
