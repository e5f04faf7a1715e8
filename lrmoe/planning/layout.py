"""The host half of executing a plan: one rank's per-instance counts (pure numpy/numba).

:func:`layout_counts` turns a plan into everything a rank's layout needs from the host: the
all-to-all split sizes and the few per-instance values the device expands into per-pair index
tensors (:class:`lrmoe.parallel.layout.Layout`). It is O(G x instances + G x E) and never loops over
pairs. It lives beside the planners (importable without torch) so that the runtime and the
simulator run the same code: the simulator times it for every plan it replays and charges it to the
forward, as the runtime pays it per MoE layer and rank (``moe_layout_s``)."""
from __future__ import annotations

import numpy as np

from .jit import njit

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
