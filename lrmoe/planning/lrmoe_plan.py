"""LRMoE's joint quota + placement planner ("lrmoe"), run before the expert forward.

Given this step's exact demand d_{r,e}, the planner decides together

* the backward retention quota q_e of every expert (``lrmoe.planning.quota.compute_quota``; the total
  n_keep <= round((1 - drop_ratio) * P) is bisected down until the plan fits the memory budget), and
* the replicas and the routing of every expert's pairs to its instances.

What it optimises. With B = ``backward_weight`` (2: a backward row costs two GEMMs of the
forward's size) the work of rank r is

    cost_r = F_r + B * K_r,  F_r = forward rows its instances compute, K_r = kept backward rows,

and the planner minimises the slowest rank's cost, max_r cost_r, over replica placements that

* use at most ``replica_slots`` replica slots per rank, at most one copy of an expert per rank,
  replicas only inside the owner's fast domain, no replica with fewer than ``min_rows`` rows;
* keep every rank's (estimated) memory within the budget when a replica is added.

Within an expert every instance keeps the same fraction q_e / d_e of its rows (rounded to
integers so that no rank exceeds the threshold below when some rounding allows it, see
:func:`_instance_quotas`), so the per-instance selection by score matches the expert's selection as closely as
possible, and a row of expert e costs w_e = 1 + B * q_e / d_e wherever it runs. The retained
demand therefore drives replication: a hot expert whose quota was trimmed (waterfill trims the
hottest first) weighs less and may no longer need a replica. The search is UltraEP-style: the
smallest integer threshold tau for which a greedy (ranks by descending cost, their experts by
descending weighted load, each chunk to the in-domain rank with the most slack that has a free
slot and memory headroom; a replica carries at least ``min_rows`` rows) brings every rank to
cost <= tau; the slack left is then used to move rows off ranks still over the memory budget. If
the plan is still over the budget, tau is raised to the smallest threshold whose plan fits (more
slack, more rows moved off those ranks) before any quota shrinks. Pairs are routed locality-first
(:func:`lrmoe.planning.plan.locality_split`), each instance receiving exactly its row capacity;
backward quotas per (source, instance) are proportional to the pairs sent.

Under memory pressure quotas shrink (``fallback == "shrink_quota"``, bisection on n_keep down to
``max_drop_ratio``), the forward stays complete; only when even that does not fit is the
microbatch split (``split_microbatch:N``) or, with ``fallback="oom"``, an out-of-memory reported.

Exact or approximate searches. By default (``search_tolerance = 0``) every bisection runs to one
unit: the plans are those of the frozen reference (:mod:`lrmoe.planning.reference`). With
``search_tolerance = t > 0`` each bisection stops once its bracket is narrower than
``max(1, floor(t * scale))`` units, the scale being the routed pairs P for the kept-pair search and
the ranks' mean cost for the threshold searches; the plan returned is the bracket's feasible end
(it meets its threshold, and under pressure it fits the budget), so it is as valid as an exact one.
Whether a plan fits is not monotone in the kept pairs nor in the threshold (the greedy's memory
pass rounds rows), so the exact bisection's answer is one of several boundaries and an approximate
search lands on a neighbouring one: single plans can keep more or fewer pairs, at a lower or
higher cost, by more than t (docs/benchmarks.md measures what a tolerance buys and costs).
"""
from __future__ import annotations

import dataclasses
import math
import numbers

import numpy as np

from .memory import instance_bytes, plan_memory, token_row_bytes, total_memory_floor
from .plan import (Cluster, ModelDims, Plan, domain_receivers, experts_by_load_per_rank, largest_remainder_cols,
                   largest_remainder_groups, locality_split_replicas, make_plan, owned_layout, replica_columns,
                   replica_instances, resolve_budget)
from .quota import check_drop_ratio, compute_quota, quota_for, retained_total

_EPS = 1e-9
_NONE: frozenset = frozenset()


def _quota(d_E: np.ndarray, n_keep: int, policy: str, options: dict, drop_ratio: float) -> np.ndarray:
    """Quotas summing exactly to n_keep from the planner quota policy (the numpy twin of the layer's).

    At the policy's own n_keep the drop ratio is passed on, so the quotas equal the layer's."""
    P = int(d_E.sum())
    if n_keep >= P:
        return d_E.copy()
    exact = n_keep == retained_total(P, drop_ratio)
    return quota_for(d_E, n_keep, policy, drop_ratio=drop_ratio if exact else None, **options)


def _slack(tolerance: float, scale) -> int:
    """Bracket width (units) at which a bisection over a range of size ``scale`` stops: 1 (exact) for
    tolerance 0."""
    return max(1, math.floor(tolerance * scale))


def _over_memory_floor(dims: ModelDims, num_ranks: int, pairs: int, kept: int, budget) -> bool:
    """No plan keeping ``kept`` of ``pairs`` routed pairs fits ``budget``: the ranks' mean memory
    before any replica (:func:`lrmoe.planning.memory.total_memory_floor`, the same for every
    placement) is over it, and the peak is at least the ceiled mean (exact int/float compare)."""
    floor = total_memory_floor(dims, dims.num_experts, pairs, kept)
    return math.isfinite(budget) and -(-floor // num_ranks) > budget


def _greedy_context(cost_G, mem_G, d_E, w_E, L_E, row_bytes_E, owner_E, free_G, domain_G) -> dict:
    """What :func:`_greedy` reads at every threshold (built once per quota): the costs (float64 array) and
    the ranks by descending cost, the rest as Python lists."""
    G = len(mem_G)
    owner_E = np.asarray(owner_E)
    cost_G = np.asarray(cost_G).astype(np.float64)
    return {"cost": cost_G, "order": np.argsort(-cost_G, kind="stable").tolist(),  # ranks by descending cost
            "mem": np.asarray(mem_G, dtype=np.float64).tolist(), "free": np.asarray(free_G).tolist(),
            "left": np.asarray(d_E).tolist(),
            "w": np.asarray(w_E, dtype=np.float64).tolist(), "rb": np.asarray(row_bytes_E, dtype=np.float64).tolist(),
            "others": domain_receivers(domain_G),
            "mine": experts_by_load_per_rank(L_E, owner_E, G)}  # by descending weighted load


def _greedy(tau, cost_G, mem_G, d_E, w_E, L_E, row_bytes_E, owner_E, free_G, domain_G, rep_bytes, budget,
            min_rows, context: dict | None = None):
    """Replicas (expert, rank, rows) that bring every rank to cost <= tau, or None.

    Pass 1 sheds every rank's cost excess (ranks by descending cost, their experts by descending
    weighted load); pass 2 then uses the slack left to shed memory from ranks still over the
    budget (best effort). A receiver never goes over tau nor over the budget. ``context``: the
    :func:`_greedy_context` of the same arguments (built here when None)."""
    ctx = context or _greedy_context(cost_G, mem_G, d_E, w_E, L_E, row_bytes_E, owner_E, free_G, domain_G)
    excess = np.maximum(ctx["cost"] - tau, 0.0)
    slack = np.maximum(tau - ctx["cost"], 0.0)
    if excess.sum() > slack.sum() + _EPS:
        return None
    # Scalar Python over the G ranks (G is small; numpy per-element calls cost more than they save).
    # Every operation is the same IEEE double arithmetic as the array form, in the same order.
    excess, slack = excess.tolist(), slack.tolist()
    mem, free, left = list(ctx["mem"]), list(ctx["free"]), list(ctx["left"])  # left: rows not moved yet
    wl, rbl, others_G, mine_G = ctx["w"], ctx["rb"], ctx["others"], ctx["mine"]
    extra: dict[int, set] = {}  # replica hosts of every expert given one (its owner hosts it too)
    rep_bytes = float(rep_bytes)
    finite = math.isfinite(budget)
    replicas = []

    def shed(r, need):
        """Move rows off rank r until its cost excess ``need`` is gone (and, in pass 2, its memory
        is within budget); returns the cost excess left."""
        peers = others_G[r]  # r sheds the experts it owns: never to itself
        for e in mine_G[r]:
            w, rb = wl[e], rbl[e]
            w_min = w - _EPS  # the least slack that takes one row
            host = extra.get(e, _NONE)
            while (need > _EPS or mem[r] > budget) and left[e] > 0:
                t, best = -1, -1.0
                for u in peers:  # the first rank with the most slack among the eligible ones
                    if slack[u] > best and free[u] > 0 and slack[u] >= w_min and u not in host \
                            and (not finite or mem[u] + rep_bytes + rb <= budget):
                        t, best = u, slack[u]
                if t < 0:
                    break
                want = max(math.ceil(need / w - _EPS), math.ceil((mem[r] - budget) / rb) if mem[r] > budget else 0)
                # A replica carries at least min_rows (it may shed more than needed, never past tau):
                # capping it at the need instead would fail at a larger tau where a smaller one
                # succeeded, and the threshold search would miss far smaller thresholds.
                x = min(max(want, min_rows), math.floor(slack[t] / w + _EPS), left[e])
                if finite:
                    x = min(x, math.floor((budget - mem[t] - rep_bytes) / rb))
                if x < min_rows:
                    break
                replicas.append((e, t, x))
                slack[t] -= x * w
                need -= x * w
                free[t] -= 1
                mem[t] += rep_bytes + x * rb
                mem[r] -= x * rb
                left[e] -= x
                if host is _NONE:
                    host = extra[e] = set()
                host.add(t)
            if need <= _EPS and mem[r] <= budget:
                break
        return need

    order = ctx["order"]
    for r in order:
        if excess[r] > _EPS and shed(r, excess[r]) > _EPS:
            return None
    for r in order:
        if mem[r] > budget:
            shed(r, 0.0)
    return replicas


def _instance_quotas(q_E, rows_E, ranks_E, G: int, backward_weight: float, tau: float) -> list[np.ndarray]:
    """Kept rows of every instance: q_e split over e's instances in proportion to their rows, each
    within 1 of its exact share q_e * rows_n / d_e (every instance keeps the floor of its share,
    the leftover units of an expert go one each to instances with a fractional share).

    The planner's threshold ``tau`` is met by the exact shares; rounding them can push a rank
    over it. The rounding is largest remainder when that keeps every rank's executed cost
    F_r + B K_r within tau; otherwise the one with the smallest executed maximum, hence within
    tau whenever any rounding is. Which rounding meets a
    cost target is a bipartite feasibility problem (leftover units of each expert -> ranks, at
    most one per instance, at most cap_r = floor((target - base_r) / B) per rank), solved
    exactly by an integral max flow (``scipy.sparse.csgraph.maximum_flow``). Deterministic."""
    ranks_E = [np.asarray(r, dtype=np.int64) for r in ranks_E]
    rows_E = [np.asarray(r, dtype=np.int64) for r in rows_E]
    sizes = [len(r) for r in rows_E]
    expert_N = np.repeat(np.arange(len(rows_E)), sizes)
    kept_N = _instance_quotas_flat(q_E, np.concatenate(rows_E + [np.zeros(0, np.int64)]), expert_N,
                                   np.concatenate(ranks_E + [np.zeros(0, np.int64)]), G, backward_weight, tau)
    return np.split(kept_N, np.cumsum(sizes)[:-1]) if sizes else []


class _QuotaSearch:
    """The threshold searches for one quota vector q_E (module docstring): :meth:`result` is the plan
    the planner returns for these quotas, :meth:`fits` only whether it fits the budget.

    ``fits`` is what the kept-pair and microbatch-split searches probe; it is computed without
    the threshold search where it can be: the plan for q_E fits iff the candidate at the
    cost-optimal threshold fits or (when that one does not) the candidate at the largest
    threshold ``top`` does (then the memory search finds a fitting threshold <= top), so a
    fitting ``top`` candidate answers ``True`` after one greedy pass; and no candidate fits when
    the ranks' mean memory (:func:`lrmoe.planning.memory.total_memory_floor`, the same for every
    placement before replicas) is over the budget, which answers ``False`` without any pass. Greedy passes and
    candidates are memoised per threshold, so ``fits`` then ``result`` costs no more than ``result``."""

    def __init__(self, d_GE, q_E, cluster: Cluster, dims: ModelDims, budget, *, free_G, owner_E,
                 backward_weight, min_rows, info, tolerance=0.0):
        G, E = d_GE.shape
        d_E = d_GE.sum(0)
        frac_E = np.divide(q_E, d_E, out=np.zeros(E), where=d_E > 0)
        w_E = np.where(d_E > 0, 1.0 + backward_weight * frac_E, 0.0)
        L_E = d_E + backward_weight * q_E
        row = token_row_bytes(dims)
        row_bytes_E = row["saved"] + frac_E * row["backward"]  # expert-side bytes per forward row
        base_G = np.bincount(owner_E, minlength=G) * instance_bytes(dims, replica=False)
        # Exactly rounded sums (not a BLAS matmul, whose summation order can depend on the CPU):
        # every rank must compute the same plan.
        kept_sent_G = np.array([math.fsum(r) for r in (d_GE * frac_E).tolist()]) if G else np.zeros(0)
        mem_G = (base_G + row["dispatch"] * (d_GE.sum(1) + kept_sent_G) + row["output"] * d_GE.sum(1)
                 + np.bincount(owner_E, weights=d_E * row_bytes_E, minlength=G))
        cost_G = np.bincount(owner_E, weights=L_E, minlength=G)
        self.args = (cost_G, mem_G, d_E, w_E, L_E, row_bytes_E, owner_E, free_G, cluster.domain_G,
                     instance_bytes(dims, replica=True), budget, min_rows)
        self.context = _greedy_context(*self.args[:9])
        self.lo, self.top = math.floor(cost_G.sum() / G), math.ceil(cost_G.max(initial=0.0))
        self.candidate_args = (d_GE, q_E, cluster, dims, budget, backward_weight, info)
        self.budget = budget
        # No plan of these quotas fits when the ranks' mean memory is over the budget
        self.over_floor = _over_memory_floor(dims, G, int(d_E.sum()), int(np.asarray(q_E).sum()), budget)
        self.greedy_memo: dict[int, list | None] = {}
        self.candidate_memo: dict[int, _Candidate | None] = {}
        self.hi: int | None = None
        self.slack = _slack(tolerance, self.lo)  # bracket width at which the threshold searches stop

    def greedy(self, tau: int):
        if tau not in self.greedy_memo:
            self.greedy_memo[tau] = _greedy(tau, *self.args, context=self.context)
        return self.greedy_memo[tau]

    def candidate(self, tau: int):
        """The candidate plan at threshold tau (None when the greedy cannot meet it)."""
        if tau not in self.candidate_memo:
            reps = self.greedy(tau)
            self.candidate_memo[tau] = None if reps is None else _candidate(*self.candidate_args[:2], reps, tau,
                                                                            *self.candidate_args[2:])
        return self.candidate_memo[tau]

    def threshold(self) -> int:
        """The smallest integer threshold the greedy meets (bisection; ``top`` always: no replica needed);
        with a tolerance, one the greedy meets less than ``slack`` above the bracket's lower end."""
        if self.hi is None:
            lo, hi = self.lo, self.top
            while hi - lo >= self.slack:  # slack 1: until lo == hi
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if self.greedy(mid) is not None else (mid + 1, hi)
            self.hi = hi
        return self.hi

    def fits(self, top_first: bool = True) -> bool:
        """Whether :meth:`result` fits the budget (class docstring). ``top_first=False`` tries the
        cost-optimal candidate first (cheaper where it usually fits: no memory pressure)."""
        if not math.isfinite(self.budget):
            return self.result().fits
        if self.over_floor:
            return False
        if not top_first and self.candidate(self.threshold()).fits:
            return True
        top = self.candidate(self.top)
        return (top is not None and top.fits) or self.candidate(self.threshold()).fits

    def result(self) -> "_Candidate":
        """The plan for these quotas: at the cost-optimal threshold, or when that one is over the
        budget, at the smallest higher threshold that fits (if any)."""
        return dataclasses.replace(self._search(), threshold_cost=self.threshold())

    def _search(self) -> "_Candidate":
        hi, top = self.threshold(), self.top
        plan = self.candidate(hi)
        if plan.fits or not math.isfinite(self.budget):
            return plan

        # Over the memory budget at the cost-optimal threshold: a higher threshold leaves more slack
        # to move rows off the ranks over the budget (pass 2 of the greedy). Smallest fitting
        # threshold above it: doubling steps, then bisection (every plan taken fits). The largest
        # threshold is tried first, so quotas that cannot fit at all cost one extra plan only.
        def fitting(tau):
            p = self.candidate(tau)
            return p if p is not None and p.fits else None

        if hi == top or fitting(top) is None:
            return plan
        bad, step, found = hi, 1, None
        while bad < top and found is None:
            tau = min(bad + step, top)
            found = fitting(tau)
            if found is None:
                bad, step = tau, 2 * step
        if found is None:
            return plan
        good = found.tau
        while good - bad > self.slack:
            mid = (bad + good) // 2
            p = fitting(mid)
            bad, good, found = (bad, mid, p) if p is not None else (mid, good, found)
        return found


def _instance_quotas_flat(q_E, rows_N, expert_N, rank_N, G: int, backward_weight: float, tau: float) -> np.ndarray:
    """:func:`_instance_quotas` over flat per-instance arrays (the instances of expert e are those
    with ``expert_N == e``, in array order; at most one per rank): the kept rows of every instance."""
    q_E = np.asarray(q_E, dtype=np.int64)
    rows_N = np.asarray(rows_N, dtype=np.int64)
    expert_N = np.asarray(expert_N, dtype=np.int64)
    rank_N = np.asarray(rank_N, dtype=np.int64)
    E = q_E.size
    d_E = np.bincount(expert_N, weights=rows_N, minlength=E).astype(np.int64)
    d_N, q_N = d_E[expert_N], q_E[expert_N]
    safe_N = np.where(d_N > 0, d_N, 1)
    floors_N = np.where(d_N > 0, rows_N * q_N // safe_N, 0)
    fractional_N = (d_N > 0) & (rows_N * q_N % safe_N != 0)
    units_E = q_E - np.bincount(expert_N, weights=floors_N, minlength=E).astype(np.int64)
    exact_N = largest_remainder_groups(np.where(d_E > 0, q_E, 0), rows_N, expert_N)
    F_G = np.bincount(rank_N, weights=rows_N, minlength=G)
    if backward_weight <= 0 or units_E.sum() == 0 or (
            F_G + backward_weight * np.bincount(rank_N, weights=exact_N, minlength=G)).max(initial=0.0) <= tau + _EPS:
        return exact_N
    from scipy.sparse import csr_matrix
    from scipy.sparse.csgraph import maximum_flow

    base_G = F_G + backward_weight * np.bincount(rank_N, weights=floors_N, minlength=G)
    cand_G = np.bincount(rank_N, weights=fractional_N, minlength=G).astype(np.int64)  # may take one more unit
    experts = np.flatnonzero(units_E > 0)
    node_E = np.zeros(E, dtype=np.int64)
    node_E[experts] = 1 + np.arange(experts.size)
    # nodes: 0 source, 1..len(experts) experts, then G ranks, then the sink; edges: source -> expert,
    # then expert -> rank per expert in instance order, then rank -> sink
    src, sink = 0, experts.size + G + 1
    order = np.argsort(expert_N, kind="stable")
    order = order[fractional_N[order] & (units_E[expert_N[order]] > 0)]
    u0 = np.r_[np.full(experts.size, src), node_E[expert_N[order]]]
    v0 = np.r_[1 + np.arange(experts.size), 1 + experts.size + rank_N[order]]
    c0 = np.r_[units_E[experts], np.ones(order.size, dtype=np.int64)]

    # One graph; every target only changes the rank -> sink capacities (explicit zeros stay
    # entries, as they do when the graph is built anew). A rank node's row holds that one edge.
    u = np.r_[u0, 1 + experts.size + np.arange(G)].astype(np.int32)
    v = np.r_[v0, np.full(G, sink)].astype(np.int32)
    template = csr_matrix((np.r_[c0, np.zeros(G, dtype=np.int64)].astype(np.int32), (u, v)),
                          shape=(sink + 1, sink + 1))
    cap_pos = template.indptr[1 + experts.size + np.arange(G)]

    def caps_at(target):
        return np.minimum(np.floor((target - base_G) / backward_weight + _EPS), cand_G).clip(0).astype(np.int64)

    def flow_at(target):
        graph = template.copy()
        graph.data[cap_pos] = caps_at(target)
        res = maximum_flow(graph, src, sink)
        return res if res.flow_value == int(units_E.sum()) else None

    # The executed maximum is one of the values base_r + B k: the smallest one that admits a flow
    # (the largest always does: every rank uncapped). Feasibility only grows with the target (the
    # capacities do), so the smallest is unique: targets whose rank capacities cannot hold the
    # units at all are skipped without a flow, the first one left is tried first (it usually
    # admits one), then binary search above it.
    targets = sorted({float(b + backward_weight * k) for b, n in zip(base_G, cand_G) for k in range(int(n) + 1)})
    targets = [t for t in targets if t >= base_G.max() - _EPS]
    total = int(units_E.sum())
    t_T = np.asarray(targets)[:, None]  # the same arithmetic as caps_at, for every target at once
    room_T = np.minimum(np.floor((t_T - base_G) / backward_weight + _EPS), cand_G).clip(0).sum(1)
    lo = int(np.argmax(room_T >= total)) if (room_T >= total).any() else len(targets) - 1
    best = flow_at(targets[lo])
    hi = lo if best is not None else len(targets) - 1
    lo += best is None
    while lo < hi:
        mid = (lo + hi) // 2
        res = flow_at(targets[mid])
        lo, hi, best = (lo, mid, res) if res is not None else (mid + 1, hi, best)
    if best is None:
        best = flow_at(targets[hi])
    flow = best.flow.tocsr()
    has = units_E[expert_N] > 0
    out = floors_N.copy()
    out[has] += np.asarray(flow[node_E[expert_N[has]], 1 + experts.size + rank_N[has]]).ravel().astype(np.int64)
    return out


@dataclasses.dataclass
class _Candidate:
    """The counts of one candidate plan and its memory; :meth:`plan` assembles the checked Plan
    (only the plan a search returns is assembled: the searches read ``fits`` alone)."""

    d_GE: np.ndarray
    q_E: np.ndarray
    hosts_E: list
    send: np.ndarray
    quota: np.ndarray
    tau: int
    fits: bool
    args: tuple
    threshold_cost: int | None = None  # the cost-optimal threshold of the quota's search

    def plan(self) -> Plan:
        cluster, dims, budget, backward_weight, info = self.args
        instances, _ = replica_instances(cluster, dims, self.hosts_E, "lrmoe")
        d_E, n_keep = self.d_GE.sum(0), int(self.q_E.sum())
        info = {**info, "threshold_cost": self.threshold_cost, "threshold": self.tau, "quota_E": self.q_E, "n_keep": n_keep,
                "backward_weight": backward_weight, "drop_ratio_effective": 1.0 - n_keep / max(int(d_E.sum()), 1)}
        return make_plan("lrmoe", self.d_GE, cluster, dims, budget, instances, self.send, self.quota, info=info)


def _candidate(d_GE, q_E, replicas, tau, cluster: Cluster, dims: ModelDims, budget, backward_weight,
               info) -> _Candidate:
    """The greedy's replicas at threshold ``tau``: locality-first routing, per-(source, instance)
    backward quotas and the memory they need (instances in the order of
    :func:`lrmoe.planning.plan.replica_instances`: owners, then replicas by expert)."""
    G, E = d_GE.shape
    d_E = d_GE.sum(0)
    hosts_E = [[] for _ in range(E)]
    for e, t, _ in replicas:
        hosts_E[e].append(t)
    expert_N, rank_N, rows_N = replica_columns(replicas, d_E, np.arange(E) // owned_layout(cluster, dims, "lrmoe"))
    send = locality_split_replicas(d_GE, expert_N, rank_N, rows_N)
    kept_N = _instance_quotas_flat(q_E, rows_N, expert_N, rank_N, G, backward_weight, tau)
    quota = largest_remainder_cols(kept_N, send)
    mem = plan_memory(dims, G, rank_N, np.arange(expert_N.size) >= E, send, quota, pairs_G=d_GE.sum(1))
    return _Candidate(d_GE, q_E, hosts_E, send, quota, tau, mem.peak <= budget,
                      (cluster, dims, budget, backward_weight, info))


def plan_lrmoe(demand_GE, cluster, dims, budget_bytes, *, state=None, drop_ratio: float = 0.0,
               quota_policy: str = "waterfill", quota_options: dict | None = None, replica_slots: int | None = None,
               backward_weight: float = 2.0, min_rows: int = 1, max_drop_ratio: float = 0.9,
               fallback: str = "split", max_split: int = 256, search_tolerance: float = 0.0):
    """LRMoE joint planner (module docstring).

    drop_ratio: requested backward drop ratio rho (kept pairs = round((1 - rho) P)).
    quota_policy / quota_options: a registered ``lrmoe.planning.quota`` policy and its keyword options.
    replica_slots: replica slots per rank (default and maximum S - E/G).
    backward_weight: cost of a kept backward row in forward rows (2.0).
    min_rows: smallest replica worth its weight transfer, in rows (1).
    max_drop_ratio: how far quotas may shrink under memory pressure (0.9).
    fallback when even max_drop_ratio does not fit: ``split`` (default) or ``oom``.
    search_tolerance: relative width at which the kept-pair and threshold bisections stop, in [0, 0.1]
    (0: exact, the reference's plans; module docstring)."""
    check_drop_ratio(drop_ratio)
    check_drop_ratio(max_drop_ratio)
    if max_drop_ratio < drop_ratio:
        raise ValueError(f"max_drop_ratio ({max_drop_ratio}) must be >= drop_ratio ({drop_ratio})")
    if fallback not in ("split", "oom"):
        raise ValueError(f"lrmoe fallback must be 'split' or 'oom' (quotas shrink first), got {fallback!r}")
    if not isinstance(backward_weight, (int, float)) or backward_weight < 0:
        raise ValueError(f"backward_weight must be a number >= 0, got {backward_weight!r}")
    if isinstance(search_tolerance, bool) or not isinstance(search_tolerance, numbers.Real) \
            or not 0 <= search_tolerance <= 0.1:
        raise ValueError(f"search_tolerance must be a number in [0, 0.1] (0: exact searches), got {search_tolerance!r}")
    if isinstance(min_rows, bool) or not isinstance(min_rows, (int, np.integer)) or min_rows < 1:
        raise ValueError(f"min_rows must be an integer >= 1, got {min_rows!r}")
    epr = owned_layout(cluster, dims, "lrmoe")
    R_max = cluster.slots_per_rank - epr
    R = R_max if replica_slots is None else replica_slots
    if isinstance(R, bool) or not isinstance(R, (int, np.integer)) or not 0 <= R <= R_max:
        raise ValueError(f"replica_slots must be an integer in [0, S - E/G = {R_max}], got {R!r}")
    quota_options = dict(quota_options or {})
    compute_quota(np.zeros(dims.num_experts, dtype=np.int64), drop_ratio, quota_policy, **quota_options)  # validates
    kw = dict(free_G=np.full(cluster.num_ranks, R, dtype=np.int64), owner_E=np.arange(dims.num_experts) // epr,
              backward_weight=float(backward_weight), min_rows=int(min_rows),
              info={"drop_ratio": drop_ratio, "quota_policy": quota_policy, "search_tolerance": search_tolerance},
              tolerance=float(search_tolerance))

    searches: dict[tuple, _QuotaSearch] = {}  # (demand piece, n_keep) -> its search, within this call

    def search(d_GE, n_keep) -> _QuotaSearch:
        key = (d_GE.tobytes(), n_keep)
        if key not in searches:
            q_E = _quota(d_GE.sum(0), n_keep, quota_policy, quota_options, drop_ratio)
            searches[key] = _QuotaSearch(d_GE, q_E, cluster, dims, budget_bytes, **kw)
        return searches[key]

    kept: dict[bytes, int | None] = {}  # demand piece -> its shrunk_keep, within this call

    def shrunk_keep(d_GE):
        """How many pairs the plan of d_GE keeps: the requested n_keep when it fits; else the
        largest n_keep >= the max_drop_ratio one that fits (bisection), None when none fits."""
        key = d_GE.tobytes()
        if key not in kept:
            kept[key] = keep_search(d_GE)
        return kept[key]

    def keep_search(d_GE):
        P = int(d_GE.sum())

        def fits_keep(n_keep, top_first=True):
            # _QuotaSearch.fits starts with the same floor test (its quotas sum to min(n_keep, P)); it
            # needs only the pair counts, so probes it refuses skip the quotas and the search
            return not _over_memory_floor(dims, cluster.num_ranks, P, min(n_keep, P), budget_bytes) \
                and search(d_GE, n_keep).fits(top_first)

        hi_keep = retained_total(P, drop_ratio)
        if fits_keep(hi_keep, top_first=False):  # the requested quotas usually fit
            return hi_keep
        lo_keep = retained_total(P, max_drop_ratio)
        if not fits_keep(lo_keep):
            return None  # quotas alone cannot make it fit: resolve_budget splits or reports oom
        slack = _slack(search_tolerance, P)
        while hi_keep - lo_keep > slack:  # lo_keep fits, hi_keep does not
            mid = (lo_keep + hi_keep) // 2
            lo_keep, hi_keep = (mid, hi_keep) if fits_keep(mid) else (lo_keep, mid)
        return lo_keep

    def build(d_GE, row_cap):
        hi_keep = retained_total(int(d_GE.sum()), drop_ratio)
        n_keep = shrunk_keep(d_GE)
        if n_keep is None:
            return search(d_GE, hi_keep).result().plan()
        plan = search(d_GE, n_keep).result().plan()
        return plan if n_keep == hi_keep else dataclasses.replace(plan, over_budget=True, fallback="shrink_quota")

    def fits(d_GE, row_cap):
        return shrunk_keep(d_GE) is not None

    return resolve_budget(build, demand_GE, budget_bytes, fallback, max_split, fits=fits)
