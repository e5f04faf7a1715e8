"""Virtual expert parallelism: one process executes what G expert-parallel ranks would.

    group = VirtualGroup(G)
    vep = VirtualExpertParallel(E, group, "symi")     # one per MoE layer (SYMI keeps state)
    y = virtual_ep_experts(hidden_TH, idx_TK, w_TK, gate_up_EIH, down_EHI, vep, policy, record)

The T tokens of a call are G source ranks' tokens, in rank order: ``group.rows`` (rows per source,
set by the caller before the forward, e.g. ``micro_batch / G`` each, as the training runner splits
a micro-batch over its ranks) or, when unset, T split into G contiguous blocks ``T*r//G``. Each
call then does what :func:`lrmoe.parallel.runtime.ep_experts` does on G ranks, with the same code
wherever no communication is involved:

* the demand [G, E] (pairs per source and expert) goes through :meth:`ExpertParallel.plan`
  (:func:`lrmoe.planning.step.plan_layer`), with the layer's planner state (SYMI's popularity,
  advanced by training calls only), the oom refusal (:func:`~lrmoe.parallel.runtime.check_fits`) and
  split microbatches (every source's tokens cut into ``num_splits`` contiguous pieces, piece j of
  all sources planned on its own demand, fallback ``oom``);
* each source's pairs are given to the plan's instances by its :class:`~lrmoe.parallel.layout.Layout`
  (``send_GN`` consecutive pairs per instance in pair order; the rest are dropped in forward: their
  output is 0, their router gradient 0, their backward none);
* the backward scores and selects per (source, instance) bucket with the runtime's
  :func:`~lrmoe.parallel.function.select_pairs` (``backward_quota_GN[source, instance]`` pairs each),
  one call per source, with the gradient a rank would see: ``G * dL/dy`` (a rank's loss is scaled
  by the world size, :mod:`lrmoe.train.ep`; for a power-of-two G the scores are exactly the rank's)
  and, for the ``random`` scorer, source r's own generator (seed ``rank_seed(seed, r)``, as
  :meth:`lrmoe.train.ep.DistributedRunner.policy_for_rank` gives rank r).

What differs is only where the arithmetic happens: every instance of an expert (owner, replica,
SYMI slot) holds the owner's weights, so the computed pairs of an expert run as one group of the
full [E, ...] weights in this process, and the gradients of every instance add up in place (the
runtime sends replica gradients back to the owner and adds them). Results equal a G-rank run up to
floating-point summation order. Nothing crosses a network, so no ``comm_bytes`` are recorded (the
cluster simulator computes the bytes from the plans).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from ..experts import (acc_dtype, autocast_inputs, autocast_off, buffer_bytes, check_routing_shapes, combine,
                       expert_backward, experts_activation, gated, row_weights)
from ..kernels.grouped_gemm import grouped_mm
from ..kernels.routing import count_by_value, sort_pairs_by_expert, sum_rows_by_token
from ..planning.plan import Plan
from ..policy import BackwardPolicy, BackwardRecord, check_policy
from .function import select_pairs
from .launch import rank_seed
from .layout import Layout
from .runtime import ExpertParallel, check_fits

__all__ = ["VirtualExpertParallel", "VirtualEPExperts", "VirtualGroup", "virtual_ep_experts"]


class VirtualGroup:
    """The G virtual ranks of a process: how the next call's tokens split into sources, and the
    ``random`` scorer's generators of sources 1..G-1 (source 0 uses the policy's own)."""

    def __init__(self, world_size: int):
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 2:
            raise ValueError(f"a virtual expert-parallel group needs world_size >= 2 ranks, got {world_size!r}")
        self.world_size = world_size
        self.rows: list[int] | None = None  # rows per source of the next calls (None: T split evenly)
        self._generators: dict[tuple[torch.device, int], torch.Generator] = {}

    def token_bounds(self, T: int) -> list[int]:
        """G + 1 token offsets: source r holds tokens ``[b[r], b[r+1])``."""
        G = self.world_size
        if self.rows is None:
            return [T * r // G for r in range(G + 1)]
        rows = list(self.rows)
        n = sum(rows)
        if len(rows) != G or n <= 0 or T % n:
            raise ValueError(f"VirtualGroup.rows {rows} (rows per source of {G}) do not split the call's {T} tokens "
                             f"into whole rows")
        per = T // n
        return [0] + [int(x) * per for x in np.cumsum(rows)]

    def generator(self, seed: int, device: torch.device) -> torch.Generator:
        key = (torch.device(device), int(seed))
        if key not in self._generators:
            self._generators[key] = torch.Generator(device=key[0]).manual_seed(key[1])
        return self._generators[key]

    def generator_states(self) -> dict:
        """{(device str, seed): state} of the sources' generators (for a checkpoint)."""
        return {(str(d), s): g.get_state() for (d, s), g in self._generators.items()}

    def load_generator_states(self, states: dict) -> None:
        for (d, s), st in states.items():
            self.generator(s, torch.device(d)).set_state(st)

    def source_policies(self, policy: BackwardPolicy, snapshot, device: torch.device) -> list:
        """The policy snapshot each source's backward uses: source r draws from its own generator."""
        if snapshot.generator is None or policy.seed is None:
            return [snapshot] * self.world_size
        return [snapshot] + [dataclasses.replace(snapshot, generator=self.generator(rank_seed(policy.seed, r), device))
                             for r in range(1, self.world_size)]


class VirtualExpertParallel(ExpertParallel):
    """An :class:`ExpertParallel` layer's settings and planner state over the G ranks of a
    :class:`VirtualGroup`, without torch.distributed (same arguments besides ``group``)."""

    def __init__(self, num_experts: int, group: VirtualGroup, placement: str = "fixed", *,
                 budget_bytes: float = math.inf, slots_per_rank: int | None = None, fast_domains=None,
                 grad_bytes: int = 4, optimizer_bytes_per_param: int = 12, **options):
        if not isinstance(group, VirtualGroup):
            raise ValueError(f"group must be a VirtualGroup, got {group!r}")
        if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
            raise ValueError(f"num_experts must be an int >= 1, got {num_experts!r}")
        self.group, self.rank, self.world_size = group, 0, group.world_size
        self.backend, self.sizes_checked = "virtual", True
        self._configure(num_experts, placement, budget_bytes=budget_bytes, slots_per_rank=slots_per_rank,
                        fast_domains=fast_domains, grad_bytes=grad_bytes,
                        optimizer_bytes_per_param=optimizer_bytes_per_param, **options)

    @property
    def local_experts(self) -> range:
        return range(self.num_experts)  # the process holds every expert

    def plans(self) -> list[Plan]:
        """The latest call's plans (one, or one per piece of a split microbatch)."""
        p = self.last_plan
        return [] if p is None else list(p) if isinstance(p, list) else [p]


class _Call:
    """What one virtual call (one plan) carries from forward to backward."""

    def __init__(self, vep, plan, bounds, layouts, send_pairs, policies, record, plan_seconds, activation):
        self.vep, self.plan, self.bounds, self.layouts = vep, plan, bounds, layouts
        self.send_pairs, self.policies, self.record, self.plan_seconds = send_pairs, policies, record, plan_seconds
        self.activation = activation


def _gemm(a, b_EXY, offs, backend):
    if a.shape[0] == 0:
        return a.new_zeros(0, b_EXY.shape[2])
    return grouped_mm(a, b_EXY, offs, backend=backend)


class VirtualEPExperts(torch.autograd.Function):
    """The experts of one virtual call (see the module docstring); recognised by the step timer."""

    @staticmethod
    def forward(ctx, hidden_TH, alpha_TK, gate_up, down, idx_TK, call: _Call):
        T, K = idx_TK.shape
        P, H, E = T * K, hidden_TH.shape[1], gate_up.shape[0]
        pol = call.policies[0]
        computed = torch.cat([sp + b * K for sp, b in zip(call.send_pairs, call.bounds)])  # global pair ids
        expert_c = idx_TK.reshape(-1).index_select(0, computed)
        rows_pair = computed.index_select(0, torch.argsort(expert_c, stable=True))  # expert-major
        offs = torch.cumsum(count_by_value(expert_c, E), 0).to(torch.int32)
        X = hidden_TH.to(gate_up.dtype).index_select(0, rows_pair // K)
        GU = _gemm(X, gate_up.transpose(1, 2), offs, pol.backend)
        h = gated(GU, call.activation)
        O = _gemm(h, down.transpose(1, 2), offs, pol.backend)
        O_TKH = O.new_zeros(P, H).index_copy_(0, rows_pair, O).view(T, K, H)  # dropped pairs: 0
        phi_TK = None
        if pol.selects:
            hf = h.float()
            phi_TK = hf.new_zeros(P).index_copy_(0, rows_pair, (hf * hf).sum(-1)).view(T, K)
        del h
        y = combine(alpha_TK, O_TKH, hidden_TH.dtype)
        ctx.save_for_backward(hidden_TH, alpha_TK, gate_up, down, idx_TK, rows_pair, O_TKH, phi_TK, X, GU)
        ctx.call = call
        return y

    @staticmethod
    def backward(ctx, g_TH):
        with autocast_off(g_TH.device):
            return VirtualEPExperts._backward(ctx, g_TH)

    @staticmethod
    def _backward(ctx, g_TH):
        hidden_TH, alpha_TK, gate_up, down, idx_TK, rows_pair, O_TKH, phi_TK, X, GU = ctx.saved_tensors
        call = ctx.call
        T, K = idx_TK.shape
        E, G = gate_up.shape[0], call.vep.world_size
        g_TH = g_TH.contiguous()
        grad_alpha = None
        if ctx.needs_input_grad[1]:
            acc = acc_dtype(O_TKH, alpha_TK)
            grad_alpha = torch.bmm(O_TKH.to(acc), g_TH.to(acc).unsqueeze(-1)).squeeze(-1).to(alpha_TK.dtype)

        # Selection per source rank, on the gradient that rank sees (G x dL/dy, see the module docstring).
        scores, keeps, incls = [], [], []
        for r in range(G):
            sl = slice(call.bounds[r], call.bounds[r + 1])
            s_r, k_r, i_r = select_pairs(call.policies[r], call.layouts[r], call.send_pairs[r], alpha_TK[sl], g_TH[sl] * G,
                                    None if phi_TK is None else phi_TK[sl], hidden_TH[sl], idx_TK[sl])
            scores.append(s_r)
            keeps.append(k_r)
            incls.append(i_r)
        keep_P = torch.cat(keeps)
        incl_P = torch.cat(incls) if incls[0] is not None else None
        scores_TK = torch.cat(scores) if scores[0] is not None else None

        # The kept rows (expert-major, as computed in forward) through the expert backward.
        kept_rows = torch.nonzero(keep_P.index_select(0, rows_pair)).squeeze(1)
        rows_k = rows_pair.index_select(0, kept_rows)
        offs_k = torch.cumsum(count_by_value(idx_TK.reshape(-1).index_select(0, rows_k), E), 0).to(torch.int32)
        acc = acc_dtype(g_TH, alpha_TK)
        G_k = g_TH.index_select(0, rows_k // K).to(acc).mul_(
            row_weights(alpha_TK.reshape(-1), acc, keep_P, incl_P).index_select(0, rows_k).unsqueeze(1)
        ).to(gate_up.dtype)
        if G_k.shape[0]:
            dX, dW_gu, dW_d = expert_backward(G_k, GU.index_select(0, kept_rows), X.index_select(0, kept_rows), offs_k,
                                              gate_up, down, backend=call.policies[0].backend,
                                              activation=call.activation)
        else:
            dX, dW_gu, dW_d = G_k.new_zeros(0, gate_up.shape[2]), torch.zeros_like(gate_up), torch.zeros_like(down)
        grad_hidden = None
        if ctx.needs_input_grad[0]:
            grad_hidden = sum_rows_by_token(dX, rows_k, T, K).to(hidden_TH.dtype)

        if call.record is not None:
            pol = call.policies[0]
            if scores_TK is not None:
                nonfinite = (~torch.isfinite(scores_TK)).sum()
            else:
                nonfinite = (~torch.isfinite(g_TH)).any(-1).sum() * K
            quota = sum(lay.local_quota_E for lay in call.layouts)
            call.record.fill(demand=count_by_value(idx_TK.reshape(-1), E),
                             quota=torch.as_tensor(quota, dtype=torch.int64, device=g_TH.device),
                             kept=count_by_value(idx_TK.reshape(-1), E, weights=keep_P), kept_mask=keep_P.view(T, K),
                             scores=scores_TK, nonfinite=nonfinite, mode=pol.mode, drop_ratio=pol.drop_ratio,
                             scorer=None if scores_TK is None else pol.scorer,
                             selection=None if scores_TK is None else pol.selection,
                             inclusion=None if incl_P is None else incl_P.view(T, K),
                             buffer_bytes=buffer_bytes(G_k.shape[0], gate_up.shape[2], gate_up.shape[1] // 2,
                                                       G_k.element_size()),
                             timings={}, plan=call.plan, world_size=G, plan_seconds=call.plan_seconds)
        return grad_hidden, grad_alpha, dW_gu, dW_d, None, None


def _demand(idx_TK: torch.Tensor, bounds: list[int], E: int) -> np.ndarray:
    return np.stack([torch.bincount(idx_TK[bounds[r]:bounds[r + 1]].reshape(-1), minlength=E).cpu().numpy()
                     for r in range(len(bounds) - 1)]).astype(np.int64)


def _run(hidden_TH, idx, w_TK, gate_up, down, vep, plan, bounds, policies, record, plan_s, activation):
    E, G = vep.num_experts, vep.world_size
    layouts = [Layout(plan, r, vep.experts_per_rank, False, hidden_TH.device) for r in range(G)]
    send_pairs = [sort_pairs_by_expert(idx[bounds[r]:bounds[r + 1]], E)[0].index_select(0, layouts[r].send_pos)
                  for r in range(G)]
    call = _Call(vep, plan, bounds, layouts, send_pairs, policies, record, plan_s, activation)
    with autocast_off(hidden_TH.device):
        return VirtualEPExperts.apply(hidden_TH, w_TK, gate_up, down, idx, call)


def _merge(target: BackwardRecord, parts: list[BackwardRecord], tokens: torch.Tensor, T: int) -> None:
    """One record for a split call: counts summed, masks and scores back in token order."""
    order = torch.argsort(tokens)
    cat = lambda name: torch.cat([getattr(p, name) for p in parts]).index_select(0, order)  # noqa: E731
    scores = cat("scores") if all(p.scores is not None for p in parts) else None
    inclusion = cat("inclusion") if all(p.inclusion is not None for p in parts) else None
    target.fill(demand=sum(p.demand for p in parts), quota=sum(p.quota for p in parts),
                kept=sum(p.kept for p in parts), kept_mask=cat("kept_mask"), scores=scores,
                selection=parts[0].selection, inclusion=inclusion,
                nonfinite=sum(p.nonfinite for p in parts), mode=parts[0].mode, drop_ratio=parts[0].drop_ratio,
                scorer=parts[0].scorer, buffer_bytes=max(p.buffer_bytes for p in parts), timings={},
                plan=[p.plan for p in parts], world_size=parts[0].world_size,
                plan_seconds=sum(p.plan_seconds for p in parts))


def virtual_ep_experts(hidden_TH: torch.Tensor, top_k_index_TK: torch.Tensor, top_k_weights_TK: torch.Tensor,
                       gate_up_proj: torch.Tensor, down_proj: torch.Tensor, vep: VirtualExpertParallel,
                       policy: BackwardPolicy | None = None, record: BackwardRecord | None = None,
                       activation=None) -> torch.Tensor:
    """Gated experts over the tokens of G virtual source ranks (module docstring); ``activation`` as in
    :func:`lrmoe.parallel.runtime.ep_experts` (None: SwiGLU).

    hidden_TH [T, H]; top_k_index_TK [T, K] expert ids; top_k_weights_TK [T, K]; gate_up_proj
    [E, 2I, H] and down_proj [E, H, I]: the full weights. Returns y_TH [T, H]. ``record`` is filled
    in backward with the sums over the sources (demand, quota, kept per expert), the kept mask and
    scores [T, K], ``plan`` (a list for a split call), ``world_size`` and ``plan_seconds``."""
    policy = check_policy(policy)
    activation = experts_activation(activation)  # SiLU in any spelling: the fused path
    T, H = hidden_TH.shape if hidden_TH.dim() == 2 else (None, None)
    if T is None:
        raise ValueError(f"hidden_TH must be [T, H], got shape {tuple(hidden_TH.shape)}")
    E = vep.num_experts
    if gate_up_proj.dim() != 3 or gate_up_proj.shape[0] != E or down_proj.dim() != 3 or down_proj.shape[0] != E:
        raise ValueError(f"virtual EP takes the full expert weights [E={E}, ...], got {tuple(gate_up_proj.shape)} "
                         f"and {tuple(down_proj.shape)}")
    check_routing_shapes(T, top_k_index_TK, top_k_weights_TK)
    idx = top_k_index_TK.to(torch.int64)
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= E):
        raise ValueError(f"expert indices must be in [0, {E - 1}], got values in [{int(idx.min())}, {int(idx.max())}]")
    bounds = vep.group.token_bounds(T)
    snap = policy.snapshot(hidden_TH.device)
    policies = vep.group.source_policies(policy, snap, hidden_TH.device)
    hidden_TH, gate_up_proj, down_proj = autocast_inputs(hidden_TH, gate_up_proj, down_proj)
    K, I = idx.shape[1], gate_up_proj.shape[1] // 2
    dims = vep.dims(H, I, K, gate_up_proj.element_size())
    prev_state = vep.state
    vep.plan_seconds = 0.0
    plan = vep.plan(_demand(idx, bounds, E), dims, snap, state=prev_state)
    plan_s = vep.plan_seconds
    if torch.is_grad_enabled():  # as the runtime: training calls advance the planner's state
        vep.state = plan.state
    check_fits(plan, vep)
    if plan.num_splits == 1:
        vep.last_plan = plan
        return _run(hidden_TH, idx, top_k_weights_TK, gate_up_proj, down_proj, vep, plan, bounds, policies, record,
                    plan_s, activation)

    # Split: piece j = the j-th of n contiguous pieces of every source's tokens, planned on its own.
    n = plan.num_splits
    pieces = []
    for j in range(n):
        ranges = [(b0 + (b1 - b0) * j // n, b0 + (b1 - b0) * (j + 1) // n) for b0, b1 in zip(bounds, bounds[1:])]
        pieces.append((torch.cat([torch.arange(a, b, device=idx.device) for a, b in ranges]),
                       [0] + list(np.cumsum([b - a for a, b in ranges]))))
    parts = [] if record is not None else None
    outs, plans = [], []
    tokens = torch.cat([tok for tok, _ in pieces])
    for j, (tok, pb) in enumerate(pieces):
        i_j = idx.index_select(0, tok)
        before = vep.plan_seconds
        p_j = vep.plan(_demand(i_j, pb, E), dims, snap, state=prev_state, piece=True)
        piece_s = vep.plan_seconds - before + (plan_s if j == 0 else 0.0)
        plans.append(p_j)
        rec_j = None
        if record is not None:
            def on_fill(_r, parts=parts):
                if all(p.filled for p in parts):
                    _merge(record, parts, tokens, T)
            rec_j = BackwardRecord(on_fill=on_fill)
            parts.append(rec_j)
        outs.append(_run(hidden_TH.index_select(0, tok), i_j, top_k_weights_TK.index_select(0, tok), gate_up_proj,
                         down_proj, vep, p_j, [int(b) for b in pb], policies, rec_j, piece_s, activation))
    vep.last_plan = plans
    return torch.cat(outs).index_select(0, torch.argsort(tokens))
