"""The distributed pieces of `lrmoe train`: expert parallelism (and data parallelism) under torchrun.

    torchrun --nproc-per-node 2 -m lrmoe.cli train --out runs/x --ep 2 --placement lrmoe ...

:func:`lrmoe.train.train` runs one step the same way in one process and under torchrun; what
differs is delegated to a *runner*: :class:`lrmoe.train.LocalRunner` (one process, the original
path) or :class:`DistributedRunner` (this module), chosen by :func:`wanted`.

Semantics (docs/expert_parallel.md, "Training with torchrun"):

* Every rank builds the same model (same seed, or the same ``init_from``), on the CPU; with
  ``ep > 1`` the routed experts are sharded over each EP group by
  :func:`lrmoe.hf.parallel.parallelize_experts` before the model moves to the rank's device and
  before the optimizer exists. Dense parameters are broadcast from rank 0 (a no-op safeguard).
* The data stream is the single-process one (every rank draws the same global indices). Every
  micro-batch of ``micro_batch`` rows is split evenly over the W ranks (contiguous blocks of
  ``micro_batch / W`` rows; ValueError when W does not divide it), so a step sees the same
  ``global_batch`` rows as one process. The loss of rank r is ``loss_sum_r / n_label * W`` with
  ``n_label`` the label tokens of the whole step (known to every rank from the indices), so that
  after :func:`lrmoe.hf.parallel.finish_grad_sync` (dense gradients averaged over the ranks,
  expert gradients summed over the EP group by the runtime and divided by W) every gradient is
  that of the single-process loss on the global batch.
* The ``random`` scorer's seed is offset per rank (:func:`rank_seed`), so ranks draw
  independent streams (rank 0 keeps the configured seed).
* Per-step statistics are sums over all ranks (loss, demand/quota/kept per expert, kept pairs,
  non-finite scores, the runtime's ``comm_bytes``); times are the maximum over ranks (also
  ``moe_plan_s``, the step's planning seconds over all MoE layers and micro-batches, EP rows only). Rank 0
  alone writes ``metrics.jsonl`` and ``summary.json``. Evaluation runs on every rank, each on its
  share of every held-out micro-batch.
* Checkpoints: ``checkpoint.step{N}.dcp/`` holds the weights and optimizer state, written by every
  rank with ``torch.distributed.checkpoint`` (its FSDP shards and its EP block of experts; nothing
  is gathered); ``checkpoint.step{N}.rank{r}.pt`` (every rank) that rank's RNG states and the
  placement planners' state; ``checkpoint.pt`` (rank 0) the scheduler, the data position, the
  config and the world layout. The folder and rank files are written first, then the main file,
  which names them (the commit point); only then are the files of other steps deleted, so a run
  killed at any moment, however often, resumes from a consistent set (:mod:`lrmoe.train.checkpoint`).
  ``lrmoe export-hf`` writes the full weights as a Hugging Face model folder.
"""
from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import torch
import torch.distributed as dist

from ..hf import fsdp
from ..hf import parallel as ep_hf
from ..parallel.launch import host_barrier, rank_seed  # rank_seed: re-exported (lrmoe.train.ep.rank_seed)
from ..parallel.runtime import ExpertParallel
from . import checkpoint, parallelize
from .parallelize import budget_bytes  # noqa: F401 - re-exported (lrmoe.train.ep.budget_bytes)
from .config import resolve_device
from .runner import load_data

# Keys of BackwardRecord.comm_bytes (lrmoe.parallel.runtime), in the order they are logged.
COMM_KEYS = ("fwd_weights", "fwd_dispatch", "fwd_combine", "fwd_phi", "bwd_grad_rows", "bwd_grad_index", "bwd_dx",
             "bwd_weight_grads")


def host_threads(cpus: int | None, ranks_per_node: int) -> int:
    """CPU threads per rank when the ranks of a node share its ``cpus`` cores (at least 1)."""
    return max(1, (cpus or 1) // max(1, ranks_per_node))


def world_size_from_env() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def wanted(cfg) -> bool:
    """True when ``cfg`` asks for expert parallelism or FSDP, or the process runs under torchrun (W > 1)."""
    return cfg.ep > 1 or cfg.fsdp or world_size_from_env() > 1


def torchrun_hint(ep: int) -> str:
    return f"torchrun --nproc-per-node {ep} -m lrmoe.cli train ... --ep {ep}"


def check_launch(cfg, world: int | None = None) -> None:
    """ValueError unless the world size fits ``cfg`` (ep divides it, it divides micro_batch)."""
    world = world_size_from_env() if world is None else world
    if getattr(cfg, "virtual_ep", 1) > 1 and world > 1:
        raise ValueError(f"virtual_ep={cfg.virtual_ep} trains in one process, but this is one of {world} (torchrun); "
                         f"launch it without torchrun, or use --ep {cfg.virtual_ep} for real ranks")
    if cfg.ep > 1 and world == 1:
        raise ValueError(f"ep={cfg.ep} needs {cfg.ep} processes (or a multiple): launch with `{torchrun_hint(cfg.ep)}`")
    if world % cfg.ep:
        raise ValueError(f"ep ({cfg.ep}) must divide the number of processes ({world}): the ranks form "
                         f"{world}/{cfg.ep} expert-parallel groups")
    if cfg.micro_batch % world:
        raise ValueError(f"micro_batch ({cfg.micro_batch}) must be divisible by the number of processes ({world}): "
                         f"every micro-batch (global_batch = micro_batch x grad_accum = {cfg.global_batch} rows per "
                         f"step) is split evenly over the ranks; use e.g. --micro-batch "
                         f"{world * max(1, cfg.micro_batch // world)} ({max(1, cfg.micro_batch // world)} per rank)")


class DistributedRunner:
    """Everything of a training step that involves other ranks (see the module docstring)."""

    distributed = True

    def __init__(self, cfg):
        from ..parallel.launch import init_distributed

        check_launch(cfg)
        self.cfg = cfg
        self.owns_group = not dist.is_initialized()
        wanted_device = resolve_device(cfg.device)
        backend = "nccl" if wanted_device.type == "cuda" else "gloo"
        self.env = init_distributed(ep=cfg.ep, backend=backend)
        self.device = self.env.device
        if self.device.type == "cpu":
            torch.set_num_threads(cfg.threads or 1)  # ranks share the cores: one thread each by default
        elif cfg.threads or cfg.offload != "none":
            # offloaded state is stepped by AdamW on the host: the node's cores shared by its ranks
            # (torchrun sets OMP_NUM_THREADS=1, which would step it on one core per rank)
            torch.set_num_threads(cfg.threads or host_threads(len(os.sched_getaffinity(0)),
                                                              int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
        self.rank, self.world = self.env.rank, self.env.world_size
        self.is_main = self.env.is_main
        self.eps: list[ExpertParallel] = []
        self.num_experts = 0
        self._plan_s0 = 0.0  # sum of the layers' plan_seconds_total when the step began
        self._layout_s0 = 0.0  # likewise layout_seconds_total

    def policy_for_rank(self, policy):
        """The backward policy of this rank: the random scorer's seed offset by the rank (see
        :func:`rank_seed`), so ranks draw independent streams instead of the same sequence."""
        if policy.seed is None or self.world == 1:
            return policy
        return dataclasses.replace(policy, seed=rank_seed(policy.seed, self.rank))

    # ------------------------------------------------------------------ data and model
    def load_data(self, cfg, progress: bool = True):
        """The prepared data; one rank per node tokenises/packs it (and trains the BPE) first."""
        first = self.env.local_rank == 0
        if first:
            out = load_data(cfg, progress)
        host_barrier()  # tokenising may outlast the collective timeout
        return out if first else load_data(cfg, False)

    def build_model(self, make, policy):
        """``make()`` the full model, shard its experts over the EP group (ep > 1), move it to the
        device and equalise the dense weights, then activation checkpointing and FSDP2
        (:func:`lrmoe.train.parallelize.apply_scale`). A checkpoint (``init_from``: ``make`` returns a
        meta model) is read rank-locally, each rank only what it keeps, by every rank at once
        (:mod:`lrmoe.hf.loading`); with FSDP the meta model is sharded first (torchtitan's order), so
        a rank reads and stores only its shard of every dense tensor, never the full fp32 model. A
        randomly initialised model is built in full by the ranks of a node in turns of
        ``cfg.load_concurrency`` (each holds a full copy only until it has sharded it)."""
        from .. import hf
        from ..hf import loading
        from ..parallel.launch import in_turns

        def build(model):
            mods = hf.experts_modules(model)
            self.num_experts = int(mods[0].gate_up_proj.shape[0]) if mods else 0
            self.eps = parallelize.shard_experts(model, self.env, self.cfg, policy)
            if loading.is_meta(model):
                if self.cfg.fsdp:  # every rank reads the same files: no broadcast needed
                    parallelize.apply_scale(model, self.env, self.cfg, self.device)
                    loading.load_weights(model, self.device)  # (offloaded shards stay on the host)
                    return model
                loading.load_weights(model, self.device)
            return model.to(self.device)

        if self.env.ep_size > 1 and not self.cfg.init_from:
            model = in_turns(lambda: build(make()), self.cfg.load_concurrency)
        else:
            model = build(make())
        if not (self.cfg.init_from and self.cfg.fsdp):
            ep_hf.broadcast_dense_params(model, src=0)
            parallelize.apply_scale(model, self.env, self.cfg, self.device)
        return model

    def describe(self) -> dict:
        return {"distributed": {"world_size": self.world, "ep": self.env.ep_size, "dp": self.world // self.env.ep_size,
                                "fsdp": self.cfg.fsdp, "offload": self.cfg.offload,
                                "activation_checkpointing": self.cfg.activation_checkpointing,
                                "backend": self.env.backend, "placement": self.cfg.placement if self.eps else None,
                                "budget_mib_per_layer": self.cfg.ep_budget_mib if self.eps else None,  # None: unlimited
                                "options": dict(self.cfg.ep_options) if self.eps else {},
                                "rows_per_rank_per_micro_batch": self.cfg.micro_batch // self.world}}

    # ------------------------------------------------------------------ step
    def local_batches(self, batches: list[dict]) -> list[dict]:
        """This rank's contiguous block of rows of every micro-batch."""
        self._plan_s0 = self.plan_seconds_total()  # the step starts here (evaluation plans are not counted)
        self._layout_s0 = self.layout_seconds_total()
        m = self.cfg.micro_batch // self.world
        lo = self.rank * m
        return [{k: v[lo:lo + m] for k, v in b.items()} for b in batches]

    def plan_seconds_total(self) -> float:
        """Host seconds this rank's EP layers have spent planning since they were built."""
        return sum(ep.plan_seconds_total for ep in self.eps)

    def layout_seconds_total(self) -> float:
        """Host seconds this rank's EP layers have spent turning plans into index layouts since they were built."""
        return sum(ep.layout_seconds_total for ep in self.eps)

    def backward(self, loss: torch.Tensor) -> None:
        (loss * self.world).backward()

    def reduce_step(self, loss_total: float, kept: list, layer_stats: dict, nonfinite: int, comm: dict):
        """Sums over all ranks of the step's statistics (one all-reduce)."""
        E = self.num_experts
        other = sum(v for k, v in comm.items() if k not in COMM_KEYS)
        vals = [loss_total, float(nonfinite), float(other)] + [float(comm.get(k, 0)) for k in COMM_KEYS]
        vals += [float(x) for pair in kept for x in pair]
        layers = sorted(layer_stats)
        parts = [torch.tensor(vals, dtype=torch.float64)]
        for li in layers:
            s = layer_stats[li]
            if s is None:
                parts.append(torch.zeros(1 + 3 * E, dtype=torch.float64))
            else:
                parts.append(torch.cat([torch.ones(1, dtype=torch.float64)]
                                       + [s[k].reshape(-1).to(torch.float64) for k in ("demand", "quota", "kept")]))
        flat = torch.cat(parts).to(self.device)
        dist.all_reduce(flat)
        flat = flat.cpu()
        loss_total, nonfinite, other = float(flat[0]), int(flat[1]), int(flat[2])
        off = 3
        comm_sum = {k: int(flat[off + i]) for i, k in enumerate(COMM_KEYS)}
        if other:
            comm_sum["other"] = other
        off += len(COMM_KEYS)
        kept = [[int(flat[off + 2 * i]), int(flat[off + 2 * i + 1])] for i in range(len(kept))]
        off += 2 * len(kept)
        out_stats = {}
        for li in layers:
            chunk = flat[off:off + 1 + 3 * E].round().to(torch.int64)
            off += 1 + 3 * E
            out_stats[li] = None if chunk[0] == 0 else {k: chunk[1 + j * E:1 + (j + 1) * E]
                                                         for j, k in enumerate(("demand", "quota", "kept"))}
        extra = {}
        if self.eps:
            # the step's planning (every MoE layer, every micro-batch, split pieces included), slowest rank
            # and the layouts built from the plans (plan -> per-pair index tensors), each the slowest rank's
            host_s = torch.tensor([self.plan_seconds_total() - self._plan_s0,
                                   self.layout_seconds_total() - self._layout_s0], dtype=torch.float64, device=self.device)
            dist.all_reduce(host_s, op=dist.ReduceOp.MAX)
            host_s = host_s.cpu()
            extra = {"comm_bytes": comm_sum, "comm_bytes_total": sum(comm_sum.values()),
                     "moe_plan_s": float(host_s[0]), "moe_layout_s": float(host_s[1])}
        return loss_total, kept, out_stats, nonfinite, extra

    def last_plans(self) -> list[list]:
        """Per MoE layer, the plans of its latest call (the pieces of a split micro-batch), the same on every rank."""
        return [ep.last_plan if isinstance(ep.last_plan, list) else [ep.last_plan] for ep in self.eps]

    def clip_(self, model, params, clip: float) -> float:
        """Gradient sync (dense: data parallel; experts: EP) then global-norm clipping; the norm. With
        FSDP the gradients were reduced in the backward: clipping only."""
        if self.cfg.fsdp:
            fsdp.finish_expert_grads(model, self.env.ep_size)
            return float(fsdp.clip_grad_norm_(model, clip if clip > 0 else math.inf))
        ep_hf.finish_grad_sync(model, self.env.dp_group, self.env.expert_dp_group)
        return float(ep_hf.clip_grad_norm_(model, clip if clip > 0 else math.inf, self.env.ep_group))

    def max_times(self, *times: float) -> tuple[float, ...]:
        t = torch.tensor(times, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return tuple(float(x) for x in t.cpu())

    # ------------------------------------------------------------------ evaluation
    def eval_rows(self, batch: dict) -> tuple[dict, bool]:
        """This rank's share of a held-out micro-batch (uneven split allowed); a rank left without
        rows runs the first row (every rank must call the EP layers) and does not count it."""
        n = next(iter(batch.values())).shape[0]
        lo, hi = n * self.rank // self.world, n * (self.rank + 1) // self.world
        if hi > lo:
            return {k: v[lo:hi] for k, v in batch.items()}, True
        return {k: v[:1] for k, v in batch.items()}, False

    def sum_eval(self, total: float, count: int) -> tuple[float, int]:
        t = torch.tensor([total, float(count)], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return float(t[0]), int(t[1])

    # ------------------------------------------------------------------ checkpoints
    def ep_keys(self, model) -> dict[str, str]:
        """State-dict keys of the EP-sharded expert weights -> their key in the DCP folder, which names
        the block (``...gate_up_proj@ep{r}of{G}``): each EP rank holds a different tensor under the same
        name, which torch.distributed.checkpoint would otherwise take for copies of one."""
        keys = {}
        for mname, m in model.named_modules():
            ep = getattr(m, "lrmoe_ep", None)
            if isinstance(ep, ExpertParallel) and ep.world_size > 1:
                for pname in ("gate_up_proj", "down_proj"):
                    key = f"{mname}.{pname}" if mname else pname
                    keys[key] = f"{key}@ep{ep.rank}of{ep.world_size}"
        return keys

    def sharded_state(self, model, opt) -> dict:
        """{"model": ..., "optim": ...}: this rank's tensors (DTensor shards, its EP block), keyed for DCP."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        rename = self.ep_keys(model)
        msd = get_model_state_dict(model)
        osd = get_optimizer_state_dict(model, opt)
        return {"model": {rename.get(k, k): v for k, v in msd.items()},
                "optim": {**osd, "state": {rename.get(k, k): v for k, v in osd["state"].items()}}}

    def save_sharded_state(self, folder: Path, model, opt) -> None:
        """Write the weights and optimizer state with torch.distributed.checkpoint (collective)."""
        import torch.distributed.checkpoint as dcp

        dcp.save(self.sharded_state(model, opt), checkpoint_id=str(folder))

    def load_sharded_state(self, folder: Path, model, opt) -> None:
        """Read them back in place (each rank its shards) and set them on the model and optimizer."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        if not (folder / ".metadata").exists():
            raise ValueError(f"{folder} is missing or incomplete (no .metadata): copy the checkpoint together "
                             f"with its folder {folder.name}")
        state = self.sharded_state(model, opt)
        dcp.load(state, checkpoint_id=str(folder))
        back = {v: k for k, v in self.ep_keys(model).items()}
        set_model_state_dict(model, {back.get(k, k): v for k, v in state["model"].items()})
        osd = state["optim"]
        set_optimizer_state_dict(model, opt, {**osd, "state": {back.get(k, k): v for k, v in osd["state"].items()}})

    def save_checkpoint(self, path: Path, common: dict, model, opt, rng_state: dict) -> None:
        """One checkpoint set (every rank calls it; see lrmoe.train.checkpoint): the DCP folder of
        the step, the rank files, then the main file."""
        step = common["step"]
        folder = checkpoint.dcp_dir(path, step)
        self.save_sharded_state(folder, model, opt)
        main = None
        if self.is_main:
            def main():
                return {**common, "dcp": folder.name, "world_size": self.world, "ep_size": self.env.ep_size}
        # host barriers: writing hundreds of GB may outlast the collective timeout
        checkpoint.save_sharded(path, step, self.rank,
                                {"world_size": self.world, "rng": rng_state,
                                 "placement_state": [ep.state for ep in self.eps]}, main, host_barrier)

    def load_checkpoint(self, path: Path) -> dict:
        ck = checkpoint.load(path, mmap=True)
        layout = (ck.get("world_size", 1), ck.get("ep_size", 1))
        if layout != (self.world, self.env.ep_size):
            raise ValueError(f"{path} was written by {layout[0]} process(es) with ep={layout[1]}; this run has "
                             f"{self.world} with ep={self.env.ep_size}: resume with the same torchrun layout")
        return ck

    def load_state(self, path: Path, ck: dict, model, opt, set_rng) -> None:
        """Weights and optimizer state from the set's DCP folder (or, in a set written before it, the
        main file's full weights and this rank's optimizer file), RNG and planner state from this
        rank's file of its set."""
        rs = checkpoint.load_rank_state(path, ck, self.rank)
        if "dcp" in ck:
            self.load_sharded_state(Path(path).parent / ck["dcp"], model, opt)
        else:
            self._load_full_weights(ck, model, opt, rs)
        set_rng(rs["rng"])
        for ep, st in zip(self.eps, rs.get("placement_state", [])):
            ep.state = st

    def _load_full_weights(self, ck: dict, model, opt, rs: dict) -> None:
        sd = ep_hf.shard_state_dict(model, ck["model"]) if self.eps else ck["model"]
        sharded = fsdp.is_sharded(model)
        if sharded:
            fsdp.load_full_state_dict(model, sd)
        else:
            model.load_state_dict(sd)
        opt.load_state_dict(rs["optimizer"])
        if sharded:
            fsdp.restore_optimizer_state(opt)

    # ------------------------------------------------------------------ end
    def barrier(self) -> None:
        host_barrier()

    def close(self) -> None:
        if self.owns_group:
            from ..parallel.launch import shutdown

            shutdown()
