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

import heapq
import math

import numpy as np

from lrmoe.planning.memory import count_memory
from lrmoe.planning.plan import (cap_rows, domain_receivers, experts_by_load_per_rank, locality_split_replicas,
                                 make_plan, owned_layout, replica_columns, replica_instances, resolve_budget)

Replica = tuple[int, int, int]  # (expert, host rank, quota rows)
_NONE: frozenset = frozenset()


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
    return _feasible(int(tau), _solver_context(load_E, owner_E, free_G, domain_G), min_tokens, overshoot)


def _solver_context(load_E, owner_E, free_G, domain_G) -> dict:
    """What :func:`_feasible` reads at every threshold (built once per search): Python lists and ints."""
    load_E = np.asarray(load_E, dtype=np.int64)
    owner_E = np.asarray(owner_E, dtype=np.int64)
    G = len(free_G)
    rank_load = np.bincount(owner_E, weights=load_E, minlength=G).astype(np.int64)
    return {"rank_load": rank_load.tolist(), "total": int(rank_load.sum()),
            "order": np.argsort(-rank_load, kind="stable").tolist(),
            "free": np.asarray(free_G, dtype=np.int64).tolist(), "loads": load_E.tolist(),
            "others": domain_receivers(domain_G),
            "mine": experts_by_load_per_rank(load_E, owner_E, G)}


def _feasible(tau: int, ctx: dict, min_tokens, overshoot: bool) -> list[Replica] | None:
    """:func:`ultraep_feasible` over a :func:`_solver_context`: scalar Python over the ranks (few;
    the same integer arithmetic and ties as the array form)."""
    rank_load = ctx["rank_load"]
    # sum(excess) - sum(slack) = sum(rank_load) - G * tau (exact integers): the first test
    if ctx["total"] > len(rank_load) * tau:
        return None
    slack = [tau - x if x < tau else 0 for x in rank_load]
    free, loads, others_G, mine_G = list(ctx["free"]), ctx["loads"], ctx["others"], ctx["mine"]
    hosts: dict[int, set] = {}  # replica hosts so far (the owner hosts every expert too)
    replicas: list[Replica] = []
    for r in ctx["order"]:
        need = rank_load[r] - tau
        if need <= 0:
            break
        peers = others_G[r]  # r sheds the experts it owns: never to itself
        for e in mine_G[r]:
            available = loads[e] - 1
            host = hosts.get(e, _NONE)
            while need > 0 and available > 0:
                t, best = -1, -1
                for u in peers:  # the first rank with the most slack among those with a free slot
                    if slack[u] > best and free[u] > 0 and u not in host:
                        t, best = u, slack[u]
                if t < 0:
                    break
                q = min(max(need, min_tokens) if overshoot else need, slack[t], available)
                if q < min_tokens:
                    break
                replicas.append((e, t, q))
                slack[t] -= q
                free[t] -= 1
                if host is _NONE:
                    host = hosts[e] = set()
                host.add(t)
                need -= q
                available -= q
            if need == 0:
                break
        if need > 0:
            return None
    return replicas


def ultraep_threshold(load_E, owner_E, free_G, domain_G, min_tokens: int = 1024, fast_path: bool = True,
                      overshoot: bool = True) -> tuple[int, list[Replica]]:
    """Smallest feasible per-rank threshold tau in [ceil(mean rank load), max rank load] by binary
    search (the max is always feasible: no replicas). UltraEP tries tau = ceil(1.01 * lo) first;
    here that probe only narrows the search range. The result is feasible and tau - 1 is not;
    it is the smallest feasible tau whenever the solver's feasibility is monotone in tau (always
    observed with overshoot=True unless min_tokens is comparable to whole expert loads)."""
    rank_load = np.bincount(owner_E, weights=np.asarray(load_E), minlength=len(free_G)).astype(np.int64)
    lo, hi = math.ceil(rank_load.sum() / len(rank_load)), int(rank_load.max())
    ctx = _solver_context(load_E, owner_E, free_G, domain_G)
    feasible = lambda tau: _feasible(int(tau), ctx, min_tokens, overshoot)  # noqa: E731
    if fast_path and lo < hi:
        probe = min(math.ceil(lo * 1.01), hi)
        if feasible(probe) is not None:
            hi = probe
        else:
            lo = probe + 1
    while lo < hi:
        mid = (lo + hi) // 2
        if feasible(mid) is not None:
            hi = mid
        else:
            lo = mid + 1
    return hi, feasible(hi)


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
    load = np.asarray(load_E, dtype=np.float64)
    G = len(free_G)
    domain_G = np.asarray(domain_G)
    dom_E = domain_G[owner_E]
    domain_size = np.bincount(domain_G, minlength=G)[dom_E]
    dom_free = np.bincount(domain_G, weights=np.asarray(free_G, dtype=np.float64), minlength=G).astype(np.int64)
    # Replica counts: a heap of (-load/instances, expert) gives argmax's pick (the largest share,
    # ties to the lower index); an expert found ineligible (all domain ranks host it, or its
    # domain has no free slot left) stays so, and is dropped from the heap.
    loads = load.tolist()
    n = [1] * len(loads)
    size = domain_size.tolist()
    dfree = dom_free.tolist()
    dom_e = dom_E.tolist()
    heap = [(-x, e) for e, x in enumerate(loads)]
    heapq.heapify(heap)
    for _ in range(int(np.sum(free_G))):
        while heap and not (n[heap[0][1]] < size[heap[0][1]] and dfree[dom_e[heap[0][1]]] > 0):
            heapq.heappop(heap)
        if not heap or -heap[0][0] <= 0:
            break
        e = heapq.heappop(heap)[1]
        n[e] += 1
        dfree[dom_e[e]] -= 1
        heapq.heappush(heap, (-(loads[e] / n[e]), e))
    n = np.array(n, dtype=np.int64)
    share = load / n
    rank_load = np.bincount(owner_E, weights=share, minlength=G).tolist()
    free = [int(f) for f in free_G]
    owner = [int(r) for r in owner_E]
    doms = [int(x) for x in domain_G]
    peers = {d: [t for t in range(G) if doms[t] == d] for d in set(dom_e)}
    hosts: dict[int, set] = {}  # replica hosts so far (the owner hosts every expert too)
    wanted = np.repeat(np.arange(len(load)), n - 1)
    shares = share.tolist()
    placed = []
    for e in wanted[np.argsort(-share[wanted], kind="stable")].tolist():
        host = hosts.setdefault(e, set())
        t, best = -1, math.inf
        own = owner[e]
        for u in peers[dom_e[e]]:  # the first least-loaded rank with a free slot not hosting e
            if rank_load[u] < best and free[u] > 0 and u != own and u not in host:  # best = inf until one is found
                t, best = u, rank_load[u]
        if t < 0:
            continue
        placed.append((int(e), t))
        rank_load[t] += shares[e]
        free[t] -= 1
        host.add(t)
    return placed


def _replica_plan(policy, demand_GE, cluster, dims, budget_bytes, hosts_E, expert_N, rank_N, quota_N, row_cap, info):
    """Masters plus replicas on ``hosts_E`` (columns as :func:`lrmoe.planning.plan.replica_columns`):
    each expert's pairs split locality-first by the instance quotas ``quota_N``, capped at
    ``row_cap`` rows per instance when given."""
    instances, _ = replica_instances(cluster, dims, hosts_E, policy)
    send = locality_split_replicas(demand_GE, expert_N, rank_N, quota_N)
    if row_cap is not None:
        send = cap_rows(send, row_cap)
    return make_plan(policy, demand_GE, cluster, dims, budget_bytes, instances, send, info=info)


def _layout_fits(demand_GE, dims, budget_bytes, rank_N, is_replica_N, quota_N) -> bool:
    """Whether the uncapped :func:`_replica_plan` of these instance quotas fits the budget, without
    the split: every instance receives its quota, every routed pair is sent and kept (the same
    integers as the plan's memory, :func:`lrmoe.planning.memory.count_memory`)."""
    pairs_G = demand_GE.sum(1)
    mem = count_memory(dims, len(pairs_G), rank_N, is_replica_N, recv_N=quota_N, kept_recv_N=quota_N, sent_G=pairs_G,
                       kept_sent_G=pairs_G, pairs_G=pairs_G)
    return mem.peak <= budget_bytes


def _check_common(cluster, dims, policy, redundant_slots):
    epr = owned_layout(cluster, dims, policy)
    R_max = cluster.slots_per_rank - epr
    R = R_max if redundant_slots is None else redundant_slots
    if isinstance(R, bool) or not isinstance(R, (int, np.integer)) or not 0 <= R <= R_max:
        raise ValueError(f"{policy}: redundant_slots must be an integer in [0, S - E/G = {R_max}], got {R!r}")
    return np.full(cluster.num_ranks, R, dtype=np.int64), np.arange(dims.num_experts) // epr


def plan_ultraep(demand_GE, cluster, dims, budget_bytes, *, state=None, min_tokens: int = 1024,
                 redundant_slots: int | None = None, fast_path: bool = True, overshoot: bool = True,
                 fallback: str = "split", max_split: int = 256):
    """UltraEP on the exact current load. min_tokens: smallest replica quota (UltraEP's default
    1024); redundant_slots: R per rank (default S - E/G); fast_path: probe tau = 1.01 * lo first;
    overshoot: how the min_tokens floor is read (:func:`ultraep_feasible`); fallback under budget
    pressure: ``split`` (default), ``drop`` or ``oom``."""
    if isinstance(min_tokens, bool) or not isinstance(min_tokens, (int, np.integer)) or min_tokens < 1:
        raise ValueError(f"min_tokens must be an integer >= 1, got {min_tokens!r}")
    free_G, owner_E = _check_common(cluster, dims, "ultraep", redundant_slots)
    domain_G = cluster.domain_G

    def layout(d_GE):
        load_E = d_GE.sum(0)
        tau, replicas = ultraep_threshold(load_E, owner_E, free_G, domain_G, min_tokens, fast_path, overshoot)
        hosts_E = [[] for _ in load_E]
        for e, t, _ in replicas:
            hosts_E[e].append(t)
        expert_N, rank_N, quota_N = replica_columns(replicas, load_E, owner_E)
        return tau, hosts_E, expert_N, rank_N, np.arange(expert_N.size) >= load_E.size, quota_N

    def build(d_GE, row_cap):
        tau, hosts_E, expert_N, rank_N, _, quota_N = layout(d_GE)
        return _replica_plan("ultraep", d_GE, cluster, dims, budget_bytes, hosts_E, expert_N, rank_N, quota_N, row_cap,
                             {"threshold": tau, "min_tokens": min_tokens})

    def fits(d_GE, row_cap):
        if row_cap is not None:
            return build(d_GE, row_cap).fits
        _, _, _, rank_N, rep_N, quota_N = layout(d_GE)
        return _layout_fits(d_GE, dims, budget_bytes, rank_N, rep_N, quota_N)

    return resolve_budget(build, demand_GE, budget_bytes, fallback, max_split, fits=fits)


def plan_ultraep_greedy(demand_GE, cluster, dims, budget_bytes, *, state=None, redundant_slots: int | None = None,
                        fallback: str = "split", max_split: int = 256):
    """UltraEP's EPLB-like greedy fallback; each expert's load split evenly over its instances."""
    free_G, owner_E = _check_common(cluster, dims, "ultraep_greedy", redundant_slots)
    domain_G = cluster.domain_G

    def layout(d_GE):
        load_E = d_GE.sum(0)
        hosts_E = [[] for _ in load_E]
        placed = eplb_replicas(load_E, owner_E, free_G, domain_G)
        for e, t in placed:
            hosts_E[e].append(t)
        expert_N, rank_N, _ = replica_columns([(e, t, 0) for e, t in placed], load_E, owner_E)
        rep_ex = expert_N[load_E.size:]
        j_N = np.r_[np.zeros(load_E.size, np.int64), 1 + np.arange(rep_ex.size) - np.searchsorted(rep_ex, rep_ex)]
        # largest remainder over equal weights: the first load mod c instances take one more (j: the
        # instance's index among its expert's, 0 the master)
        base_E, extra_E = np.divmod(load_E, 1 + np.array([len(h) for h in hosts_E], dtype=np.int64))
        return hosts_E, expert_N, rank_N, j_N > 0, base_E[expert_N] + (j_N < extra_E[expert_N])

    def build(d_GE, row_cap):
        hosts_E, expert_N, rank_N, _, quota_N = layout(d_GE)
        return _replica_plan("ultraep_greedy", d_GE, cluster, dims, budget_bytes, hosts_E, expert_N, rank_N, quota_N,
                             row_cap, {})

    def fits(d_GE, row_cap):
        if row_cap is not None:
            return build(d_GE, row_cap).fits
        _, _, rank_N, rep_N, quota_N = layout(d_GE)
        return _layout_fits(d_GE, dims, budget_bytes, rank_N, rep_N, quota_N)

    return resolve_budget(build, demand_GE, budget_bytes, fallback, max_split, fits=fits)
