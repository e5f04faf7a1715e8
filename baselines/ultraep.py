"""UltraEP (arXiv 2606.04101): exact-load rebalancing with redundant expert slots.

"ultraep": every rank keeps its fixed master experts (e on rank e // (E/G)) plus R redundant
slots. On this step's exact load it binary-searches the smallest per-rank load threshold tau
that its greedy quota solver (:func:`ultraep_feasible`) can meet, adds the replicas that solver
chose, and splits each expert's pairs over its instances locality-first
(:func:`lrmoe.planning.plan.locality_split`). Replicas stay inside the master's fast domain,
at most one copy of an expert per rank, and carry weights and gradients but no optimizer state.

"ultraep_greedy": UltraEP's simpler EPLB-like fallback (:func:`eplb_replicas`).

Every computed pair is kept in backward; nothing is dropped unless the ``drop`` budget fallback
is chosen.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from lrmoe.planning.jit import njit
from lrmoe.planning.memory import memory_constants, memory_from_counts
from lrmoe.planning.plan import (cap_rows_kernel, heap_pop, heap_push, locality_split_kernel, make_plan,
                                 replica_layout, replica_slot_count, resolve_budget)

Replica = tuple[int, int, int]  # (expert, host rank, quota rows)


def _int64(x) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.int64)


# ----------------------------------------------------------------------------- compiled solver
@njit
def domain_members(domain_G):
    """The ranks of every fast domain in rank order, as CSR over domain ids (0..max id)."""
    G = domain_G.size
    D = 0
    for r in range(G):
        if domain_G[r] + 1 > D:
            D = domain_G[r] + 1
    start = np.zeros(D + 1, np.int64)
    for r in range(G):
        start[domain_G[r] + 1] += 1
    for d in range(D):
        start[d + 1] += start[d]
    fill = start[:-1].copy()
    members = np.empty(G, np.int64)
    for r in range(G):
        members[fill[domain_G[r]]] = r
        fill[domain_G[r]] += 1
    return start, members


@njit
def solver_context(load_E, owner_E, num_ranks):
    """What the solver reads at every threshold: rank loads, ranks by descending load, and every
    rank's experts by descending load (CSR; ties to the lower index)."""
    G, E = num_ranks, load_E.size
    rank_load = np.zeros(G, np.int64)
    for e in range(E):
        rank_load[owner_E[e]] += load_E[e]
    order = np.argsort(-rank_load, kind="mergesort")
    by_load = np.argsort(-load_E, kind="mergesort")
    start = np.zeros(G + 1, np.int64)
    for e in range(E):
        start[owner_E[e] + 1] += 1
    for r in range(G):
        start[r + 1] += start[r]
    fill = start[:-1].copy()
    mine = np.empty(E, np.int64)
    for i in range(E):
        e = by_load[i]
        mine[fill[owner_E[e]]] = e
        fill[owner_E[e]] += 1
    return rank_load, order, start, mine


@njit
def feasible_kernel(tau, load_E, free_G, domain_G, rank_load, order, mine_start, mine, dom_start, dom_members,
                    min_tokens, overshoot, slack, free, host_EG, rep_e, rep_t, rep_q):
    """:func:`ultraep_feasible` over a :func:`solver_context`: the number of replicas written to
    rep_e/rep_t/rep_q, or -1 if infeasible. slack, free and host_EG are scratch (host_EG all False
    on entry and on return)."""
    G = rank_load.size
    total = 0
    for r in range(G):
        total += rank_load[r]
    # sum(excess) - sum(slack) = sum(rank_load) - G * tau (exact integers): the first test
    if total > G * tau:
        return -1
    for r in range(G):
        slack[r] = tau - rank_load[r] if rank_load[r] < tau else 0
        free[r] = free_G[r]
    k = 0
    ok = True
    for i in range(G):
        r = order[i]
        need = rank_load[r] - tau
        if need <= 0:
            break
        d = domain_G[r]
        for m in range(mine_start[r], mine_start[r + 1]):
            e = mine[m]
            available = load_E[e] - 1
            while need > 0 and available > 0:
                t, best = -1, -1
                for p in range(dom_start[d], dom_start[d + 1]):  # r sheds the experts it owns: never to itself
                    u = dom_members[p]
                    if u != r and slack[u] > best and free[u] > 0 and not host_EG[e, u]:
                        t, best = u, slack[u]
                if t < 0:
                    break
                q = (need if need > min_tokens else min_tokens) if overshoot else need
                if slack[t] < q:
                    q = slack[t]
                if available < q:
                    q = available
                if q < min_tokens:
                    break
                rep_e[k], rep_t[k], rep_q[k] = e, t, q
                k += 1
                slack[t] -= q
                free[t] -= 1
                host_EG[e, t] = True
                need -= q
                available -= q
            if need <= 0:
                break
        if need > 0:
            ok = False
            break
    for i in range(k):
        host_EG[rep_e[i], rep_t[i]] = False
    return k if ok else -1


@njit
def solve(load_E, owner_E, free_G, domain_G, min_tokens, fast_path, overshoot, search, tau):
    """The solver's threshold search (``search``) or one feasibility test at ``tau``: returns
    (tau, k, rep_e, rep_t, rep_q) with k = -1 when infeasible."""
    G, E = free_G.size, load_E.size
    rank_load, order, mine_start, mine = solver_context(load_E, owner_E, G)
    dom_start, dom_members = domain_members(domain_G)
    slots = 0
    for r in range(G):
        slots += max(free_G[r], 0)
    slack = np.empty(G, np.int64)
    free = np.empty(G, np.int64)
    host_EG = np.zeros((E, G), np.bool_)
    rep_e = np.empty(slots + 1, np.int64)
    rep_t = np.empty(slots + 1, np.int64)
    rep_q = np.empty(slots + 1, np.int64)
    if search:
        total = 0
        hi = 0
        for r in range(G):
            total += rank_load[r]
            if r == 0 or rank_load[r] > hi:
                hi = rank_load[r]
        lo = math.ceil(total / G)
        if fast_path and lo < hi:
            probe = min(math.ceil(lo * 1.01), hi)
            if feasible_kernel(probe, load_E, free_G, domain_G, rank_load, order, mine_start, mine, dom_start,
                               dom_members, min_tokens, overshoot, slack, free, host_EG, rep_e, rep_t, rep_q) >= 0:
                hi = probe
            else:
                lo = probe + 1
        while lo < hi:
            mid = (lo + hi) // 2
            if feasible_kernel(mid, load_E, free_G, domain_G, rank_load, order, mine_start, mine, dom_start,
                               dom_members, min_tokens, overshoot, slack, free, host_EG, rep_e, rep_t, rep_q) >= 0:
                hi = mid
            else:
                lo = mid + 1
        tau = hi
    k = feasible_kernel(tau, load_E, free_G, domain_G, rank_load, order, mine_start, mine, dom_start, dom_members,
                        min_tokens, overshoot, slack, free, host_EG, rep_e, rep_t, rep_q)
    return tau, k, rep_e, rep_t, rep_q


@njit
def replica_columns_kernel(load_E, owner_E, rep_e, rep_t, rep_q, k):
    """:func:`lrmoe.planning.plan.replica_columns` of the first k replicas: owners, then the
    replicas by expert (stable); an owner's rows are its load less its replicas'."""
    E = load_E.size
    N = E + k
    expert_N = np.empty(N, np.int64)
    rank_N = np.empty(N, np.int64)
    rows_N = np.empty(N, np.int64)
    count = np.zeros(E + 1, np.int64)
    for e in range(E):
        expert_N[e] = e
        rank_N[e] = owner_E[e]
        rows_N[e] = load_E[e]
    for i in range(k):
        count[rep_e[i] + 1] += 1
        rows_N[rep_e[i]] -= rep_q[i]
    for e in range(E):
        count[e + 1] += count[e]
    for i in range(k):
        n = E + count[rep_e[i]]
        count[rep_e[i]] += 1
        expert_N[n] = rep_e[i]
        rank_N[n] = rep_t[i]
        rows_N[n] = rep_q[i]
    return expert_N, rank_N, rows_N


@njit
def column_sums(d_GE):
    G, E = d_GE.shape
    out = np.zeros(E, np.int64)
    for g in range(G):
        for e in range(E):
            out[e] += d_GE[g, e]
    return out


@njit
def ultraep_layout(d_GE, owner_E, free_G, domain_G, min_tokens, fast_path, overshoot):
    """plan_ultraep's layout of a demand: (tau, expert_N, rank_N, quota_N) of its instance columns."""
    load_E = column_sums(d_GE)
    tau, k, rep_e, rep_t, rep_q = solve(load_E, owner_E, free_G, domain_G, min_tokens, fast_path, overshoot, True, 0)
    expert_N, rank_N, quota_N = replica_columns_kernel(load_E, owner_E, rep_e, rep_t, rep_q, k)
    return tau, expert_N, rank_N, quota_N


@njit
def eplb_kernel(load_E, owner_E, free_G, domain_G):
    """:func:`eplb_replicas`: (expert, host) arrays of the replicas, in placement order."""
    E, G = load_E.size, free_G.size
    dom_start, members = domain_members(domain_G)
    D = dom_start.size - 1
    dfree = np.zeros(D, np.int64)
    total_free = 0
    for r in range(G):
        dfree[domain_G[r]] += free_G[r]
        total_free += free_G[r]
    n = np.ones(E, np.int64)
    size_E = np.empty(E, np.int64)
    dom_E = np.empty(E, np.int64)
    keys = np.empty(E, np.float64)
    idx = np.empty(E, np.int64)
    hs = 0
    for e in range(E):
        dom_E[e] = domain_G[owner_E[e]]
        size_E[e] = dom_start[dom_E[e] + 1] - dom_start[dom_E[e]]
        hs = heap_push(keys, idx, hs, -load_E[e], e)
    # replica counts: the largest load / instances (ties to the lower index) among the eligible
    for _ in range(total_free):
        while hs > 0 and not (n[idx[0]] < size_E[idx[0]] and dfree[dom_E[idx[0]]] > 0):
            _, hs = heap_pop(keys, idx, hs)
        if hs == 0 or -keys[0] <= 0:
            break
        e, hs = heap_pop(keys, idx, hs)
        n[e] += 1
        dfree[dom_E[e]] -= 1
        hs = heap_push(keys, idx, hs, -(load_E[e] / n[e]), e)
    share = np.empty(E, np.float64)
    rank_load = np.zeros(G, np.float64)
    W = 0
    for e in range(E):
        share[e] = load_E[e] / n[e]
        rank_load[owner_E[e]] += share[e]
        W += n[e] - 1
    wanted = np.empty(W, np.int64)
    neg = np.empty(W, np.float64)
    w = 0
    for e in range(E):
        for _ in range(n[e] - 1):
            wanted[w] = e
            neg[w] = -share[e]
            w += 1
    free = free_G.copy()
    host_EG = np.zeros((E, G), np.bool_)
    out_e = np.empty(W, np.int64)
    out_t = np.empty(W, np.int64)
    k = 0
    for i in np.argsort(neg, kind="mergesort"):
        e = wanted[i]
        t, best = -1, np.inf
        own = owner_E[e]
        d = dom_E[e]
        for p in range(dom_start[d], dom_start[d + 1]):  # the first least-loaded rank with a free slot not hosting e
            u = members[p]
            if rank_load[u] < best and free[u] > 0 and u != own and not host_EG[e, u]:
                t, best = u, rank_load[u]
        if t < 0:
            continue
        out_e[k], out_t[k] = e, t
        k += 1
        rank_load[t] += share[e]
        free[t] -= 1
        host_EG[e, t] = True
    return out_e[:k], out_t[:k]


@njit
def greedy_layout(d_GE, owner_E, free_G, domain_G):
    """plan_ultraep_greedy's layout of a demand: (expert_N, rank_N, quota_N); each expert's load
    split evenly over its instances, the first load mod c (master first) taking one more."""
    load_E = column_sums(d_GE)
    E = load_E.size
    rep_e, rep_t = eplb_kernel(load_E.astype(np.float64), owner_E, free_G, domain_G)
    k = rep_e.size
    expert_N, rank_N, _ = replica_columns_kernel(load_E, owner_E, rep_e, rep_t, np.zeros(k, np.int64), k)
    c_E = np.ones(E, np.int64)
    for i in range(k):
        c_E[rep_e[i]] += 1
    quota_N = np.empty(E + k, np.int64)
    j = np.zeros(E, np.int64)
    for n in range(E + k):
        e = expert_N[n]
        base, extra = load_E[e] // c_E[e], load_E[e] % c_E[e]
        quota_N[n] = base + (j[e] < extra)
        j[e] += 1
    return expert_N, rank_N, quota_N


@njit
def layout_peak(d_GE, rank_N, is_replica_N, quota_N, consts):
    """The memory peak of the uncapped plan of these instance quotas (every instance receives
    its quota, every routed pair is sent and kept): :func:`_layout_fits`'s number."""
    G, E = d_GE.shape
    pairs_G = np.zeros(G, np.int64)
    for g in range(G):
        for e in range(E):
            pairs_G[g] += d_GE[g, e]
    return memory_from_counts(rank_N, is_replica_N, quota_N, quota_N, pairs_G, pairs_G, pairs_G, G, consts)[5]


# ----------------------------------------------------------------------------- the solver's interface
def ultraep_feasible(tau: int, load_E, owner_E, free_G, domain_G, min_tokens: int = 1024,
                     overshoot: bool = True) -> list[Replica] | None:
    """UltraEP's quota solver at threshold ``tau``: the replicas it adds, or None if infeasible.

        excess_r = max(rank_load[r] - tau, 0); slack_r = max(tau - rank_load[r], 0)
        if sum(excess) > sum(slack): infeasible
        for source rank r by descending load, for expert e on r by descending load:
            available = d_e - 1 - exported_e                    # the master keeps >= 1 token
            while need_r > 0 and available > 0:
                t = rank with most slack (same fast domain) with a free slot, not hosting e
                q = min(need_r, slack_t, available); stop if q < min_tokens
                add a replica of e on t with quota q
        if need_r > 0: infeasible
    Ties go to the lower index (ranks, experts).

    ``overshoot=True`` (default) reads the floor as "a replica carries at least min_tokens":
    q = min(max(need_r, min_tokens), slack_t, available), so a rank less than min_tokens over
    tau may shed min_tokens and end below tau. Taken literally (``overshoot=False``) the rule
    makes the solver fail at a larger tau where it succeeded at a smaller one (the residual need
    falls under the floor), and the binary search then misses far smaller thresholds; see
    docs/placement.md."""
    load_E, owner_E = _int64(load_E), _int64(owner_E)
    _, k, rep_e, rep_t, rep_q = solve(load_E, owner_E, _int64(free_G), _int64(domain_G), int(min_tokens), False,
                                      bool(overshoot), False, int(tau))
    return None if k < 0 else _replicas(rep_e, rep_t, rep_q, k)


def _replicas(rep_e, rep_t, rep_q, k) -> list[Replica]:
    return list(zip(rep_e[:k].tolist(), rep_t[:k].tolist(), rep_q[:k].tolist()))


def ultraep_threshold(load_E, owner_E, free_G, domain_G, min_tokens: int = 1024, fast_path: bool = True,
                      overshoot: bool = True) -> tuple[int, list[Replica]]:
    """Smallest feasible per-rank threshold tau in [ceil(mean rank load), max rank load] by binary
    search (the max is always feasible: no replicas). UltraEP tries tau = ceil(1.01 * lo) first;
    here that probe only narrows the search range. The result is feasible and tau - 1 is not;
    it is the smallest feasible tau whenever the solver's feasibility is monotone in tau (always
    observed with overshoot=True unless min_tokens is comparable to whole expert loads)."""
    tau, k, rep_e, rep_t, rep_q = solve(_int64(load_E), _int64(owner_E), _int64(free_G), _int64(domain_G),
                                        int(min_tokens), bool(fast_path), bool(overshoot), True, 0)
    return int(tau), _replicas(rep_e, rep_t, rep_q, k)


def eplb_replicas(load_E, owner_E, free_G, domain_G) -> list[tuple[int, int]]:
    """UltraEP's EPLB-like fallback (docs/placement.md): (expert, host rank) of every replica.

    Repeatedly add a replica to the expert with the highest load / instances until the free
    slots are used (an expert has at most one copy per rank of its domain, counts only against
    its own fast domain's free slots, and zero-load experts get none); then place replicas largest
    share first on the least-loaded rank (load = sum of the shares it hosts, masters included)
    with a free slot in the domain that does not host it. A replica that fits nowhere is not added.

    Counting against the domain's own slots keeps a full domain from taking the replicas another
    domain could place (counted against the global total, they were dropped in placement while
    the other domain's slots stayed free). It is a heuristic, as published: with masters pinned to
    their owners a replica can land on a busier rank than its master's."""
    rep_e, rep_t = eplb_kernel(np.ascontiguousarray(load_E, dtype=np.float64), _int64(owner_E), _int64(free_G),
                               _int64(domain_G))
    return list(zip(rep_e.tolist(), rep_t.tolist()))


def _replica_plan(policy, demand_GE, cluster, dims, budget_bytes, hosts_E, expert_N, rank_N, quota_N, row_cap, info):
    """Masters plus replicas (columns as :func:`lrmoe.planning.plan.replica_columns`; ``hosts_E``,
    every expert's replica hosts, is what they list): each expert's pairs split locality-first by
    the instance quotas ``quota_N``, capped at ``row_cap`` rows per instance when given."""
    instances = replica_layout(cluster, dims, expert_N, rank_N, policy)
    send, bad = locality_split_kernel(demand_GE, instances.expert_N, instances.rank_N, _int64(quota_N))
    if bad >= 0:
        raise ValueError(f"{policy}: instance quotas of expert {bad} do not split over its demand")
    if row_cap is not None:
        send = cap_rows_kernel(send, np.full(send.shape[1], int(row_cap), dtype=np.int64))
    return make_plan(policy, demand_GE, cluster, dims, budget_bytes, instances, send, info=info)


def _layout_fits(demand_GE, dims, budget_bytes, rank_N, is_replica_N, quota_N) -> bool:
    """Whether the uncapped :func:`_replica_plan` of these instance quotas fits the budget, without
    the split: every instance receives its quota, every routed pair is sent and kept (the same
    integers as the plan's memory, :func:`lrmoe.planning.memory.count_memory`)."""
    return layout_peak(demand_GE, _int64(rank_N), np.ascontiguousarray(is_replica_N, dtype=np.bool_), _int64(quota_N),
                       memory_constants(dims)) <= budget_bytes


def _redundant_slots(cluster, dims, policy, redundant_slots) -> int:
    """R, the replica slots per rank (default S - E/G), checked."""
    return replica_slot_count(cluster, dims, policy, redundant_slots, f"{policy}: redundant_slots")


def _check_common(cluster, dims, policy, redundant_slots):
    """free_G (R per rank) and owner_E (e // (E/G))."""
    free_G, owner_E, _ = _solver_inputs(cluster, dims, policy, redundant_slots)
    return free_G.copy(), owner_E.copy()


def _solver_inputs(cluster, dims, policy, redundant_slots):
    """free_G, owner_E and domain_G, made once per layout (shared arrays the kernels only read)."""
    R = _redundant_slots(cluster, dims, policy, redundant_slots)
    return _solver_arrays(cluster.num_ranks, dims.num_experts, R, cluster.fast_domains)


@functools.lru_cache(maxsize=64)
def _solver_arrays(G: int, E: int, R: int, fast_domains) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    domain_G = np.empty(G, dtype=np.int64)
    for i, ranks in enumerate(fast_domains):
        domain_G[list(ranks)] = i
    return np.full(G, R, dtype=np.int64), np.arange(E, dtype=np.int64) // (E // G), domain_G


def plan_ultraep(demand_GE, cluster, dims, budget_bytes, *, state=None, min_tokens: int = 1024,
                 redundant_slots: int | None = None, fast_path: bool = True, overshoot: bool = True,
                 fallback: str = "split", max_split: int = 256):
    """UltraEP on the exact current load. min_tokens: smallest replica quota (UltraEP's default
    1024); redundant_slots: R per rank (default S - E/G); fast_path: probe tau = 1.01 * lo first;
    overshoot: how the min_tokens floor is read (:func:`ultraep_feasible`); fallback under budget
    pressure: ``split`` (default), ``drop`` or ``oom``."""
    if isinstance(min_tokens, bool) or not isinstance(min_tokens, (int, np.integer)) or min_tokens < 1:
        raise ValueError(f"min_tokens must be an integer >= 1, got {min_tokens!r}")
    free_G, owner_E, domain_G = _solver_inputs(cluster, dims, "ultraep", redundant_slots)
    options = (int(min_tokens), bool(fast_path), bool(overshoot))
    consts = memory_constants(dims)
    E = dims.num_experts

    def build(d_GE, row_cap):
        tau, expert_N, rank_N, quota_N = ultraep_layout(d_GE, owner_E, free_G, domain_G, *options)
        return _replica_plan("ultraep", d_GE, cluster, dims, budget_bytes, None, expert_N, rank_N, quota_N, row_cap,
                             {"threshold": int(tau), "min_tokens": min_tokens})

    def fits(d_GE, row_cap):
        if row_cap is not None:
            return build(d_GE, row_cap).fits
        _, expert_N, rank_N, quota_N = ultraep_layout(d_GE, owner_E, free_G, domain_G, *options)
        return layout_peak(d_GE, rank_N, np.arange(expert_N.size) >= E, quota_N, consts) <= budget_bytes

    return resolve_budget(build, demand_GE, budget_bytes, fallback, max_split, fits=fits)


def plan_ultraep_greedy(demand_GE, cluster, dims, budget_bytes, *, state=None, redundant_slots: int | None = None,
                        fallback: str = "split", max_split: int = 256):
    """UltraEP's EPLB-like greedy fallback; each expert's load split evenly over its instances."""
    free_G, owner_E, domain_G = _solver_inputs(cluster, dims, "ultraep_greedy", redundant_slots)
    consts = memory_constants(dims)
    E = dims.num_experts

    def build(d_GE, row_cap):
        expert_N, rank_N, quota_N = greedy_layout(d_GE, owner_E, free_G, domain_G)
        return _replica_plan("ultraep_greedy", d_GE, cluster, dims, budget_bytes, None, expert_N, rank_N, quota_N,
                             row_cap, {})

    def fits(d_GE, row_cap):
        if row_cap is not None:
            return build(d_GE, row_cap).fits
        expert_N, rank_N, quota_N = greedy_layout(d_GE, owner_E, free_G, domain_G)
        return layout_peak(d_GE, rank_N, np.arange(expert_N.size) >= E, quota_N, consts) <= budget_bytes

    return resolve_budget(build, demand_GE, budget_bytes, fallback, max_split, fits=fits)
