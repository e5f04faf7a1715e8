"""Routing traces: routed token-expert pair counts ``[steps, layers, G, E]`` with their provenance.

A :class:`Trace` holds, for every training step, MoE layer, source rank (the rank whose tokens were
routed) and expert, how many (token, expert) pairs were routed; ``meta`` says where it came from.
:meth:`Trace.scaled` replays the same routing at another number of pairs per rank and
:meth:`Trace.regrouped` the same tokens over another number of source ranks. One file format
(:func:`save_trace` / :func:`load_trace`, docs/simulator.md "Routing traces") and one set of
statistics (:func:`trace_stats`). Numpy only.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from lrmoe.files import CorruptFileError, atomic_write

FORMAT = "lrmoe-trace/1"
SOURCES = ("runtime", "model", "synthetic")
KEYS = ("format", "counts", "meta", "sha256")
STATS = ("rank_max_mean", "expert_max_mean", "source_max_mean", "gini", "drift_tv")


@dataclass(frozen=True, eq=False)
class Trace:
    """``counts`` int64 ``[steps, layers, G, E]`` (routed pairs per step, MoE layer, source rank,
    expert; a read-only copy of what was passed) and ``meta``, a JSON-able dict with at least
    ``source`` (one of :data:`SOURCES`), ``top_k`` and ``tokens_per_rank``; anything else
    (workload, parameters, seed, model, git revision, ``history`` of rescalings) is provenance."""

    counts: np.ndarray
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        c = np.asarray(self.counts)
        if c.dtype == bool or not np.issubdtype(c.dtype, np.integer):
            raise ValueError(f"trace counts must be an integer array [steps, layers, G, E], got dtype {c.dtype}")
        if c.ndim != 4:
            raise ValueError(f"trace counts must be 4-D [steps, layers, G, E], got shape {c.shape}")
        if min(c.shape) < 1:
            raise ValueError(f"trace counts need at least one step, layer, rank and expert, got shape {c.shape}")
        if c.size and int(c.min()) < 0:
            raise ValueError(f"trace counts must be non-negative, found {int(c.min())} at "
                             f"[step, layer, rank, expert] {tuple(int(i) for i in np.argwhere(c < 0)[0])}")
        c = np.array(c, dtype=np.int64)
        c.setflags(write=False)
        object.__setattr__(self, "counts", c)
        object.__setattr__(self, "meta", _checked_meta(self.meta))

    @property
    def steps(self) -> int:
        return self.counts.shape[0]

    @property
    def layers(self) -> int:
        return self.counts.shape[1]

    @property
    def num_ranks(self) -> int:
        return self.counts.shape[2]

    @property
    def num_experts(self) -> int:
        return self.counts.shape[3]

    @property
    def top_k(self) -> int:
        return self.meta["top_k"]

    def __eq__(self, other):
        if not isinstance(other, Trace):
            return NotImplemented
        return self.meta == other.meta and np.array_equal(self.counts, other.counts)

    __hash__ = None

    def scaled(self, pairs_per_rank: int) -> Trace:
        """The same routing with every (step, layer, source rank) row holding exactly
        ``pairs_per_rank`` pairs, split over the experts in the row's proportions by largest
        remainder (floors first; the leftover pairs to the largest fractional parts, ties to the
        lower expert index): deterministic, and a row already at that scale is unchanged. An
        all-zero row (a rank that routed nothing) stays all zero: there are no proportions to keep.
        ``meta["tokens_per_rank"]`` becomes ``pairs_per_rank / top_k`` and ``meta["history"]``
        gains the scale it came from."""
        if isinstance(pairs_per_rank, bool) or not isinstance(pairs_per_rank, (int, np.integer)) \
                or pairs_per_rank < 1:
            raise ValueError(f"pairs_per_rank must be a positive integer, got {pairs_per_rank!r}")
        t = int(pairs_per_rank)
        w = self.counts.reshape(-1, self.num_experts)
        W = w.sum(1)
        if w.size and int(w.max()) > (2 ** 63 - 1) // t:
            raise ValueError(f"cannot scale to {t} pairs per rank: counts up to {int(w.max())} would overflow int64")
        out = largest_remainder_rows(np.where(W > 0, t, 0), w)
        row_sums = W.reshape(self.counts.shape[:3])
        step = {"op": "scaled", "pairs_per_rank": t, "tokens_per_rank_before": self.meta["tokens_per_rank"],
                "pairs_per_rank_before": {"min": int(row_sums.min()), "max": int(row_sums.max())}}
        return Trace(out.reshape(self.counts.shape), _with_history(self.meta, step, tokens_per_rank=t / self.top_k))

    def regrouped(self, num_ranks: int) -> Trace:
        """The same tokens split over ``num_ranks`` source ranks (replaying an EP8 trace at EP16 or
        EP64): per (step, layer, expert) the pairs of all current source ranks are summed and split
        evenly, every rank getting ``total // num_ranks`` and the ``total % num_ranks`` leftover pairs
        of expert e going to ranks e, e+1, ... (mod num_ranks), so no rank collects every expert's
        leftovers. Per-expert totals are kept exactly; which rank a token came from is not (the
        sources of the result differ only by those leftovers). ``num_experts`` must be divisible by
        ``num_ranks`` (fixed ownership needs E / G experts per rank)."""
        if isinstance(num_ranks, bool) or not isinstance(num_ranks, (int, np.integer)) or num_ranks < 1:
            raise ValueError(f"num_ranks must be a positive integer, got {num_ranks!r}")
        R, E = int(num_ranks), self.num_experts
        if E % R:
            raise ValueError(f"cannot regroup {E} experts over {R} ranks: num_experts must be divisible by "
                             f"num_ranks (divisors of {E}: {[d for d in range(1, E + 1) if E % d == 0]})")
        total = self.counts.sum(2)  # [S, L, E]
        base, rem = np.divmod(total, R)
        offset = (np.arange(R)[:, None] - np.arange(E)[None, :]) % R  # [R, E]: rank r's place in e's order
        out = base[:, :, None, :] + (offset[None, None] < rem[:, :, None, :])
        step = {"op": "regrouped", "num_ranks": R, "num_ranks_before": self.num_ranks,
                "tokens_per_rank_before": self.meta["tokens_per_rank"]}
        tokens = self.meta["tokens_per_rank"] * self.num_ranks / R
        return Trace(out, _with_history(self.meta, step, tokens_per_rank=tokens))


def largest_remainder_rows(total_R, w_RE) -> np.ndarray:
    """Row-wise largest remainder: row r of ``w_RE`` split into ``total_R[r]`` integers in its
    proportions (floors, then one more for the largest fractional parts; ties to the lower column).
    A row with zero weight must have total 0."""
    w = np.asarray(w_RE, dtype=np.int64)
    t = np.asarray(total_R, dtype=np.int64)
    W = w.sum(1)
    bad = (W <= 0) & (t != 0)
    if bad.any():
        r = int(np.flatnonzero(bad)[0])
        raise ValueError(f"cannot split {int(t[r])} over row {r} of zero weights")
    base, rem = np.divmod(w * t[:, None], np.where(W > 0, W, 1)[:, None])
    missing = t - base.sum(1)
    order = np.argsort(-rem, axis=1, kind="stable")
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(w.shape[1])[None, :], axis=1)
    return base + (rank < missing[:, None])


def _to_int(x):
    return int(x) if float(x).is_integer() else float(x)


def _with_history(meta: dict, step: dict, *, tokens_per_rank) -> dict:
    out = dict(meta)
    out["history"] = list(meta.get("history", [])) + [step]
    out["tokens_per_rank"] = _to_int(tokens_per_rank)
    return out


def _checked_meta(meta) -> dict:
    if not isinstance(meta, dict):
        raise ValueError(f"trace meta must be a dict, got {type(meta).__name__}")
    try:
        out = json.loads(json.dumps(meta, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise ValueError(f"trace meta must be JSON-able (str keys; str, number, bool, None, list, dict values): {e}")
    missing = [k for k in ("source", "top_k", "tokens_per_rank") if k not in out]
    if missing:
        raise ValueError(f"trace meta lacks {missing}; it needs 'source' (one of {list(SOURCES)}), 'top_k' "
                         f"(a positive integer) and 'tokens_per_rank' (a positive number)")
    if out["source"] not in SOURCES:
        raise ValueError(f"trace meta 'source' must be one of {list(SOURCES)}, got {out['source']!r}")
    k = out["top_k"]
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"trace meta 'top_k' must be a positive integer, got {k!r}")
    tpr = out["tokens_per_rank"]
    if isinstance(tpr, bool) or not isinstance(tpr, (int, float)) or not tpr > 0:
        raise ValueError(f"trace meta 'tokens_per_rank' must be a positive number, got {tpr!r}")
    return out


# ---------------------------------------------------------------------------------------------- file


def meta_json(meta: dict) -> str:
    """The canonical JSON of ``meta`` stored in the file (sorted keys, no spaces, ASCII)."""
    return json.dumps(meta, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def checksum(counts: np.ndarray, meta_text: str, fmt: str = FORMAT) -> str:
    """SHA-256 (hex) of ``fmt + "\\n" + "S,L,G,E" + "\\n" + meta_text + "\\n"`` (UTF-8) followed by
    the counts as little-endian int64 in C order (docs/simulator.md)."""
    c = np.ascontiguousarray(counts, dtype="<i8")
    h = hashlib.sha256()
    h.update(f"{fmt}\n{','.join(str(n) for n in c.shape)}\n{meta_text}\n".encode())
    h.update(c.tobytes(order="C"))
    return h.hexdigest()


def save_trace(path, trace: Trace) -> Path:
    """Write ``trace`` to ``path`` (one ``.npz`` archive, compressed; docs/simulator.md) atomically."""
    if not isinstance(trace, Trace):
        raise ValueError(f"save_trace needs a Trace, got {type(trace).__name__}")
    text = meta_json(trace.meta)
    arrays = {"format": np.array(FORMAT), "counts": np.ascontiguousarray(trace.counts, dtype="<i8"),
              "meta": np.array(text), "sha256": np.array(checksum(trace.counts, text))}
    return atomic_write(path, lambda f: np.savez_compressed(f, **arrays))


def load_trace(path) -> Trace:
    """The :class:`Trace` in ``path``; :class:`~lrmoe.files.CorruptFileError` naming the file and what
    is wrong (not an .npz archive, truncated, a missing or unknown key, another format version,
    counts not int64 [S, L, G, E], meta not JSON, checksum mismatch); ``FileNotFoundError`` if absent."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such trace file")

    def bad(what):
        return CorruptFileError(f"{path}: not a valid routing trace ({FORMAT}): {what}")

    try:
        z = np.load(path, allow_pickle=False)
    except Exception as e:  # truncated archives, random bytes, pickles
        raise bad(f"cannot be opened as an .npz archive ({type(e).__name__}: {e})") from e
    if not isinstance(z, np.lib.npyio.NpzFile):
        raise bad(f"a single .npy array, not an .npz archive with keys {list(KEYS)}")
    with z:
        keys = sorted(z.files)
        if sorted(KEYS) != keys:
            missing, extra = sorted(set(KEYS) - set(keys)), sorted(set(keys) - set(KEYS))
            raise bad(f"keys {keys}; expected exactly {sorted(KEYS)}" + (f" (missing {missing})" if missing else "")
                      + (f" (unknown {extra})" if extra else ""))
        try:
            arrays = {k: z[k] for k in KEYS}
        except Exception as e:  # a damaged member: bad CRC, truncated deflate stream
            raise bad(f"an archive member cannot be read ({type(e).__name__}: {e})") from e
    strings = {}
    for k in ("format", "meta", "sha256"):
        a = arrays[k]
        if a.ndim != 0 or a.dtype.kind != "U":
            raise bad(f"{k!r} must be a 0-d string array, got dtype {a.dtype} shape {a.shape}")
        strings[k] = str(a)
    if strings["format"] != FORMAT:
        raise bad(f"format {strings['format']!r}; this kit reads {FORMAT!r}")
    counts = arrays["counts"]
    if counts.dtype != np.dtype("<i8") or counts.ndim != 4:
        raise bad(f"'counts' must be int64 [steps, layers, G, E], got dtype {counts.dtype} shape {counts.shape}")
    actual = checksum(counts, strings["meta"])
    if actual != strings["sha256"]:
        raise bad(f"checksum mismatch: stored sha256 {strings['sha256']}, counts and meta give {actual}")
    try:
        meta = json.loads(strings["meta"])
    except json.JSONDecodeError as e:
        raise bad(f"'meta' is not valid JSON ({e})") from e
    try:
        return Trace(counts, meta)
    except ValueError as e:
        raise bad(str(e)) from e


# ---------------------------------------------------------------------------------------------- stats


def trace_stats(trace: Trace, experts_per_rank: int | None = None) -> dict:
    """Load statistics per (step, layer), summarised over all steps and layers.

    ``rank_max_mean``: max/mean of the pairs each rank receives under fixed ownership (expert e on
    rank ``e // experts_per_rank``; default ``E // G``), UltraEP's imbalance metric.
    ``expert_max_mean``: max/mean of the pairs per expert. ``source_max_mean``: max/mean of the
    pairs each source rank routes. ``gini``: Gini coefficient of the pairs per expert (0 equal,
    1 - 1/E all on one). ``drift_tv``: total-variation distance ``0.5 * sum_e |p_t(e) - p_{t-1}(e)|``
    between consecutive steps' expert distributions of a layer (``steps - 1`` values per layer).
    A (step, layer) that routed nothing gives NaN, which the summaries skip.

    Returns ``{"experts_per_rank", "owner_ranks", "steps", "layers", NAME: {"median", "p95", "max"}
    for NAME in STATS, "per_step_layer": {NAME: array [steps, layers] (drift_tv: [steps - 1, layers])}}``.
    """
    S, L, G, E = trace.counts.shape
    epr = E // G if experts_per_rank is None else experts_per_rank
    if isinstance(epr, bool) or not isinstance(epr, (int, np.integer)) or epr < 1 or E % epr:
        raise ValueError(f"experts_per_rank must be a positive divisor of num_experts={E}, got {experts_per_rank!r}"
                         + (f" (E // G = {E // G} does not divide E: pass experts_per_rank)" if experts_per_rank
                            is None else ""))
    epr = int(epr)
    c = trace.counts.astype(np.float64)
    expert = c.sum(2)  # [S, L, E]
    total = expert.sum(-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        per = {"rank_max_mean": _max_mean(expert.reshape(S, L, E // epr, epr).sum(-1)),
               "expert_max_mean": _max_mean(expert),
               "source_max_mean": _max_mean(c.sum(3)),
               "gini": _gini(expert)}
        p = expert / total[..., None]
        per["drift_tv"] = 0.5 * np.abs(np.diff(p, axis=0)).sum(-1)
    out = {"experts_per_rank": epr, "owner_ranks": E // epr, "steps": S, "layers": L}
    for name in STATS:
        out[name] = summary(per[name])
    out["per_step_layer"] = per
    return out


def _max_mean(x: np.ndarray) -> np.ndarray:
    mean = x.mean(-1)
    return np.where(mean > 0, x.max(-1) / np.where(mean > 0, mean, 1), np.nan)


def _gini(x: np.ndarray) -> np.ndarray:
    n = x.shape[-1]
    s = np.sort(x, axis=-1)
    coef = 2.0 * np.arange(1, n + 1) - n - 1
    tot = s.sum(-1)
    return np.where(tot > 0, (s * coef).sum(-1) / (n * np.where(tot > 0, tot, 1)), np.nan)


def summary(values) -> dict:
    """``{"median", "p95", "max"}`` of the finite values (NaN for each if there are none)."""
    v = np.asarray(values, dtype=np.float64).ravel()
    v = v[np.isfinite(v)]
    if not v.size:
        return {"median": float("nan"), "p95": float("nan"), "max": float("nan")}
    return {"median": float(np.median(v)), "p95": float(np.percentile(v, 95)), "max": float(v.max())}
