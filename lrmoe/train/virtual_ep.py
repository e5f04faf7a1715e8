"""`lrmoe train --virtual-ep G`: one process trains exactly as ``torchrun --nproc-per-node G ... --ep G`` would.

    lrmoe train --out runs/symi --virtual-ep 8 --placement symi --micro-batch 8 ...

:class:`VirtualRunner` is the runner of :func:`lrmoe.train.train` for such a run (a
:class:`~lrmoe.train.runner.LocalRunner` that knows G virtual ranks): every micro-batch's rows are
split into G contiguous blocks of ``micro_batch / G`` rows, one per source rank, as
:meth:`lrmoe.train.ep.DistributedRunner.local_batches` splits them, and every routed-experts
module runs :func:`lrmoe.parallel.virtual.virtual_ep_experts` over those sources (the planner,
forward drops, per-(source, instance) backward quotas and selection of the expert-parallel
runtime). The loss, dense and expert gradients, clipping and optimizer are the single-process ones,
which the distributed run reproduces by construction (docs/expert_parallel.md); evaluation splits
every held-out micro-batch as the distributed run does (uneven shares; a source without rows runs
the first row, not counted). The model keeps its full expert weights (no sharding), so
``checkpoint.pt`` is a single-process checkpoint plus the planners' state and the sources'
random-scorer generators.

Rows add ``moe_plan_s`` (the step's planning) and ``plans`` (:mod:`lrmoe.train.plan_log`); the
run writes its routing trace (``record_trace``, default ``routing_trace.npz`` in the run folder).
``moe_fwd_s``/``moe_bwd_s`` are this process's time inside the experts of all G virtual ranks
(planning and G layouts included): a single-process measurement, not a cluster's.
"""
from __future__ import annotations

import math
import types
import weakref

import torch
from torch import nn

from ..data import IGNORE_INDEX
from ..hf import integration as _hf
from ..parallel.virtual import VirtualExpertParallel, VirtualGroup, virtual_ep_experts
from ..policy import BackwardPolicy, BackwardRecord
from . import checkpoint
from .runner import LocalRunner

_VEP_ATTR = "lrmoe_virtual_ep"


def virtual_experts_forward(self: nn.Module, hidden_states, top_k_index, top_k_weights):
    """Forward of a virtualised transformers experts module: hidden [T, H] -> [T, H]."""
    policy = getattr(self, _hf.POLICY_ATTR, None) or BackwardPolicy()
    record = None
    if torch.is_grad_enabled():
        ref = weakref.ref(self)
        record = BackwardRecord(on_fill=lambda r: (m := ref()) is not None and setattr(m, _hf.RECORD_ATTR, r))
    y = virtual_ep_experts(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj,
                           getattr(self, _VEP_ATTR), policy, record, _hf.activation_of(self))
    return y.to(hidden_states.dtype)


def virtualize_experts(model: nn.Module, group: VirtualGroup, placement: str = "fixed", budget_bytes: float = math.inf,
                       *, slots_per_rank: int | None = None, fast_domains=None, **options) -> list[VirtualExpertParallel]:
    """Run every routed-experts module of ``model`` as G virtual expert-parallel ranks (weights
    untouched); the arguments are those of :func:`lrmoe.hf.parallel.parallelize_experts`. Returns
    the layers' :class:`VirtualExpertParallel` in layer order."""
    mods = _hf.experts_modules(model)
    if not mods:
        raise ValueError(f"{type(model).__name__} has no routed-experts modules (gate_up_proj [E, 2I, H])")
    veps = []
    for m in mods:
        if isinstance(getattr(m, _VEP_ATTR, None), VirtualExpertParallel):
            raise ValueError(f"{type(m).__name__} is already virtual expert parallel")
        _hf.check_supported(m)
        vep = VirtualExpertParallel(int(m.gate_up_proj.shape[0]), group, placement, budget_bytes=budget_bytes,
                                    slots_per_rank=slots_per_rank, fast_domains=fast_domains, **options)
        setattr(m, _VEP_ATTR, vep)
        m.forward = types.MethodType(virtual_experts_forward, m)
        veps.append(vep)
    return veps


class VirtualRunner(LocalRunner):
    """One process, G virtual expert-parallel ranks (module docstring)."""

    def __init__(self, cfg):
        from .ep import world_size_from_env

        if world_size_from_env() > 1:
            raise ValueError(f"virtual_ep={cfg.virtual_ep} runs in one process; launch it without torchrun "
                             f"(under torchrun use --ep {cfg.virtual_ep} for real ranks)")
        super().__init__(cfg)
        self.cfg = cfg
        self.group = VirtualGroup(cfg.virtual_ep)
        self.eps: list[VirtualExpertParallel] = []
        self._plan_s0 = 0.0

    def build_model(self, make, policy):
        from .parallelize import budget_bytes

        model = make()
        self.eps = virtualize_experts(model, self.group, self.cfg.placement, budget_bytes(self.cfg),
                                      **self.cfg.ep_options)
        return model.to(self.device)

    def describe(self) -> dict:
        c = self.cfg
        return {"virtual_ep": {"world_size": c.virtual_ep, "placement": c.placement,
                               "budget_mib_per_layer": c.ep_budget_mib, "options": dict(c.ep_options),
                               "rows_per_rank_per_micro_batch": c.micro_batch // c.virtual_ep}}

    def local_batches(self, batches):
        self._plan_s0 = self.plan_seconds_total()
        self.group.rows = [self.cfg.micro_batch // self.cfg.virtual_ep] * self.cfg.virtual_ep
        return batches

    def plan_seconds_total(self) -> float:
        return sum(ep.plan_seconds_total for ep in self.eps)

    def last_plans(self) -> list[list]:
        return [ep.plans() for ep in self.eps]

    def reduce_step(self, loss_total, kept, layer_stats, nonfinite, comm):
        return loss_total, kept, layer_stats, nonfinite, {"moe_plan_s": self.plan_seconds_total() - self._plan_s0}

    def eval_rows(self, batch):
        """Every source's share of a held-out micro-batch, as :meth:`DistributedRunner.eval_rows`
        gives each rank: rows ``[n*r//G, n*(r+1)//G)``; a source without rows runs the first row
        with its labels ignored (it routes, so it counts in the plan, but adds no loss)."""
        n, G = next(iter(batch.values())).shape[0], self.cfg.virtual_ep
        idx, rows, dummy = [], [], []
        for r in range(G):
            lo, hi = n * r // G, n * (r + 1) // G
            if hi > lo:
                idx += range(lo, hi)
            else:
                dummy.append(len(idx))
                idx.append(0)
            rows.append(max(1, hi - lo))
        self.group.rows = rows
        out = {k: v[idx] for k, v in batch.items()}
        if dummy:
            out["labels"] = out["labels"].clone()
            out["labels"][dummy] = IGNORE_INDEX
        return out, True

    def save_checkpoint(self, path, common: dict, model, opt, rng_state: dict) -> None:
        checkpoint.save({**common, "model": model.state_dict(), "optimizer": opt.state_dict(), "rng": rng_state,
                         "placement_state": [ep.state for ep in self.eps],
                         "virtual_generators": self.group.generator_states()}, path)

    def load_state(self, path, ck: dict, model, opt, set_rng) -> None:
        super().load_state(path, ck, model, opt, set_rng)
        for ep, st in zip(self.eps, ck.get("placement_state", [])):
            ep.state = st
        self.group.load_generator_states(ck.get("virtual_generators", {}))
