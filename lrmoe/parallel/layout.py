"""Plan to index layout: everything one rank needs to execute a placement plan.

:class:`Layout` is the runtime's: the host works on the plan's per-instance counts only (numpy over
O(G x instances) entries, no loop over experts or pairs), uploads them in one non-blocking copy, and
the per-pair index tensors are built on the tokens' device by ``repeat_interleave`` with output sizes
the plan already knows (no device synchronisation). :class:`ReferenceLayout` is its plain reference
(numpy over every routed pair on the host, then copied), which the tests compare it with."""
from __future__ import annotations

import numpy as np
import torch

from ..kernels.host import host_reads_free, upload
from ..planning.layout import KEPT_RECV, KEPT_SEND, RECV, SEND, WRECV, WSEND, layout_counts  # noqa: F401
from ..planning.plan import Plan, expert_sum


def instance_columns(plan: Plan) -> tuple[np.ndarray, np.ndarray]:
    """(expert_N, rank_N) of a plan's instances (int64), in one pass over them."""
    return np.ascontiguousarray(plan.expert_N, dtype=np.int64), np.ascontiguousarray(plan.rank_N, dtype=np.int64)


def segments(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Concatenation of arange(starts[j], starts[j] + lens[j]) over j (int64)."""
    starts, lens = np.asarray(starts, dtype=np.int64), np.asarray(lens, dtype=np.int64)
    total = int(lens.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    out_start = np.cumsum(lens) - lens
    return np.repeat(starts - out_start, lens) + np.arange(total, dtype=np.int64)


class Layout:
    """Everything rank ``r`` needs to execute a plan, derived from the plan alone.

    Instances on rank t are ordered by instance index; the all-to-all chunk a source sends to t
    holds, for each of t's instances in that order, the source's pairs assigned to it in pair
    order. The pairs of expert e on a source are given to e's instances in instance order
    (``send_GN`` consecutive pairs each, in pair order); the rest are dropped (forward drops:
    latest positions first). On the expert side, GEMM groups are the rank's owned experts
    (E/G, in order) followed by the experts it fetches from their owners (ascending).

    The host runs :func:`layout_counts` (compiled; O(G x instances + G x E), nothing per pair) and
    uploads its small arrays in one non-blocking copy; every per-pair index is then one slice of a
    single ``repeat_interleave`` on the device, whose output size the plan gives (no synchronisation).
    Host values (Python ints and lists, numpy): the all-to-all splits, ``num_groups``, ``n_buckets``,
    ``n_kept_send``, ``rows_g``, ``kept_g``, ``any_fetch``. Device tensors: ``send_pos``,
    ``send_inst``, ``recv_order``, ``recv_to_g`` and, when ``compacts``, ``kept_send_chunk_off`` and
    ``kept_recv_chunk_off`` (one entry per routed or kept pair; None without ``compacts``);
    ``quota_B``, ``offs_g``, ``offs_kept``, ``wsend_idx`` and ``local_quota_E``. Equal to
    :class:`ReferenceLayout`'s (whose ``local_quota_E`` is numpy)."""

    def __init__(self, plan: Plan, rank: int, experts_per_rank: int, compacts: bool, device: torch.device):
        ex, rk = instance_columns(plan)
        G = plan.send_GN.shape[0]
        head, up, self.rows_g, self.kept_g = layout_counts(
            ex, rk, np.ascontiguousarray(plan.send_GN, dtype=np.int64),
            np.ascontiguousarray(plan.backward_quota_GN, dtype=np.int64),
            np.ascontiguousarray(plan.demand_GE[rank], dtype=np.int64), rank, experts_per_rank, compacts)
        rows = head[:6 * G].reshape(6, G).tolist()
        self.send_splits, self.kept_send_splits, self.recv_splits, self.kept_recv_splits = rows[:4]
        self.wsend_splits, self.wrecv_splits = rows[WSEND], rows[WRECV]
        ng, n_send, n_recv, self.n_kept_send, n_kept_recv, S, V, n_w, any_fetch = head[6 * G:].tolist()
        N = len(ex)
        self.num_groups, self.n_buckets, self.compacts = ng, N, compacts
        self.any_fetch = bool(any_fetch)  # (on any rank: the weight all-to-all is a collective)

        buf = upload(up, device)  # one copy of everything, then two repeat_interleaves of known sizes
        shift, lens, vals, vlens = buf[:S], buf[S:2 * S], buf[2 * S:2 * S + V], buf[2 * S + V:2 * S + 2 * V]
        small = buf[2 * S + 2 * V:]
        m = n_send + 2 * n_recv
        k = n_send + (self.n_kept_send + n_kept_recv) * compacts
        if host_reads_free(buf):  # the CPU is the device: numpy's repeat (torch's is ~50x slower there)
            pos = torch.from_numpy(np.repeat(up[:S], up[S:2 * S]) + np.arange(m))
            rep = torch.from_numpy(np.repeat(up[2 * S:2 * S + V], up[2 * S + V:2 * S + 2 * V]))
        else:
            pos = torch.repeat_interleave(shift, lens, output_size=m) + torch.arange(m, device=buf.device)
            rep = torch.repeat_interleave(vals, vlens, output_size=k)
        self.send_pos = pos[:n_send]  # positions in this rank's sorted-pair order
        self.recv_order = pos[n_send:n_send + n_recv]  # group order -> receive-buffer row
        self.recv_to_g = pos[n_send + n_recv:]  # receive-buffer row -> group order position
        self.send_inst = rep[:n_send]  # instance of every send row
        self.kept_send_chunk_off = rep[n_send:n_send + self.n_kept_send] if compacts else None
        self.kept_recv_chunk_off = rep[n_send + self.n_kept_send:] if compacts else None
        self.quota_B = small[:N + 1]  # per bucket (instance), + the bucket of dropped pairs
        offs = small[N + 1:N + 1 + 2 * ng].to(torch.int32)
        self.offs_g, self.offs_kept = offs[:ng], offs[ng:]
        self.wsend_idx = small[N + 1 + 2 * ng:N + 1 + 2 * ng + n_w]
        self.local_quota_E = small[N + 1 + 2 * ng + n_w:]


class ReferenceLayout:
    """The plain reference of :class:`Layout` (numpy over every routed pair on the host, then copied
    to the device; the test oracle). Everything rank ``r`` needs to execute a plan, derived from the plan alone.

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
        self.send_pos = dev(segments(inst_start[seq], lens))  # positions in this rank's sorted-pair order
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
        recv_order = segments(seg_start.ravel()[o], rl.ravel()[o])
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

