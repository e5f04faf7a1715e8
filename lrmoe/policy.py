"""Configuration of the selective backward (:class:`BackwardPolicy`) and what it did (:class:`BackwardRecord`)."""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable

import torch

from .kernels.grouped_gemm import BACKENDS
from .quota import check_drop_ratio, check_min_keep, get_quota_policy
from .scorers import PHI_SCORERS, PHIS, get_scorer

MODES = ("full", "compact", "mask")
#: Values of ``BackwardPolicy.selection``: deterministic top-quota (the paper's rule) or unbiased sampling.
SELECTIONS = ("top", "sample")
# built-in scorers that do not look at phi (a phi other than the default would change nothing)
_PHI_BLIND = ("grad_norm", "abs_grad", "random")


@dataclass
class BackwardPolicy:
    """How an MoE layer's expert backward is pruned.

    drop_ratio: fraction rho of routed pairs dropped from the expert backward, in [0, 1);
        in modes ``compact`` and ``mask`` exactly ``round((1 - rho) * P)`` pairs are kept per
        layer call (P = tokens x top_k); mode ``full`` keeps all P whatever rho.
    scorer: registered pair scorer (``lrmoe.scorers.scorers()``): lrm, lrm_input, grad_norm,
        abs_grad, random.
    quota: registered quota policy (``lrmoe.quota.quota_policies()``): waterfill, proportional.
    mode: ``full`` (no selection: the C0 fast path), ``compact`` (LRMoE: kept rows physically
        compacted, grouped GEMMs over kept rows only), ``mask`` (same selection, dropped rows
        zero-masked in full-size GEMMs; saves nothing, kept for the ablation).
    seed: seed of the ``random`` scorer's generator (None: torch's global RNG).
    backend: grouped GEMM backend (``auto``, ``triton``, ``torch``, ``loop``).
    fuse_gather: read token rows inside the grouped GEMMs' loads (forward and wgrad) and write
        the forward output straight to pair order, instead of gathering into contiguous buffers;
        None (default) fuses when the grouped GEMM backend resolves to ``triton``.
    profile: record per-phase backward timings in ``BackwardRecord.timings`` (synchronises the
        device after each phase: for analysis, not for training runs).
    phi: which activation norm the LRM score R = alpha^2 ||g||^2 ||phi||^2 uses (``lrmoe.scorers.PHIS``):
        ``h`` (the down-projection input, the paper's phi; default), ``x`` (the expert input; the
        ``lrm_input`` scorer is ``lrm`` with phi ``x``), ``both`` (the sum of both projections' terms).
        Read by the ``lrm`` scorer (and user scorers through ``ScoreInputs.phi``); the built-in
        scorers that ignore it (grad_norm, abs_grad, random) refuse a value other than ``h``.
    selection: how each expert's quota is filled: ``top`` (its highest-scoring pairs, the paper's
        rule; default) or ``sample`` (pairs drawn with inclusion probabilities pi proportional to
        sqrt(score), capped at 1, by systematic sampling so that exactly the quota is kept, each
        kept pair's gradient row scaled by 1/pi: the expert weight gradients, and the expert-input
        gradient, are unbiased; :mod:`lrmoe.kernels.sampling`). Draws come from ``seed``'s generator.
    """

    drop_ratio: float = 0.0
    scorer: str = "lrm"
    quota: str = "waterfill"
    mode: str = "compact"
    seed: int | None = None
    scorer_kwargs: dict = field(default_factory=dict)
    quota_kwargs: dict = field(default_factory=dict)
    backend: str = "auto"
    fuse_gather: bool | None = None
    profile: bool = False
    phi: str = "h"
    selection: str = "top"

    def __post_init__(self):
        self.validate()
        self._generators: dict[tuple[torch.device, int], torch.Generator] = {}

    def validate(self) -> "BackwardPolicy":
        """Check every field (also called on each use, so a policy mutated after creation is re-checked)."""
        self.drop_ratio = check_drop_ratio(self.drop_ratio)
        scorer_fn, quota_fn = get_scorer(self.scorer), get_quota_policy(self.quota)
        if self.mode not in MODES:
            raise ValueError(f"unknown backward mode {self.mode!r}; accepted: {list(MODES)}")
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown grouped_mm backend {self.backend!r}; accepted: {list(BACKENDS)}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        for name in ("scorer_kwargs", "quota_kwargs"):
            if not isinstance(getattr(self, name), dict):
                raise ValueError(f"{name} must be a dict of keyword arguments, got {getattr(self, name)!r}")
        _check_kwargs("scorer", self.scorer, scorer_fn, self.scorer_kwargs, skip=1)
        _check_kwargs("quota policy", self.quota, quota_fn, self.quota_kwargs, skip=2, reserved=("drop_ratio",))
        if not any(self.fuse_gather is v for v in (None, True, False)):  # not 1 or 0: those compare equal
            raise ValueError(f"fuse_gather must be None, True or False, got {self.fuse_gather!r}")
        if not isinstance(self.profile, bool):
            raise ValueError(f"profile must be a bool (True or False), got {self.profile!r}")
        if "min_keep" in self.quota_kwargs:  # fail at construction, not at the first backward
            check_min_keep(self.quota_kwargs["min_keep"])
        check_phi(self.scorer, self.phi)
        if self.selection not in SELECTIONS:
            raise ValueError(f"unknown selection {self.selection!r}; accepted: {list(SELECTIONS)} (top: each "
                             f"expert's highest-scoring pairs; sample: unbiased sampling within the quota)")
        return self

    def __getstate__(self):  # generators are device state, not configuration
        state = dict(self.__dict__)
        state["_generators"] = {}
        return state

    @property
    def selects(self) -> bool:
        """True when the backward scores and selects pairs (mode compact/mask with rho > 0)."""
        return _selects(self.mode, self.drop_ratio)

    def snapshot(self, device: torch.device) -> "PolicySnapshot":
        """The validated settings as one layer call sees them in forward; its backward uses the same
        (a policy changed between a forward and its backward does not change that backward)."""
        self.validate()
        return PolicySnapshot(
            drop_ratio=self.drop_ratio, scorer=self.scorer, quota=self.quota, mode=self.mode,
            scorer_kwargs=dict(self.scorer_kwargs), quota_kwargs=dict(self.quota_kwargs), backend=self.backend,
            fuse_gather=self.fuse_gather, profile=self.profile, scorer_fn=get_scorer(self.scorer),
            phi=self.phi, selection=self.selection,
            # (no generator on the meta device: shape-only forwards never score)
            generator=self.generator(device) if self.selects and torch.device(device).type != "meta" else None)

    def generator(self, device: torch.device) -> torch.Generator | None:
        """The seeded generator for ``device`` (created on first use, one stream per device and
        seed: changing ``seed`` starts the new seed's stream), or None without a seed. ``cuda``
        without an index means the current CUDA device, as for tensors."""
        if self.seed is None:
            return None
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        key = (device, self.seed)
        if key not in self._generators:
            self._generators[key] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[key]


@dataclass(frozen=True)
class PolicySnapshot:
    """A :class:`BackwardPolicy`'s settings fixed for one layer call (:meth:`BackwardPolicy.snapshot`):
    the same fields, plus the scorer function and the random scorer's generator for the call's device."""

    drop_ratio: float
    scorer: str
    quota: str
    mode: str
    scorer_kwargs: dict
    quota_kwargs: dict
    backend: str
    fuse_gather: bool | None
    profile: bool
    scorer_fn: Callable
    generator: torch.Generator | None
    phi: str = "h"
    selection: str = "top"

    @property
    def selects(self) -> bool:
        return _selects(self.mode, self.drop_ratio)


def check_phi(scorer: str, phi) -> None:
    """ValueError unless ``phi`` is one of PHIS and means something for ``scorer``."""
    if phi not in PHIS:
        raise ValueError(f"unknown phi {phi!r}; accepted: {list(PHIS)} (the activation norm of the LRM score: h, "
                         f"the down-projection input; x, the expert input; both, the sum of both terms)")
    if scorer == "lrm_input" and phi == "both":
        raise ValueError("scorer 'lrm_input' is 'lrm' with phi 'x'; for phi 'both' use scorer 'lrm'")
    if scorer in _PHI_BLIND and phi != "h":
        raise ValueError(f"scorer {scorer!r} does not use phi (phi={phi!r} would change nothing); phi applies to "
                         f"{list(PHI_SCORERS)} (and user scorers that read ScoreInputs.phi): leave it at 'h'")


def check_policy(policy: "BackwardPolicy | None") -> "BackwardPolicy":
    """``policy`` itself (``BackwardPolicy()`` for None); ValueError for anything else."""
    if policy is None:
        return BackwardPolicy()
    if not isinstance(policy, BackwardPolicy):
        raise ValueError(f"policy must be a BackwardPolicy (lrmoe.BackwardPolicy; None for the default), got {policy!r}")
    return policy


def _selects(mode: str, drop_ratio: float) -> bool:
    return mode != "full" and drop_ratio > 0


_KWARGS_OK: set = set()  # (function identity, options) pairs already checked: validate() runs on every use


def _check_kwargs(kind: str, name: str, fn, kwargs: dict, skip: int, reserved: tuple = ()) -> None:
    """ValueError unless ``kwargs`` bind to ``fn`` after its first ``skip`` positional arguments."""
    key = (id(fn), skip, tuple(sorted(kwargs)))
    if key in _KWARGS_OK:
        return
    bad = sorted(k for k in kwargs if k in reserved)
    if bad:
        raise ValueError(f"{kind} {name!r}: {bad} are set by the layer and cannot be given as options")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C callable: nothing to check
        return
    try:
        sig.bind_partial(*([None] * skip), **kwargs)
    except TypeError as e:
        params = [p for p in list(sig.parameters)[skip:] if p not in reserved]
        raise ValueError(f"{kind} {name!r} does not accept the options {sorted(kwargs)} ({e}); "
                         f"its options: {params}") from None
    _KWARGS_OK.add(key)


class BackwardRecord:
    """What one selective backward did; filled when the backward runs.

    demand [E]: routed pairs per expert; quota [E]: retention quota fixed in forward;
    kept [E]: pairs kept in backward; kept_mask [T, K] bool; scores [T, K] float32 (None when the
    policy does not score, i.e. mode ``full`` or drop_ratio 0); scorer: the scorer's name (None
    without scoring); mode, drop_ratio: the policy's, as the forward saw them; nonfinite: number of
    pairs whose score (or, without scoring, whose incoming gradient) is NaN/Inf; selection: the
    policy's selection rule when it scored (None otherwise); inclusion [T, K] float64: with
    ``selection="sample"``, each pair's inclusion probability pi in the draw (kept pairs' gradient rows
    were scaled by 1/pi), else None; buffer_bytes: bytes of the
    backward execution buffers (gathered rows, intermediate and output gradients of the GEMMs);
    timings: seconds per backward phase when the policy has ``profile=True``: router_grad,
    score_select, compact (kept positions and the gathers of kept rows; zero without
    compaction), grad_rows (alpha * g rows), gemm, scatter.
    """

    def __init__(self, on_fill: Callable[["BackwardRecord"], None] | None = None):
        self.filled = False
        self.demand = self.quota = self.kept = self.kept_mask = self.scores = None
        self.mode: str | None = None
        self.drop_ratio: float | None = None
        self.scorer: str | None = None
        self.selection: str | None = None
        self.inclusion: torch.Tensor | None = None
        self.buffer_bytes = 0
        self.timings: dict[str, float] = {}
        self._nonfinite: torch.Tensor | int = 0
        self._on_fill = on_fill

    def __getstate__(self):  # the fill callback belongs to the module that made the record
        return {**self.__dict__, "_on_fill": None}

    @property
    def nonfinite(self) -> int:
        return int(self._nonfinite)

    @property
    def kept_fraction(self) -> float:
        total = int(self.demand.sum())
        return int(self.kept.sum()) / total if total else 1.0

    def fill(self, **values) -> None:
        for k, v in values.items():
            setattr(self, "_nonfinite" if k == "nonfinite" else k, v)
        self.filled = True
        if self._on_fill is not None:
            self._on_fill(self)

    def __repr__(self) -> str:
        if not self.filled:
            return "BackwardRecord(pending)"
        return (f"BackwardRecord(mode={self.mode}, drop_ratio={self.drop_ratio}, demand={self.demand.tolist()}, "
                f"quota={self.quota.tolist()}, kept={self.kept.tolist()}, nonfinite={self.nonfinite})")
