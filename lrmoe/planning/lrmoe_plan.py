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
unit: the plans are those of the frozen reference (:mod:`lrmoe.planning.reference`), but for one
search. The requested quotas' threshold is searched from below, from a floor no plan can beat
(:func:`lrmoe.planning.lrmoe_jit.threshold_from_floor`: 3-5 greedy passes, not ~20), and its plan
is kept when it fits the budget; it is the reference's threshold wherever the greedy's feasibility
grows with the threshold, elsewhere another one the greedy meets (one plan of the tests' 2,000
random ones, 5 % faster there; docs/benchmarks.md counts the benchmark's). When that plan does
not fit, the reference's searches run, so under pressure the kept pairs are the reference's. With
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
import functools
import math
import numbers

import numpy as np

from . import lrmoe_jit as K
from .memory import MemoryBreakdown, instance_bytes, token_row_bytes, total_memory_floor
from .plan import (Cluster, Instances, ModelDims, PieceKey, Plan, domain_receivers, new_plan, owned_layout,
                   replace_plan, replica_slot_count, resolve_budget)
from .quota import (check_drop_ratio, check_min_keep, compute_quota, get_quota_policy, keep_fraction,
                    proportional_quota, quota_for, retained_count, retained_total, waterfill_quota)

_EPS = K.EPS
# Plan.check's messages for the codes of lrmoe_jit.check_plan
_CHECK_ERRORS = {1: "instances must have valid experts, ranks and distinct slots",
                 2: "instances must have valid experts, ranks and distinct slots",
                 3: "every expert needs an instance and at most one owner",
                 4: "negative send or dropped counts", 5: "backward quotas must be in [0, send]"}


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


@functools.lru_cache(maxsize=64)
def _receivers(cluster: Cluster) -> tuple[np.ndarray, np.ndarray]:
    """Every rank's in-domain receivers (:func:`lrmoe.planning.plan.domain_receivers`) as CSR arrays."""
    others = domain_receivers(cluster.domain_G)
    ptr = np.r_[0, np.cumsum([len(o) for o in others])].astype(np.int64)
    idx = np.array([u for o in others for u in o], dtype=np.int64)
    return ptr, idx  # shared by the calls: never written (writable, so numba compiles one specialisation)


def _problem(cluster: Cluster, dims: ModelDims, budget, free_G, owner_E, backward_weight, min_rows,
             tolerance=0.0) -> tuple:
    """The compiled searches' constants of one planner call (:func:`lrmoe.planning.lrmoe_jit.problem`)."""
    row = token_row_bytes(dims)
    ptr, idx = _receivers(cluster)
    return K.problem(owner_E, ptr, idx, free_G, instance_bytes(dims, replica=True), instance_bytes(dims, replica=False),
                     row["dispatch"], row["saved"], row["output"], row["backward"], budget, backward_weight, min_rows,
                     tolerance)


@functools.lru_cache(maxsize=64)
def _planner_problem(cluster: Cluster, dims: ModelDims, budget, replica_slots: int, backward_weight: float,
                     min_rows: int, tolerance: float) -> tuple:
    """:func:`_problem` of a planner call's options, made once per distinct call (shared by the calls:
    its arrays are never written, but for the greedy-pass counter)."""
    return _problem(cluster, dims, budget, *_layout(cluster, dims, replica_slots), backward_weight, min_rows, tolerance)


@functools.lru_cache(maxsize=64)
def _layout(cluster: Cluster, dims: ModelDims, replica_slots: int) -> tuple:
    """Free replica slots per rank and every expert's owner."""
    epr = owned_layout(cluster, dims, "lrmoe")
    free_G = np.full(cluster.num_ranks, replica_slots, dtype=np.int64)
    owner_E = np.arange(dims.num_experts, dtype=np.int64) // epr
    return free_G, owner_E  # shared by the calls: never written



def _replica_slots(cluster: Cluster, dims: ModelDims, replica_slots) -> int:
    """The replica slots per rank a planner call uses: ``replica_slots``, checked, or all (S - E/G) when None."""
    return replica_slot_count(cluster, dims, "lrmoe", replica_slots, "replica_slots")


def _builtin_quota(policy: str, options: dict):
    """(policy code, min_keep) of a built-in quota policy the compiled searches compute themselves, or
    None (a user policy, or options they do not know: the quotas then come from Python)."""
    fn = get_quota_policy(policy)
    if fn is waterfill_quota and set(options) <= {"min_keep"}:
        return K.WATERFILL, int(options.get("min_keep", 0))
    if fn is proportional_quota and not options:
        return K.PROPORTIONAL, 0
    return None


def _greedy_context(cost_G, mem_G, d_E, w_E, L_E, row_bytes_E, owner_E, free_G, domain_G, rep_bytes=0.0,
                    budget=math.inf, min_rows=1) -> tuple:
    """The compiled greedy's (qs, prob) for these arguments (:func:`_greedy`)."""
    G, E = len(mem_G), len(d_E)
    others = domain_receivers(domain_G)
    ptr = np.r_[0, np.cumsum([len(o) for o in others])].astype(np.int64)
    idx = np.array([u for o in others for u in o], dtype=np.int64)
    prob = K.problem(owner_E, ptr, idx, free_G, rep_bytes, 0, 0, 0, 0, 0, budget, 0.0, min_rows, 0.0)
    cost_G = np.asarray(cost_G, dtype=np.float64)
    L_E = np.asarray(L_E, dtype=np.float64)
    owner_E = np.asarray(owner_E, dtype=np.int64)
    by_load = np.argsort(-L_E, kind="stable")
    by_rank = by_load[np.argsort(owner_E[by_load], kind="stable")].astype(np.int64)
    mine_ptr = np.r_[0, np.cumsum(np.bincount(owner_E, minlength=G))].astype(np.int64)
    qs = (np.zeros((G, E), dtype=np.int64), np.zeros(E, dtype=np.int64), np.asarray(d_E, dtype=np.int64),
          np.asarray(w_E, dtype=np.float64), np.asarray(row_bytes_E, dtype=np.float64), cost_G,
          np.asarray(mem_G, dtype=np.float64), np.argsort(-cost_G, kind="stable").astype(np.int64), mine_ptr, by_rank,
          0, 0, False, 1, L_E, np.zeros((E, G), dtype=np.int64), np.zeros(G, dtype=np.int64))
    return qs, prob


def _greedy(tau, cost_G, mem_G, d_E, w_E, L_E, row_bytes_E, owner_E, free_G, domain_G, rep_bytes, budget,
            min_rows, context: tuple | None = None):
    """Replicas (expert, rank, rows) that bring every rank to cost <= tau, or None
    (:func:`lrmoe.planning.lrmoe_jit.greedy`, compiled).

    Pass 1 sheds every rank's cost excess (ranks by descending cost, their experts by descending
    weighted load; each chunk to the in-domain rank with the most slack that has a free slot and
    memory headroom; a replica carries at least ``min_rows`` rows: capping it at the need instead
    would fail at a larger tau where a smaller one succeeded, and the threshold search would miss
    far smaller thresholds); pass 2 then uses the slack left to shed memory from ranks still over
    the budget (best effort). A receiver never goes over tau nor over the budget. ``context``: the
    (qs, prob) of these arguments (built here when None)."""
    qs, prob = context or _greedy_context(cost_G, mem_G, d_E, w_E, L_E, row_bytes_E, owner_E, free_G, domain_G,
                                          rep_bytes, budget, min_rows)
    work = K.workspace(prob)
    n = K.greedy(int(tau), qs, prob, work)
    return None if n < 0 else [tuple(r) for r in work[0][:n].tolist()]


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
    exactly by an integral max flow (:func:`lrmoe.planning.lrmoe_jit.dinic_flow`, scipy's
    ``maximum_flow`` compiled). Deterministic."""
    ranks_E = [np.asarray(r, dtype=np.int64) for r in ranks_E]
    rows_E = [np.asarray(r, dtype=np.int64) for r in rows_E]
    sizes = [len(r) for r in rows_E]
    expert_N = np.repeat(np.arange(len(rows_E)), sizes)
    kept_N = _instance_quotas_flat(q_E, np.concatenate(rows_E + [np.zeros(0, np.int64)]), expert_N,
                                   np.concatenate(ranks_E + [np.zeros(0, np.int64)]), G, backward_weight, tau)
    return np.split(kept_N, np.cumsum(sizes)[:-1]) if sizes else []


def _instance_quotas_flat(q_E, rows_N, expert_N, rank_N, G: int, backward_weight: float, tau: float) -> np.ndarray:
    """:func:`_instance_quotas` over flat per-instance arrays (the instances of expert e are those
    with ``expert_N == e``, in array order; at most one per rank): the kept rows of every instance."""
    i64 = np.int64
    return K.instance_quotas(np.asarray(q_E, dtype=i64), np.asarray(rows_N, dtype=i64), np.asarray(expert_N, dtype=i64),
                             np.asarray(rank_N, dtype=i64), int(G), float(backward_weight), float(tau))


@dataclasses.dataclass
class _Result:
    """The compiled search's answer for one quota vector: the candidate plan's arrays (assembled
    into a checked :class:`Plan` by :meth:`plan`)."""

    d_GE: np.ndarray
    q_E: np.ndarray
    tau: int
    threshold_cost: int
    expert_N: np.ndarray
    rank_N: np.ndarray
    slot_N: np.ndarray
    send: np.ndarray
    quota: np.ndarray
    memory: tuple
    peak: int
    args: tuple  # cluster, dims, budget, backward_weight, info

    @property
    def fits(self) -> bool:
        return self.peak <= self.args[2]

    def plan(self) -> Plan:
        """The checked Plan (what make_plan would build from these counts, without its Python loops)."""
        cluster, dims, budget, backward_weight, info = self.args
        code, dropped, is_rep, pairs, n_keep = K.check_plan(self.d_GE, self.expert_N, self.rank_N, self.slot_N,
                                                             self.send, self.quota)
        if code:
            raise ValueError(f"plan lrmoe: {_CHECK_ERRORS[code]}")
        # the arrays as they are (owners first, then replicas): no Python object per instance
        instances = Instances.trusted(self.expert_N, self.rank_N, self.slot_N, is_rep)
        info = {**info, "threshold_cost": self.threshold_cost, "threshold": self.tau, "quota_E": self.q_E,
                "n_keep": n_keep, "backward_weight": backward_weight,
                "drop_ratio_effective": 1.0 - n_keep / max(pairs, 1)}
        memory = MemoryBreakdown.of(*self.memory, self.peak)
        return new_plan("lrmoe", self.d_GE, instances, self.send, self.quota, dropped, memory, budget,
                        over_budget=self.peak > budget, info=info)


def _result(d_GE, q_E, raw, args) -> _Result:
    tau, thr, expert_N, rank_N, slot_N, send, quota, mem, peak = raw
    return _Result(d_GE, q_E, tau, thr, expert_N, rank_N, slot_N, send, quota, mem, peak, args)


class _QuotaSearch:
    """The threshold searches for one quota vector q_E (module docstring; compiled:
    :func:`lrmoe.planning.lrmoe_jit.search_fits` and :func:`~lrmoe.planning.lrmoe_jit.quota_result`):
    :meth:`result` is the plan the planner returns for these quotas, :meth:`fits` only whether it
    fits the budget.

    ``fits`` is what the kept-pair and microbatch-split searches probe; it is computed without
    the threshold search where it can be: the plan for q_E fits iff the candidate at the
    cost-optimal threshold fits or (when that one does not) the candidate at the largest
    threshold ``top`` does (then the memory search finds a fitting threshold <= top), so a
    fitting ``top`` candidate answers ``True`` after one greedy pass; and no candidate fits when
    the ranks' mean memory (:func:`lrmoe.planning.memory.total_memory_floor`, the same for every
    placement before replicas) is over the budget, which answers ``False`` without any pass."""

    def __init__(self, d_GE, q_E, cluster: Cluster, dims: ModelDims, budget, *, free_G, owner_E,
                 backward_weight, min_rows, info, tolerance=0.0):
        self.d_GE = np.ascontiguousarray(d_GE, dtype=np.int64)
        self.q_E = np.ascontiguousarray(q_E, dtype=np.int64)
        self.prob = _problem(cluster, dims, budget, free_G, owner_E, backward_weight, min_rows, tolerance)
        self.qs = K.search_setup(self.d_GE, self.q_E, self.prob)
        qs = self.qs
        self.lo, self.top = qs[10], qs[11]
        self.args = (qs[5], qs[6], qs[2], qs[3], qs[14], qs[4], self.prob[0], self.prob[3], cluster.domain_G,
                     self.prob[4], budget, self.prob[12])
        self.context = (qs, self.prob)
        self.result_args = (cluster, dims, budget, float(backward_weight), info)
        self.thr, self.thr_fits = -1, False

    def threshold(self) -> int:
        """The smallest integer threshold the greedy meets (bisection; ``top`` always: no replica needed);
        with a tolerance, one the greedy meets less than ``slack`` above the bracket's lower end."""
        if self.thr < 0:
            self.thr = K.threshold(self.qs, self.prob, K.workspace(self.prob))
        return self.thr

    def fits(self, top_first: bool = True) -> bool:
        """Whether :meth:`result` fits the budget (class docstring). ``top_first=False`` tries the
        cost-optimal candidate first (cheaper where it usually fits: no memory pressure)."""
        fit, self.thr, thr_fits = K.search_fits(self.qs, self.prob, K.workspace(self.prob), top_first, self.thr)
        self.thr_fits = self.thr_fits or thr_fits
        return bool(fit)

    def result(self) -> _Result:
        """The plan for these quotas: at the cost-optimal threshold, or when that one is over the
        budget, at the smallest higher threshold that fits (if any)."""
        return _result(self.d_GE, self.q_E, K.quota_result(self.d_GE, self.q_E, self.prob, self.thr, self.thr_fits),
                       self.result_args)


@dataclasses.dataclass(frozen=True)
class _Options:
    """A planner call's options, checked, and the constants they fix (:func:`_options`)."""

    policy_args: tuple | None  # the compiled built-in quota policy's arguments, None for a user policy
    prob: tuple  # the compiled searches' constants (_planner_problem)
    backward_weight: float
    keep: tuple[int, int]  # 1 - drop_ratio as (numerator, denominator): quota.keep_fraction
    keep_max: tuple[int, int]  # 1 - max_drop_ratio


def _options(cluster, dims, budget_bytes, drop_ratio, quota_policy, quota_options, replica_slots, backward_weight,
             min_rows, max_drop_ratio, fallback, search_tolerance) -> _Options:
    """:func:`_make_options`, made once per distinct call (checking the options cost about 2 of an
    EP8 plan's 60 us) when every argument is hashable and every quota option a scalar. The cache keys
    on every argument's type (True is not 1) and on the function registered under ``quota_policy``
    now (a policy registered again under its name is checked again); a quota option that is a
    container is not cached (``(1, 2)`` equals ``(1.0, 2.0)``: a policy's check could pass on the
    other's entry); a call whose options fail raises every time."""
    try:
        opts = tuple(sorted((k, type(v), v) for k, v in quota_options.items())) if quota_options else ()
        if not all(isinstance(v, _SCALARS) for _, _, v in opts):
            opts = None
        fn = get_quota_policy(quota_policy)
    except (TypeError, ValueError, KeyError, AttributeError):  # unhashable, unsortable, not a mapping or
        opts, fn = None, None  # unknown: _make_options says which
    args = (cluster, dims, budget_bytes, drop_ratio, quota_policy, quota_options, replica_slots, backward_weight,
            min_rows, max_drop_ratio, fallback, search_tolerance)
    if opts is not None:
        try:
            return _cached_options(fn, opts, *args[:5], *args[6:])
        except TypeError:  # an unhashable argument (a check raising TypeError raises it again below)
            pass
    return _make_options(*args)


_SCALARS = (bool, int, float, str, bytes, type(None), np.generic)  # option values cached by (type, value)


@functools.lru_cache(maxsize=256, typed=True)
def _cached_options(fn, opts, cluster, dims, budget_bytes, drop_ratio, quota_policy, *rest) -> _Options:
    return _make_options(cluster, dims, budget_bytes, drop_ratio, quota_policy, {k: v for k, _, v in opts}, *rest)


def _make_options(cluster, dims, budget_bytes, drop_ratio, quota_policy, quota_options, replica_slots,
                  backward_weight, min_rows, max_drop_ratio, fallback, search_tolerance) -> _Options:
    """The planner call's options checked (:func:`plan_lrmoe`'s errors) and the constants they fix."""
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
    R = _replica_slots(cluster, dims, replica_slots)
    quota_options = dict(quota_options or {})
    builtin = _builtin_quota(quota_policy, quota_options)
    if builtin is None:
        compute_quota(np.zeros(dims.num_experts, dtype=np.int64), drop_ratio, quota_policy, **quota_options)  # validates
    else:
        check_min_keep(quota_options.get("min_keep", 0))
    bw = float(backward_weight)
    prob = _planner_problem(cluster, dims, budget_bytes, int(R), bw, int(min_rows), float(search_tolerance))
    keep, keep_max = keep_fraction(drop_ratio), keep_fraction(max_drop_ratio)
    # the compiled built-in policies' arguments after the demand piece and the constants
    policy_args = None if builtin is None else (builtin[0], builtin[1], keep.numerator, keep.denominator)
    return _Options(policy_args, prob, bw, (keep.numerator, keep.denominator),
                    (keep_max.numerator, keep_max.denominator))


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
    o = _options(cluster, dims, budget_bytes, drop_ratio, quota_policy, quota_options, replica_slots,
                 backward_weight, min_rows, max_drop_ratio, fallback, search_tolerance)
    prob, policy_args = o.prob, o.policy_args
    quota_options = dict(quota_options or {})  # the caller's own objects, not a cached call's equal ones
    info = {"drop_ratio": drop_ratio, "quota_policy": quota_policy, "search_tolerance": search_tolerance}
    result_args = (cluster, dims, budget_bytes, o.backward_weight, info)

    def keep_range(P):
        """(requested kept pairs, the max_drop_ratio ones) of P routed pairs (quota.retained_total)."""
        return retained_count(P, *o.keep), retained_count(P, *o.keep_max)

    def quotas(d_GE, n_keep):
        """Quotas of n_keep pairs of the piece d_GE from Python (a user policy)."""
        return _quota(d_GE.sum(0), n_keep, quota_policy, quota_options, drop_ratio)

    # demand piece -> (its shrunk keep or None, that quota's threshold or -1, whether the candidate there fits)
    kept: dict[PieceKey, tuple] = {}

    def shrunk_keep(d_GE):
        """How many pairs the plan of d_GE keeps: the requested n_keep when it fits; else the
        largest n_keep >= the max_drop_ratio one that fits (bisection), None when none fits."""
        key = PieceKey(d_GE)
        if key not in kept:
            P = int(d_GE.sum())
            hi_keep, lo_keep = keep_range(P)
            if policy_args is not None:
                n_keep, thr, thr_fits, bad = K.keep_search(d_GE, prob, *policy_args, hi_keep, lo_keep, True,
                                                           -1, -1, -1, False)
                _raise_on_bad_quota(bad)
                kept[key] = (None if n_keep < 0 else n_keep, thr, thr_fits)
            else:
                kept[key] = python_keep_search(d_GE, P, hi_keep, lo_keep)
        return kept[key][0]

    def python_keep_search(d_GE, P, hi_keep, lo_keep):
        """The kept-pair search with quotas from Python (a user policy): the same bisection as
        lrmoe_jit.keep_search, every probe's threshold searches compiled."""
        thresholds = {}

        def fits_keep(n_keep, top_first=True):
            # the floor needs only the pair counts: probes it refuses skip the quotas and the search
            if _over_memory_floor(dims, cluster.num_ranks, P, min(n_keep, P), budget_bytes):
                return False
            fit, *thresholds[n_keep] = K.quota_search_fits(d_GE, quotas(d_GE, n_keep), prob, top_first)
            return bool(fit)

        if fits_keep(hi_keep, top_first=False):  # the requested quotas usually fit
            return (hi_keep, *thresholds[hi_keep])
        if not fits_keep(lo_keep):
            return None, -1, False  # quotas alone cannot make it fit: resolve_budget splits or reports oom
        slack = _slack(search_tolerance, P)
        while hi_keep - lo_keep > slack:  # lo_keep fits, hi_keep does not
            mid = (lo_keep + hi_keep) // 2
            lo_keep, hi_keep = (mid, hi_keep) if fits_keep(mid) else (lo_keep, mid)
        return (lo_keep, *thresholds[lo_keep])

    def build(d_GE, row_cap):
        P = P_whole if d_GE is demand_GE else int(d_GE.sum())
        hi_keep, lo_keep = keep_range(P)
        key = PieceKey(d_GE)
        if policy_args is not None and key not in kept:  # the search and the plan in one compiled call
            # a split probe's answer for this piece (hi_keep over, lo_keep fits): not probed again
            lo_known, lo_thr, lo_thr_fits = probed.get(key, (-1, -1, False))
            n_keep, q_E, bad, raw = K.plan_piece(d_GE, prob, *policy_args, hi_keep, lo_keep, lo_known, lo_thr,
                                                 lo_thr_fits)
            _raise_on_bad_quota(bad)
            kept[key] = (None if n_keep < 0 else n_keep, raw[1], False)
            n_keep = kept[key][0]
        else:
            shrunk_keep(d_GE)
            n_keep, thr, thr_fits = kept[key]
            if n_keep is None:
                thr, thr_fits = -1, False
            use = hi_keep if n_keep is None else n_keep
            if policy_args is not None:
                q_E, bad, raw = K.piece_result(d_GE, prob, *policy_args, use, hi_keep, thr, thr_fits)
                _raise_on_bad_quota(bad)
            else:
                q_E = quotas(d_GE, use)
                raw = K.quota_result(d_GE, q_E, prob, thr, thr_fits)
        plan = _result(d_GE, q_E, raw, result_args).plan()
        return plan if n_keep in (None, hi_keep) else replace_plan(plan, over_budget=True, fallback="shrink_quota")

    feasible: dict[PieceKey, bool] = {}  # demand piece -> some kept-pair count fits (keep_search, bisect=False)
    probed: dict[PieceKey, tuple] = {}  # piece -> (1, lo_keep's threshold, thr_fits): hi_keep over, lo_keep fits

    def fits(d_GE, row_cap):
        """Whether some kept-pair count fits d_GE: the microbatch-split search's probe. Only the piece
        it returns is planned, so its kept-pair bisection runs there (in build), not in every probe."""
        key = PieceKey(d_GE)
        if key in kept:
            return kept[key][0] is not None
        if policy_args is None:
            return shrunk_keep(d_GE) is not None
        if key not in feasible:
            P = int(d_GE.sum())
            hi_keep, lo_keep = keep_range(P)
            n_keep, thr, thr_fits, bad = K.keep_search(d_GE, prob, *policy_args, hi_keep, lo_keep, False,
                                                       -1, -1, -1, False)
            _raise_on_bad_quota(bad)
            if n_keep == hi_keep or n_keep < 0:  # the search's answer already: hi_keep fits, or none does
                kept[key] = (None if n_keep < 0 else n_keep, thr, thr_fits)
            else:  # lo_keep fits: build's bisection starts from these two probes
                probed[key] = (1, thr, thr_fits)
            feasible[key] = n_keep >= 0
        return feasible[key]

    # no kept-pair count of the whole demand fits when even max_drop_ratio's is over the memory floor:
    # its plan (hi_keep's, over the budget) is then built only if the microbatch split fails too
    P_whole = int(demand_GE.sum())  # build reuses it for the whole demand
    unfit = _over_memory_floor(dims, cluster.num_ranks, P_whole, keep_range(P_whole)[1],
                               budget_bytes)
    return resolve_budget(build, demand_GE, budget_bytes, fallback, max_split, fits=fits, unfit=unfit)


def kept_pairs_fit(demand_GE, cluster: Cluster, dims: ModelDims, budget_bytes, counts, *, drop_ratio: float = 0.0,
                   quota_policy: str = "waterfill", quota_options: dict | None = None,
                   replica_slots: int | None = None, backward_weight: float = 2.0, min_rows: int = 1) -> np.ndarray:
    """Whether the plan of ``demand_GE`` keeping each of ``counts`` backward pairs fits the budget, as
    :func:`plan_lrmoe`'s kept-pair search decides it in a probe (the quotas of that count, the
    candidate at their cost-optimal threshold or at the largest one). A built-in quota policy only;
    ``counts`` in [1, routed pairs]. For studying the search (``lrmoe bench keep-scan``): the fit is
    not monotone in the count, so the bisection's answer is one of several boundaries. It calls the
    compiled probe from Python with the types the search passes (no extra compilation)."""
    d_GE = np.ascontiguousarray(demand_GE, dtype=np.int64)
    quota_options = dict(quota_options or {})
    builtin = _builtin_quota(quota_policy, quota_options)
    if builtin is None:
        raise ValueError(f"kept_pairs_fit needs a built-in quota policy (waterfill, proportional) without other "
                         f"options than min_keep, got {quota_policy!r} with {sorted(quota_options)}")
    counts = np.ascontiguousarray(counts, dtype=np.int64).reshape(-1)
    P = int(d_GE.sum())
    if counts.size and (counts.min() < 1 or counts.max() > P):
        raise ValueError(f"counts must be in [1, routed pairs = {P}], got {int(counts.min())}..{int(counts.max())}")
    R = _replica_slots(cluster, dims, replica_slots)
    prob = _planner_problem(cluster, dims, budget_bytes, R, float(backward_weight), int(min_rows), 0.0)
    keep = keep_fraction(drop_ratio)
    piece, work, hi_keep = K.piece_sums(d_GE), K.workspace(prob), retained_total(P, drop_ratio)
    fit = np.zeros(counts.size, dtype=bool)
    for i, n_keep in enumerate(counts.tolist()):  # the search's own compiled probe, as it calls it
        fit[i], _, _, bad = K.fits_keep(d_GE, piece, prob, work, builtin[0], builtin[1], keep.numerator,
                                         keep.denominator, hi_keep, n_keep, False)
        _raise_on_bad_quota(bad)
    return fit


def _raise_on_bad_quota(status) -> None:
    if status != K.QUOTA_OK:  # a bug in a compiled quota policy, never a user error
        raise ValueError("a compiled quota policy broke the quota contract (0 <= q <= d, sum == n_keep); "
                         "compare lrmoe.planning.lrmoe_jit.quota with lrmoe.planning.quota")
