"""Placement planners: one interface for LRMoE and every baseline (pure functions, numpy only).

A planner maps this step's per-rank per-expert routed demand to a :class:`Plan`::

    plan = plan_placement(name, demand_GE, cluster, dims, budget_bytes, state=prev.state, **options)

* ``demand_GE[r, e]``: routed (token, expert) pairs of expert e that originate on rank r.
* ``cluster``: G ranks, S expert slots per rank, fast-interconnect domains (:class:`Cluster`).
* ``dims``: model dimensions and byte sizes (:class:`ModelDims`).
* ``budget_bytes``: what this MoE layer may use per GPU (see :mod:`lrmoe.planning.memory`).
* ``state``: planners are pure; a stateful one (SYMI, which plans from the *previous* step's
  popularity) returns the state for the next call in ``plan.state``. Pass ``state=None`` on
  the first step. Stateless planners return ``state=None``.

A plan lists expert instances (owner or replica, by rank and slot), how many pairs each
source rank sends to each instance, how many of them each (source, instance) keeps in backward,
the forward drops, and the per-rank memory the plan needs. When the policy's first-choice plan
does not fit the budget the plan says so (``over_budget``) and carries what the policy did
(``fallback``): ``none``, ``split_microbatch:N`` (the plan is for the largest of N pieces),
``drop_over_capacity`` (a per-instance row cap), ``shrink_quota`` (LRMoE keeps fewer pairs in
backward) or ``oom`` (nothing fits: the real system fails).

This module holds the interface types and the small routing helpers the planners share
(largest-remainder splits, capacity caps, the budget fallbacks). The registry of policies and
:func:`plan_placement` live in :mod:`lrmoe.planning.policies`; the built-in policies in
``baselines/`` (fixed, symi, ultraep, ultraep_greedy) and :mod:`lrmoe.planning.lrmoe_plan` (lrmoe).
"""
from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from .jit import njit
from .memory import MemoryBreakdown, memory_constants, memory_from_counts

__all__ = ["Cluster", "ModelDims", "Instance", "Instances", "Plan", "MemoryBreakdown", "check_inputs"]


# ----------------------------------------------------------------------------- descriptions
@dataclass(frozen=True)
class Cluster:
    """G expert-parallel ranks with S expert weight slots each.

    ``slots_per_rank`` counts every expert instance a rank can hold (owned experts included):
    owner-based policies use E/G of them for owned experts and the rest for replicas; SYMI fills
    all G*S slots. ``fast_domains`` partitions the ranks into groups that share a fast
    interconnect (e.g. NVLink islands); None means one domain of all ranks."""

    num_ranks: int
    slots_per_rank: int
    fast_domains: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self):
        for name in ("num_ranks", "slots_per_rank"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"Cluster.{name} must be an integer >= 1, got {v!r}")
        G = int(self.num_ranks)
        domains = self.fast_domains if self.fast_domains is not None else (tuple(range(G)),)
        if not _is_int_groups(domains):
            raise ValueError(f"Cluster.fast_domains must be None or groups of integer ranks, e.g. ((0, 1), (2, 3)), "
                             f"got {self.fast_domains!r}")
        domains = tuple(tuple(int(r) for r in dom) for dom in domains)
        if sorted(r for dom in domains for r in dom) != list(range(G)) or any(not dom for dom in domains):
            raise ValueError(f"Cluster.fast_domains must partition ranks 0..{G - 1} into non-empty groups, "
                             f"got {self.fast_domains!r}")
        object.__setattr__(self, "fast_domains", domains)

    @property
    def domain_G(self) -> np.ndarray:
        """Fast-domain id of every rank."""
        dom = np.empty(self.num_ranks, dtype=np.int64)
        for i, ranks in enumerate(self.fast_domains):
            dom[list(ranks)] = i
        return dom


@dataclass(frozen=True)
class ModelDims:
    """What the planners need of the model: one MoE layer of E SwiGLU experts.

    dtype_bytes: weights and activations (2 for bf16). grad_bytes: expert gradients (4: fp32
    main grads as Megatron-LM keeps them). optimizer_bytes_per_param: optimizer state per
    parameter where it lives on the GPU (12: AdamW fp32 master + m + v; divide by the
    distributed-optimizer shard count yourself; 0 excludes it, as the paper's memory table
    appears to)."""

    hidden: int
    intermediate: int
    num_experts: int
    top_k: int = 1
    dtype_bytes: int = 2
    grad_bytes: int = 4
    optimizer_bytes_per_param: int = 12

    def __post_init__(self):
        for name in ("hidden", "intermediate", "num_experts", "top_k", "dtype_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"ModelDims.{name} must be an integer >= 1, got {v!r}")
        for name in ("grad_bytes", "optimizer_bytes_per_param"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
                raise ValueError(f"ModelDims.{name} must be an integer >= 0, got {v!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"ModelDims.top_k must be <= num_experts = {self.num_experts} (each token picks top_k "
                             f"distinct experts), got {self.top_k}")


def _is_int_groups(domains) -> bool:
    """Whether ``domains`` is an iterable of iterables of integers (bools and strings excluded)."""
    def ints(dom):
        return not isinstance(dom, (str, bytes)) and hasattr(dom, "__iter__") and all(
            isinstance(r, (int, np.integer)) and not isinstance(r, bool) for r in dom)
    return not isinstance(domains, (str, bytes)) and hasattr(domains, "__iter__") and all(ints(d) for d in domains)


@dataclass(frozen=True)
class Instance:
    """One copy of an expert's weights in slot ``slot`` of rank ``rank``."""

    expert: int
    rank: int
    slot: int
    is_replica: bool


class Instances(Sequence):
    """A plan's instances held as four arrays (expert, rank, slot, replica flag per instance) and
    read as the tuple of :class:`Instance` they describe: ``len``, indexing, iteration and equality
    (with another ``Instances`` or with a tuple of ``Instance``) are the tuple's. The planners
    build these from compiled kernels without a Python object per instance; the tuple is made on
    first use. The arrays are read-only (several plans may share one layout)."""

    __slots__ = ("expert_N", "rank_N", "slot_N", "is_replica_N", "_items")

    def __init__(self, expert_N, rank_N, slot_N, is_replica_N):
        arrays = (np.ascontiguousarray(expert_N, dtype=np.int64), np.ascontiguousarray(rank_N, dtype=np.int64),
                  np.ascontiguousarray(slot_N, dtype=np.int64), np.ascontiguousarray(is_replica_N, dtype=np.bool_))
        if len({a.shape for a in arrays}) != 1 or arrays[0].ndim != 1:
            raise ValueError(f"Instances needs four 1-D arrays of one length, got shapes {[a.shape for a in arrays]}")
        for a in arrays:
            a.setflags(write=False)
        self.expert_N, self.rank_N, self.slot_N, self.is_replica_N = arrays
        self._items = None

    @classmethod
    def trusted(cls, expert_N, rank_N, slot_N, is_replica_N) -> "Instances":
        """From four arrays a compiled kernel just made (1-D, one length, int64 and bool, contiguous,
        owned by no one else): no conversion nor check (the constructor's cost on every small plan)."""
        out = object.__new__(cls)
        for a in (expert_N, rank_N, slot_N, is_replica_N):
            a.setflags(write=False)
        out.expert_N, out.rank_N, out.slot_N, out.is_replica_N = expert_N, rank_N, slot_N, is_replica_N
        out._items = None
        return out

    @classmethod
    def of(cls, instances) -> "Instances":
        """From an iterable of :class:`Instance` (or an ``Instances``, returned as is)."""
        if isinstance(instances, Instances):
            return instances
        items = tuple(instances)
        out = cls([i.expert for i in items], [i.rank for i in items], [i.slot for i in items],
                  [i.is_replica for i in items])
        out._items = items
        return out

    def as_tuple(self) -> tuple[Instance, ...]:
        if self._items is None:
            self._items = tuple(map(Instance, self.expert_N.tolist(), self.rank_N.tolist(), self.slot_N.tolist(),
                                    self.is_replica_N.tolist()))
        return self._items

    def __len__(self) -> int:
        return self.expert_N.size

    def __getitem__(self, i):
        return self.as_tuple()[i]

    def __iter__(self):
        return iter(self.as_tuple())

    def __eq__(self, other):
        if isinstance(other, Instances):
            return (other is self or (self.expert_N.size == other.expert_N.size
                                      and np.array_equal(self.expert_N, other.expert_N)
                                      and np.array_equal(self.rank_N, other.rank_N)
                                      and np.array_equal(self.slot_N, other.slot_N)
                                      and np.array_equal(self.is_replica_N, other.is_replica_N)))
        if isinstance(other, (tuple, list)):
            return self.as_tuple() == tuple(other)
        return NotImplemented

    def __hash__(self):
        return hash(self.as_tuple())

    def __repr__(self) -> str:
        return f"Instances({list(self.as_tuple())!r})"

    def __reduce__(self):
        return Instances, (self.expert_N, self.rank_N, self.slot_N, self.is_replica_N)


@dataclass(frozen=True)
class Plan:
    """What a placement policy decided for one step of one MoE layer (N = len(instances)).

    demand_GE: the demand this plan serves (a piece of the input demand when the microbatch was
        split, see ``num_splits``).
    send_GN[s, i]: pairs source rank s sends to instance i (forward; every one computed).
    backward_quota_GN[s, i] <= send_GN[s, i]: of those, how many are kept in backward.
    dropped_GE[s, e]: pairs of expert e from source s dropped in forward (over capacity);
        ``sum_{i of e} send_GN[s, i] + dropped_GE[s, e] == demand_GE[s, e]`` always.
    memory: per-rank memory (:class:`MemoryBreakdown`). over_budget: the policy's first-choice
    plan did not fit ``budget_bytes``; fallback: what the policy then did (module docstring).
    info: policy-specific facts (threshold, slot counts, capacity, quotas...). state: pass it as
    ``state=`` to the next call (stateful policies only)."""

    policy: str
    demand_GE: np.ndarray
    instances: tuple[Instance, ...]
    send_GN: np.ndarray
    backward_quota_GN: np.ndarray
    dropped_GE: np.ndarray
    memory: MemoryBreakdown
    budget_bytes: float
    over_budget: bool = False
    fallback: str = "none"
    num_splits: int = 1
    info: dict = field(default_factory=dict)
    state: Any = None

    # The names for the three count matrices.
    send = property(lambda self: self.send_GN)
    backward_quota = property(lambda self: self.backward_quota_GN)
    dropped = property(lambda self: self.dropped_GE)

    @property
    def expert_N(self) -> np.ndarray:
        """Expert of every instance (read-only when the plan holds :class:`Instances`)."""
        return Instances.of(self.instances).expert_N

    @property
    def rank_N(self) -> np.ndarray:
        return Instances.of(self.instances).rank_N

    @property
    def is_replica_N(self) -> np.ndarray:
        return Instances.of(self.instances).is_replica_N

    @property
    def rows_N(self) -> np.ndarray:
        """Forward rows each instance computes."""
        return self.send_GN.sum(0)

    @property
    def kept_N(self) -> np.ndarray:
        """Backward rows each instance computes."""
        return self.backward_quota_GN.sum(0)

    def per_rank(self, values_N) -> np.ndarray:
        return np.bincount(self.rank_N, weights=values_N, minlength=len(self.memory.base_G)).astype(np.int64)

    @property
    def rows_G(self) -> np.ndarray:
        return self.per_rank(self.rows_N)

    @property
    def kept_G(self) -> np.ndarray:
        return self.per_rank(self.kept_N)

    @property
    def kept_E(self) -> np.ndarray:
        return np.bincount(self.expert_N, weights=self.kept_N, minlength=self.demand_GE.shape[1]).astype(np.int64)

    def cost_G(self, backward_weight: float = 2.0) -> np.ndarray:
        """Per-rank expert work in forward-row units: rows + backward_weight * kept rows."""
        return self.rows_G + backward_weight * self.kept_G

    @property
    def num_replicas_G(self) -> np.ndarray:
        return np.bincount(self.rank_N[self.is_replica_N], minlength=len(self.memory.base_G))

    @property
    def fits(self) -> bool:
        return self.memory.peak <= self.budget_bytes

    def check(self) -> "Plan":
        """Raise ValueError unless the plan is internally consistent; return self."""
        G, E = self.demand_GE.shape
        inst = Instances.of(self.instances)
        N = len(inst)
        if self.send_GN.shape != (G, N) or self.backward_quota_GN.shape != (G, N) or self.dropped_GE.shape != (G, E):
            raise ValueError(f"plan {self.policy}: count matrices have the wrong shapes")
        send, quota = _int64(self.send_GN), _int64(self.backward_quota_GN)
        err = check_counts(_int64(self.demand_GE), send, quota, _int64(self.dropped_GE), inst.expert_N, inst.rank_N,
                           inst.slot_N, inst.is_replica_N, G, E)
        if err:
            raise ValueError(f"plan {self.policy}: {_CHECK_ERRORS[err]}")
        return self


_CHECK_ERRORS = {1: "instances must have valid experts, ranks and distinct slots",
                 2: "every expert needs an instance and at most one owner",
                 3: "negative send or dropped counts",
                 4: "backward quotas must be in [0, send]",
                 5: "sent + dropped pairs do not equal the demand"}


def _int64(x) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.int64)


@njit
def check_instances(expert_N, rank_N, slot_N, is_replica_N, num_ranks, num_experts):
    """Plan.check's instance rules: 0 if valid, 1 (bad expert / rank / slot, or two instances in one
    slot), 2 (an expert without an instance, or with two owners)."""
    N = expert_N.size
    max_slot = 0
    for n in range(N):
        e, r, s = expert_N[n], rank_N[n], slot_N[n]
        if e < 0 or e >= num_experts or r < 0 or r >= num_ranks or s < 0:
            return 1
        if s > max_slot:
            max_slot = s
    width = max_slot + 1
    if num_ranks * width <= 1 << 22:
        taken = np.zeros(num_ranks * width, np.bool_)
        for n in range(N):
            k = rank_N[n] * width + slot_N[n]
            if taken[k]:
                return 1
            taken[k] = True
    else:  # sparse slot numbers: sort the (rank, slot) keys
        keys = np.sort(rank_N * width + slot_N)
        for n in range(1, N):
            if keys[n] == keys[n - 1]:
                return 1
    count = np.zeros(num_experts, np.int64)
    owners = np.zeros(num_experts, np.int64)
    for n in range(N):
        count[expert_N[n]] += 1
        if not is_replica_N[n]:
            owners[expert_N[n]] += 1
    for e in range(num_experts):
        if count[e] < 1 or owners[e] > 1:
            return 2
    return 0


@njit
def check_counts(demand_GE, send_GN, quota_GN, dropped_GE, expert_N, rank_N, slot_N, is_replica_N, num_ranks,
                 num_experts):
    """All of Plan.check's rules after the shapes: 0 or the first broken rule's code (_CHECK_ERRORS)."""
    err = check_instances(expert_N, rank_N, slot_N, is_replica_N, num_ranks, num_experts)
    if err:
        return err
    G, N = send_GN.shape
    for g in range(G):
        for n in range(N):
            if send_GN[g, n] < 0:
                return 3
    for g in range(G):
        for e in range(num_experts):
            if dropped_GE[g, e] < 0:
                return 3
    for g in range(G):
        for n in range(N):
            q = quota_GN[g, n]
            if q < 0 or q > send_GN[g, n]:
                return 4
    total = dropped_GE.copy()
    for g in range(G):
        for n in range(N):
            total[g, expert_N[n]] += send_GN[g, n]
    for g in range(G):
        for e in range(num_experts):
            if total[g, e] != demand_GE[g, e]:
                return 5
    return 0


PlanFn = Callable[..., Plan]


def check_inputs(demand_GE, cluster: Cluster, dims: ModelDims, budget_bytes) -> np.ndarray:
    """Validate the planner inputs; return the demand as an int64 array (a copy)."""
    if not isinstance(cluster, Cluster) or not isinstance(dims, ModelDims):
        raise ValueError(f"cluster must be a Cluster and dims a ModelDims, got {type(cluster).__name__} "
                         f"and {type(dims).__name__}")
    G, E = cluster.num_ranks, dims.num_experts
    d = np.asarray(demand_GE)
    if d.shape != (G, E):
        raise ValueError(f"demand_GE must have shape [G={G}, E={E}] (ranks x experts), got {d.shape}")
    if d.dtype == _INT64 and d.flags.c_contiguous:  # the usual case: one compiled pass checks and copies
        out, low, high, total = nonnegative_copy(d)
    else:
        if d.dtype == bool or not (np.issubdtype(d.dtype, np.integer) or np.issubdtype(d.dtype, np.floating)):
            raise ValueError(f"demand_GE must hold integer counts, got dtype {d.dtype}")
        if np.issubdtype(d.dtype, np.floating) and not (np.isfinite(d).all() and (d == np.round(d)).all()):
            raise ValueError("demand_GE must hold whole-number counts")
        if d.size and (float(d.max()) > MAX_ROUTED_PAIRS or d.min() < 0):  # before the int64 cast (a float
            low, high, total = d.min(), float(d.max()), 0  # may not fit); compared as Python floats (no float16 2^31)
        else:
            out, low, high, total = nonnegative_copy(np.ascontiguousarray(d, dtype=np.int64))
    if low < 0:
        raise ValueError(f"demand_GE counts must be >= 0, got minimum {low}")
    if high > MAX_ROUTED_PAIRS or total > MAX_ROUTED_PAIRS:
        exact = sum(int(x) for x in d.ravel().tolist())  # the int64 sum may have wrapped
        raise ValueError(f"demand_GE holds {exact:,} routed pairs; the planners support at most "
                         f"{MAX_ROUTED_PAIRS:,} per MoE layer (2^31: their int64 arithmetic multiplies two counts)")
    check_budget(budget_bytes)
    return out


#: The most routed (token, expert) pairs one demand may hold: the compiled planners multiply two
#: counts in int64 (a largest-remainder split, kept x sent), so every product stays below 2^62.
MAX_ROUTED_PAIRS = 2**31


_INT64 = np.dtype(np.int64)


@njit
def nonnegative_copy(d_GE):
    """A copy of a 2-D int64 array, its minimum and maximum (0 and 0 when empty) and its sum (valid when
    the entries are at most MAX_ROUTED_PAIRS: a sum of fewer than 2^32 of them fits int64)."""
    out = np.empty_like(d_GE)
    low = high = d_GE[0, 0] if d_GE.size else 0
    total = 0
    G, E = d_GE.shape
    for g in range(G):
        for e in range(E):
            v = d_GE[g, e]
            out[g, e] = v
            low = min(low, v)
            high = max(high, v)
            total += v
    return out, low, high, total


def check_budget(budget_bytes) -> float:
    """ValueError unless ``budget_bytes`` is a number > 0 (math.inf: no budget)."""
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, (int, float, np.integer, np.floating)) \
            or math.isnan(budget_bytes) or budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be a number > 0 (math.inf for no budget), got {budget_bytes!r}")
    return budget_bytes


# ----------------------------------------------------------------------------- compiled cores
# Integer division dominates the largest-remainder splits; ``divmod_nonneg`` divides in floating
# point and corrects the quotient, exact for every a >= 0, b > 0 (a < 2**62).
@njit
def divmod_nonneg(a, b):
    """(a // b, a % b) for a >= 0, b > 0 (floor division on other signs)."""
    if a < 0 or b <= 0:
        return a // b, a % b
    q = np.int64(a / b)
    r = a - q * b
    while r < 0:
        q -= 1
        r += b
    while r >= b:
        q += 1
        r -= b
    return q, r


@njit
def pop_largest(key, n):
    """The index of the largest of key[:n] (the first on ties), which is then set to -1: with
    unique nonnegative keys, called missing times, the missing largest one at a time (the short
    splits' selection)."""
    best, at = -1, 0
    for i in range(n):
        if key[i] > best:
            best, at = key[i], i
    key[at] = -1
    return at


@njit
def kth_largest(buf, n, k):
    """The k-th largest of buf[:n] (1 <= k <= n; buf is scratch: reordered; Hoare quickselect)."""
    lo, hi, target = 0, n - 1, k - 1
    while lo < hi:
        pivot = buf[(lo + hi) // 2]
        i, j = lo, hi
        while i <= j:  # Hoare partition, descending
            while buf[i] > pivot:
                i += 1
            while buf[j] < pivot:
                j -= 1
            if i <= j:
                buf[i], buf[j] = buf[j], buf[i]
                i += 1
                j -= 1
        if target <= j:
            hi = j
        elif target >= i:
            lo = i
        else:
            return buf[target]
    return buf[target]


@njit
def add_top(out, key, missing, buf):
    """``out[i] += 1`` for the ``missing`` largest entries of ``key`` (ties: the lower index), as
    ``out + (rank < missing)`` with ``rank`` from a stable argsort of ``-key``: the largest-remainder
    step of every split. ``buf``: int64 scratch of key's size; key is not changed.

    Up to 16 entries: the largest, missing times. Longer: a bucket select (the keys' range cut into
    n buckets, monotone in the key: every entry of a higher bucket is larger), then the largest of
    the threshold bucket when it holds up to 16 entries, else a quickselect over all (ties, or a
    skewed key whose outlier leaves the rest in one bucket; also keys spanning 2**63 or more, whose
    range overflows). Twice as fast as the quickselect at 32-128 entries (the split of a column over
    EP64's sources). ``lrmoe_jit`` calls it: after editing it, clear numba's cache (jit.py)."""
    n = key.size
    if missing <= 0:
        return
    if missing >= n:
        for i in range(n):
            out[i] += 1
        return
    if n <= 16:
        for i in range(n):
            buf[i] = 0  # taken
        for _ in range(missing):
            at = -1
            for i in range(n):
                if buf[i] == 0 and (at < 0 or key[i] > key[at]):
                    at = i
            out[at] += 1
            buf[at] = 1
        return
    lo, hi = key[0], key[0]
    for i in range(n):
        lo = min(lo, key[i])
        hi = max(hi, key[i])
    span = hi - lo  # < 0: the range overflowed int64 (the quickselect below)
    scale = n / (float(span) + 1.0)
    t, above = n - 1, 0
    if span >= 0:
        for b in range(n):
            buf[b] = 0
        for i in range(n):
            buf[min(np.int64((key[i] - lo) * scale), n - 1)] += 1
        while above + buf[t] < missing:
            above += buf[t]
            t -= 1
    if span >= 0 and buf[t] <= 16:
        m = 0
        for i in range(n):  # buf now lists the threshold bucket's entries
            b = min(np.int64((key[i] - lo) * scale), n - 1)
            if b > t:
                out[i] += 1
            elif b == t:
                buf[m] = i
                m += 1
        for _ in range(missing - above):
            at = -1
            for j in range(m):
                if buf[j] >= 0 and (at < 0 or key[buf[j]] > key[buf[at]]):
                    at = j
            out[buf[at]] += 1
            buf[at] = -1
        return
    for i in range(n):
        buf[i] = key[i]
    T = kth_largest(buf, n, missing)
    ties = missing
    for i in range(n):
        if key[i] > T:
            ties -= 1
    for i in range(n):
        if key[i] > T:
            out[i] += 1
        elif key[i] == T and ties > 0:
            out[i] += 1
            ties -= 1


@njit
def largest_remainder_scratch(out, w, total, key, sel):
    """``out[:] = largest_remainder(total, w)`` for a 1-D ``w`` whose sum is > 0 (or total == 0);
    remainders to the largest fractional parts, ties to the lower index (:func:`add_top`). ``key``
    and ``sel`` are scratch of at least w.size entries."""
    n = w.size
    if total == 0:
        for i in range(n):
            out[i] = 0
        return
    W = 0
    for i in range(n):
        W += w[i]
    inv = 1.0 / W
    placed = 0
    for i in range(n):  # floor(w * total / W) by a float estimate and an exact correction
        a = w[i] * total
        q = np.int64(a * inv)
        r = a - q * W
        while r < 0:
            q -= 1
            r += W
        while r >= W:
            q += 1
            r -= W
        out[i] = q
        key[i] = r
        placed += q
    add_top(out, key[:n], total - placed, sel)


@njit
def largest_remainder_into(out, w, total):
    """:func:`largest_remainder_scratch` with its own scratch."""
    largest_remainder_scratch(out, w, total, np.empty(w.size, np.int64), np.empty(w.size, np.int64))


@njit
def largest_remainder_kernel(total, w):
    out = np.empty(w.size, np.int64)
    largest_remainder_into(out, w, total)
    return out


@njit
def expert_sum_kernel(x_GN, expert_N, num_experts):
    G, N = x_GN.shape
    out = np.zeros((G, num_experts), np.int64)
    for g in range(G):
        for n in range(N):
            out[g, expert_N[n]] += x_GN[g, n]
    return out


@njit
def expert_columns(expert_N, num_experts):
    """Every expert's instance columns in ascending order, as CSR: (start_E1, cols_N)."""
    N = expert_N.size
    start = np.zeros(num_experts + 1, np.int64)
    for n in range(N):
        start[expert_N[n] + 1] += 1
    for e in range(num_experts):
        start[e + 1] += start[e]
    fill = start[:-1].copy()
    cols = np.empty(N, np.int64)
    for n in range(N):
        e = expert_N[n]
        cols[fill[e]] = n
        fill[e] += 1
    return start, cols


@njit
def prefix_split_ranges(d_GE, expert_N, quota_N):
    """:func:`prefix_split_experts` for nonnegative counts; also every column's nonzero rows as a
    range [lo_N, hi_N). Instance j of an expert takes the ordinals [Q_{j-1}, Q_j) of its quota prefix
    sums, source g holds [S_{g-1}, S_g): send[g, j] is their overlap, walked source by source."""
    G, E = d_GE.shape
    N = expert_N.size
    send = np.zeros((G, N), np.int64)
    lo_N = np.zeros(N, np.int64)
    hi_N = np.zeros(N, np.int64)
    start, cols = expert_columns(expert_N, E)
    for e in range(E):
        a, b = start[e], start[e + 1]
        if a == b or G == 0:
            continue
        g, s_lo, s_hi = 0, 0, d_GE[0, e]  # source g's interval [s_lo, s_hi)
        q_lo = 0
        for j in range(a, b):
            n = cols[j]
            q_hi = q_lo + quota_N[n]
            if q_hi > q_lo:
                while g < G - 1 and s_hi <= q_lo:  # the first source reaching into the interval
                    g += 1
                    s_lo = s_hi
                    s_hi += d_GE[g, e]
                lo_N[n] = g
                gg, lo, hi = g, s_lo, s_hi
                while True:
                    v = (hi if hi < q_hi else q_hi) - (lo if lo > q_lo else q_lo)
                    if v > 0:
                        send[gg, n] = v
                    gg += 1
                    if gg >= G or hi >= q_hi:
                        break
                    lo = hi
                    hi += d_GE[gg, e]
                hi_N[n] = gg
            q_lo = q_hi
    return send, lo_N, hi_N


@njit
def prefix_split_kernel(d_GE, expert_N, quota_N):
    return prefix_split_ranges(d_GE, expert_N, quota_N)[0]


@njit
def cap_columns(send, over_N, lo_N, hi_N, cap_N):
    """Trim every column n of send with ``over_N[n]`` (its rows over its cap) to ``cap_N[n]`` rows by
    largest remainder over its nonzero rows, which lie in rows lo_N[n]..hi_N[n]-1 (zero rows never
    take a unit, so leaving them out changes nothing). A column of up to 16 nonzero rows summing to
    under 2**58 (SYMI's slots at EP8) is split here in place, its remainders handed out one largest
    at a time; another by :func:`largest_remainder_scratch`. One call for all columns: a call per
    column passing ten arrays cost as much as the split (SYMI's route at Qwen3 EP8 log-normal, 81
    trimmed columns: 16.4 -> 5.9 us). Tested against the plain definition (test_planner_speedups)."""
    G, N = send.shape
    idx = np.empty(G, np.int64)
    val = np.empty(G, np.int64)
    out = np.empty(G, np.int64)
    key = np.empty(G, np.int64)
    sel = np.empty(G, np.int64)
    for n in range(N):
        if not over_N[n]:
            continue
        cap = cap_N[n]
        m, W = 0, 0
        for g in range(lo_N[n], hi_N[n]):
            v = send[g, n]
            if v != 0:
                idx[m] = g
                W += v
                m += 1
        if m > 16 or W >= (1 << 58):
            for i in range(m):
                val[i] = send[idx[i], n]
            largest_remainder_scratch(out[:m], val[:m], cap, key, sel)
            for i in range(m):
                send[idx[i], n] = out[i]
            continue
        placed = 0
        for i in range(m):
            q, r = divmod_nonneg(send[idx[i], n] * cap, W)
            send[idx[i], n] = q
            key[i] = r * m + (m - 1 - i)  # unique, ordered as (remainder desc, row asc)
            placed += q
        for _ in range(cap - placed):
            send[idx[pop_largest(key, m)], n] += 1


@njit
def cap_rows_kernel(send_GN, cap_N):
    send = send_GN.copy()
    G, N = send.shape
    total = np.zeros(N, np.int64)
    for g in range(G):
        for n in range(N):
            total[n] += send[g, n]
    cap_columns(send, total > cap_N, np.zeros(N, np.int64), np.full(N, G, np.int64), cap_N)
    return send


@njit
def largest_remainder_cols_kernel(total_N, w_GN):
    G, N = w_GN.shape
    out_GN = np.empty((G, N), np.int64)
    col = np.empty(G, np.int64)
    out = np.empty(G, np.int64)
    for n in range(N):
        for g in range(G):
            col[g] = w_GN[g, n]
        largest_remainder_into(out, col, total_N[n])
        for g in range(G):
            out_GN[g, n] = out[g]
    return out_GN


@njit
def largest_remainder_groups_kernel(total_K, w_M, group_M):
    K = total_K.size
    start, members = expert_columns(group_M, K)
    out = np.empty(w_M.size, np.int64)
    for k in range(K):
        a, b = start[k], start[k + 1]
        w = np.empty(b - a, np.int64)
        for i in range(a, b):
            w[i - a] = w_M[members[i]]
        part = np.empty(b - a, np.int64)
        largest_remainder_into(part, w, total_K[k])
        for i in range(a, b):
            out[members[i]] = part[i - a]
    return out


@njit
def locality_split_kernel(d_GE, expert_N, rank_N, quota_N):
    """:func:`locality_split_replicas` (instance e is expert e's owner; an expert's replicas in
    column order). Returns (send, -1) or (send, e) for the first expert whose split is impossible."""
    G, E = d_GE.shape
    N = expert_N.size
    send = np.zeros((G, N), np.int64)
    for g in range(G):  # an expert without replicas: its owner takes every pair (row-major copy)
        for e in range(E):
            send[g, e] = d_GE[g, e]
    start, cols = expert_columns(expert_N, E)
    rem = np.empty(G, np.int64)
    alloc = np.empty(G, np.int64)
    key = np.empty(G, np.int64)
    sel = np.empty(G, np.int64)
    for e in range(E):
        a, b = start[e], start[e + 1]
        if b - a < 2:
            continue
        for g in range(G):
            rem[g] = d_GE[g, e]
        # cols[a] is the owner (column e < E), then the replicas in column order
        for i in range(a + 1, b):  # pass 1: pairs already on the host rank
            n = cols[i]
            r = rank_N[n]
            take = quota_N[n] if quota_N[n] < rem[r] else rem[r]
            send[r, n] = take
            rem[r] -= take
        for i in range(a + 1, b):  # pass 2: the rest of the quota, largest remainder over the sources
            n = cols[i]
            need = quota_N[n] - send[rank_N[n], n]
            if need == 0:
                continue
            W = 0
            for g in range(G):
                W += rem[g]
            if W <= 0:
                return send, e
            largest_remainder_scratch(alloc, rem, need, key, sel)
            for g in range(G):
                send[g, n] += alloc[g]
                rem[g] -= alloc[g]
        for g in range(G):
            send[g, e] = rem[g]
    return send, -1


# A binary min-heap over (key, index) pairs in two arrays, ordered as Python orders the tuples
# (heapq's order): the compiled planners' priority queues. The entry that moves is held aside and
# the others shift over its hole (the same layout as swapping it along, about 20x faster compiled).
@njit
def heap_push(keys, idx, size, key, i):
    """Push (key, i) on the binary min-heap keys[:size], idx[:size] (ordered as tuples); new size."""
    c = size
    while c > 0:
        p = (c - 1) // 2
        kp = keys[p]
        if key < kp or (key == kp and i < idx[p]):  # (key, i) orders before its parent
            keys[c], idx[c] = kp, idx[p]
            c = p
        else:
            break
    keys[c], idx[c] = key, i
    return size + 1


@njit
def heap_pop(keys, idx, size):
    """Remove the smallest (key, i) of the heap; returns (i, new size)."""
    top = idx[0]
    size -= 1
    key, i = keys[size], idx[size]  # the last entry, sifted down from the root
    c = 0
    while True:
        m = 2 * c + 1
        if m >= size:
            break
        if m + 1 < size and (keys[m + 1] < keys[m] or (keys[m + 1] == keys[m] and idx[m + 1] < idx[m])):
            m += 1
        km = keys[m]
        if km < key or (km == key and idx[m] < i):  # the smaller child orders before it
            keys[c], idx[c] = km, idx[m]
            c = m
        else:
            break
    keys[c], idx[c] = key, i
    return top, size


# ----------------------------------------------------------------------------- shared helpers
def fetched_GE(expert_N, rank_N, num_ranks: int, num_experts: int) -> np.ndarray:
    """bool [G, E]: rank r holds an instance of expert e that it does not own (the owner of e is
    rank e // (E/G)). The expert-parallel runtime fetches one copy of such an expert's weights to r
    before the forward and returns one weight gradient in the backward, however many instances of
    e sit on r and whatever their ``is_replica`` flags (a SYMI slot's first instance can sit off
    its owner rank). The simulator charges these copies (:func:`lrmoe.sim.cost.replica_bytes_GG`);
    ``tests/sim`` checks them against the runtime's layout."""
    expert_N, rank_N = np.asarray(expert_N, dtype=np.int64), np.asarray(rank_N, dtype=np.int64)
    out = np.zeros((num_ranks, num_experts), dtype=bool)
    off = expert_N // (num_experts // num_ranks) != rank_N
    out[rank_N[off], expert_N[off]] = True
    return out


def expert_sum(x_GN: np.ndarray, expert_N: np.ndarray, num_experts: int) -> np.ndarray:
    """Sum the instance columns of x_GN per expert -> [G, E]."""
    x_GN = _int64(x_GN)
    expert_N = _int64(expert_N)
    if x_GN.ndim != 2 or x_GN.shape[1] != expert_N.size:
        raise ValueError(f"x_GN must have one column per instance ({expert_N.size}), got shape {x_GN.shape}")
    if expert_N.size and (expert_N.min() < 0 or expert_N.max() >= num_experts):
        raise ValueError(f"instance experts must be in [0, {num_experts}), got {expert_N.min()}..{expert_N.max()}")
    return expert_sum_kernel(x_GN, expert_N, int(num_experts))


def domain_peers(domain_G) -> list[list[int]]:
    """For every rank, the ranks of its fast domain (itself included), in rank order."""
    dom = np.asarray(domain_G).tolist()
    members = {d: [t for t in range(len(dom)) if dom[t] == d] for d in set(dom)}
    return [members[d] for d in dom]


def experts_by_load_per_rank(load_E, owner_E, num_ranks: int) -> list[list[int]]:
    """For every rank, the experts it owns by descending load (ties to the lower expert index)."""
    owner_E = np.asarray(owner_E)
    by_load = np.argsort(-np.asarray(load_E), kind="stable")
    by_rank = by_load[np.argsort(owner_E[by_load], kind="stable")].tolist()
    starts = np.r_[0, np.cumsum(np.bincount(owner_E, minlength=num_ranks))].tolist()
    return [by_rank[starts[r]:starts[r + 1]] for r in range(num_ranks)]


def largest_remainder(total: int, weights) -> np.ndarray:
    """Split ``total`` into integers proportional to ``weights``; remainders to the largest
    fractional parts (ties: lower index). Each part is <= its weight when total <= sum(weights)."""
    w = np.asarray(weights, dtype=np.int64)
    W = int(w.sum())
    if total == 0:
        return np.zeros_like(w)
    if W <= 0:
        raise ValueError(f"cannot split {total} over zero weights")
    if w.ndim == 1:
        return largest_remainder_kernel(int(total), np.ascontiguousarray(w))
    base, rem = np.divmod(w * int(total), W)
    missing = int(total) - int(base.sum())
    base[np.argsort(-rem, kind="stable")[:missing]] += 1
    return base


def prefix_split(d_G, quota_N) -> np.ndarray:
    """Ordinal routing: pairs of one expert are numbered source-major; instance n takes the
    ordinals in the n-th interval of the quota prefix sums. Returns send [G, N]."""
    d_G = np.asarray(d_G, dtype=np.int64)
    quota_N = np.asarray(quota_N, dtype=np.int64)
    s_end = np.cumsum(d_G)
    n_end = np.cumsum(quota_N)
    lo = np.maximum((s_end - d_G)[:, None], (n_end - quota_N)[None, :])
    return np.clip(np.minimum(s_end[:, None], n_end[None, :]) - lo, 0, None)


def prefix_split_experts(d_GE, expert_N, quota_N) -> np.ndarray:
    """:func:`prefix_split` of every expert at once: ``send[:, cols_e] == prefix_split(d_GE[:, e],
    quota_N[cols_e])`` for every expert e, cols_e its instance columns in ascending order."""
    d_GE = _int64(d_GE)
    expert_N = _int64(expert_N)
    quota_N = _int64(quota_N)
    if d_GE.ndim == 2 and expert_N.ndim == 1 and quota_N.shape == expert_N.shape and (
            not expert_N.size or (0 <= expert_N.min() and expert_N.max() < d_GE.shape[1])) \
            and not (d_GE < 0).any() and not (quota_N < 0).any():
        return prefix_split_kernel(d_GE, expert_N, quota_N)
    s_end_GN = np.cumsum(d_GE, 0)[:, expert_N]
    s_start_GN = s_end_GN - d_GE[:, expert_N]
    order = np.argsort(expert_N, kind="stable")
    csum = np.cumsum(quota_N[order])
    group_start = np.searchsorted(expert_N[order], expert_N[order])  # first position of each one's expert
    before = np.where(group_start > 0, csum[np.maximum(group_start - 1, 0)], 0)
    n_end_N = np.empty_like(quota_N)
    n_end_N[order] = csum - before
    n_start_N = n_end_N - quota_N
    return np.clip(np.minimum(s_end_GN, n_end_N[None, :]) - np.maximum(s_start_GN, n_start_N[None, :]), 0, None)


def locality_split(d_G, rank_N, quota_N, rest: int = 0) -> np.ndarray:
    """Per-source split of one expert's pairs over its instances (UltraEP's rule).

    Every instance except ``rest`` is filled first by pairs already on its host rank, then the
    rest of its quota is shared among the source ranks' remaining pairs by largest-remainder
    proportional rounding; instance ``rest`` (the owner) takes what is left. Returns send [G, N]."""
    rem = np.array(d_G, dtype=np.int64)
    quota_N = np.asarray(quota_N, dtype=np.int64)
    if int(quota_N.sum()) != int(rem.sum()):
        raise ValueError(f"instance quotas sum to {int(quota_N.sum())}, demand to {int(rem.sum())}")
    send = np.zeros((rem.size, quota_N.size), dtype=np.int64)
    others = [n for n in range(quota_N.size) if n != rest]
    for n in others:
        r = rank_N[n]
        send[r, n] = take = min(int(quota_N[n]), int(rem[r]))
        rem[r] -= take
    for n in others:
        need = int(quota_N[n]) - int(send[:, n].sum())
        if need:
            alloc = largest_remainder(need, rem)
            send[:, n] += alloc
            rem -= alloc
    send[:, rest] = rem
    return send


def largest_remainder_cols(total_N, w_GN) -> np.ndarray:
    """Column-wise :func:`largest_remainder`: ``out[:, n] == largest_remainder(total_N[n], w_GN[:, n])``
    for every column n, in one pass (same ties: the lower row index)."""
    w = _int64(w_GN)
    t = np.ascontiguousarray(np.broadcast_to(np.asarray(total_N, dtype=np.int64), (w.shape[1],)))
    W = w.sum(0)
    bad = (W <= 0) & (t != 0)
    if bad.any():
        n = int(np.flatnonzero(bad)[0])
        raise ValueError(f"cannot split {int(t[n])} over zero weights")
    return largest_remainder_cols_kernel(t, w)


def largest_remainder_groups(total_K, w_M, group_M) -> np.ndarray:
    """Grouped :func:`largest_remainder` over a flat array: the elements of group k (``group_M == k``,
    in array order) get ``largest_remainder(total_K[k], w_M[group_M == k])``."""
    w = _int64(w_M)
    g = _int64(group_M)
    t_K = _int64(total_K)
    W_K = np.bincount(g, weights=w, minlength=len(t_K)).astype(np.int64)
    bad = (W_K <= 0) & (t_K != 0)
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        raise ValueError(f"cannot split {int(t_K[k])} over zero weights")
    return largest_remainder_groups_kernel(t_K, w, g)


def locality_split_replicas(d_GE, expert_N, rank_N, quota_N) -> np.ndarray:
    """:func:`locality_split` of every expert at once, for the owner-plus-replicas layout of
    :func:`replica_instances` (instance e is expert e's owner, the ``rest``; replicas follow in
    order). Returns send [G, N]; ``send[:, cols_e] == locality_split(d_GE[:, e], rank_N[cols_e],
    quota_N[cols_e])`` for every expert e with instance columns cols_e (owner first)."""
    d_GE = _int64(d_GE)
    expert_N = _int64(expert_N)
    rank_N = _int64(rank_N)
    quota_N = _int64(quota_N)
    E = d_GE.shape[1]
    q_E = np.bincount(expert_N, weights=quota_N, minlength=E).astype(np.int64)
    bad = np.flatnonzero(q_E != d_GE.sum(0))
    if bad.size:
        e = int(bad[0])
        raise ValueError(f"instance quotas sum to {int(q_E[e])}, demand to {int(d_GE[:, e].sum())}")
    send, e = locality_split_kernel(d_GE, expert_N, rank_N, quota_N)
    if e >= 0:
        raise ValueError(f"cannot split the quota of a replica of expert {e} over zero weights")
    return send


def cap_rows(send_GN: np.ndarray, cap) -> np.ndarray:
    """Drop over capacity: each instance keeps at most ``cap`` rows (scalar or [N]), trimmed
    proportionally over its sources (largest remainder)."""
    send = _int64(send_GN)
    cap_N = np.ascontiguousarray(np.broadcast_to(np.asarray(cap, dtype=np.int64), (send.shape[1],)))
    return cap_rows_kernel(send, cap_N)


def owned_layout(cluster: Cluster, dims: ModelDims, policy: str) -> int:
    """Experts per rank for owner-based policies (expert e owned by rank e // (E/G), slot e % (E/G))."""
    G, E, S = cluster.num_ranks, dims.num_experts, cluster.slots_per_rank
    if E % G:
        raise ValueError(f"{policy}: num_experts ({E}) must be divisible by num_ranks ({G}) for fixed ownership")
    if E // G > S:
        raise ValueError(f"{policy}: slots_per_rank ({S}) must be >= experts per rank E/G = {E // G}")
    return E // G


def owner_instances(cluster: Cluster, dims: ModelDims, policy: str) -> list[Instance]:
    """The owned instances of fixed ownership: expert e in slot e % (E/G) of rank e // (E/G)."""
    return list(_owner_instances(dims.num_experts, owned_layout(cluster, dims, policy)))


@functools.lru_cache(maxsize=64)
def _owner_instances(num_experts: int, experts_per_rank: int) -> tuple[Instance, ...]:
    # Built once per layout (Instance is frozen, so sharing is safe): constructing 128 of them
    # costs more than a small plan.
    return tuple(Instance(e, e // experts_per_rank, e % experts_per_rank, False) for e in range(num_experts))


def owner_layout(cluster: Cluster, dims: ModelDims, policy: str) -> Instances:
    """:func:`owner_instances` as :class:`Instances` (one shared read-only object per layout)."""
    return _owner_layout(dims.num_experts, owned_layout(cluster, dims, policy))


@functools.lru_cache(maxsize=64)
def _owner_layout(num_experts: int, experts_per_rank: int) -> Instances:
    e = np.arange(num_experts, dtype=np.int64)
    return Instances(e, e // experts_per_rank, e % experts_per_rank, np.zeros(num_experts, dtype=np.bool_))


@njit
def replica_slots(expert_N, rank_N, num_ranks, experts_per_rank, slots_per_rank):
    """Slots of the owner-plus-replicas layout (:func:`replica_instances`): owner e in slot e % (E/G),
    replicas in the slots after the owned ones, in column order. Returns (slot_N, is_replica_N, -1),
    or (slot_N, is_replica_N, n) for the first replica column n whose rank has no free slot."""
    N = expert_N.size
    E = num_ranks * experts_per_rank
    slot_N = np.empty(N, np.int64)
    is_replica_N = np.empty(N, np.bool_)
    used = np.full(num_ranks, experts_per_rank, np.int64)
    for n in range(N):
        is_replica_N[n] = n >= E
        if n < E:
            slot_N[n] = n % experts_per_rank
            continue
        t = rank_N[n]
        if used[t] >= slots_per_rank:
            return slot_N, is_replica_N, n
        slot_N[n] = used[t]
        used[t] += 1
    return slot_N, is_replica_N, -1


def replica_slot_count(cluster: Cluster, dims: ModelDims, policy: str, value, name: str) -> int:
    """The replica slots per rank of an owner-based policy: ``value`` checked, or all S - E/G when None;
    ``name`` opens the error message (the option as the caller calls it)."""
    R_max = cluster.slots_per_rank - owned_layout(cluster, dims, policy)
    R = R_max if value is None else value
    if isinstance(R, bool) or not isinstance(R, (int, np.integer)) or not 0 <= R <= R_max:
        raise ValueError(f"{name} must be an integer in [0, S - E/G = {R_max}], got {R!r}")
    return int(R)


def replica_layout(cluster: Cluster, dims: ModelDims, expert_N, rank_N, policy: str) -> Instances:
    """:func:`replica_instances` from the instance columns of :func:`replica_columns` (owners 0..E-1,
    then replicas by expert): the same instances, as :class:`Instances`."""
    epr = owned_layout(cluster, dims, policy)
    expert_N, rank_N = _int64(expert_N), _int64(rank_N)
    if expert_N.ndim != 1 or expert_N.shape != rank_N.shape:
        raise ValueError(f"{policy}: instance experts and ranks must be 1-D of one length, got shapes "
                         f"{expert_N.shape} and {rank_N.shape}")
    slot_N, is_replica_N, bad = replica_slots(expert_N, rank_N, cluster.num_ranks, epr, cluster.slots_per_rank)
    if bad >= 0:
        raise ValueError(f"{policy}: rank {int(rank_N[bad])} has no free slot for a replica of expert "
                         f"{int(expert_N[bad])}")
    return Instances.trusted(expert_N, rank_N, slot_N, is_replica_N)


def replica_instances(cluster: Cluster, dims: ModelDims, hosts_E,
                      policy: str) -> tuple[list[Instance], list[list[int]]]:
    """Owner instances (index e) followed by replicas of expert e on the ranks ``hosts_E[e]``,
    in the slots after the owned ones. Returns the instances and each expert's instance columns
    (owner first)."""
    instances = owner_instances(cluster, dims, policy)
    used = [len(instances) // cluster.num_ranks] * cluster.num_ranks  # slots taken per rank
    S = cluster.slots_per_rank
    cols_E = [[e] for e in range(dims.num_experts)]
    for e, hosts in enumerate(hosts_E):
        for t in hosts:
            t = int(t)
            if used[t] >= S:
                raise ValueError(f"{policy}: rank {t} has no free slot for a replica of expert {e}")
            cols_E[e].append(len(instances))
            instances.append(Instance(e, t, used[t], True))
            used[t] += 1
    return instances, cols_E


def replica_columns(replicas, load_E, owner_E) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per instance column of :func:`replica_instances` for ``replicas`` = (expert, host, rows)
    (owners, then every expert's replicas in the order given): its expert, its rank
    (``owner_E[e]`` for the owner) and its rows (a replica its own, an owner its expert's load
    less its replicas' rows)."""
    E = len(load_E)
    rep = np.array(replicas, dtype=np.int64).reshape(-1, 3)
    rep = rep[np.argsort(rep[:, 0], kind="stable")]  # replica columns follow expert order
    rows_N = np.concatenate([np.asarray(load_E, dtype=np.int64), rep[:, 2]])
    np.subtract.at(rows_N, rep[:, 0], rep[:, 2])
    return (np.concatenate([np.arange(E), rep[:, 0]]), np.concatenate([np.asarray(owner_E, dtype=np.int64), rep[:, 1]]),
            rows_N)


def domain_receivers(domain_G) -> list[list[int]]:
    """For every rank, the other ranks of its fast domain (those it can place replicas on), in rank order."""
    return [[u for u in peers if u != r] for r, peers in enumerate(domain_peers(domain_G))]


@njit
def owner_prefix(expert_N, num_experts):
    """How many leading columns hold experts 0, 1, 2, ... in order (the owners of every planner but
    SYMI): :func:`take_sends` subtracts those as one difference."""
    K = 0
    while K < expert_N.size and K < num_experts and expert_N[K] == K:
        K += 1
    return K


@njit
def take_sends(drop, row, ex, K):
    """``drop[e] -= row[n]`` for every column n of expert e, one source's row: columns [0, K) (experts
    0..K-1, :func:`owner_prefix`) as one difference, then the nonzero sends of the columns from K
    (experts ``ex = expert_N[K:]``) one by one. The loop from K runs over a slice: a loop from a
    variable start compiled 1.5x slower."""
    for c in range(K):
        drop[c] -= row[c]
    tail = row[K:]
    for j in range(tail.size):
        v = tail[j]
        if v != 0:
            drop[ex[j]] -= v


@njit
def assemble(demand_GE, send_GN, quota_GN, same, expert_N, rank_N, slot_N, is_replica_N, num_experts, consts):
    """Plan assembly in one pass over the counts: the forward drops, the memory (as
    :func:`lrmoe.planning.memory.plan_memory`, pairs from the demand) and Plan.check's verdict
    (0 or an error code of _CHECK_ERRORS; ``same``: quota is send)."""
    G, N = send_GN.shape
    E = num_experts
    empty = np.zeros(0, np.int64)
    err = check_instances(expert_N, rank_N, slot_N, is_replica_N, G, E)
    if err:
        return np.zeros((G, E), np.int64), empty, empty, empty, empty, empty, 0, err
    dropped = np.zeros((G, E), np.int64)
    sent_G = np.zeros(G, np.int64)
    recv_N = np.zeros(N, np.int64)
    pairs_G = np.zeros(G, np.int64)
    K = owner_prefix(expert_N, E)
    ex = expert_N[K:]
    low = 0  # the smallest send or dropped count (negative: error 3)
    for g in range(G):
        row, dem, drop = send_GN[g], demand_GE[g], dropped[g]
        acc = 0
        for n in range(N):
            v = row[n]
            acc += v
            recv_N[n] += v
            low = min(low, v)
        sent_G[g] = acc
        take_sends(drop, row, ex, K)
        p = 0
        for e in range(E):
            p += dem[e]
            drop[e] += dem[e]
            low = min(low, drop[e])
        pairs_G[g] = p
    if low < 0:
        return dropped, empty, empty, empty, empty, empty, 0, 3
    kept_G, kept_N = sent_G, recv_N
    if not same:
        kept_G = np.zeros(G, np.int64)
        kept_N = np.zeros(N, np.int64)
        for g in range(G):
            acc = 0
            for n in range(N):
                q = quota_GN[g, n]
                if q < 0 or q > send_GN[g, n]:
                    err = 4
                acc += q
                kept_N[n] += q
            kept_G[g] = acc
        if err:
            return dropped, empty, empty, empty, empty, empty, 0, err
    base, reps, dispatch, saved, backward, peak = memory_from_counts(rank_N, is_replica_N, recv_N, kept_N, sent_G,
                                                                     kept_G, pairs_G, G, consts)
    return dropped, base, reps, dispatch, saved, backward, peak, 0


@njit
def keep_all_peak(demand_GE, send_GN, rank_N, is_replica_N, consts):
    """The memory peak of the plan that sends ``send_GN`` and keeps every pair sent (what
    :func:`make_plan` would report), without assembling it: the budget fallbacks' probes."""
    G, N = send_GN.shape
    sent_G = np.zeros(G, np.int64)
    recv_N = np.zeros(N, np.int64)
    pairs_G = np.zeros(G, np.int64)
    for g in range(G):
        acc = 0
        for n in range(N):
            v = send_GN[g, n]
            acc += v
            recv_N[n] += v
        sent_G[g] = acc
        p = 0
        for e in range(demand_GE.shape[1]):
            p += demand_GE[g, e]
        pairs_G[g] = p
    return memory_from_counts(rank_N, is_replica_N, recv_N, recv_N, sent_G, sent_G, pairs_G, G, consts)[5]


def make_plan(policy: str, demand_GE, cluster: Cluster, dims: ModelDims, budget_bytes: float, instances,
              send_GN, backward_quota_GN=None, *, optimizer_on_gpu: bool = True, info: dict | None = None,
              state: Any = None) -> Plan:
    """Assemble and check a plan: drops and memory are derived from the counts.
    ``instances``: :class:`Instances` or an iterable of :class:`Instance`.
    ``backward_quota_GN`` defaults to ``send_GN`` (keep every pair)."""
    inst = Instances.of(instances)
    send_GN = np.asarray(send_GN, dtype=np.int64)
    quota_GN = send_GN if backward_quota_GN is None else np.asarray(backward_quota_GN, dtype=np.int64)
    G, E, N = cluster.num_ranks, dims.num_experts, len(inst)
    ex = inst.expert_N
    if send_GN.ndim != 2 or send_GN.shape[1] != N:
        raise ValueError(f"x_GN must have one column per instance ({N}), got shape {send_GN.shape}")
    d = np.asarray(demand_GE)
    if d.shape != (G, E) or send_GN.shape != (G, N) or quota_GN.shape != (G, N):
        raise ValueError(f"plan {policy}: count matrices have the wrong shapes")
    same = quota_GN is send_GN
    send_c = np.ascontiguousarray(send_GN)
    dropped, base, reps, dispatch, saved, backward, peak, err = assemble(
        _int64(d), send_c, send_c if same else np.ascontiguousarray(quota_GN), same, ex, inst.rank_N, inst.slot_N,
        inst.is_replica_N, E, memory_constants(dims, bool(optimizer_on_gpu)))
    if err:
        if N and (ex.min() < 0 or ex.max() >= E):  # the kernel's instance check refused it: say why
            raise ValueError(f"instance experts must be in [0, {E}), got {ex.min()}..{ex.max()}")
        raise ValueError(f"plan {policy}: {_CHECK_ERRORS[err]}")
    mem = MemoryBreakdown.of(base, reps, dispatch, saved, backward, peak)
    return new_plan(policy, demand_GE, inst, send_GN, quota_GN, dropped, mem, budget_bytes, over_budget=peak > budget_bytes,
                    info=dict(info) if info else {}, state=state)


@njit
def split_piece_kernel(demand_GE, n):
    out = np.empty_like(demand_GE)
    G, E = demand_GE.shape
    for g in range(G):
        for e in range(E):
            q, r = divmod_nonneg(demand_GE[g, e], n)
            out[g, e] = q + (r > 0)
    return out


def split_piece(demand_GE: np.ndarray, n: int) -> np.ndarray:
    """The largest of n microbatch pieces: every count split as evenly as possible (ceil)."""
    if demand_GE.dtype == _INT64 and demand_GE.ndim == 2 and demand_GE.flags.c_contiguous and n > 0:
        return split_piece_kernel(demand_GE, int(n))
    return -(-demand_GE // n)


@njit
def fingerprint_kernel(a):
    """A 64-bit fingerprint of an int64 array's values (a weighted sum with odd pseudo-random
    weights, wrapping): equal arrays give equal fingerprints, different ones almost never do."""
    h = np.uint64(a.size)
    w = np.uint64(0x9E3779B97F4A7C15)
    for i in range(a.size):
        h += np.uint64(a[i]) * ((np.uint64(i) * w) | np.uint64(1))
    return h


class PieceKey:
    """A demand piece as a dict key (the fallback searches remember what they learnt per piece): hashed
    by :func:`fingerprint_kernel`, equal when the arrays are equal. ``hash(a.tobytes())`` cost 16 us
    on a [64, 128] demand, as much as a tenth of a plan."""

    __slots__ = ("array", "hash")

    def __init__(self, array: np.ndarray):
        self.array = np.ascontiguousarray(array, dtype=np.int64)
        self.hash = int(fingerprint_kernel(self.array.reshape(-1)))

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other) -> bool:
        return isinstance(other, PieceKey) and self.hash == other.hash and bool(np.array_equal(self.array, other.array))


def new_plan(policy: str, demand_GE, instances, send_GN, backward_quota_GN, dropped_GE, memory, budget_bytes, *,
             over_budget: bool = False, fallback: str = "none", num_splits: int = 1, info: dict | None = None,
             state: Any = None) -> Plan:
    """``Plan(...)`` with its fields set directly: a frozen dataclass's ``__init__`` costs a setattr call
    per field (1.2 us of a 40 us plan); Plan has no ``__post_init__``. Every planner builds its plans here."""
    plan = object.__new__(Plan)
    plan.__dict__.update(policy=policy, demand_GE=demand_GE, instances=instances, send_GN=send_GN,
                         backward_quota_GN=backward_quota_GN, dropped_GE=dropped_GE, memory=memory,
                         budget_bytes=budget_bytes, over_budget=over_budget, fallback=fallback, num_splits=num_splits,
                         info={} if info is None else info, state=state)
    return plan


def replace_plan(plan: Plan, **changes) -> Plan:
    """``dataclasses.replace`` for a :class:`Plan` without its per-call introspection (the fields
    are copied as they are; Plan has no ``__post_init__``)."""
    new = object.__new__(Plan)
    new.__dict__.update(plan.__dict__)
    new.__dict__.update(changes)
    return new


FALLBACKS = ("split", "drop", "oom")


def resolve_budget(build: Callable[[np.ndarray, int | None], Plan], demand_GE: np.ndarray, budget_bytes: float,
                   fallback: str = "split", max_split: int = 256,
                   fits: Callable[[np.ndarray, int | None], bool] | None = None, unfit: bool = False) -> Plan:
    """Apply a policy's fallback when its plan does not fit the budget.

    ``build(demand_GE, row_cap)`` plans a demand with an optional per-instance row cap.
    split: the smallest number N <= max_split of microbatch pieces whose largest piece fits
        (doubling, then bisection; memory is assumed not to grow as N grows);
    drop: the largest per-instance row cap that fits (bisection);
    oom: report the over-budget plan. Any fallback that cannot fit ends as ``oom``.

    ``fits(demand_GE, row_cap)``, when given, must equal ``build(demand_GE, row_cap).fits``; the
    searches then probe it and build only the plan they return (for planners whose ``fits`` is
    cheaper than their plan). Without it every probe builds its plan. ``unfit=True``: the caller
    knows ``build(demand_GE, None)`` does not fit (LRMoE: over the memory floor at every kept-pair
    count); that plan is then built only when the fallback fails, for its ``oom`` report."""
    if fallback not in FALLBACKS:
        raise ValueError(f"fallback must be one of {FALLBACKS}, got {fallback!r}")
    if isinstance(max_split, bool) or not isinstance(max_split, int) or max_split < 1:
        raise ValueError(f"max_split must be an integer >= 1, got {max_split!r}")
    built: dict[tuple, Plan] = {}  # every probe's plan when fits is not given (the answer is one of them)

    def plan_of(d_GE, row_cap) -> Plan:
        key = (PieceKey(d_GE), row_cap)
        if key not in built:
            built[key] = build(d_GE, row_cap)
        return built[key]

    whole: list[Plan] = []  # the plan of the whole demand, once built

    def whole_plan() -> Plan:
        if not whole:
            whole.append(build(demand_GE, None))
        return whole[0]

    if not unfit and whole_plan().fits:
        return whole[0]

    def oom() -> Plan:
        return replace_plan(whole_plan(), over_budget=True, fallback="oom")

    if fits is None:
        def fits(d_GE, row_cap):
            return plan_of(d_GE, row_cap).fits
    if fallback == "drop":
        if not fits(demand_GE, 0):
            return oom()
        lo, hi = 0, int(whole_plan().rows_N.max())  # cap lo fits, cap hi does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(demand_GE, mid) else (lo, mid)
        best = plan_of(demand_GE, lo)
        return replace_plan(best, over_budget=True, fallback="drop_over_capacity", info={**best.info, "row_cap": lo})
    if fallback == "split":
        lo, hi = 1, None  # lo pieces do not fit, hi pieces do
        while hi is None and lo < max_split:
            n = min(2 * lo, max_split)
            if fits(split_piece(demand_GE, n), None):
                hi = n
            else:
                lo = n
        if hi is None:
            return oom()
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if fits(split_piece(demand_GE, mid), None) else (mid, hi)
        best = plan_of(split_piece(demand_GE, hi), None)
        return replace_plan(best, over_budget=True, fallback=f"split_microbatch:{hi}", num_splits=hi)
    return oom()
