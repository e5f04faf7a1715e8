"""Per-rank GPU memory of one MoE layer under a placement plan (numpy only, bytes everywhere).

Notation: H hidden size, I expert intermediate size, b = ``dims.dtype_bytes`` (weights and
activations), b_g = ``dims.grad_bytes``, b_o = ``dims.optimizer_bytes_per_param``.
Every expert is a SwiGLU MLP (``gate_up_proj`` [2I, H] + ``down_proj`` [H, I]):

    params per expert        p = 3 * H * I

Three components per rank r, as in the paper's memory table (T4):

1. **base expert placement** (owned instances, ``is_replica == False``)
       base_r = n_owned_r * p * (b + b_g + b_o * optimizer_on_gpu)
   Optimizer state counts only where it lives on the GPU (Megatron, UltraEP, LRMoE owners);
   SYMI keeps it in host memory (``optimizer_on_gpu=False``).
2. **additional replicas** (``is_replica == True``): weights and gradients, never optimizer state
       replicas_r = n_replica_r * p * (b + b_g)
3. **token buffers**, sized by the rank's actual rows under the plan
   (send[s, i] pairs source s routes to instance i, quota[s, i] of them kept in backward):
       sent_r      = sum_i send[r, i]            kept_sent_r = sum_i quota[r, i]
       recv_r      = sum_{i on r} sum_s send[s, i]
       kept_recv_r = sum_{i on r} sum_s quota[s, i]
   * dispatch/combine (token side: all-to-all send + receive buffers, forward and backward;
     the local chunk is part of the buffer, as with ``all_to_all_single``)
       dispatch_r = b * H * (2 * sent_r + 2 * kept_sent_r)
   * saved activations, as the EP runtime saves them: on the expert side, per received row, the
     gathered input X (H) and the gate/up pre-activation GU (2I); on the token side the combined
     expert outputs O (H) of each of the rank's own routed pairs (P_r = sum_e demand[r, e], the
     [T, K, H] buffer the exact router gradient needs; zero rows for pairs dropped over capacity)
       saved_r = b * (H + 2I) * recv_r + b * H * P_r
   * backward execution buffers (expert side, per retained row: alpha*g (H), X (H), GU (2I),
     h (I), dh (I), dGU (2I), dX (H); equals ``lrmoe.experts.buffer_bytes``)
       backward_r = b * (3H + 6I) * kept_recv_r

    total_r = base_r + replicas_r + dispatch_r + saved_r + backward_r

The model is per layer: ``budget_bytes`` given to a planner is the share of the GPU this MoE
layer may use (the caller subtracts the rest of the model). Router, shared expert and attention
activations are not part of it.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from .jit import njit

GIB = 1024**3


@dataclass(frozen=True)
class MemoryBreakdown:
    """Per-rank memory of a plan in bytes; every field is an int64 array of shape [G]."""

    base_G: np.ndarray
    replicas_G: np.ndarray
    dispatch_G: np.ndarray
    saved_G: np.ndarray
    backward_G: np.ndarray

    @property
    def tokens_G(self) -> np.ndarray:
        """Token buffers: dispatch/combine + saved activations + backward execution buffers."""
        return self.dispatch_G + self.saved_G + self.backward_G

    @property
    def total_G(self) -> np.ndarray:
        return self.base_G + self.replicas_G + self.tokens_G

    @functools.cached_property
    def peak(self) -> int:
        """The largest per-rank total (what must fit the per-GPU budget)."""
        return int(self.total_G.max(initial=0))

    @classmethod
    def of(cls, base_G, replicas_G, dispatch_G, saved_G, backward_G, peak: int) -> "MemoryBreakdown":
        """A breakdown whose ``peak`` was computed with it (by a compiled kernel): no numpy call on reading it.
        Its fields set directly (a frozen dataclass's ``__init__`` costs a setattr call per field; this
        one has no ``__post_init__``), ``peak`` in cached_property's slot."""
        out = object.__new__(cls)
        out.__dict__.update(base_G=base_G, replicas_G=replicas_G, dispatch_G=dispatch_G, saved_G=saved_G,
                            backward_G=backward_G, peak=int(peak))
        return out

    def summary(self) -> dict[str, int]:
        """Max over ranks of each component, and the peak total (not the sum of the maxima)."""
        return {"base": int(self.base_G.max(initial=0)), "replicas": int(self.replicas_G.max(initial=0)),
                "tokens": int(self.tokens_G.max(initial=0)), "total": self.peak}


def expert_params(dims) -> int:
    """p = 3 * H * I parameters of one SwiGLU expert."""
    return 3 * dims.hidden * dims.intermediate


def instance_bytes(dims, *, replica: bool, optimizer_on_gpu: bool = True) -> int:
    """Static bytes of one expert instance: weights + gradients (+ optimizer state for owners on GPU)."""
    per_param = dims.dtype_bytes + dims.grad_bytes
    if not replica and optimizer_on_gpu:
        per_param += dims.optimizer_bytes_per_param
    return expert_params(dims) * per_param


def token_row_bytes(dims) -> dict[str, int]:
    """Bytes per row of each token-buffer term (see the module docstring)."""
    H, I, b = dims.hidden, dims.intermediate, dims.dtype_bytes
    return {"dispatch": 2 * H * b,  # per sent or kept-sent row
            "saved": (H + 2 * I) * b,  # per received row (expert side: X, GU)
            "output": H * b,  # per routed pair of the rank's own tokens (token side: O)
            "backward": (3 * H + 6 * I) * b}  # per retained received row


def memory_constants(dims, optimizer_on_gpu: bool = True) -> tuple[int, int, int, int, int, int]:
    """Bytes of an owned instance, of a replica, and per row of each token-buffer term (dispatch,
    saved, output, backward): what the compiled memory kernels multiply the counts by."""
    try:
        return _memory_constants(dims, optimizer_on_gpu)
    except TypeError:  # an unhashable dims-like object
        return _memory_constants.__wrapped__(dims, optimizer_on_gpu)


@functools.lru_cache(maxsize=256)
def _memory_constants(dims, optimizer_on_gpu: bool) -> tuple[int, int, int, int, int, int]:
    row = token_row_bytes(dims)
    return (instance_bytes(dims, replica=False, optimizer_on_gpu=optimizer_on_gpu), instance_bytes(dims, replica=True),
            row["dispatch"], row["saved"], row["output"], row["backward"])


@njit
def memory_from_counts(rank_N, is_replica_N, recv_N, kept_recv_N, sent_G, kept_sent_G, pairs_G, num_ranks, consts):
    """The five per-rank components and the peak (module docstring) from the counts; consts as
    :func:`memory_constants`. Integer arithmetic, the same integers as the numpy form."""
    owner_b, replica_b, dispatch_b, saved_b, output_b, backward_b = consts
    G = num_ranks
    base = np.zeros(G, np.int64)
    reps = np.zeros(G, np.int64)
    recv = np.zeros(G, np.int64)
    kept = np.zeros(G, np.int64)
    for n in range(rank_N.size):
        r = rank_N[n]
        if is_replica_N[n]:
            reps[r] += 1
        else:
            base[r] += 1
        recv[r] += recv_N[n]
        kept[r] += kept_recv_N[n]
    dispatch = np.empty(G, np.int64)
    saved = np.empty(G, np.int64)
    backward = np.empty(G, np.int64)
    peak = 0  # max(initial=0), as MemoryBreakdown.peak
    for r in range(G):
        base[r] *= owner_b
        reps[r] *= replica_b
        dispatch[r] = dispatch_b * (sent_G[r] + kept_sent_G[r])
        saved[r] = saved_b * recv[r] + output_b * pairs_G[r]
        backward[r] = backward_b * kept[r]
        total = base[r] + reps[r] + dispatch[r] + saved[r] + backward[r]
        if total > peak:
            peak = total
    return base, reps, dispatch, saved, backward, peak


@njit
def plan_counts(send_GN, quota_GN, same):
    """Row and column sums of send and quota (``same``: quota is send, one pass)."""
    G, N = send_GN.shape
    sent_G = np.zeros(G, np.int64)
    recv_N = np.zeros(N, np.int64)
    for g in range(G):
        acc = 0
        for n in range(N):
            v = send_GN[g, n]
            acc += v
            recv_N[n] += v
        sent_G[g] = acc
    if same:
        return sent_G, recv_N, sent_G, recv_N
    kept_G = np.zeros(G, np.int64)
    kept_N = np.zeros(N, np.int64)
    for g in range(G):
        acc = 0
        for n in range(N):
            v = quota_GN[g, n]
            acc += v
            kept_N[n] += v
        kept_G[g] = acc
    return sent_G, recv_N, kept_G, kept_N


def _int64(x) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.int64)


def plan_memory(dims, num_ranks: int, rank_N, is_replica_N, send_GN, quota_GN, *,
                optimizer_on_gpu: bool = True, pairs_G=None) -> MemoryBreakdown:
    """Memory of every rank for instances on ``rank_N`` with the given send and backward quotas.
    ``pairs_G``: each rank's routed pairs P_r (default: the pairs it sends, i.e. no capacity drops)."""
    send_GN = _int64(send_GN)
    quota_GN = send_GN if quota_GN is send_GN else _int64(quota_GN)
    sent_G, recv_N, kept_sent_G, kept_recv_N = plan_counts(send_GN, quota_GN, quota_GN is send_GN)
    return count_memory(dims, num_ranks, rank_N, is_replica_N, recv_N=recv_N, kept_recv_N=kept_recv_N,
                        sent_G=sent_G, kept_sent_G=kept_sent_G, pairs_G=sent_G if pairs_G is None else pairs_G,
                        optimizer_on_gpu=optimizer_on_gpu)


def count_memory(dims, num_ranks: int, rank_N, is_replica_N, *, recv_N, kept_recv_N, sent_G, kept_sent_G, pairs_G,
                 optimizer_on_gpu: bool = True) -> MemoryBreakdown:
    """:func:`plan_memory` from the counts it reads (module docstring): the rows every instance
    receives and keeps, and the pairs every source rank sends, keeps sent, and routes. A planner
    that knows these without the [G, N] matrices (every instance receives its quota) sizes a
    candidate plan with it; the result is the same integers as :func:`plan_memory`'s."""
    G = int(num_ranks)
    return MemoryBreakdown.of(*memory_from_counts(
        _int64(rank_N), np.ascontiguousarray(is_replica_N, dtype=np.bool_), _int64(recv_N), _int64(kept_recv_N),
        _int64(sent_G), _int64(kept_sent_G), _int64(pairs_G), G, memory_constants(dims, bool(optimizer_on_gpu))))


def total_memory_floor(dims, num_owned: int, pairs: int, kept: int, *, optimizer_on_gpu: bool = True) -> int:
    """The sum over ranks of ``total_G`` for any plan with ``num_owned`` owned instances, ``pairs``
    routed pairs all sent (no capacity drops) and ``kept`` of them retained, before any replica
    (each replica only adds): every token-buffer term is a per-row constant times a count whose sum
    over ranks is fixed (sum_r sent_r = sum_r recv_r = sum_r P_r = pairs, sum_r kept_sent_r =
    sum_r kept_recv_r = kept). The peak is at least this divided by the number of ranks."""
    row = token_row_bytes(dims)
    return (num_owned * instance_bytes(dims, replica=False, optimizer_on_gpu=optimizer_on_gpu)
            + row["dispatch"] * (pairs + kept) + (row["saved"] + row["output"]) * pairs + row["backward"] * kept)
