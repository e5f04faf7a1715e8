"""Expert-parallel SwiGLU experts on torch.distributed (NCCL on GPUs, gloo on CPU).

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
parameters are sums over the tokens of all ranks (no 1/G; see :func:`finish_grad_sync`).

Every rank must call every EP layer with the same configuration and backpropagate through every
call (the backward runs collectives). Collective failures (a peer that died or never came, a
timeout) raise :class:`EPCommunicationError` where the backend reports them to the caller (gloo;
NCCL with ``TORCH_NCCL_BLOCKING_WAIT=1``); NCCL collectives otherwise do not block the host and
the NCCL watchdog aborts the process when one times out. Set the process-group timeout with
``init_process_group(timeout=...)`` (:func:`lrmoe.parallel.launch.init_distributed`). With NCCL
every tensor must be on this rank's GPU (``torch.cuda.current_device()``).
"""
from __future__ import annotations

import dataclasses
import math
import time
import weakref
import zlib
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ..experts import (Stopwatch, acc_dtype, autocast_inputs, autocast_off, buffer_bytes, check_routing_shapes,
                       expert_backward, score_pairs, swiglu)
from ..kernels.grouped_gemm import grouped_mm
from ..kernels.routing import select_top_quota, sort_pairs_by_expert, sum_rows_by_token
from ..policy import BackwardPolicy, BackwardRecord, check_policy
from ..planning.memory import plan_memory
from ..planning.plan import Cluster, ModelDims, Plan, expert_sum, largest_remainder
from ..planning.policies import get_placement, plan_placement

__all__ = ["EPCommunicationError", "EPOutOfMemoryError", "ExpertParallel", "ExpertParallelExperts", "ep_experts",
           "selection_quotas", "finish_grad_sync", "broadcast_dense_params", "is_expert_parallel_param",
           "BACKWARD_ROW_KEYS"]

# Keys of ``record.comm_bytes`` that are the backward all-to-alls of token rows.
BACKWARD_ROW_KEYS = ("bwd_grad_rows", "bwd_grad_index", "bwd_dx")
_EP_PARAM_ATTR = "_lrmoe_expert_parallel"


class EPCommunicationError(RuntimeError):
    """A collective of the expert-parallel runtime failed (timeout, peer gone, backend error)."""


class EPOutOfMemoryError(RuntimeError):
    """The placement policy's plan does not fit the memory budget and its fallback is ``oom``."""


def is_expert_parallel_param(p: torch.Tensor) -> bool:
    """True for expert weights sharded by the EP runtime (their gradients are not data parallel)."""
    return bool(getattr(p, _EP_PARAM_ATTR, False))


def _mark(p: nn.Parameter) -> nn.Parameter:
    setattr(p, _EP_PARAM_ATTR, True)
    return p


def _crc(s: str) -> int:
    return zlib.crc32(s.encode()) & 0x7FFFFFFF


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
        self._sizes_checked = False  # the first call checks the message sizes before the demand gather
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
        self.budget_bytes = budget_bytes
        self.grad_bytes, self.optimizer_bytes_per_param = grad_bytes, optimizer_bytes_per_param
        self.options = dict(options)
        self.state: Any = None  # planner state (SYMI: last step's popularity)
        self.last_plan: Plan | list[Plan] | None = None
        self.last_forward_bytes: dict[str, int] = {}
        self.plan_seconds = 0.0  # host time of the latest call's planning (all pieces)

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

    def planner_options(self, policy: BackwardPolicy) -> dict:
        opts = dict(self.options)
        if self.placement == "lrmoe":
            opts.setdefault("drop_ratio", policy.drop_ratio if policy.selects else 0.0)
            if not policy.selects:  # nothing is scored, so every row is kept: quotas cannot shrink
                opts["max_drop_ratio"] = 0.0
            opts.setdefault("quota_policy", policy.quota)
            opts.setdefault("quota_options", dict(policy.quota_kwargs))
        return opts

    def plan(self, demand_GE: np.ndarray, dims: ModelDims, policy: BackwardPolicy, *, state=None,
             piece: bool = False) -> Plan:
        """The plan every rank computes for this demand (pure, deterministic); backward quotas from
        the policy are applied to baseline placements (:func:`selection_quotas`). ``piece``: a
        piece of a split microbatch, planned with fallback ``oom`` (executed even if over budget)."""
        t0 = time.perf_counter()
        opts = self.planner_options(policy)
        if piece:
            opts["fallback"] = "oom"
        plan = plan_placement(self.placement, demand_GE, self.cluster, dims, self.budget_bytes, state=state, **opts)
        if policy.selects and plan.policy != "lrmoe":
            plan = selection_quotas(plan, policy, dims)
        self.plan_seconds += time.perf_counter() - t0
        return plan

    def planner_signature(self) -> str:
        """Everything besides the demand and the policy that decides the plan (compared across ranks)."""
        return repr((sorted(self.options.items()), repr(self.budget_bytes), self.cluster.domain_G.tolist(),
                     self.grad_bytes, self.optimizer_bytes_per_param))

    def __repr__(self) -> str:
        return (f"ExpertParallel(E={self.num_experts}, rank={self.rank}/{self.world_size}, placement={self.placement!r}, "
                f"slots_per_rank={self.cluster.slots_per_rank}, budget_bytes={self.budget_bytes}, options={self.options})")


def selection_quotas(plan: Plan, policy: BackwardPolicy, dims: ModelDims) -> Plan:
    """Backward quotas of ``policy`` on a plan that keeps every pair (a baseline placement).

    The same rule as the LRMoE planner: q_e = the policy's quota over the global computed demand
    (sent pairs), split over e's instances in proportion to their rows, then over each instance's
    source ranks in proportion to the pairs each sent (largest remainder both times)."""
    from ..quota import quota_for, retained_total

    ex = plan.expert_N
    E = plan.demand_GE.shape[1]
    sent_E = expert_sum(plan.send_GN, ex, E).sum(0)
    P = int(sent_E.sum())
    # n_keep is exactly round((1 - rho) P): pass rho on, as the single-process layer does (the
    # proportional policy targets (1 - rho) d_e, not n_keep / P * d_e).
    q_E = quota_for(torch.as_tensor(sent_E), retained_total(P, policy.drop_ratio), policy.quota,
                    drop_ratio=policy.drop_ratio, **policy.quota_kwargs).numpy()
    quota = np.zeros_like(plan.send_GN)
    rows_N = plan.rows_N
    for e in range(E):
        cols = np.flatnonzero(ex == e)
        if q_E[e] == 0:
            continue
        for n, b in zip(cols, largest_remainder(int(q_E[e]), rows_N[cols])):
            quota[:, n] = largest_remainder(int(b), plan.send_GN[:, n])
    mem = plan_memory(dims, plan.demand_GE.shape[0], plan.rank_N, plan.is_replica_N, plan.send_GN, quota,
                      optimizer_on_gpu=plan.policy != "symi", pairs_G=plan.demand_GE.sum(1))
    info = {**plan.info, "quota_E": q_E, "n_keep": int(q_E.sum()), "selection": "runtime quotas over a baseline placement"}
    return dataclasses.replace(plan, backward_quota_GN=quota, memory=mem, info=info).check()


# ----------------------------------------------------------------------------- collectives
def _collective(ep: ExpertParallel, what: str, fn):
    try:
        return fn()
    except EPCommunicationError:
        raise
    except (RuntimeError, dist.DistError) as err:  # DistBackendError, gloo/NCCL timeouts, closed peers
        raise EPCommunicationError(
            f"expert-parallel {what} failed on rank {ep.rank} of {ep.world_size} (placement {ep.placement!r}): "
            f"{type(err).__name__}: {err}. Every rank of the EP group must call every expert-parallel layer "
            f"with the same configuration and run its backward; a peer may have crashed or timed out.") from err


def _all_to_all(ep: ExpertParallel, x: torch.Tensor, out_splits, in_splits, what: str, comm: dict) -> torch.Tensor:
    """all_to_all_single with uneven splits; counts the bytes this rank sends to other ranks."""
    row = math.prod(x.shape[1:]) * x.element_size()
    comm[what] = comm.get(what, 0) + row * (sum(in_splits) - in_splits[ep.rank])
    if ep.world_size == 1:
        return x
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    _collective(ep, f"all_to_all ({what})",
                lambda: dist.all_to_all_single(out, x.contiguous(), list(out_splits), list(in_splits), group=ep.group))
    return out


_HEADER_NAMES = ("num_experts", "hidden", "intermediate", "top_k", "experts_per_rank", "weight dtype",
                 "placement", "backward mode", "drop_ratio (1e-9)", "scorer", "quota policy", "slots_per_rank",
                 "quota/scorer options (crc)", "planner options, budget, fast domains, byte sizes (crc)")


def _check_headers(ep: ExpertParallel, rows: np.ndarray, h: int, readable: list | None = None) -> None:
    """ValueError on every rank when the gathered headers differ; ``readable`` (this rank's values
    behind the header's checksums) is then gathered too, on that error path only, so the message
    names the differing values rather than their checksums."""
    bad = [r for r in range(ep.world_size) if not np.array_equal(rows[r, :h], rows[0, :h])]
    if bad:
        shown = rows[:, :h].tolist()
        if readable is not None and ep.world_size > 1:  # every rank sees the mismatch: all take part
            gathered = [None] * ep.world_size
            _collective(ep, "all_gather_object (differing configuration)",
                        lambda: dist.all_gather_object(gathered, list(readable), group=ep.group))
            shown = gathered
        diff = [f"{n}: rank 0 has {shown[0][j]!s}, rank {r} has {shown[r][j]!s}" for r in bad
                for j, n in enumerate(_HEADER_NAMES) if rows[r, j] != rows[0, j]]
        raise ValueError(f"expert-parallel layer configured differently across ranks ({'; '.join(diff)})")


def _gather_demand(ep: ExpertParallel, demand_E: torch.Tensor, header: list[int],
                   readable: list | None = None) -> np.ndarray:
    """all_gather of [header, demand]; raises ValueError on every rank if the headers differ.

    The message has len(header) + E entries. NCCL does not check that every rank sends as many
    bytes (gloo does): ranks with different E would hang or read garbage. So the first call of
    each layer first gathers the fixed-size header alone; E is fixed per layer after that."""
    dev = demand_E.device
    mine = torch.cat([torch.tensor(header, dtype=torch.int64, device=dev), demand_E.to(torch.int64)])
    if ep.world_size == 1:
        rows = mine[None].cpu().numpy()
    else:
        if not ep._sizes_checked:
            head = mine[:len(header)].contiguous()
            hparts = [torch.empty_like(head) for _ in range(ep.world_size)]
            _collective(ep, "all_gather (demand) of the layer's sizes",
                        lambda: dist.all_gather(hparts, head, group=ep.group))
            _check_headers(ep, torch.stack(hparts).cpu().numpy(), len(header), readable)
            ep._sizes_checked = True
        parts = [torch.empty_like(mine) for _ in range(ep.world_size)]
        _collective(ep, "all_gather (demand)", lambda: dist.all_gather(parts, mine, group=ep.group))
        rows = torch.stack(parts).cpu().numpy()
    h = len(header)
    _check_headers(ep, rows, h, readable)
    return rows[:, h:]


# ----------------------------------------------------------------------------- plan -> index layout
def _segments(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Concatenation of arange(starts[j], starts[j] + lens[j]) over j (int64)."""
    starts, lens = np.asarray(starts, dtype=np.int64), np.asarray(lens, dtype=np.int64)
    total = int(lens.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    out_start = np.cumsum(lens) - lens
    return np.repeat(starts - out_start, lens) + np.arange(total, dtype=np.int64)


class _Layout:
    """Everything rank ``r`` needs to execute a plan, derived from the plan alone (host side).

    Instances on rank t are ordered by instance index; the all-to-all chunk a source sends to t
    holds, for each of t's instances in that order, the source's pairs assigned to it in pair
    order. The pairs of expert e on a source are given to e's instances in instance order
    (``send_GN`` consecutive pairs each, in pair order); the rest are dropped (forward drops:
    latest positions first). On the expert side, GEMM groups are the rank's owned experts
    (E/G, in order) followed by the experts it fetches from their owners (ascending)."""

    def __init__(self, plan: Plan, rank: int, experts_per_rank: int, compacts: bool, device: torch.device):
        G, E = plan.demand_GE.shape
        El, r = experts_per_rank, rank
        ex, rk = plan.expert_N, plan.rank_N
        send, quota = plan.send_GN, plan.backward_quota_GN
        N = len(ex)
        owner = ex // El
        local = [np.flatnonzero(rk == t) for t in range(G)]
        self.fetched = [np.unique(ex[loc][owner[loc] != t]) for t, loc in enumerate(local)]
        group_N = np.zeros(N, dtype=np.int64)
        for t, loc in enumerate(local):
            own = owner[loc] == t
            group_N[loc[own]] = ex[loc[own]] - t * El
            group_N[loc[~own]] = El + np.searchsorted(self.fetched[t], ex[loc[~own]])
        self.num_groups = El + len(self.fetched[r])
        self.compacts = compacts
        ints = lambda a: [int(v) for v in a]  # noqa: E731
        dev = lambda a: torch.as_tensor(np.asarray(a, dtype=np.int64), device=device)  # noqa: E731

        # Token side (this rank as a source).
        self.send_splits = ints(send[r, loc].sum() for loc in local)
        self.kept_send_splits = ints(quota[r, loc].sum() for loc in local)
        d_E = plan.demand_GE[r]
        start_E = np.cumsum(d_E) - d_E
        inst_start = np.zeros(N, dtype=np.int64)
        for e in range(E):
            cols = np.flatnonzero(ex == e)
            inst_start[cols] = start_E[e] + np.cumsum(send[r, cols]) - send[r, cols]
        seq = np.concatenate(local)  # rank-major instance order = send buffer order
        lens = send[r, seq]
        self.send_pos = dev(_segments(inst_start[seq], lens))  # positions in this rank's sorted-pair order
        self.send_inst = dev(np.repeat(seq, lens))  # instance of every send row
        self.quota_B = dev(np.r_[quota[r], 0])  # per bucket (instance), + the bucket of dropped pairs
        self.n_buckets = N
        self.n_kept_send = int(quota[r].sum())
        send_off = np.cumsum(self.send_splits) - self.send_splits
        self.kept_send_chunk_off = dev(np.repeat(send_off, self.kept_send_splits))
        self.local_quota_E = expert_sum(quota[r:r + 1], ex, E)[0]

        # Expert side (this rank as a destination).
        mine = local[r]
        rl = send[:, mine]  # [G, n] source-major, then instance
        self.recv_splits = ints(rl.sum(1))
        seg_start = (np.cumsum(rl.ravel()) - rl.ravel()).reshape(rl.shape)
        seg_group = np.broadcast_to(group_N[mine], rl.shape)
        o = np.lexsort((np.broadcast_to(np.arange(len(mine)), rl.shape).ravel(),
                        np.broadcast_to(np.arange(G)[:, None], rl.shape).ravel(), seg_group.ravel()))
        recv_order = _segments(seg_start.ravel()[o], rl.ravel()[o])
        self.recv_order = dev(recv_order)  # group order -> receive-buffer row
        inv = np.empty_like(recv_order)
        inv[recv_order] = np.arange(recv_order.size)
        self.recv_to_g = dev(inv)  # receive-buffer row -> group order position
        rows_g = np.bincount(seg_group.ravel(), weights=rl.ravel(), minlength=self.num_groups).astype(np.int64)
        self.rows_g = rows_g
        self.offs_g = torch.as_tensor(np.cumsum(rows_g), dtype=torch.int32, device=device)
        kl = quota[:, mine]
        self.kept_recv_splits = ints(kl.sum(1))
        kept_g = np.bincount(seg_group.ravel(), weights=kl.ravel(), minlength=self.num_groups).astype(np.int64)
        self.kept_g = kept_g
        self.offs_kept = torch.as_tensor(np.cumsum(kept_g), dtype=torch.int32, device=device)
        recv_off = np.cumsum(self.recv_splits) - self.recv_splits
        self.kept_recv_chunk_off = dev(np.repeat(recv_off, self.kept_recv_splits))

        # Replica weight sync: owner r sends t the experts of fetched[t] it owns (ascending).
        self.any_fetch = any(len(f) for f in self.fetched)
        own_block = lambda f, s: f[(f // El) == s]  # noqa: E731
        out = [own_block(self.fetched[t], r) - r * El for t in range(G)]
        self.wsend_splits = ints(len(x) for x in out)
        self.wsend_idx = dev(np.concatenate(out) if out else np.zeros(0))
        self.wrecv_splits = ints(len(own_block(self.fetched[r], s)) for s in range(G))


# ----------------------------------------------------------------------------- the autograd function
class _Call:
    """What one EP layer call carries from forward to backward (besides saved tensors)."""

    def __init__(self, ep, plan, layout, policy, record, num_experts):
        self.ep, self.plan, self.layout, self.policy, self.record = ep, plan, layout, policy, record
        self.num_experts = num_experts
        self.comm: dict[str, int] = {}


def _pack(gu: torch.Tensor, dn: torch.Tensor) -> torch.Tensor:
    return torch.cat([gu.flatten(1), dn.flatten(1)], 1)


def _unpack(buf: torch.Tensor, I2: int, H: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = buf.shape[0]
    return buf[:, :I2 * H].reshape(n, I2, H), buf[:, I2 * H:].reshape(n, H, I2 // 2)


def _row_gemm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, backend: str) -> torch.Tensor:
    if a.shape[0] == 0:
        return a.new_zeros(0, b.shape[2])
    return grouped_mm(a, b, offs, backend=backend)


class _EPExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_TH, alpha_TK, gate_up, down, idx_TK, call: _Call):
        ep, lay, policy = call.ep, call.layout, call.policy
        T, K = idx_TK.shape
        P = T * K
        H = hidden_TH.shape[1]
        w_dtype, backend = gate_up.dtype, policy.backend
        watch = Stopwatch(policy.profile, hidden_TH.device)
        perm_P, _, _ = sort_pairs_by_expert(idx_TK, call.num_experts)
        send_pair = perm_P.index_select(0, lay.send_pos)

        # Replica weight sync (owners -> hosts); the groups are owned experts then fetched ones.
        W_gu, W_d = gate_up, down
        if lay.any_fetch:
            buf = _all_to_all(ep, _pack(gate_up.index_select(0, lay.wsend_idx), down.index_select(0, lay.wsend_idx)),
                              lay.wrecv_splits, lay.wsend_splits, "fwd_weights", call.comm)
            f_gu, f_d = _unpack(buf, gate_up.shape[1], H)
            W_gu, W_d = torch.cat([gate_up, f_gu]), torch.cat([down, f_d])
        watch.lap("weight_sync")

        # Dispatch, expert GEMMs, combine.
        X_send = hidden_TH.to(w_dtype).index_select(0, send_pair // K)
        X_recv = _all_to_all(ep, X_send, lay.recv_splits, lay.send_splits, "fwd_dispatch", call.comm)
        watch.lap("dispatch")
        X_g = X_recv.index_select(0, lay.recv_order)
        del X_recv, X_send
        GU = _row_gemm(X_g, W_gu.transpose(1, 2), lay.offs_g, backend)
        h = swiglu(GU)
        O_g = _row_gemm(h, W_d.transpose(1, 2), lay.offs_g, backend)
        phi_g = None
        if policy.selects:
            hf = h.float()
            phi_g = (hf * hf).sum(-1)
        del h
        watch.lap("gemm")
        O_send = _all_to_all(ep, O_g.index_select(0, lay.recv_to_g), lay.send_splits, lay.recv_splits,
                             "fwd_combine", call.comm)
        O_TKH = O_send.new_zeros(P, H).index_copy_(0, send_pair, O_send).view(T, K, H)
        phi_TK = None
        if phi_g is not None:
            phi_send = _all_to_all(ep, phi_g.index_select(0, lay.recv_to_g), lay.send_splits, lay.recv_splits,
                                   "fwd_phi", call.comm)
            phi_TK = phi_send.new_zeros(P).index_copy_(0, send_pair, phi_send).view(T, K)
        watch.lap("combine")
        acc = acc_dtype(O_TKH, alpha_TK)
        y = torch.bmm(alpha_TK.to(acc).unsqueeze(1), O_TKH.to(acc)).squeeze(1).to(hidden_TH.dtype)
        for k, v in call.comm.items():  # summed over the pieces of a split microbatch
            ep.last_forward_bytes[k] = ep.last_forward_bytes.get(k, 0) + v
        call.forward_timings = watch.times
        ctx.save_for_backward(hidden_TH, alpha_TK, gate_up, down, idx_TK, send_pair, O_TKH, phi_TK, X_g, GU, W_gu, W_d)
        ctx.call = call
        return y

    @staticmethod
    def backward(ctx, g_TH):
        with autocast_off(g_TH.device):  # explicit dtypes, also when backward runs inside autocast
            return _EPExperts._backward(ctx, g_TH)

    @staticmethod
    def _backward(ctx, g_TH):
        hidden_TH, alpha_TK, gate_up, down, idx_TK, send_pair, O_TKH, phi_TK, X_g, GU, W_gu, W_d = ctx.saved_tensors
        call = ctx.call
        ep, lay, policy, record = call.ep, call.layout, call.policy, call.record
        T, K = idx_TK.shape
        P = T * K
        El = gate_up.shape[0]
        w_dtype, dev = gate_up.dtype, g_TH.device
        g_TH = g_TH.contiguous()
        watch = Stopwatch(policy.profile, dev)

        # 1. Router gradient for every routed pair (dropped pairs: O = 0).
        grad_alpha = None
        if ctx.needs_input_grad[1]:
            acc = acc_dtype(O_TKH, alpha_TK)
            grad_alpha = torch.bmm(O_TKH.to(acc), g_TH.to(acc).unsqueeze(-1)).squeeze(-1).to(alpha_TK.dtype)
        watch.lap("router_grad")

        # 2. Scores and selection within (source = this rank, instance) buckets.
        scores_TK = None
        bucket_P = torch.full((P,), lay.n_buckets, dtype=torch.int64, device=dev)
        bucket_P.index_copy_(0, send_pair, lay.send_inst)
        if policy.selects:
            scores_TK = score_pairs(policy, alpha_TK, g_TH, phi_TK, hidden_TH, idx_TK)
            keep_P = select_top_quota(scores_TK.reshape(-1), bucket_P, lay.quota_B)
        else:
            keep_P = bucket_P < lay.n_buckets  # every computed pair
        watch.lap("score_select")

        # 3. Rows that cross the network: the kept ones (compact), or all with dropped zeroed (mask/keep-all).
        if lay.compacts:
            kept_idx = torch.nonzero_static(keep_P.index_select(0, send_pair), size=lay.n_kept_send).squeeze(1)
            rows_pair = send_pair.index_select(0, kept_idx)
            pos = (kept_idx - lay.kept_send_chunk_off).to(torch.int32)
            out_splits, in_splits = lay.kept_recv_splits, lay.kept_send_splits
        else:
            rows_pair = send_pair
            out_splits, in_splits = lay.recv_splits, lay.send_splits
        acc = acc_dtype(g_TH, alpha_TK)
        G_rows = g_TH.index_select(0, rows_pair // K).to(acc).mul_(
            alpha_TK.reshape(-1).index_select(0, rows_pair).to(acc).unsqueeze(1))
        if not lay.compacts and policy.selects:  # mask mode, or a plan that keeps everything
            G_rows = torch.where(keep_P.index_select(0, rows_pair).unsqueeze(1), G_rows,
                                 torch.zeros((), dtype=G_rows.dtype, device=dev))
        G_rows = G_rows.to(w_dtype)
        watch.lap("grad_rows")
        G_recv = _all_to_all(ep, G_rows, out_splits, in_splits, "bwd_grad_rows", call.comm)
        if lay.compacts:
            pos_recv = _all_to_all(ep, pos, out_splits, in_splits, "bwd_grad_index", call.comm)
            gpos = lay.recv_to_g.index_select(0, lay.kept_recv_chunk_off + pos_recv.to(torch.int64))
            order = torch.argsort(gpos)
            gpos = gpos.index_select(0, order)
            G_k = G_recv.index_select(0, order)
            GU_k, X_k, offs = GU.index_select(0, gpos), X_g.index_select(0, gpos), lay.offs_kept
        else:
            G_k, GU_k, X_k, offs = G_recv.index_select(0, lay.recv_order), GU, X_g, lay.offs_g
        del G_recv, GU, X_g
        watch.lap("dispatch")

        # 4. Compacted grouped GEMMs on the expert side.
        if G_k.shape[0]:
            dX_k, dW_gu, dW_d = expert_backward(G_k, GU_k, X_k, offs, W_gu, W_d, backend=policy.backend)
        else:
            dX_k, dW_gu, dW_d = G_k.new_zeros(0, W_gu.shape[2]), torch.zeros_like(W_gu), torch.zeros_like(W_d)
        watch.lap("gemm")

        # 5. dX of the kept rows back to the token side; replica gradients back to the owners.
        if lay.compacts:
            dX_recv = torch.empty_like(dX_k).index_copy_(0, order, dX_k)
        else:
            dX_recv = dX_k.index_select(0, lay.recv_to_g)
        dX_rows = _all_to_all(ep, dX_recv, in_splits, out_splits, "bwd_dx", call.comm)
        grad_hidden = None
        if ctx.needs_input_grad[0]:
            grad_hidden = sum_rows_by_token(dX_rows, rows_pair, T, K).to(hidden_TH.dtype)
        dW_gu_own, dW_d_own = dW_gu[:El], dW_d[:El]
        if lay.any_fetch:
            back = _all_to_all(ep, _pack(dW_gu[El:], dW_d[El:]), lay.wsend_splits, lay.wrecv_splits,
                               "bwd_weight_grads", call.comm)
            r_gu, r_d = _unpack(back, gate_up.shape[1], gate_up.shape[2])
            dW_gu_own = dW_gu_own.contiguous().index_add_(0, lay.wsend_idx, r_gu)
            dW_d_own = dW_d_own.contiguous().index_add_(0, lay.wsend_idx, r_d)
        watch.lap("combine")

        if record is not None:
            E = call.num_experts
            kept_mask = keep_P.view(T, K)
            if scores_TK is not None:
                nonfinite = (~torch.isfinite(scores_TK)).sum()
            else:
                nonfinite = (~torch.isfinite(g_TH)).any(-1).sum() * K
            I = gate_up.shape[1] // 2
            record.fill(demand=torch.bincount(idx_TK.reshape(-1), minlength=E),
                        quota=torch.as_tensor(lay.local_quota_E, device=dev),
                        kept=torch.bincount(idx_TK.reshape(-1)[keep_P], minlength=E), kept_mask=kept_mask,
                        scores=scores_TK, nonfinite=nonfinite, mode=policy.mode, drop_ratio=policy.drop_ratio,
                        scorer=None if scores_TK is None else policy.scorer,
                        buffer_bytes=buffer_bytes(G_k.shape[0], gate_up.shape[2], I, G_k.element_size()),
                        timings={**{f"fwd_{k}": v for k, v in call.forward_timings.items()}, **watch.times},
                        comm_bytes=dict(call.comm), plan=call.plan, rank=ep.rank, world_size=ep.world_size)
        return grad_hidden, grad_alpha, dW_gu_own, dW_d_own, None, None


# ----------------------------------------------------------------------------- entry point
_MODES = {"full": 0, "compact": 1, "mask": 2}


def _check_devices(hidden_TH, idx_TK, w_TK, gate_up, down, ep: ExpertParallel):
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
    _check_devices(hidden_TH, idx_TK, w_TK, gate_up, down, ep)
    T, H = hidden_TH.shape
    El = ep.experts_per_rank
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[0] != El or gate_up.shape[2] != H \
            or gate_up.shape[1] % 2 or tuple(down.shape) != (El, H, gate_up.shape[1] // 2):
        raise ValueError(f"expert weights must be this rank's block of E/G = {El} experts: gate_up_proj [{El}, 2I, {H}] "
                         f"and down_proj [{El}, {H}, I], got {tuple(gate_up.shape)} and {tuple(down.shape)}")
    check_routing_shapes(T, idx_TK, w_TK)
    if idx_TK.numel():
        lo, hi = int(idx_TK.min()), int(idx_TK.max())
        if lo < 0 or hi >= ep.num_experts:
            raise ValueError(f"expert indices must be in [0, {ep.num_experts - 1}] (global ids), got values in [{lo}, {hi}]")


def _merge_records(target: BackwardRecord, parts: list[BackwardRecord]) -> None:
    """One record for a split microbatch: counts summed, masks and scores concatenated over tokens."""
    cat = lambda name: torch.cat([getattr(p, name) for p in parts])  # noqa: E731
    comm: dict[str, int] = {}
    for p in parts:
        for k, v in p.comm_bytes.items():
            comm[k] = comm.get(k, 0) + v
    scores = cat("scores") if all(p.scores is not None for p in parts) else None
    timings: dict[str, float] = {}  # seconds per phase, summed over the pieces
    for p in parts:
        for k, v in p.timings.items():
            timings[k] = timings.get(k, 0.0) + v
    target.fill(demand=sum(p.demand for p in parts), quota=sum(p.quota for p in parts), kept=sum(p.kept for p in parts),
                kept_mask=cat("kept_mask"), scores=scores, nonfinite=sum(p.nonfinite for p in parts),
                mode=parts[0].mode, drop_ratio=parts[0].drop_ratio, scorer=parts[0].scorer,
                buffer_bytes=max(p.buffer_bytes for p in parts), timings=timings, comm_bytes=comm, plan=[p.plan for p in parts], rank=parts[0].rank,
                world_size=parts[0].world_size)


def ep_experts(hidden_TH: torch.Tensor, top_k_index_TK: torch.Tensor, top_k_weights_TK: torch.Tensor,
               gate_up_proj: torch.Tensor, down_proj: torch.Tensor, ep: ExpertParallel,
               policy: BackwardPolicy | None = None, record: BackwardRecord | None = None) -> torch.Tensor:
    """Expert-parallel SwiGLU experts over this rank's tokens (a collective: every rank calls it).

    hidden_TH [T, H] (this rank's tokens; T may be 0); top_k_index_TK [T, K] global expert ids;
    top_k_weights_TK [T, K]; gate_up_proj [E/G, 2I, H] and down_proj [E/G, H, I]: this rank's
    owned experts ``ep.local_experts``. Returns y_TH [T, H]. ``record`` (a fresh
    :class:`BackwardRecord`) is filled in backward with this rank's view: demand, quota, kept
    (per expert, this rank's pairs), kept_mask, scores, plus ``comm_bytes`` (bytes this rank sent
    to other ranks per all-to-all: fwd_weights, fwd_dispatch, fwd_combine, fwd_phi,
    bwd_grad_rows, bwd_grad_index, bwd_dx, bwd_weight_grads), ``plan``, ``rank``, ``world_size``."""
    policy = check_policy(policy)
    _check_local_inputs(hidden_TH, top_k_index_TK, top_k_weights_TK, gate_up_proj, down_proj, ep)
    policy = policy.snapshot(hidden_TH.device)  # what this call's forward and backward use
    # under torch.autocast: bf16/fp16 rows and weights, like lrmoe_experts (then autocast off inside)
    hidden_TH, gate_up_proj, down_proj = autocast_inputs(hidden_TH, gate_up_proj, down_proj)
    idx = top_k_index_TK.to(torch.int64)
    T, K = idx.shape
    E, H, I = ep.num_experts, hidden_TH.shape[1], gate_up_proj.shape[1] // 2
    header = [E, H, I, K, ep.experts_per_rank, _crc(str(gate_up_proj.dtype)), _crc(ep.placement), _MODES[policy.mode],
              round(policy.drop_ratio * 1e9), _crc(policy.scorer), _crc(policy.quota), ep.cluster.slots_per_rank,
              _crc(repr((sorted(policy.quota_kwargs.items()), sorted(policy.scorer_kwargs.items())))),
              _crc(ep.planner_signature())]
    readable = [E, H, I, K, ep.experts_per_rank, gate_up_proj.dtype, ep.placement, policy.mode, policy.drop_ratio,
                policy.scorer, policy.quota, ep.cluster.slots_per_rank,
                (sorted(policy.quota_kwargs.items()), sorted(policy.scorer_kwargs.items())), ep.planner_signature()]
    demand_GE = _gather_demand(ep, torch.bincount(idx.reshape(-1), minlength=E), header, readable)
    dims = ep.dims(H, I, K, gate_up_proj.element_size())
    prev_state = ep.state
    ep.plan_seconds = 0.0
    ep.last_forward_bytes = {}
    plan = ep.plan(demand_GE, dims, policy, state=prev_state)
    if torch.is_grad_enabled():  # training calls advance the planner's state (SYMI's popularity);
        ep.state = plan.state    # evaluation under no_grad plans from it and leaves it unchanged
    if plan.fallback == "oom":
        m = plan.memory.summary()
        raise EPOutOfMemoryError(
            f"placement {ep.placement!r}: the plan needs {m['total']} bytes on its largest rank (base {m['base']}, "
            f"replicas {m['replicas']}, tokens {m['tokens']}) but the budget is {ep.budget_bytes} bytes, and its "
            f"fallback {ep.options.get('fallback', 'split')!r} could not make it fit"
            f"{' (the static part alone is over the budget)' if m['base'] + m['replicas'] > ep.budget_bytes else ''}; "
            f"raise budget_bytes or use smaller microbatches")
    if plan.num_splits == 1:
        ep.last_plan = plan
        return _run(hidden_TH, idx, top_k_weights_TK, gate_up_proj, down_proj, ep, plan, policy, record)

    # split_microbatch:N: N pieces of this rank's tokens (contiguous, as even as possible), each
    # planned on its own demand (fallback oom: executed even if a piece is still over budget).
    n = plan.num_splits
    bounds = [T * j // n for j in range(n + 1)]
    parts = [] if record is not None else None
    outs, plans = [], []
    for j in range(n):
        sl = slice(bounds[j], bounds[j + 1])
        i_j = idx[sl]
        d_j = _gather_demand(ep, torch.bincount(i_j.reshape(-1), minlength=E), header, readable)
        p_j = ep.plan(d_j, dims, policy, state=prev_state, piece=True)
        plans.append(p_j)
        rec_j = None
        if record is not None:
            def on_fill(_r, parts=parts):
                if all(p.filled for p in parts):
                    _merge_records(record, parts)
            rec_j = BackwardRecord(on_fill=on_fill)
            parts.append(rec_j)
        outs.append(_run(hidden_TH[sl], i_j, top_k_weights_TK[sl], gate_up_proj, down_proj, ep, p_j, policy, rec_j))
    ep.last_plan = plans
    return torch.cat(outs)


def _run(hidden_TH, idx, w_TK, gate_up, down, ep, plan, policy, record):
    compacts = policy.selects and policy.mode == "compact" and bool((plan.backward_quota_GN != plan.send_GN).any())
    layout = _Layout(plan, ep.rank, ep.experts_per_rank, compacts, hidden_TH.device)
    call = _Call(ep, plan, layout, policy, record, ep.num_experts)
    with autocast_off(hidden_TH.device):
        return _EPExperts.apply(hidden_TH, w_TK, gate_up, down, idx, call)


# ----------------------------------------------------------------------------- module
class ExpertParallelExperts(nn.Module):
    """This rank's share of an expert-parallel SwiGLU experts layer (transformers layout).

    gate_up_proj [E/G, 2I, H], down_proj [E/G, H, I]: the experts ``ep.local_experts``.
    ``forward(hidden [T, H], top_k_index [T, K] (global ids), top_k_weights [T, K])``.
    ``last_backward``: this rank's :class:`BackwardRecord` of the latest backward."""

    def __init__(self, ep: ExpertParallel, hidden_size: int, intermediate_size: int,
                 policy: BackwardPolicy | None = None):
        super().__init__()
        El = ep.experts_per_rank
        self.ep, self.hidden_size, self.intermediate_size = ep, hidden_size, intermediate_size
        self.num_experts = ep.num_experts
        self.gate_up_proj = _mark(nn.Parameter(torch.empty(El, 2 * intermediate_size, hidden_size)))
        self.down_proj = _mark(nn.Parameter(torch.empty(El, hidden_size, intermediate_size)))
        self.policy = check_policy(policy)
        self.last_backward: BackwardRecord | None = None

    @classmethod
    def from_full(cls, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, ep: ExpertParallel,
                  policy: BackwardPolicy | None = None) -> "ExpertParallelExperts":
        """This rank's module from full [E, 2I, H] / [E, H, I] weights (every rank passes the same)."""
        E, I2, H = gate_up_proj.shape
        m = cls(ep, H, I2 // 2, policy).to(device=gate_up_proj.device, dtype=gate_up_proj.dtype)
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
                          self.policy, record)


# ----------------------------------------------------------------------------- data parallel rest
def _dense_params(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if not is_expert_parallel_param(p)]


@torch.no_grad()
def broadcast_dense_params(model: nn.Module, src: int = 0, group=None) -> None:
    """Make every non-expert parameter equal to rank ``src``'s (global rank) on all ranks of ``group``."""
    for p in _dense_params(model):
        dist.broadcast(p.data, src=src, group=group)


@torch.no_grad()
def finish_grad_sync(model: nn.Module, group=None, expert_dp_group=None, bucket_numel: int = 1 << 24) -> None:
    """Gradient sync after ``loss.backward()`` when every rank's loss is the mean over its own tokens.

    The objective is the mean of the ranks' losses: non-expert gradients are averaged over
    ``group`` (all data-parallel ranks); expert gradients (already summed over the EP group's
    tokens by the runtime) are summed over ``expert_dp_group`` (ranks holding the same experts in
    other EP groups; None when EP spans every rank) and divided by the number of ranks of ``group``.

    Dense gradients travel in flat buckets of at most ``bucket_numel`` elements per dtype (one
    all-reduce each; default 16 M elements, 64 MiB in fp32), not one copy of every dense gradient
    at once. Ranks first agree on which parameters have a gradient (one small all-reduce): a
    parameter with a gradient on some ranks only gets zeros on the others, so every rank's
    all-reduces have the same sizes (NCCL does not check, and would hang or mix up buckets)."""
    if isinstance(bucket_numel, bool) or not isinstance(bucket_numel, int) or bucket_numel < 1:
        raise ValueError(f"bucket_numel must be a positive int, got {bucket_numel!r}")
    world = dist.get_world_size(group)
    params = [p for p in model.parameters() if p.requires_grad]
    if world > 1 and params:
        has = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=params[0].device)
        dist.all_reduce(has, op=dist.ReduceOp.MAX, group=group)
        for p, h in zip(params, has.tolist()):
            if h and p.grad is None:
                p.grad = torch.zeros_like(p)
    dense = [p.grad for p in _dense_params(model) if p.grad is not None]
    if dense and world > 1:
        for bucket in _buckets(dense, bucket_numel):
            flat = torch.cat([g.reshape(-1) for g in bucket])
            dist.all_reduce(flat, group=group)
            flat.div_(world)
            off = 0
            for g in bucket:
                g.copy_(flat[off:off + g.numel()].view_as(g))
                off += g.numel()
    for p in model.parameters():
        if is_expert_parallel_param(p) and p.grad is not None:
            if expert_dp_group is not None and dist.get_world_size(expert_dp_group) > 1:
                dist.all_reduce(p.grad, group=expert_dp_group)
            p.grad.div_(world)


def _buckets(grads: list[torch.Tensor], bucket_numel: int) -> list[list[torch.Tensor]]:
    """Consecutive gradients of one dtype and device, at most ``bucket_numel`` elements per bucket
    (a larger gradient is a bucket of its own); the same buckets on every rank."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for g in grads:
        if out and size + g.numel() <= bucket_numel and out[-1][0].dtype == g.dtype and out[-1][0].device == g.device:
            out[-1].append(g)
            size += g.numel()
        else:
            out.append([g])
            size = g.numel()
    return out
