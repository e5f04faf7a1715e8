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
from ..planning.jit import njit
from ..planning.plan import Plan, expert_sum


def instance_columns(plan: Plan) -> tuple[np.ndarray, np.ndarray]:
    """(expert_N, rank_N) of a plan's instances (int64), in one pass over them."""
    n = len(plan.instances)
    er = np.fromiter((v for i in plan.instances for v in (i.expert, i.rank)), dtype=np.int64, count=2 * n)
    return er[0::2], er[1::2]


def segments(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Concatenation of arange(starts[j], starts[j] + lens[j]) over j (int64)."""
    starts, lens = np.asarray(starts, dtype=np.int64), np.asarray(lens, dtype=np.int64)
    total = int(lens.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    out_start = np.cumsum(lens) - lens
    return np.repeat(starts - out_start, lens) + np.arange(total, dtype=np.int64)


# Host values of :func:`layout_counts` (``head``): one [G] row each, then the scalars.
SEND, KEPT_SEND, RECV, KEPT_RECV, WSEND, WRECV = range(6)


@njit
def layout_counts(ex, rk, send, quota, d_r, r, El, compacts):  # pragma: no cover - compiled (tested via py_func too)
    """The per-instance arithmetic of :class:`Layout` for rank ``r``, O(G x instances + G x E).

    Returns ``head`` (int64: the six [G] split rows SEND .. WRECV, then num_groups, n_send, n_recv,
    n_kept_send, n_kept_recv, S, V, the number of weights this rank sends, whether any rank fetches),
    ``up`` (what the device needs: ``shift`` [S] and ``lens`` [S], ``vals`` [V] and ``vlens`` [V],
    then ``quota_B``, the cumulative ``rows_g`` and ``kept_g``, ``wsend_idx``, ``local_quota_E``),
    ``rows_g`` and ``kept_g``. Runs: ``repeat_interleave(shift, lens) + arange`` is, in order, the
    send rows' positions in sorted-pair order (instances in rank-major order), the receive rows in
    group order (-> receive-buffer row) and the receive rows in buffer order (-> group-order
    position). Repeated values: ``repeat_interleave(vals, vlens)`` is the send rows' instances and,
    when ``compacts``, the kept send rows' chunk offsets in the send buffer and the kept receive
    rows' in the receive buffer."""
    G, N = send.shape
    E = d_r.shape[0]
    per_rank = np.zeros(G, np.int64)
    for i in range(N):
        per_rank[rk[i]] += 1
    first = np.zeros(G, np.int64)
    for t in range(1, G):
        first[t] = first[t - 1] + per_rank[t - 1]
    seq = np.empty(N, np.int64)  # instances in send-buffer order: rank-major, then instance index
    fill = first.copy()
    for i in range(N):
        seq[fill[rk[i]]] = i
        fill[rk[i]] += 1
    # GEMM groups: owned experts, then the fetched ones of the rank in ascending order
    fetched = np.zeros((G, E), np.bool_)
    any_fetch = 0
    for i in range(N):
        if ex[i] // El != rk[i]:
            fetched[rk[i], ex[i]] = True
            any_fetch = 1
    fgroup = np.zeros((G, E), np.int64)
    for t in range(G):
        k = El
        for e in range(E):
            if fetched[t, e]:
                fgroup[t, e] = k
                k += 1
    group = np.empty(N, np.int64)
    for i in range(N):
        group[i] = ex[i] - rk[i] * El if ex[i] // El == rk[i] else fgroup[rk[i], ex[i]]
    num_groups = El
    for e in range(E):
        num_groups += fetched[r, e]

    head = np.zeros(6 * G + 9, np.int64)
    # token side: instance i of expert e takes send[r, i] pairs of e after those of e's earlier instances
    run = np.zeros(E, np.int64)
    acc = 0
    for e in range(E):
        run[e] = acc
        acc += d_r[e]
    inst_start = np.empty(N, np.int64)
    for i in range(N):
        inst_start[i] = run[ex[i]]
        run[ex[i]] += send[r, i]
        head[SEND * G + rk[i]] += send[r, i]
        head[KEPT_SEND * G + rk[i]] += quota[r, i]
    n_send = 0
    for i in range(N):
        n_send += send[r, i]
    # expert side: receive segments (source-major, then this rank's instances in order)
    n = per_rank[r]
    mine = seq[first[r]:first[r] + n]
    nseg = G * n
    rl = np.empty(nseg, np.int64)
    seg_group = np.empty(nseg, np.int64)
    rows_g = np.zeros(num_groups, np.int64)
    kept_g = np.zeros(num_groups, np.int64)
    for s in range(G):
        for j in range(n):
            v = send[s, mine[j]]
            rl[s * n + j] = v
            seg_group[s * n + j] = group[mine[j]]
            rows_g[group[mine[j]]] += v
            kept_g[group[mine[j]]] += quota[s, mine[j]]
            head[RECV * G + s] += v
            head[KEPT_RECV * G + s] += quota[s, mine[j]]
    n_recv = 0
    n_kept_send = 0
    n_kept_recv = 0
    for t in range(G):
        n_recv += head[RECV * G + t]
        n_kept_send += head[KEPT_SEND * G + t]
        n_kept_recv += head[KEPT_RECV * G + t]
    seg_start = np.empty(nseg, np.int64)
    acc = 0
    for k in range(nseg):
        seg_start[k] = acc
        acc += rl[k]
    # group order of the receive segments: by group, then source, then instance (a stable counting sort)
    gfirst = np.zeros(num_groups + 1, np.int64)
    for k in range(nseg):
        gfirst[seg_group[k] + 1] += 1
    for g in range(num_groups):
        gfirst[g + 1] += gfirst[g]
    order = np.empty(nseg, np.int64)
    for k in range(nseg):
        order[gfirst[seg_group[k]]] = k
        gfirst[seg_group[k]] += 1
    g_start = np.empty(nseg, np.int64)
    acc = 0
    for k in range(nseg):
        g_start[order[k]] = acc
        acc += rl[order[k]]

    S = N + 2 * nseg  # runs of consecutive values
    shift = np.empty(S, np.int64)
    lens = np.empty(S, np.int64)
    out = 0  # output offset over all runs (the device adds one arange over the whole output)
    for k in range(N):
        shift[k] = inst_start[seq[k]] - out
        lens[k] = send[r, seq[k]]
        out += lens[k]
    for k in range(nseg):
        shift[N + k] = seg_start[order[k]] - out
        lens[N + k] = rl[order[k]]
        out += lens[N + k]
    for k in range(nseg):
        shift[N + nseg + k] = g_start[k] - out
        lens[N + nseg + k] = rl[k]
        out += rl[k]
    V = N + (2 * G if compacts else 0)  # repeated values
    vals = np.empty(V, np.int64)
    vlens = np.empty(V, np.int64)
    for k in range(N):
        vals[k] = seq[k]
        vlens[k] = send[r, seq[k]]
    if compacts:
        off_s = 0
        off_r = 0
        for t in range(G):
            vals[N + t] = off_s
            vlens[N + t] = head[KEPT_SEND * G + t]
            vals[N + G + t] = off_r
            vlens[N + G + t] = head[KEPT_RECV * G + t]
            off_s += head[SEND * G + t]
            off_r += head[RECV * G + t]

    # weights: owner r sends t the experts of t's fetched list it owns (ascending); r receives its own
    n_w = 0
    for t in range(G):
        for e in range(E):
            if fetched[t, e] and e // El == r:
                head[WSEND * G + t] += 1
                n_w += 1
    for e in range(E):
        if fetched[r, e]:
            head[WRECV * G + e // El] += 1
    small = np.zeros(N + 1 + 2 * num_groups + n_w + E, np.int64)
    for i in range(N):
        small[i] = quota[r, i]
        small[N + 1 + 2 * num_groups + n_w + ex[i]] += quota[r, i]  # local_quota_E
    a = 0
    b = 0
    for g in range(num_groups):
        a += rows_g[g]
        b += kept_g[g]
        small[N + 1 + g] = a
        small[N + 1 + num_groups + g] = b
    w = N + 1 + 2 * num_groups
    for t in range(G):
        for e in range(E):
            if fetched[t, e] and e // El == r:
                small[w] = e - r * El
                w += 1
    h = 6 * G
    head[h] = num_groups
    head[h + 1] = n_send
    head[h + 2] = n_recv
    head[h + 3] = n_kept_send
    head[h + 4] = n_kept_recv
    head[h + 5] = S
    head[h + 6] = V
    head[h + 7] = n_w
    head[h + 8] = any_fetch
    return head, np.concatenate((shift, lens, vals, vlens, small)), rows_g, kept_g


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

