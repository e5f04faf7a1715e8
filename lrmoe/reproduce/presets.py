"""The presets of `lrmoe reproduce` as data: models, data, steps, hardware assumptions, cost.

A preset selects the models of both families, the training settings every run shares (``base``),
the data file and the experiment axes; :meth:`Preset.runs` turns it into its list of runs
(:mod:`lrmoe.reproduce.experiments`). docs/reproduce.md states each preset's cost."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from lrmoe.runs import RunSpec

from .experiments import DROPS_E1, FAMILIES, SCORERS_E2, preset_runs


@dataclass
class Preset:
    name: str
    description: str
    models: dict  # family -> model preset name
    base: dict  # TrainConfig fields shared by every run
    data_file: str | None  # file under the shared data folder (None: $LRMOE_ALPACA or the hub)
    model_overrides: dict = field(default_factory=dict)  # family -> transformers config overrides
    family_config: dict = field(default_factory=dict)  # family -> TrainConfig field overrides
    e1_drops: tuple = DROPS_E1
    e1_seeds: tuple = (0,)
    e2_drop: float = 0.2
    e2_scorers: tuple = SCORERS_E2
    e2_seeds: tuple = (0, 1, 2)
    families: tuple = FAMILIES
    jobs: int = 1  # runs in parallel (CPU presets: one thread each)
    cost: str = ""  # expected cost, stated in docs/reproduce.md
    launcher: str = "local"  # "local" (runs in this process / a process pool) or "torchrun" (one launch per run)
    nproc: int = 1  # torchrun: processes per run (one node; one GPU each)
    hardware: str = ""
    e3: dict = field(default_factory=dict)  # E3 (time to target) settings; {}: no E3 runs (experiments.e3_runs)
    # the gradient-fidelity probe after the runs (lrmoe.reproduce.probe): {"run": a run's name, "args": extra
    # `lrmoe ablate probe` arguments, "cost": what it takes}; {}: none
    probe: dict = field(default_factory=dict)

    # what the driver calls it (class attributes, not fields: the manifest holds the fields only)
    prog = "lrmoe reproduce"
    kind = "preset"
    elsewhere = "use --preset cpu (or smoke) here"

    def runs(self) -> list[RunSpec]:
        """Every run of the preset, E1, E2 and E3 (:func:`lrmoe.reproduce.experiments.preset_runs`)."""
        return preset_runs(self)

    def command(self) -> str:
        """The command that runs the preset (said where a machine lacks its hardware)."""
        return f"lrmoe reproduce --preset {self.name}"

    def run_line(self, r: RunSpec) -> str:
        """What the dry run lists of a run, after its name, experiments and state."""
        c = r.config
        ep = (f" placement={c['placement']} virtual_ep={c['virtual_ep']}" if c.get("virtual_ep", 1) > 1 else
              f" placement={c['placement']} ep={c['ep']}" if c.get("ep", 1) > 1 else "")
        ep += "".join(f" {k}={v}" for k, v in (c.get("ep_options") or {}).items())
        ep += " +trace" if r.record_trace else ""
        over = "".join(f" {k}={v}" for k, v in (c.get("model_overrides") or {}).items())
        return (f"model={c['model']}{over} drop={c['drop_ratio']} scorer={c['scorer']} seed={c['seed']} "
                f"steps={c['steps']}{ep}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_SMOKE_BASE = dict(tokenizer="bpe:384", max_records=None, heldout_fraction=0.1, seq_len=64, micro_batch=4,
                   steps=30, lr=3e-3, warmup_steps=3, min_lr_ratio=0.1, weight_decay=0.01, clip=1.0,
                   eval_interval=12, eval_batches=2, log_interval=6, checkpoint_interval=12, threads=1,
                   device="cpu", sample_layers=[0, -1])
# cpu: a small Alpaca sample trained for many epochs, so the models approach memorisation as in
# the paper's regime (PPL ~1.015 after ~200 epochs). Sized to run the whole preset within
# 30 minutes on 2 cores (two runs in parallel, one thread each); see docs/reproduce.md.
_CPU_BASE = dict(tokenizer="bpe:1024", max_records=16, heldout_fraction=0.125, seq_len=256, micro_batch=8,
                 steps=200, lr=3e-3, warmup_steps=15, min_lr_ratio=0.1, weight_decay=0.01, clip=1.0,
                 eval_interval=50, eval_batches=None, log_interval=25, checkpoint_interval=100, threads=1,
                 device="cpu", sample_layers=[0, -1])
_GPU_BASE = dict(tokenizer="bpe:32768", max_records=None, heldout_fraction=0.01, seq_len=8192, micro_batch=1,
                 grad_accum=4, steps=1000, lr=1e-3, warmup_steps=50, min_lr_ratio=0.1, weight_decay=0.01,
                 clip=1.0, eval_interval=250, eval_batches=8, log_interval=10, checkpoint_interval=100,
                 device="cuda", dtype="auto", sample_layers=[0, -1])

PRESETS: dict[str, Preset] = {
    "smoke": Preset(
        "smoke", "CI end-to-end check: tiny Qwen3-MoE / GLM-4.5-style models, 100 Alpaca records, 30 steps",
        {"qwen3": "qwen3-moe-tiny", "glm4": "glm4-moe-tiny"}, _SMOKE_BASE, "alpaca/alpaca_tiny.json",
        e2_seeds=(0, 1), jobs=2, hardware="2 CPU cores",
        probe=dict(run="qwen3-C00-s0", args=["--drops", "0,0.5", "--scorers", "lrm,random", "--draws", "2",
                                             "--batches", "1", "--rows", "2"], cost="seconds"),
        cost="measured: 29 s on an idle 2-core Intel Xeon (24 runs 9 s, simulation 7 s, probe 9 s), 50 s at load 4"),
    "cpu": Preset(
        "cpu", "CPU-scale reproduction: qwen3-moe-small / glm4-moe-small (16 experts, top-4) near memorisation "
               "of a 16-record Alpaca sample (alpaca_en_demo; 14 train / 2 held out), E1 + E2 with 3 seeds; "
               "E3: the same "
               "families with 128 experts and top-8 on 8 virtual EP ranks, 6 methods (SYMI at 3 capacity settings) "
               "x 3 seeds",
        {"qwen3": "qwen3-moe-small", "glm4": "glm4-moe-small"}, _CPU_BASE, "alpaca/alpaca_en_demo.json",
        e2_seeds=(0, 1, 2), jobs=2, hardware="2 CPU cores",
        # E3: the same small models with the paper's 128 experts and top-8 routing (so that their traces
        # replay at the paper's dimensions), moe_intermediate 32 (top-8 x 32 = the E1 models' top-4 x 64
        # active expert width), 8 virtual EP ranks as the paper's EP8 (1 row of 256 tokens per rank)
        # (no per-expert logging: 128 experts would triple the metrics files; the routing trace has the demand)
        e3=dict(seeds=(0, 1, 2), config=dict(virtual_ep=8, steps=100, warmup_steps=10, eval_interval=50,
                                        checkpoint_interval=50, sample_layers=[]),
                model_overrides={"qwen3": {"num_local_experts": 128, "num_experts_per_tok": 8,
                                           "moe_intermediate_size": 32},
                                 "glm4": {"n_routed_experts": 128, "num_experts_per_tok": 8,
                                          "moe_intermediate_size": 32}}),
        # the probe's defaults on the preset's own Qwen3 C0 model (docs/ablations.md: cost)
        probe=dict(run="qwen3-C00-s0", cost="measured: 143 s on 2 AMD EPYC cores, retraining the "
                                                "committed run for its checkpoint included"),
        cost="measured: see docs/reproduce.md (target <= 45 minutes on 2 CPU cores, 70 runs)"),
    "gpu1": Preset(
        "gpu1", "one Hopper GPU: the paper's Qwen3-30B-A3B and GLM-4.5-Air layer dimensions (128 experts, top-8) "
                "with fewer layers, bf16 autocast, full Alpaca, seq 8192",
        {"qwen3": "qwen3-30b-a3b", "glm4": "glm-4.5-air"}, _GPU_BASE, None,
        model_overrides={"qwen3": {"num_hidden_layers": 4}, "glm4": {"num_hidden_layers": 3}},
        e2_seeds=(0, 1, 2), jobs=1, hardware="1x NVIDIA Hopper GPU: Qwen3 runs estimated 55-56 GiB (an 80 GiB H100 fits), GLM runs 105 GiB "
                 "(an H200, 141 GB; the pre-launch check refuses them on 80 GiB)",
        cost="estimated (not measured): ~1-2 s per step, 34 runs x 1,000 steps = 10-20 GPU-hours"),
    "paper": Preset(
        "paper", "the paper's setting: Qwen3-30B-A3B and GLM-4.5-Air (full depth), EP8 on 8 Hopper GPUs "
                 "(torchrun, LRMoE placement), seq 8192, micro-batch 4 per GPU, 10,000 steps",
        {"qwen3": "qwen3-30b-a3b", "glm4": "glm-4.5-air"},
        # micro_batch counts the rows of one forward over all ranks: 32 = 4 per GPU x 8 GPUs
        # fsdp, activation checkpointing and the experts' fp32 state on the host: what the memory estimate needs
        # on 8 x 80 GiB (docs/memory.md; each launch is checked against it first, lrmoe.reproduce.memory_check)
        dict(_GPU_BASE, micro_batch=32, grad_accum=1, steps=10_000, warmup_steps=100, lr=1e-5,
             eval_interval=1000, checkpoint_interval=500, ep=8, placement="lrmoe", fsdp=True,
             activation_checkpointing=True, offload="experts"), None,
        # fine-tuning of the released checkpoints with their own tokenizers (the paper does not say
        # whether it starts from them; a PPL of 1.015 on Alpaca suggests so)
        family_config={"qwen3": {"init_from": "Qwen/Qwen3-30B-A3B", "tokenizer": "Qwen/Qwen3-30B-A3B"},
                       "glm4": {"init_from": "zai-org/GLM-4.5-Air", "tokenizer": "zai-org/GLM-4.5-Air"}},
        e2_seeds=(0, 1, 2), jobs=1, launcher="torchrun", nproc=8,
        hardware="8x NVIDIA Hopper (80 GiB), EP8; host memory available: 480 GiB (Qwen3) and 1.5 TiB "
                 "(GLM-4.5-Air) for the offloaded expert state and the 8 processes (estimated, docs/memory.md)",
        # E3: every method at EP8 with its own placement (the base's lrmoe replaced), each recording its
        # routing trace; T3/F4 then read their logged MoE-layer times ("measured, 8 x GPU") beside the
        # simulated replay. One seed: each run costs as much as an E1 run. LRMoE at C20 is E1's C20 run
        # (the same config), so E3 adds 6 runs (experiments.preset_runs).
        e3=dict(seeds=(0,), record_trace=True),
        cost="estimated (not measured): the paper's 10,000-step runs; 34 E1/E2 runs + 10 E3 runs (fixed, SYMI at 3 capacity settings, "
             "UltraEP x 2 models, one seed; LRMoE is E1's C20 run) at roughly 1-2 days each on 8 GPUs"),
}


def resolve_data(preset: Preset, data: str | None) -> tuple[str | None, str | None]:
    """(data source, None) or (None, reason to skip)."""
    if data:
        return data, None
    if os.environ.get("LRMOE_ALPACA"):
        return os.environ["LRMOE_ALPACA"], None
    if preset.data_file is None:
        return None, None  # the loader falls back to the hub id tatsu-lab/alpaca
    from lrmoe.data import shared_data_dir

    path = shared_data_dir() / preset.data_file
    if not path.exists():
        return None, (f"preset {preset.name!r} needs {preset.data_file} from the shared data folder, not found at "
                      f"{path}; set LRMOE_SHARED_DATA to that folder, or give --data PATH (or LRMOE_ALPACA) "
                      f"with Alpaca records")
    return str(path), None
