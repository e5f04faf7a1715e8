"""Expert-parallel gated experts on torch.distributed (NCCL on GPUs, gloo on CPU): SwiGLU by default,
any elementwise activation through the general path of :func:`lrmoe.experts.gated`.

One call of :func:`ep_experts` on every rank of the expert-parallel group runs one MoE layer's
routed experts over the tokens of all ranks (see docs/expert_parallel.md)::

    local demand [E] --all_gather--> demand_GE --plan_placement (same on every rank)--> Plan
    replica weight sync (all_to_all of packed owner weights)
    dispatch: all_to_all of X rows (uneven splits) -> grouped GEMMs over the local instances
    combine:  all_to_all of O rows back (+ ||h||^2 per row when the backward selects)
    y_t = sum_k alpha_{t,k} O_{t,k} on the token side (the single-process combine)

Backward, given g = dL/dy on the token side:

    dL/dalpha for every routed pair (exact; dropped pairs have O = 0 and get 0)
    scores R_u (the policy's scorer) and, per (instance, source rank) bucket, the
        ``plan.backward_quota_GN[source, instance]`` best pairs (ties: lower pair index,
        non-finite first, as :func:`lrmoe.kernels.routing.select_top_quota`)
    all_to_all of the kept alpha*g rows (+ their row positions in the forward receive buffer)
    expert side: compaction of the saved X / GU rows, :func:`lrmoe.experts.expert_backward`
    all_to_all of the kept rows' dX back; per-token sums (:func:`sum_rows_by_token`)
    replica weight gradients: all_to_all back to the owners and added to the owners' gradients

Only the rows kept in backward cross the network. Parameters: rank r owns experts
``[r*E/G, (r+1)*E/G)`` (Megatron-LM's contiguous blocks) as ``gate_up_proj [E/G, 2I, H]`` and
``down_proj [E/G, H, I]``; every other instance of an expert (a replica, or any SYMI slot away
from the owner rank) is a per-call buffer filled from the owner. Gradients returned for the local
parameters are sums over the tokens of all ranks (no 1/G; see :func:`lrmoe.parallel.grad_sync.finish_grad_sync`).

Every rank must call every EP layer with the same configuration and backpropagate through every
call (the backward runs collectives). Collective failures (a peer that died or never came, a
timeout) raise :class:`EPCommunicationError` where the backend reports them to the caller (gloo;
NCCL with ``TORCH_NCCL_BLOCKING_WAIT=1``); NCCL collectives otherwise do not block the host and
the NCCL watchdog aborts the process when one times out. Set the process-group timeout with
``init_process_group(timeout=...)`` (:func:`lrmoe.parallel.launch.init_distributed`). With NCCL
every tensor must be on this rank's GPU (``torch.cuda.current_device()``).

This module holds the layer's settings and planning (:class:`ExpertParallel`), the entry point
(:func:`ep_experts`) and the module (:class:`ExpertParallelExperts`). The parts it runs:
:mod:`.collectives` (all-to-all, the demand all-gather and its header check),
:mod:`.layout` (plan -> index layout), :mod:`.function` (the autograd function) and
:mod:`.grad_sync` (data parallelism for the dense parameters).
"""
from __future__ import annotations

import functools
import math
import time
import weakref
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ..experts import autocast_inputs, autocast_off, check_routing_shapes, experts_activation
from ..kernels.routing import count_by_value
from ..policy import MODES, BackwardPolicy, BackwardRecord, check_policy
from ..recompute import recomputing
from ..planning.plan import Cluster, ModelDims, Plan, check_budget
from ..planning.policies import get_placement, plan_placement
from ..planning.step import plan_layer
from . import fake
from .collectives import crc, gather_demand
from .function import Call, EPExperts
from .grad_sync import mark_expert_parallel
from .layout import Layout

# EPExperts: the autograd function (its backward nodes are what a timer or profiler looks for).
__all__ = ["EPExperts", "EPOutOfMemoryError", "ExpertParallel", "ExpertParallelExperts", "ep_experts", "check_devices"]


class EPOutOfMemoryError(RuntimeError):
    """The placement policy's plan does not fit the memory budget and its fallback is ``oom``."""


# ----------------------------------------------------------------------------- per-layer settings
class ExpertParallel:
    """Settings and state of one expert-parallel MoE layer (one per layer: SYMI keeps state).

    num_experts: E (global); group: the EP process group (None: the default group);
    placement: a registered placement policy (``lrmoe.planning.policies.placement_policies()``);
    budget_bytes: this layer's per-rank memory budget for the planner (inf: none);
    slots_per_rank: S expert slots per rank, owned ones included (default E/G + 2; E/G: no replicas);
    fast_domains: rank groups that share a fast interconnect (None: all ranks);
    grad_bytes, optimizer_bytes_per_param: the memory model's byte sizes (:class:`ModelDims`);
    options: keyword options of the placement policy (e.g. ``min_tokens`` for ultraep,
    ``capacity_factor`` for fixed/symi). For ``lrmoe`` the drop ratio, quota policy and its
    options come from the layer's :class:`BackwardPolicy` unless given here.

    After a call: ``last_plan`` (the executed :class:`Plan`, or the list of piece plans when the
    microbatch was split), ``last_forward_bytes`` (bytes this rank sent per forward all-to-all).
    """

    def __init__(self, num_experts: int, group=None, placement: str = "fixed", *, budget_bytes: float = math.inf,
                 slots_per_rank: int | None = None, fast_domains=None, grad_bytes: int = 4,
                 optimizer_bytes_per_param: int = 12, **options):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: call lrmoe.parallel.launch.init_distributed() "
                               "(or torch.distributed.init_process_group) before building expert-parallel layers")
        if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
            raise ValueError(f"num_experts must be an int >= 1, got {num_experts!r}")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        if self.rank < 0:
            raise ValueError("this process is not a member of the given expert-parallel group")
        # "nccl", "gloo" or e.g. "cpu:gloo,cuda:nccl": whether the group can take CPU tensors.
        self.backend = str(dist.get_backend(group)).lower()
        self.sizes_checked = False  # the first call checks the message sizes before the demand gather
        self._configure(num_experts, placement, budget_bytes=budget_bytes, slots_per_rank=slots_per_rank,
                        fast_domains=fast_domains, grad_bytes=grad_bytes,
                        optimizer_bytes_per_param=optimizer_bytes_per_param, **options)

    def _configure(self, num_experts, placement, *, budget_bytes, slots_per_rank, fast_domains, grad_bytes,
                   optimizer_bytes_per_param, **options) -> None:
        """The planner settings over ``self.world_size`` ranks (also used by the single-process
        :class:`lrmoe.parallel.virtual.VirtualExpertParallel`)."""
        G = self.world_size
        if num_experts % G:
            raise ValueError(f"num_experts ({num_experts}) must be divisible by the EP group size ({G}): "
                             f"every rank owns E/G experts")
        get_placement(placement)  # validates the name
        self.num_experts, self.placement = num_experts, placement
        self.experts_per_rank = num_experts // G
        S = self.experts_per_rank + 2 if slots_per_rank is None else slots_per_rank
        if isinstance(S, bool) or not isinstance(S, int) or S < self.experts_per_rank:
            raise ValueError(f"slots_per_rank must be an int >= E/G = {self.experts_per_rank}, got {slots_per_rank!r}")
        self.cluster = Cluster(G, S, fast_domains)
        self.budget_bytes = check_budget(budget_bytes)
        probe_dims = ModelDims(1, 1, num_experts, 1, 1, grad_bytes, optimizer_bytes_per_param)  # validates the sizes
        self.grad_bytes, self.optimizer_bytes_per_param = grad_bytes, optimizer_bytes_per_param
        self.options = dict(options)
        # The planner's options are checked now, by planning an empty step, not at the first call
        # (a misspelt or out-of-range option would otherwise surface mid-training).
        plan_placement(placement, np.zeros((G, num_experts), dtype=np.int64), self.cluster, probe_dims, math.inf,
                       **self.options)
        self.state: Any = None  # planner state (SYMI: last step's popularity)
        self.last_plan: Plan | list[Plan] | None = None
        self.last_forward_bytes: dict[str, int] = {}
        self.plan_seconds = 0.0  # host time of the latest call's planning (all pieces)
        self.plan_seconds_total = 0.0  # host time of every planning since construction (never reset)
        self.layout_seconds = 0.0  # host time of the latest call's layouts (plan -> index tensors; all pieces)
        self.layout_seconds_total = 0.0  # host time of every layout since construction (never reset)

    @property
    def local_experts(self) -> range:
        """Global ids of the experts this rank owns."""
        El = self.experts_per_rank
        return range(self.rank * El, (self.rank + 1) * El)

    def shard(self, weight_E: torch.Tensor) -> torch.Tensor:
        """This rank's block ``weight_E[r*E/G:(r+1)*E/G]`` of a full [E, ...] expert weight (a copy)."""
        if weight_E.shape[0] != self.num_experts:
            raise ValueError(f"expected a full expert weight with {self.num_experts} experts, got shape "
                             f"{tuple(weight_E.shape)}")
        r = self.local_experts
        return weight_E.detach()[r.start:r.stop].clone()

    def dims(self, hidden: int, intermediate: int, top_k: int, dtype_bytes: int) -> ModelDims:
        return ModelDims(hidden, intermediate, self.num_experts, top_k, dtype_bytes, self.grad_bytes,
                         self.optimizer_bytes_per_param)

    def plan(self, demand_GE: np.ndarray, dims: ModelDims, policy: BackwardPolicy, *, state=None,
             piece: bool = False) -> Plan:
        """The plan every rank computes for this demand (pure, deterministic):
        :func:`lrmoe.planning.step.plan_layer`, the function the cluster simulator calls too
        (baseline placements get the runtime's backward quotas when the policy selects). ``piece``:
        a piece of a split microbatch, planned with fallback ``oom`` (executed even if over budget)."""
        t0 = time.perf_counter()
        plan = plan_layer(self.placement, demand_GE, self.cluster, dims, self.budget_bytes, options=self.options,
                          selects=policy.selects, drop_ratio=policy.drop_ratio, quota=policy.quota,
                          quota_options=policy.quota_kwargs, state=state, piece=piece)
        dt = time.perf_counter() - t0
        self.plan_seconds += dt
        self.plan_seconds_total += dt
        return plan

    def planner_signature(self) -> str:
        """Everything besides the demand and the policy that decides the plan (compared across ranks)."""
        return repr((sorted(self.options.items()), repr(self.budget_bytes), self.cluster.domain_G.tolist(),
                     self.grad_bytes, self.optimizer_bytes_per_param))

    def __repr__(self) -> str:
        return (f"ExpertParallel(E={self.num_experts}, rank={self.rank}/{self.world_size}, placement={self.placement!r}, "
                f"slots_per_rank={self.cluster.slots_per_rank}, budget_bytes={self.budget_bytes}, options={self.options})")


# ----------------------------------------------------------------------------- entry point


def check_devices(hidden_TH, idx_TK, w_TK, gate_up, down, ep: ExpertParallel):
    """ValueError, before any collective, for inputs on different devices, or not on this rank's
    GPU when the EP group is NCCL (whose collectives take CUDA tensors of the current device only)."""
    dev = hidden_TH.device
    others = {"top_k_index": idx_TK.device, "top_k_weights": w_TK.device, "gate_up_proj": gate_up.device,
              "down_proj": down.device}
    wrong = {k: str(d) for k, d in others.items() if d != dev}
    if wrong:
        raise ValueError(f"expert-parallel inputs must be on one device: hidden_TH is on {dev}, but {wrong}")
    if "gloo" not in ep.backend and "nccl" in ep.backend:
        if dev.type != "cuda":
            raise ValueError(f"the expert-parallel group uses {ep.backend!r}, whose collectives take CUDA tensors, "
                             f"but the inputs are on {dev}: move the model and batch to this rank's GPU "
                             f"(launch.init_distributed's env.device)")
        cur = torch.cuda.current_device()
        if dev.index is not None and dev.index != cur:
            raise ValueError(f"the inputs are on {dev} but this rank's current CUDA device is cuda:{cur}; NCCL "
                             f"needs one GPU per rank: call torch.cuda.set_device(local_rank) before anything "
                             f"else (launch.init_distributed does) and keep the model on it")


def _check_local_inputs(hidden_TH, idx_TK, w_TK, gate_up, down, ep: ExpertParallel):
    if hidden_TH.dim() != 2:
        raise ValueError(f"hidden_TH must be [T, H], got shape {tuple(hidden_TH.shape)}")
    if gate_up.dtype != down.dtype:
        raise ValueError(f"gate_up_proj and down_proj must share a dtype, got {gate_up.dtype} and {down.dtype}")
    check_devices(hidden_TH, idx_TK, w_TK, gate_up, down, ep)
    T, H = hidden_TH.shape
    El = ep.experts_per_rank
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[0] != El or gate_up.shape[2] != H \
            or gate_up.shape[1] % 2 or tuple(down.shape) != (El, H, gate_up.shape[1] // 2):
        raise ValueError(f"expert weights must be this rank's block of E/G = {El} experts: gate_up_proj [{El}, 2I, {H}] "
                         f"and down_proj [{El}, {H}, I], got {tuple(gate_up.shape)} and {tuple(down.shape)}")
    check_routing_shapes(T, idx_TK, w_TK)
    # The indices' range is checked on the host after the demand gather, which carries every rank's
    # lowest and highest index (layer_demand): no synchronisation of its own, and every rank raises.


def check_fits(plan: Plan, ep: ExpertParallel) -> None:
    """:class:`EPOutOfMemoryError` when the plan of a whole call is over budget with fallback ``oom``."""
    if plan.fallback != "oom":
        return
    m = plan.memory.summary()
    raise EPOutOfMemoryError(
        f"placement {ep.placement!r}: the plan needs {m['total']} bytes on its largest rank (base {m['base']}, "
        f"replicas {m['replicas']}, tokens {m['tokens']}) but the budget is {ep.budget_bytes} bytes, and its "
        f"fallback {ep.options.get('fallback', 'split')!r} could not make it fit"
        f"{' (the static part alone is over the budget)' if m['base'] + m['replicas'] > ep.budget_bytes else ''}; "
        f"raise budget_bytes or use smaller microbatches")


def _merge_records(target: BackwardRecord, parts: list[BackwardRecord]) -> None:
    """One record for a split microbatch: counts summed, masks and scores concatenated over tokens."""
    cat = lambda name: torch.cat([getattr(p, name) for p in parts])  # noqa: E731
    comm: dict[str, int] = {}
    for p in parts:
        for k, v in p.comm_bytes.items():
            comm[k] = comm.get(k, 0) + v
    scores = cat("scores") if all(p.scores is not None for p in parts) else None
    inclusion = cat("inclusion") if all(p.inclusion is not None for p in parts) else None
    plan_s = sum(p.plan_seconds for p in parts)  # the whole call's planning (the first piece holds the split's)
    timings: dict[str, float] = {}  # seconds per phase, summed over the pieces
    for p in parts:
        for k, v in p.timings.items():
            timings[k] = timings.get(k, 0.0) + v
    target.fill(demand=sum(p.demand for p in parts), quota=sum(p.quota for p in parts), kept=sum(p.kept for p in parts),
                kept_mask=cat("kept_mask"), scores=scores, nonfinite=sum(p.nonfinite for p in parts),
                mode=parts[0].mode, drop_ratio=parts[0].drop_ratio, scorer=parts[0].scorer,
                selection=parts[0].selection, inclusion=inclusion,
                buffer_bytes=max(p.buffer_bytes for p in parts), timings=timings, comm_bytes=comm, plan=[p.plan for p in parts], rank=parts[0].rank,
                world_size=parts[0].world_size, plan_seconds=plan_s)


def ep_experts(hidden_TH: torch.Tensor, top_k_index_TK: torch.Tensor, top_k_weights_TK: torch.Tensor,
               gate_up_proj: torch.Tensor, down_proj: torch.Tensor, ep: ExpertParallel,
               policy: BackwardPolicy | None = None, record: BackwardRecord | None = None,
               activation=None) -> torch.Tensor:
    """Expert-parallel gated experts over this rank's tokens (a collective: every rank calls it).
    ``activation``: as in :class:`lrmoe.layer.LRMoEExperts` (None, ``F.silu`` or ``nn.SiLU()``: the fused
    SwiGLU path; any elementwise callable without parameters otherwise, with its exact backward;
    :func:`lrmoe.experts.experts_activation`); every rank must pass the same one.

    hidden_TH [T, H] (this rank's tokens; T may be 0); top_k_index_TK [T, K] global expert ids;
    top_k_weights_TK [T, K]; gate_up_proj [E/G, 2I, H] and down_proj [E/G, H, I]: this rank's
    owned experts ``ep.local_experts``. Returns y_TH [T, H]. ``record`` (a fresh
    :class:`BackwardRecord`) is filled in backward with this rank's view: demand, quota, kept
    (per expert, this rank's pairs), kept_mask, scores, plus ``comm_bytes`` (bytes this rank sent
    to other ranks per all-to-all: fwd_weights, fwd_dispatch, fwd_combine, fwd_phi,
    bwd_grad_rows, bwd_grad_index, bwd_dx, bwd_weight_grads), ``plan``, ``rank``, ``world_size``,
    and ``plan_seconds``: host seconds this call spent planning (``ExpertParallel.plan``: the
    placement planner and, for baselines under a selecting policy, the backward quotas; for a split
    microbatch the whole-call plan and every piece's, summed), measured always (also without
    ``profile``); with ``profile=True`` it is also ``timings["fwd_plan"]``. It is part of the
    forward's time (the planner runs inside the experts function, before the dispatch)."""
    policy = check_policy(policy)
    activation = experts_activation(activation)  # SiLU in any spelling: the fused path
    _check_local_inputs(hidden_TH, top_k_index_TK, top_k_weights_TK, gate_up_proj, down_proj, ep)
    policy = policy.snapshot(hidden_TH.device)  # what this call's forward and backward use
    # under torch.autocast: bf16/fp16 rows and weights, like lrmoe_experts (then autocast off inside)
    hidden_TH, gate_up_proj, down_proj = autocast_inputs(hidden_TH, gate_up_proj, down_proj)
    idx = top_k_index_TK.to(torch.int64)
    act_key = activation_key(activation)
    T, K = idx.shape
    E, H, I = ep.num_experts, hidden_TH.shape[1], gate_up_proj.shape[1] // 2
    header = [E, H, I, K, ep.experts_per_rank, crc(str(gate_up_proj.dtype)), crc(ep.placement), MODES.index(policy.mode),
              round(policy.drop_ratio * 1e9), crc(policy.scorer), crc(policy.quota), ep.cluster.slots_per_rank,
              crc(repr((sorted(policy.quota_kwargs.items()), sorted(policy.scorer_kwargs.items()), policy.phi,
                        policy.selection))),
              crc(ep.planner_signature()), crc(act_key)]
    readable = [E, H, I, K, ep.experts_per_rank, gate_up_proj.dtype, ep.placement, policy.mode, policy.drop_ratio,
                policy.scorer, policy.quota, ep.cluster.slots_per_rank,
                (sorted(policy.quota_kwargs.items()), sorted(policy.scorer_kwargs.items()), policy.phi, policy.selection),
                ep.planner_signature(), act_key]
    if recomputing():  # activation checkpointing's second forward: the first one's plan, no planning
        return _rerun(hidden_TH, idx, top_k_weights_TK, gate_up_proj, down_proj, ep, policy, activation)
    demand_GE = layer_demand(ep, idx, header, readable)
    dims = ep.dims(H, I, K, gate_up_proj.element_size())
    prev_state = ep.state
    ep.plan_seconds = ep.layout_seconds = 0.0
    ep.last_forward_bytes = {}
    plan = ep.plan(demand_GE, dims, policy, state=prev_state)
    plan_s = ep.plan_seconds  # this call's planning so far (a split adds each piece's below)
    if torch.is_grad_enabled():  # training calls advance the planner's state (SYMI's popularity);
        ep.state = plan.state    # evaluation under no_grad plans from it and leaves it unchanged
    check_fits(plan, ep)
    if plan.num_splits == 1:
        ep.last_plan = plan
        return _run(hidden_TH, idx, top_k_weights_TK, gate_up_proj, down_proj, ep, plan, policy, record, plan_s,
                    activation)

    # split_microbatch:N: N pieces of this rank's tokens (contiguous, as even as possible), each
    # planned on its own demand (fallback oom: executed even if a piece is still over budget).
    n = plan.num_splits
    bounds = [T * j // n for j in range(n + 1)]
    parts = [] if record is not None else None
    outs, plans = [], []
    for j in range(n):
        sl = slice(bounds[j], bounds[j + 1])
        i_j = idx[sl]
        d_j = layer_demand(ep, i_j, header, readable)
        before = ep.plan_seconds
        p_j = ep.plan(d_j, dims, policy, state=prev_state, piece=True)
        piece_s = ep.plan_seconds - before + (plan_s if j == 0 else 0.0)  # the first piece carries the split's plan
        plans.append(p_j)
        rec_j = None
        if record is not None:
            def on_fill(_r, parts=parts):
                if all(p.filled for p in parts):
                    _merge_records(record, parts)
            rec_j = BackwardRecord(on_fill=on_fill)
            parts.append(rec_j)
        outs.append(_run(hidden_TH[sl], i_j, top_k_weights_TK[sl], gate_up_proj, down_proj, ep, p_j, policy, rec_j,
                         piece_s, activation))
    ep.last_plan = plans
    return torch.cat(outs)


def layer_demand(ep: ExpertParallel, idx: torch.Tensor, header: list[int], readable: list) -> np.ndarray:
    """The [G, E] demand of this call over the EP group (a collective: the layer's one host read), or
    the stated one when the indices are fake (:mod:`lrmoe.parallel.fake`: a memory estimate; no
    collective). ValueError on every rank when a rank's expert indices leave [0, E)."""
    if fake.is_fake(idx):
        return fake.demand(ep.world_size, ep.num_experts, idx.numel())
    E = ep.num_experts
    flat = idx.reshape(-1)
    inside = (flat >= 0) & (flat < E)
    demand_E = count_by_value(torch.where(inside, flat, E), E + 1)  # out-of-range indices in bin E
    if flat.numel():
        extremes = torch.stack([flat.min(), flat.max()])
    else:  # (no tokens: an in-range pair, made on the device)
        extremes = torch.arange(2, dtype=torch.int64, device=idx.device) * (E - 1)
    rows = gather_demand(ep, torch.cat([demand_E, extremes]), header, readable)
    bad = np.flatnonzero(rows[:, E] > 0)
    if bad.size:
        r = int(bad[0])
        raise ValueError(f"expert indices must be in [0, {E - 1}] (global ids), got values in "
                         f"[{rows[r, E + 1]}, {rows[r, E + 2]}] on rank {r}")
    return rows[:, :E]


def _rerun(hidden_TH, idx, w_TK, gate_up, down, ep, policy, activation):
    """The recompute of a checkpointed forward (:mod:`lrmoe.recompute`): the pieces of the layer's last
    plan, run again on the same tokens; no demand collective, no planning, no state, no record (the
    backward runs the first forward's graph, whose record it fills)."""
    plans = ep.last_plan if isinstance(ep.last_plan, list) else [ep.last_plan]
    if plans[0] is None:
        raise RuntimeError("activation checkpointing recomputes an expert-parallel layer that has no plan: "
                           "the recompute must follow this layer's forward")
    T, n = idx.shape[0], len(plans)
    bounds = [T * j // n for j in range(n + 1)]
    outs = [_run(hidden_TH[a:b], idx[a:b], w_TK[a:b], gate_up, down, ep, p, policy, None, 0.0, activation)
            for p, a, b in zip(plans, bounds, bounds[1:])]
    return outs[0] if n == 1 else torch.cat(outs)


def activation_key(activation) -> str:
    """A name of the activation that is the same in every process (the ranks' header check):
    'silu' for None, a module's repr (its settings, e.g. ``GELU(approximate='tanh')``), a
    ``functools.partial``'s function and arguments, a function's qualified name (so two lambdas,
    or two local functions of one name, are not told apart)."""
    if activation is None:
        return "silu"
    if isinstance(activation, nn.Module):
        return repr(activation)
    if isinstance(activation, functools.partial):
        kw = sorted(activation.keywords.items())
        return f"partial({activation_key(activation.func)}, {activation.args!r}, {kw!r})"
    return f"{getattr(activation, '__module__', '')}.{getattr(activation, '__qualname__', type(activation).__name__)}"


def _run(hidden_TH, idx, w_TK, gate_up, down, ep, plan, policy, record, plan_seconds=0.0, activation=None):
    compacts = policy.selects and policy.mode == "compact" and bool((plan.backward_quota_GN != plan.send_GN).any())
    t0 = time.perf_counter()
    layout = Layout(plan, ep.rank, ep.experts_per_rank, compacts, hidden_TH.device)
    dt = time.perf_counter() - t0
    ep.layout_seconds += dt
    ep.layout_seconds_total += dt
    call = Call(ep, plan, layout, policy, record, ep.num_experts, activation)
    call.plan_seconds = plan_seconds
    with autocast_off(hidden_TH.device):
        return EPExperts.apply(hidden_TH, w_TK, gate_up, down, idx, call)


# ----------------------------------------------------------------------------- module
class ExpertParallelExperts(nn.Module):
    """This rank's share of an expert-parallel gated experts layer (transformers layout; ``activation``
    as in :func:`ep_experts`, None: SwiGLU).

    gate_up_proj [E/G, 2I, H], down_proj [E/G, H, I]: the experts ``ep.local_experts``.
    ``forward(hidden [T, H], top_k_index [T, K] (global ids), top_k_weights [T, K])``.
    ``last_backward``: this rank's :class:`BackwardRecord` of the latest backward."""

    def __init__(self, ep: ExpertParallel, hidden_size: int, intermediate_size: int,
                 policy: BackwardPolicy | None = None, activation=None):
        super().__init__()
        self.activation = experts_activation(activation)  # None for SiLU in any spelling
        El = ep.experts_per_rank
        self.ep, self.hidden_size, self.intermediate_size = ep, hidden_size, intermediate_size
        self.num_experts = ep.num_experts
        self.gate_up_proj = mark_expert_parallel(nn.Parameter(torch.empty(El, 2 * intermediate_size, hidden_size)))
        self.down_proj = mark_expert_parallel(nn.Parameter(torch.empty(El, hidden_size, intermediate_size)))
        self.policy = check_policy(policy)
        self.last_backward: BackwardRecord | None = None

    @classmethod
    def from_full(cls, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, ep: ExpertParallel,
                  policy: BackwardPolicy | None = None, activation=None) -> "ExpertParallelExperts":
        """This rank's module from full [E, 2I, H] / [E, H, I] weights (every rank passes the same)."""
        E, I2, H = gate_up_proj.shape
        m = cls(ep, H, I2 // 2, policy, activation).to(device=gate_up_proj.device, dtype=gate_up_proj.dtype)
        with torch.no_grad():
            m.gate_up_proj.copy_(ep.shard(gate_up_proj))
            m.down_proj.copy_(ep.shard(down_proj))
        return m

    def _on_backward(self, record: BackwardRecord) -> None:
        self.last_backward = record

    def forward(self, hidden_TH, top_k_index_TK, top_k_weights_TK):
        record = None
        if torch.is_grad_enabled():
            ref = weakref.ref(self)
            record = BackwardRecord(on_fill=lambda r: (m := ref()) is not None and m._on_backward(r))
        return ep_experts(hidden_TH, top_k_index_TK, top_k_weights_TK, self.gate_up_proj, self.down_proj, self.ep,
                          self.policy, record, self.activation)
