"""Plan to index layout: everything one rank needs to execute a placement plan, on the host."""
from __future__ import annotations

import numpy as np
import torch

from ..planning.plan import Plan, expert_sum


def segments(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Concatenation of arange(starts[j], starts[j] + lens[j]) over j (int64)."""
    starts, lens = np.asarray(starts, dtype=np.int64), np.asarray(lens, dtype=np.int64)
    total = int(lens.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    out_start = np.cumsum(lens) - lens
    return np.repeat(starts - out_start, lens) + np.arange(total, dtype=np.int64)


class Layout:
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

