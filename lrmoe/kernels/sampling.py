"""Unbiased selection within quotas: fixed-size sampling of pairs with inclusion probabilities
proportional to sqrt(score), so that scaling each kept pair by 1/pi makes the kept sum unbiased.

For every expert e with d_e routed pairs and quota q_e (``selection="sample"`` of
:class:`lrmoe.BackwardPolicy`; docs/method.md):

1. *Inclusion probabilities* (:func:`inclusion_probabilities`): size w_u = sqrt(max(score_u, 0))
   (for the LRM score, sqrt(R_u) = the Frobenius norm of the pair's rank-one weight gradient, as in
   column-row sampling, Adelman et al. 2021), pi_u = min(1, c w_u) with c such that
   sum_u pi_u = q_e; the pairs whose c w_u >= 1 are capped at 1 and c is recomputed for the rest
   until none is capped anew. Closed form used here: with the pairs sorted by decreasing w, the
   number m of capped pairs is the smallest m with (q_e - m) w_(m) <= S_m (S_m: the sum of the
   weights of rank >= m), and c = (q_e - m) / S_m. Non-finite scores (NaN/Inf gradients) are capped
   first (kept with pi = 1, as the top rule keeps them); when the positive weights cannot fill the
   quota, the rest of it is spread evenly over the zero-weight pairs.
2. *Systematic sampling* (:func:`systematic_select`), in pair order inside each expert: the pairs
   with pi = 1 (within 1e-6) are kept; the others' probabilities, renormalised to sum to the rest
   r_e of the quota, are laid end to end as intervals and the points u_e + k (k = 0..r_e - 1, u_e
   uniform in [0, 1)) pick the pairs whose interval holds one. Exactly r_e pairs are picked and
   pair u is picked with probability exactly its interval's length. The arithmetic is integer
   (interval ends in units of 2^-32, u_e an integer in [0, 2^32)), so the quota is met exactly
   and the inclusion probabilities returned are the exact ones of the draw (multiples of 2^-32).

Every op is vectorised over all experts at once (no host synchronisation) and has a plain loop
reference next to it (the test oracle)."""
from __future__ import annotations

import math

import torch

#: Interval ends and the uniform point are integers in units of 2^-UNIT_BITS.
UNIT_BITS = 32
_UNIT = 1 << UNIT_BITS
#: Probabilities within this of 1 count as certain (kept without drawing).
CERTAIN = 1.0 - 1e-6


def sample_sizes(scores_P: torch.Tensor) -> torch.Tensor:
    """float64 sizes sqrt(max(score, 0)); +inf for non-finite scores (certain, as the top rule keeps them)."""
    s = scores_P.double()
    return torch.where(torch.isfinite(s), s.clamp(min=0).sqrt(), torch.full_like(s, math.inf))


def inclusion_probabilities(scores_P: torch.Tensor, expert_P: torch.Tensor, quota_E: torch.Tensor) -> torch.Tensor:
    """float64 pi [P]: per expert, probabilities proportional to sqrt(score) capped at 1 and summing to the quota."""
    P, E = scores_P.numel(), quota_E.numel()
    dev = scores_P.device
    w = sample_sizes(scores_P.reshape(-1))
    expert_P = expert_P.reshape(-1).to(torch.int64)
    q_E = quota_E.to(torch.int64)
    # sorted by expert, then decreasing size, then pair index
    by_size = torch.argsort(w, descending=True, stable=True)
    order = by_size.index_select(0, torch.argsort(expert_P.index_select(0, by_size), stable=True))
    e_s, w_s = expert_P.index_select(0, order), w.index_select(0, order)
    d_E = torch.zeros(E, dtype=torch.int64, device=dev).index_add_(0, expert_P, torch.ones_like(expert_P))
    start_E = torch.cumsum(d_E, 0) - d_E
    rank = torch.arange(P, device=dev) - start_E.index_select(0, e_s)
    forced = torch.isinf(w_s)
    n_forced_E = torch.zeros(E, dtype=torch.int64, device=dev).index_add_(0, e_s, forced.to(torch.int64))
    w_fin = torch.where(forced, torch.zeros_like(w_s), w_s)
    total_E = torch.zeros(E, dtype=torch.float64, device=dev).index_add_(0, e_s, w_fin)
    S = (total_E.index_select(0, e_s) - (torch.cumsum(w_fin, 0) - w_fin
                                         - (torch.cumsum(total_E, 0) - total_E).index_select(0, e_s))).clamp(min=0)
    q_s = q_E.index_select(0, e_s)
    valid = (rank >= n_forced_E.index_select(0, e_s)) & (rank <= q_s) & ((q_s - rank).double() * w_fin <= S)
    # number of capped pairs: the least valid rank (invalid pairs offer their expert's quota, the start value)
    m_E = q_E.clone().scatter_reduce_(0, e_s, torch.where(valid, rank, q_s), "amin")
    at_m = (start_E + m_E).clamp(max=max(P - 1, 0))
    S_m_E = torch.where(m_E < d_E, S.index_select(0, at_m) if P else total_E, torch.zeros_like(total_E))
    rest_E = (q_E - m_E).double()
    # positive weights left after the capped ones (counted, not read off S: S is a difference of sums)
    n_pos_E = torch.zeros(E, dtype=torch.int64, device=dev).index_add_(0, e_s, (w_s > 0).to(torch.int64))
    m_s, S_m, rest = m_E.index_select(0, e_s), S_m_E.index_select(0, e_s), rest_E.index_select(0, e_s)
    weighted = (m_E < n_pos_E).index_select(0, e_s)
    zeros_left = (d_E - m_E).clamp(min=1).double().index_select(0, e_s)
    free = torch.where(weighted, (rest * w_fin / S_m.clamp(min=1e-300)).clamp(max=1.0), rest / zeros_left)
    pi_s = torch.where(rank < m_s, torch.ones_like(w_s), torch.where(rest > 0, free, torch.zeros_like(w_s)))
    return torch.empty_like(pi_s).index_copy_(0, order, pi_s)


def systematic_select(pi_P: torch.Tensor, expert_P: torch.Tensor, quota_E: torch.Tensor,
                      u_E: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(keep [P] bool, exact inclusion probabilities [P] float64) of systematic sampling in pair
    order within each expert, given ``pi`` (:func:`inclusion_probabilities`) and the integer
    points ``u_E`` in [0, 2^32) (one per expert). Keeps exactly ``quota_E[e]`` pairs of expert e."""
    P, E = pi_P.numel(), quota_E.numel()
    dev = pi_P.device
    expert_P = expert_P.reshape(-1).to(torch.int64)
    perm = torch.argsort(expert_P, stable=True)  # pair order within each expert
    e_s, pi_s = expert_P.index_select(0, perm), pi_P.reshape(-1).double().index_select(0, perm)
    certain = pi_s >= CERTAIN
    cand = ~certain & (pi_s > 0)
    n_certain_E = torch.zeros(E, dtype=torch.int64, device=dev).index_add_(0, e_s, certain.to(torch.int64))
    r_E = (quota_E.to(torch.int64) - n_certain_E).clamp(min=0)
    p_c = torch.where(cand, pi_s, torch.zeros_like(pi_s))
    tot_E = torch.zeros(E, dtype=torch.float64, device=dev).index_add_(0, e_s, p_c)
    # cumulative probability within the expert, renormalised to r_e, in integer units (non-decreasing)
    before_E = torch.cumsum(tot_E, 0) - tot_E
    C = (torch.cumsum(p_c, 0) - before_E.index_select(0, e_s)).clamp(min=0)
    scale = (r_E.double() / tot_E.clamp(min=1e-300)).index_select(0, e_s) * _UNIT
    R = r_E.index_select(0, e_s) * _UNIT
    A = torch.minimum(torch.floor(C * scale).to(torch.int64), R)
    # the last candidate of each expert ends exactly at r_e; a candidate starts where the previous one ended
    pos = torch.arange(P, device=dev)
    last_cand, _ = torch.cummax(torch.where(cand, pos, torch.full_like(pos, -1)), 0)
    prev = torch.cat([last_cand.new_full((1,), -1), last_cand[:-1]]) if P else last_cand
    end_E = torch.cumsum(torch.zeros(E, dtype=torch.int64, device=dev).index_add_(0, e_s, torch.ones_like(e_s)), 0)
    last_of_E = torch.where(end_E > 0, last_cand.index_select(0, (end_E - 1).clamp(min=0)) if P else end_E,
                            torch.full_like(end_E, -1))
    is_last = cand & (pos == last_of_E.index_select(0, e_s))
    A = torch.where(is_last, R, A)
    same = (prev >= 0) & (e_s.index_select(0, prev.clamp(min=0)) == e_s) if P else cand
    A_prev = torch.where(same, A.index_select(0, prev.clamp(min=0)) if P else A, torch.zeros_like(A))
    u = u_E.to(torch.int64).index_select(0, e_s)
    # points u + k * UNIT (k >= 0) in [A_prev, A): ceil((A - u) / UNIT) - ceil((A_prev - u) / UNIT)
    hits = _ceil_div(A - u, _UNIT) - _ceil_div(A_prev - u, _UNIT)
    keep_s = certain | (cand & (hits > 0))
    pi_used = torch.where(certain, torch.ones_like(pi_s),
                          torch.where(cand, (A - A_prev).double() / _UNIT, torch.zeros_like(pi_s)))
    keep = torch.empty_like(keep_s).index_copy_(0, perm, keep_s)
    return keep, torch.empty_like(pi_used).index_copy_(0, perm, pi_used)


def _ceil_div(a: torch.Tensor, b: int) -> torch.Tensor:
    return -torch.div(-a, b, rounding_mode="floor")


def draw_points(num_experts: int, device, generator: torch.Generator | None = None) -> torch.Tensor:
    """One uniform integer point in [0, 2^32) per expert (from ``generator``; torch's global RNG when None)."""
    return torch.randint(0, _UNIT, (num_experts,), generator=generator, dtype=torch.int64, device=device)


def sample_quota(scores_P: torch.Tensor, expert_P: torch.Tensor, quota_E: torch.Tensor,
                 generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(keep [P] bool, inclusion probabilities [P] float64): per expert exactly ``quota_E[e]`` pairs,
    pair u kept with probability pi_u proportional to sqrt(score_u) (capped at 1; module docstring).
    Scale a kept pair's contribution by 1/pi_u for an unbiased sum."""
    pi = inclusion_probabilities(scores_P, expert_P, quota_E)
    return systematic_select(pi, expert_P, quota_E, draw_points(quota_E.numel(), scores_P.device, generator))


# --- plain references (the test oracle) ------------------------------------------------------------

def inclusion_probabilities_loop(scores_P: torch.Tensor, expert_P: torch.Tensor, quota_E: torch.Tensor) -> list:
    """Reference for :func:`inclusion_probabilities`: the textbook iteration per expert (cap the
    pairs whose probability reaches 1, recompute the others, until none is capped anew)."""
    w = sample_sizes(scores_P.reshape(-1)).tolist()
    experts = expert_P.reshape(-1).tolist()
    pi = [0.0] * len(w)
    for e, q in enumerate(quota_E.tolist()):
        pairs = [u for u, x in enumerate(experts) if x == e]
        forced = [u for u in pairs if math.isinf(w[u])]
        capped = forced[:q]
        while True:
            rest = q - len(capped)
            free = [u for u in pairs if u not in capped and not math.isinf(w[u])]
            if rest <= 0 or not free:
                break
            S = sum(w[u] for u in free)
            if S == 0:  # the positive weights are all capped: the rest evenly over the zero-weight pairs
                for u in free:
                    pi[u] = rest / len(free)
                break
            new = [u for u in free if rest * w[u] / S > 1]
            if not new:
                for u in free:
                    pi[u] = rest * w[u] / S
                break
            capped += new
        for u in capped:
            pi[u] = 1.0
    return pi


def systematic_select_loop(pi: list, expert_P: torch.Tensor, quota_E: torch.Tensor, u_E: list) -> tuple[list, list]:
    """Reference for :func:`systematic_select`: per expert, one pass in pair order."""
    experts = expert_P.reshape(-1).tolist()
    keep, used = [False] * len(pi), [0.0] * len(pi)
    for e, q in enumerate(quota_E.tolist()):
        pairs = [u for u, x in enumerate(experts) if x == e]
        certain = [u for u in pairs if pi[u] >= CERTAIN]
        cand = [u for u in pairs if 0 < pi[u] < CERTAIN]
        for u in certain:
            keep[u], used[u] = True, 1.0
        r = max(q - len(certain), 0)
        tot = sum(pi[u] for u in cand)
        cum, a_prev = 0.0, 0
        for i, u in enumerate(cand):
            cum += pi[u]
            a = r * _UNIT if i == len(cand) - 1 else min(math.floor(cum * (r / tot) * _UNIT), r * _UNIT)
            hits = -((u_E[e] - a) // _UNIT) + ((u_E[e] - a_prev) // _UNIT)  # points u + k*UNIT in [a_prev, a)
            keep[u], used[u] = hits > 0, (a - a_prev) / _UNIT
            a_prev = a
    return keep, used
