"""Pair bookkeeping ops: sort pairs by expert, per-expert top-quota selection, compaction indices.

Pairs are numbered u = t*K + k (token t, slot k). "Sorted order" is the stable sort of pairs by
expert id, so every expert's pairs are contiguous and in pair-index order. Each op has a
vectorised torch implementation (any device, no host synchronisation) and a plain loop reference.
"""
from __future__ import annotations

import torch

from .host import emulating


def count_by_value(values_N: torch.Tensor, n: int, weights: torch.Tensor | None = None) -> torch.Tensor:
    """int64 ``counts[v] = #{i : values_N[i] == v}`` (or the sum of integer/bool ``weights``) for v < n.

    Unlike ``torch.bincount``, never synchronises with the host on accelerators (integer
    ``index_add_`` is exact and deterministic)."""
    ones = torch.ones_like(values_N, dtype=torch.int64) if weights is None else weights.to(torch.int64)
    return torch.zeros(n, dtype=torch.int64, device=values_N.device).index_add_(0, values_N, ones)


def sort_pairs_by_expert(top_k_index_TK: torch.Tensor, num_experts: int):
    """Returns ``perm_P`` (pair ids in sorted order), ``demand_E`` (int64) and ``offs_E`` (int32 ends)."""
    expert_P = top_k_index_TK.reshape(-1)
    perm_P = torch.argsort(expert_P, stable=True)
    demand_E = count_by_value(expert_P, num_experts)
    offs_E = torch.cumsum(demand_E, 0).to(torch.int32)
    return perm_P, demand_E, offs_E


def rank_keys(scores_P: torch.Tensor) -> torch.Tensor:
    """Ranking keys: float32 scores with every non-finite value mapped to +inf (ranked first)."""
    s = scores_P.float()
    return torch.where(torch.isfinite(s), s, torch.full_like(s, float("inf")))


def _descending_int_keys(keys_P: torch.Tensor) -> torch.Tensor:
    """int64 in [0, 2^32) that orders like ``-keys`` (float32): the float's bit pattern made monotone."""
    bits = (keys_P + 0.0).view(torch.int32).to(torch.int64)  # + 0.0 turns -0.0 into +0.0
    monotone = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # increasing in the float value
    return (2**31 - 1) - monotone


def select_top_quota(scores_P: torch.Tensor, expert_P: torch.Tensor, quota_E: torch.Tensor) -> torch.Tensor:
    """Boolean mask [P]: for every expert e, its ``quota_E[e]`` pairs with the highest score.

    Ties go to the lower pair index; non-finite scores rank first (so NaN/Inf gradients are kept
    and reach the optimizer's checks). One stable sort of the int64 key (expert, -score): the
    float32 score's bit pattern, made order-preserving, fills the low 32 bits."""
    P = scores_P.numel()
    E = quota_E.numel()
    key = (expert_P.to(torch.int64) << 32) | _descending_int_keys(rank_keys(scores_P))
    order = torch.argsort(key, stable=True)  # expert-major, best first, lower pair index on ties
    e_sorted = expert_P.index_select(0, order)
    counts_E = count_by_value(expert_P, E)
    start_E = torch.cumsum(counts_E, 0) - counts_E
    rank = torch.arange(P, device=scores_P.device) - start_E.index_select(0, e_sorted)
    keep = torch.empty(P, dtype=torch.bool, device=scores_P.device)
    keep[order] = rank < quota_E.index_select(0, e_sorted)
    return keep


def select_top_quota_loop(scores_P: torch.Tensor, expert_P: torch.Tensor, quota_E: torch.Tensor) -> torch.Tensor:
    """Reference for :func:`select_top_quota`: a Python sort per expert."""
    keys = rank_keys(scores_P).tolist()
    experts = expert_P.tolist()
    keep = [False] * len(keys)
    for e, q in enumerate(quota_E.tolist()):
        pairs = [u for u, x in enumerate(experts) if x == e]
        pairs.sort(key=lambda u: (-keys[u], u))
        for u in pairs[:q]:
            keep[u] = True
    return torch.tensor(keep, dtype=torch.bool, device=scores_P.device)


def kept_positions(keep_P: torch.Tensor, perm_P: torch.Tensor, n_keep: int) -> torch.Tensor:
    """Positions (in sorted order) of the kept pairs, expert-contiguous and in pair order.

    ``n_keep`` is the host-known number of kept pairs, so no host synchronisation is needed."""
    return torch.nonzero_static(keep_P[perm_P], size=n_keep).squeeze(1)


def sum_rows_by_token(rows_NH: torch.Tensor, rows_pair_N: torch.Tensor, num_tokens: int, top_k: int,
                      workspace: torch.Tensor | None = None, method: str | None = None) -> torch.Tensor:
    """``out[t] = sum of rows_NH[i] over the rows whose pair belongs to token t`` (pair // top_k == t).

    Deterministic on every device: rows are first put in pair order (= token order), then summed
    per token — on CPU by ``index_add_`` over the now sorted token ids (a sequential pass, several
    times faster than ``segment_reduce`` there), on accelerators by ``segment_reduce`` (no
    atomics). Tokens without rows get zeros. ``workspace`` (a dead buffer shaped like
    ``rows_NH``, e.g. one the caller no longer needs) receives the reordered rows instead of a new
    allocation. ``method`` ("index_add" or "segment_reduce") overrides the per-device choice (under
    :func:`lrmoe.kernels.host.emulate_accelerator` the CPU takes the accelerators' one)."""
    method = method or ("index_add" if rows_NH.device.type == "cpu" and not emulating() else "segment_reduce")
    if method not in ("index_add", "segment_reduce"):
        raise ValueError(f"method must be 'index_add' or 'segment_reduce', got {method!r}")
    if rows_pair_N.numel() == 0:
        return rows_NH.new_zeros(num_tokens, rows_NH.shape[1])
    order = torch.argsort(rows_pair_N)
    if workspace is not None:
        ordered = torch.index_select(rows_NH, 0, order, out=workspace)
    else:
        ordered = rows_NH.index_select(0, order)
    token_N = rows_pair_N.index_select(0, order) // top_k  # non-decreasing
    if method == "index_add":
        return rows_NH.new_zeros(num_tokens, rows_NH.shape[1]).index_add_(0, token_N, ordered)
    lengths = count_by_value(token_N, num_tokens)  # valid by construction: unsafe=True skips its host-read checks
    return torch.segment_reduce(ordered, "sum", lengths=lengths, axis=0, unsafe=True)


def sum_rows_by_token_loop(rows_NH: torch.Tensor, rows_pair_N: torch.Tensor, num_tokens: int, top_k: int) -> torch.Tensor:
    """Reference for :func:`sum_rows_by_token`: one row at a time."""
    out = rows_NH.new_zeros(num_tokens, rows_NH.shape[1])
    for i, u in enumerate(rows_pair_N.tolist()):
        out[u // top_k] += rows_NH[i]
    return out
