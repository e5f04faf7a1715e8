"""The expert-parallel experts as one autograd function (:class:`EPExperts`).

Forward: replica weight sync, dispatch all-to-all, grouped GEMMs over the local instances,
combine all-to-all (+ ||h||^2 per row when the backward selects). Backward: router gradient for
every pair, scores and selection per (instance, source rank) bucket, kept rows to the expert
side, compacted grouped GEMMs, dX back, replica gradients back to the owners. The module
docstring of :mod:`lrmoe.parallel.runtime` has the whole picture."""
from __future__ import annotations

import torch

from ..experts import (Stopwatch, acc_dtype, autocast_off, buffer_bytes, combine, expert_backward, gated,
                       row_weights, score_pairs, select_within_quota)
from ..kernels.grouped_gemm import grouped_mm
from ..kernels.routing import count_by_value, sort_pairs_by_expert, sum_rows_by_token
from . import fake
from .collectives import all_to_all

#: Keys of ``record.comm_bytes`` that are the backward all-to-alls of token rows.
BACKWARD_ROW_KEYS = ("bwd_grad_rows", "bwd_grad_index", "bwd_dx")


class Call:
    """What one EP layer call carries from forward to backward (besides saved tensors)."""

    def __init__(self, ep, plan, layout, policy, record, num_experts, activation=None):
        self.ep, self.plan, self.layout, self.policy, self.record = ep, plan, layout, policy, record
        self.num_experts = num_experts
        self.activation = activation  # as in lrmoe.experts.gated: None is SiLU (the fused SwiGLU path)
        self.comm: dict[str, int] = {}
        self.plan_seconds = 0.0  # host seconds spent planning this call (set by the runtime; goes into the record)


def _pack(gu: torch.Tensor, dn: torch.Tensor) -> torch.Tensor:
    return torch.cat([gu.flatten(1), dn.flatten(1)], 1)


def _unpack(buf: torch.Tensor, I2: int, H: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = buf.shape[0]
    return buf[:, :I2 * H].reshape(n, I2, H), buf[:, I2 * H:].reshape(n, H, I2 // 2)


def _row_gemm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, backend: str) -> torch.Tensor:
    if a.shape[0] == 0:
        return a.new_zeros(0, b.shape[2])
    return grouped_mm(a, b, offs, backend=backend)


def select_pairs(policy, lay, send_pair, alpha_TK, g_TH, phi_TK, hidden_TH, idx_TK):
    """(scores [T, K] or None, keep mask [P], inclusion probabilities [P] or None) of one source
    rank's pairs: within every (source, instance) bucket ``plan.backward_quota_GN[source, instance]``
    pairs by the policy's scorer and selection rule (:func:`lrmoe.experts.select_within_quota`: the
    best, or sampled with pi ~ sqrt(score), whose rows the caller scales by 1/pi); pairs dropped in
    forward are never kept; a backward that does not select keeps every computed pair. ``lay``: the source's
    :class:`~lrmoe.parallel.layout.Layout`; ``send_pair``: its computed pairs in send order.
    Also the selection of :mod:`lrmoe.parallel.virtual` (one call per virtual source rank)."""
    P = idx_TK.numel()
    bucket_P = torch.full((P,), lay.n_buckets, dtype=torch.int64, device=g_TH.device)
    bucket_P.index_copy_(0, send_pair, lay.send_inst)
    if not policy.selects:
        return None, bucket_P < lay.n_buckets, None  # every computed pair
    scores_TK = score_pairs(policy, alpha_TK, g_TH, phi_TK, hidden_TH, idx_TK)
    return (scores_TK, *select_within_quota(policy, scores_TK.reshape(-1), bucket_P, lay.quota_B))


class EPExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_TH, alpha_TK, gate_up, down, idx_TK, call: Call):
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
            buf = all_to_all(ep, _pack(gate_up.index_select(0, lay.wsend_idx), down.index_select(0, lay.wsend_idx)),
                              lay.wrecv_splits, lay.wsend_splits, "fwd_weights", call.comm)
            f_gu, f_d = _unpack(buf, gate_up.shape[1], H)
            W_gu, W_d = torch.cat([gate_up, f_gu]), torch.cat([down, f_d])
        watch.lap("weight_sync")

        # Dispatch, expert GEMMs, combine.
        X_send = hidden_TH.to(w_dtype).index_select(0, send_pair // K)
        X_recv = all_to_all(ep, X_send, lay.recv_splits, lay.send_splits, "fwd_dispatch", call.comm)
        watch.lap("dispatch")
        X_g = X_recv.index_select(0, lay.recv_order)
        del X_recv, X_send
        GU = _row_gemm(X_g, W_gu.transpose(1, 2), lay.offs_g, backend)
        h = gated(GU, call.activation)
        O_g = _row_gemm(h, W_d.transpose(1, 2), lay.offs_g, backend)
        phi_g = None
        if policy.selects:
            hf = h.float()
            phi_g = (hf * hf).sum(-1)
        del h
        watch.lap("gemm")
        O_send = all_to_all(ep, O_g.index_select(0, lay.recv_to_g), lay.send_splits, lay.recv_splits,
                             "fwd_combine", call.comm)
        O_TKH = O_send.new_zeros(P, H).index_copy_(0, send_pair, O_send).view(T, K, H)
        phi_TK = None
        if phi_g is not None:
            phi_send = all_to_all(ep, phi_g.index_select(0, lay.recv_to_g), lay.send_splits, lay.recv_splits,
                                   "fwd_phi", call.comm)
            phi_TK = phi_send.new_zeros(P).index_copy_(0, send_pair, phi_send).view(T, K)
        watch.lap("combine")
        y = combine(alpha_TK, O_TKH, hidden_TH.dtype)
        for k, v in call.comm.items():  # summed over the pieces of a split microbatch
            ep.last_forward_bytes[k] = ep.last_forward_bytes.get(k, 0) + v
        call.forward_timings = watch.times
        ctx.save_for_backward(hidden_TH, alpha_TK, gate_up, down, idx_TK, send_pair, O_TKH, phi_TK, X_g, GU, W_gu, W_d)
        ctx.call = call
        return y

    @staticmethod
    def backward(ctx, g_TH):
        with autocast_off(g_TH.device):  # explicit dtypes, also when backward runs inside autocast
            return EPExperts._backward(ctx, g_TH)

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
        scores_TK, keep_P, incl_P = select_pairs(policy, lay, send_pair, alpha_TK, g_TH, phi_TK, hidden_TH, idx_TK)
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
            row_weights(alpha_TK.reshape(-1), acc, keep_P, incl_P).index_select(0, rows_pair).unsqueeze(1))
        if not lay.compacts and policy.selects:  # mask mode, or a plan that keeps everything
            G_rows = torch.where(keep_P.index_select(0, rows_pair).unsqueeze(1), G_rows,
                                 torch.zeros((), dtype=G_rows.dtype, device=dev))
        G_rows = G_rows.to(w_dtype)
        watch.lap("grad_rows")
        G_recv = all_to_all(ep, G_rows, out_splits, in_splits, "bwd_grad_rows", call.comm)
        if lay.compacts:
            pos_recv = all_to_all(ep, pos, out_splits, in_splits, "bwd_grad_index", call.comm)
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
            dX_k, dW_gu, dW_d = expert_backward(G_k, GU_k, X_k, offs, W_gu, W_d, backend=policy.backend,
                                                activation=call.activation)
        else:
            dX_k, dW_gu, dW_d = G_k.new_zeros(0, W_gu.shape[2]), torch.zeros_like(W_gu), torch.zeros_like(W_d)
        watch.lap("gemm")

        # 5. dX of the kept rows back to the token side; replica gradients back to the owners.
        if lay.compacts:
            dX_recv = torch.empty_like(dX_k).index_copy_(0, order, dX_k)
        else:
            dX_recv = dX_k.index_select(0, lay.recv_to_g)
        dX_rows = all_to_all(ep, dX_recv, in_splits, out_splits, "bwd_dx", call.comm)
        grad_hidden = None
        if ctx.needs_input_grad[0]:
            grad_hidden = sum_rows_by_token(dX_rows, rows_pair, T, K).to(hidden_TH.dtype)
        dW_gu_own, dW_d_own = dW_gu[:El], dW_d[:El]
        if lay.any_fetch:
            back = all_to_all(ep, _pack(dW_gu[El:], dW_d[El:]), lay.wsend_splits, lay.wrecv_splits,
                               "bwd_weight_grads", call.comm)
            r_gu, r_d = _unpack(back, gate_up.shape[1], gate_up.shape[2])
            dW_gu_own = dW_gu_own.contiguous().index_add_(0, lay.wsend_idx, r_gu)
            dW_d_own = dW_d_own.contiguous().index_add_(0, lay.wsend_idx, r_d)
        watch.lap("combine")

        if record is not None and not fake.is_fake(idx_TK):  # (a memory estimate's fake step keeps no record)
            E = call.num_experts
            kept_mask = keep_P.view(T, K)
            if scores_TK is not None:
                nonfinite = (~torch.isfinite(scores_TK)).sum()
            else:
                nonfinite = (~torch.isfinite(g_TH)).any(-1).sum() * K
            I = gate_up.shape[1] // 2
            record.fill(demand=count_by_value(idx_TK.reshape(-1), E), quota=lay.local_quota_E,
                        kept=count_by_value(idx_TK.reshape(-1), E, weights=keep_P), kept_mask=kept_mask,
                        scores=scores_TK, nonfinite=nonfinite, mode=policy.mode, drop_ratio=policy.drop_ratio,
                        scorer=None if scores_TK is None else policy.scorer,
                        selection=None if scores_TK is None else policy.selection,
                        inclusion=None if incl_P is None else incl_P.view(T, K),
                        buffer_bytes=buffer_bytes(G_k.shape[0], gate_up.shape[2], I, G_k.element_size()),
                        timings={**({"fwd_plan": call.plan_seconds} if policy.profile else {}),
                                 **{f"fwd_{k}": v for k, v in call.forward_timings.items()}, **watch.times},
                        comm_bytes=dict(call.comm), plan=call.plan, rank=ep.rank, world_size=ep.world_size,
                        plan_seconds=call.plan_seconds)
        return grad_hidden, grad_alpha, dW_gu_own, dW_d_own, None, None

