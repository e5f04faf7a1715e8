"""Named, seeded synthetic routing workloads (docs/simulator.md "Synthetic workloads").

A workload is a function ``fn(rng, *, steps, num_ranks, num_experts, top_k, **params)`` returning
the *base* log popularity of the experts, ``[steps, E]`` (one row per step; a row's additive
constant does not matter). :func:`synthetic_trace` then, for every MoE layer independently:

1. adds AR(1) drift: ``z_0 ~ N(0, innovation^2 / (1 - phi^2))`` (the stationary law; ``z_0 = 0``
   when ``phi = 1``), ``z_t = phi z_{t-1} + innovation eps_t``, one ``z`` per expert;
2. turns ``base + z`` into expert probabilities (softmax), each capped at ``1 / top_k`` (a token
   picks ``top_k`` distinct experts, so no expert can get more than one pair per token; the mass
   over the cap goes to the other experts in proportion);
3. draws, per source rank, a multinomial of ``tokens_per_rank * top_k`` pairs; a draw that puts
   more than ``tokens_per_rank`` pairs on one expert (possible only near the cap) has the excess
   moved to the experts below it in proportion to their probabilities (deterministic).

Layer ``l`` of seed ``s`` uses the random streams of ``SeedSequence([s, l])`` only, so adding
layers does not change earlier ones, and every built-in draws step by step, so adding steps does
not change earlier steps. The built-ins are listed in :data:`WORKLOADS`; users add their own
with ``WORKLOADS.register(name, fn)``.
"""
from __future__ import annotations

import inspect
import math

import numpy as np

from lrmoe.registry import Registry

from .trace import Trace, largest_remainder_rows

GENERATOR = "lrmoe.sim.workloads/1"
# AR(1) drift on log popularity (docs/simulator.md: correlation time 1 / (1 - phi) = 100 steps, hot
# experts stable over tens to hundreds of iterations; stationary std innovation / sqrt(1 - phi^2) = 0.14)
DRIFT = {"phi": 0.99, "innovation": 0.02}
CONTEXT = ("steps", "num_ranks", "num_experts", "top_k")


def balanced(rng, *, steps, num_ranks, num_experts, top_k):
    """Every expert equally popular (only sampling noise and drift)."""
    return np.zeros((steps, num_experts))


def lognormal(rng, *, steps, num_ranks, num_experts, top_k, sigma=1.0):
    """Log popularity ~ N(0, sigma^2) per expert, fixed over steps (the bench's log-normal routing)."""
    _check(sigma >= 0, f"sigma must be >= 0, got {sigma!r}")
    return np.broadcast_to(rng.normal(0.0, sigma, num_experts), (steps, num_experts)).copy()


def powerlaw(rng, *, steps, num_ranks, num_experts, top_k, alpha=1.2):
    """Zipf popularity: the i-th most popular expert (in a random expert order) has weight i^-alpha."""
    _check(alpha >= 0, f"alpha must be >= 0, got {alpha!r}")
    order = rng.permutation(num_experts)
    logp = np.empty(num_experts)
    logp[order] = -alpha * np.log(np.arange(1, num_experts + 1))
    return np.broadcast_to(logp, (steps, num_experts)).copy()


def hot_experts(rng, *, steps, num_ranks, num_experts, top_k, n=4, share=0.4):
    """``n`` experts (a random set) carry ``share`` of all pairs between them, the rest evenly."""
    logp = np.broadcast_to(_hot_logp(rng.choice(num_experts, n, replace=False), num_experts, top_k, share),
                           (steps, num_experts))
    return logp.copy()


def hot_rank(rng, *, steps, num_ranks, num_experts, top_k, factor=4.0, rank=0):
    """The experts owned by ``rank`` (fixed ownership, E / G per rank) ``factor`` times as popular."""
    _check(factor > 0, f"factor must be > 0, got {factor!r}")
    _check(num_experts % num_ranks == 0, f"hot_rank needs num_experts ({num_experts}) divisible by num_ranks "
                                         f"({num_ranks})")
    _check(isinstance(rank, (int, np.integer)) and 0 <= rank < num_ranks,
           f"rank must be an integer in [0, {num_ranks}), got {rank!r}")
    epr = num_experts // num_ranks
    logp = np.zeros((steps, num_experts))
    logp[:, rank * epr:(rank + 1) * epr] = math.log(factor)
    return logp


def rotating_hotspot(rng, *, steps, num_ranks, num_experts, top_k, n=4, share=0.4, period=50):
    """Like ``hot_experts``, but every ``period`` steps a new random hot set is drawn."""
    _check(isinstance(period, (int, np.integer)) and period >= 1, f"period must be an integer >= 1, got {period!r}")
    _hot_logp(np.arange(n), num_experts, top_k, share)  # checks n and share
    rows = []
    for _ in range(-(-steps // period)):
        rows.append(_hot_logp(rng.choice(num_experts, n, replace=False), num_experts, top_k, share))
    return np.repeat(np.array(rows), period, axis=0)[:steps]


def burst(rng, *, steps, num_ranks, num_experts, top_k, sigma=1.0, prob=0.05, n=4, factor=8.0):
    """Log-normal base (``sigma``); each step, with probability ``prob``, ``n`` random experts are
    ``factor`` times as popular for that step only."""
    _check(0 <= prob <= 1, f"prob must be in [0, 1], got {prob!r}")
    _check(factor > 0, f"factor must be > 0, got {factor!r}")
    _check(isinstance(n, (int, np.integer)) and 1 <= n <= num_experts, f"n must be an integer in [1, {num_experts}], "
                                                                       f"got {n!r}")
    logp = lognormal(rng, steps=steps, num_ranks=num_ranks, num_experts=num_experts, top_k=top_k, sigma=sigma)
    for t in range(steps):
        hit, chosen = rng.random() < prob, rng.choice(num_experts, n, replace=False)  # both drawn every step
        if hit:
            logp[t, chosen] += math.log(factor)
    return logp


def _hot_logp(hot, E, top_k, share):
    n = len(hot)
    _check(1 <= n < E, f"n must be an integer in [1, {E - 1}], got {n!r}")
    _check(0 < share < 1, f"share must be in (0, 1), got {share!r}")
    _check(share / n <= 1 / top_k, f"share / n = {share / n:.4g} exceeds 1 / top_k = {1 / top_k:.4g} (an expert gets "
                                   f"at most one pair per token); use share <= {n / top_k:.4g} or more hot experts")
    logp = np.full(E, math.log((1 - share) / (E - n)))
    logp[hot] = math.log(share / n)
    return logp


def _check(ok, message):
    if not ok:
        raise ValueError(message)


WORKLOADS = Registry("workload", {"balanced": balanced, "lognormal": lognormal, "powerlaw": powerlaw,
                                  "hot_experts": hot_experts, "hot_rank": hot_rank,
                                  "rotating_hotspot": rotating_hotspot, "burst": burst})
SKEWED = ("lognormal", "powerlaw", "hot_experts", "hot_rank", "rotating_hotspot", "burst")


def workload_params(name: str) -> dict:
    """The parameters ``name`` accepts and their defaults: its own, then the drift's."""
    fn = WORKLOADS.get(name)
    own = {p.name: p.default for p in inspect.signature(fn).parameters.values()
           if p.kind is p.KEYWORD_ONLY and p.name not in CONTEXT}
    return {**own, **DRIFT}


def capped_probabilities(logits, cap: float) -> np.ndarray:
    """Row-wise softmax of ``logits`` [..., E] with every entry at most ``cap`` (needs cap * E >= 1):
    entries over the cap are set to it and the rest renormalised over the others, until none is over."""
    x = np.asarray(logits, dtype=np.float64)
    E = x.shape[-1]
    if cap * E < 1 - 1e-12:
        raise ValueError(f"cannot cap {E} probabilities at {cap}: they would sum to less than 1")
    w = np.exp(x - x.max(-1, keepdims=True))
    fixed = np.zeros(x.shape, dtype=bool)
    for _ in range(E):
        free = np.where(fixed, 0.0, w)
        mass = 1.0 - cap * fixed.sum(-1, keepdims=True)
        tot = free.sum(-1, keepdims=True)
        p = np.where(fixed, cap, free * mass / np.where(tot > 0, tot, 1))
        over = ~fixed & (p > cap * (1 + 1e-12))
        if not over.any():
            return p
        fixed |= over
    return p


def synthetic_trace(workload: str, *, steps: int, layers: int, num_ranks: int, num_experts: int,
                    tokens_per_rank: int, top_k: int, seed: int = 0, **params) -> Trace:
    """A deterministic synthetic :class:`~lrmoe.sim.trace.Trace` of the named workload (module docstring);
    ``params`` override the workload's defaults and the drift's (``phi``, ``innovation``)."""
    fn = WORKLOADS.get(workload)  # ValueError listing the workloads
    for name, v in (("steps", steps), ("layers", layers), ("num_ranks", num_ranks), ("num_experts", num_experts),
                    ("tokens_per_rank", tokens_per_rank), ("top_k", top_k)):
        _check(isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 1,
               f"{name} must be a positive integer, got {v!r}")
    _check(top_k <= num_experts, f"top_k ({top_k}) cannot exceed num_experts ({num_experts})")
    _check(isinstance(seed, (int, np.integer)) and not isinstance(seed, bool) and seed >= 0,
           f"seed must be a non-negative integer, got {seed!r}")
    accepted = workload_params(workload)
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise ValueError(f"workload {workload!r} has no parameter {', '.join(map(repr, unknown))}; it accepts "
                         f"{', '.join(f'{k}={v!r}' for k, v in accepted.items())}")
    full = {**accepted, **params}
    phi, innovation = full["phi"], full["innovation"]
    _check(0 <= phi <= 1, f"phi must be in [0, 1], got {phi!r}")
    _check(innovation >= 0, f"innovation must be >= 0, got {innovation!r}")
    own = {k: v for k, v in full.items() if k not in DRIFT}
    pairs = tokens_per_rank * top_k
    counts = np.empty((steps, layers, num_ranks, num_experts), dtype=np.int64)
    for layer in range(layers):
        structure, drift, sampling = (np.random.default_rng(s) for s in np.random.SeedSequence([seed, layer]).spawn(3))
        base = np.asarray(fn(structure, steps=steps, num_ranks=num_ranks, num_experts=num_experts, top_k=top_k, **own),
                          dtype=np.float64)
        _check(base.shape == (steps, num_experts) and np.isfinite(base).all(),
               f"workload {workload!r} must return finite log popularity [steps, E] = {(steps, num_experts)}, "
               f"got shape {base.shape}")
        z = drift.normal(0.0, innovation / math.sqrt(1 - phi * phi) if phi < 1 else 0.0, num_experts)
        eps = drift.normal(0.0, innovation, (steps, num_experts))
        zs = np.empty((steps, num_experts))
        for t in range(steps):
            z = phi * z + eps[t]
            zs[t] = z
        p = capped_probabilities(base + zs, 1.0 / top_k)
        draw = sampling.multinomial(pairs, np.broadcast_to(p[:, None, :], (steps, num_ranks, num_experts)))
        counts[:, layer] = _within_tokens(draw, p, tokens_per_rank)
    meta = {"source": "synthetic", "top_k": int(top_k), "tokens_per_rank": int(tokens_per_rank),
            "workload": workload, "params": full, "seed": int(seed), "generator": GENERATOR}
    return Trace(counts, meta)


def _within_tokens(draw, p, tokens):
    """``draw`` [S, G, E] with no entry over ``tokens``: each row's excess moved to the entries below
    ``tokens`` in proportion to ``p`` (largest remainder), repeated until none is over."""
    out = draw.copy()
    S, G, E = out.shape
    flat = out.reshape(-1, E)
    prob = np.repeat(p, G, axis=0)
    for _ in range(E):
        over = (flat > tokens).any(1)
        if not over.any():
            break
        rows = flat[over]
        excess = np.clip(rows - tokens, 0, None).sum(1)
        rows = np.minimum(rows, tokens)
        room = tokens - rows
        w = np.where(room > 0, np.maximum(np.rint(prob[over] * 2 ** 30), 1), 0).astype(np.int64)
        rows += largest_remainder_rows(excess, w)
        flat[over] = rows
    return out
