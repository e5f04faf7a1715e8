"""Routing traces: validation, scaled()/regrouped() against plain loops, the file format (roundtrip
and every corruption case named), trace_stats on a hand-computed case."""
import hashlib
import json
import zipfile

import numpy as np
import pytest

from lrmoe.files import CorruptFileError
from lrmoe.sim.trace import FORMAT, Trace, checksum, load_trace, meta_json, save_trace, trace_stats

META = {"source": "synthetic", "top_k": 2, "tokens_per_rank": 10}


def random_trace(rng, shape=(3, 2, 4, 6), zero_rows=True, high=40):
    c = rng.integers(0, high, shape)
    if zero_rows:
        c[rng.random(shape[:3]) < 0.3] = 0  # ranks that routed nothing in some (step, layer)
        c[..., rng.integers(shape[3])] = 0  # an expert nobody picked
    return Trace(c, dict(META, seed=int(rng.integers(1 << 30))))


# ------------------------------------------------------------------------------------- validation


def test_trace_validates_and_copies():
    c = np.ones((1, 2, 3, 4), dtype=np.int32)
    t = Trace(c, META)
    assert t.counts.dtype == np.int64 and (t.steps, t.layers, t.num_ranks, t.num_experts) == (1, 2, 3, 4)
    c[0, 0, 0, 0] = 99
    assert t.counts[0, 0, 0, 0] == 1  # a copy
    with pytest.raises(ValueError):
        t.counts[0, 0, 0, 0] = 5  # read-only
    for counts, what in [(np.ones((2, 3, 4), int), "4-D"), (np.ones((1, 1, 2, 2)) * 0.5, "integer"),
                         (np.ones((1, 1, 2, 2), dtype=bool), "integer"), (-np.ones((1, 1, 2, 2), int), "non-negative"),
                         (np.ones((0, 1, 2, 2), int), "at least one")]:
        with pytest.raises(ValueError, match=what):
            Trace(counts, META)
    for meta, what in [({"top_k": 2, "tokens_per_rank": 1}, "source"), (dict(META, source="guess"), "one of"),
                       (dict(META, top_k=0), "top_k"), (dict(META, tokens_per_rank=-1), "tokens_per_rank"),
                       (dict(META, extra=object()), "JSON-able"), ([1], "dict")]:
        with pytest.raises(ValueError, match=what):
            Trace(np.ones((1, 1, 2, 2), int), meta)


# ------------------------------------------------------------------------------------- scaled


def scaled_loop(counts, t):
    """Plain-loop largest remainder per (step, layer, rank) row."""
    out = np.zeros_like(counts)
    S, L, G, E = counts.shape
    for s in range(S):
        for layer in range(L):
            for g in range(G):
                w = [int(x) for x in counts[s, layer, g]]
                W = sum(w)
                if W == 0:
                    continue
                floors = [x * t // W for x in w]
                rems = [x * t % W for x in w]
                left = t - sum(floors)
                # largest remainders first, ties to the lower expert index
                for e in sorted(range(E), key=lambda e: (-rems[e], e))[:left]:
                    floors[e] += 1
                out[s, layer, g] = floors
    return out


@pytest.mark.parametrize("shape", [(3, 2, 4, 6), (1, 1, 1, 1), (2, 3, 5, 7), (1, 2, 3, 1)])
@pytest.mark.parametrize("pairs", [1, 13, 1000, 262144])
def test_scaled_equals_loop(rng_seed, shape, pairs):
    rng = np.random.default_rng(rng_seed)
    t = random_trace(rng, shape)
    s = t.scaled(pairs)
    np.testing.assert_array_equal(s.counts, scaled_loop(t.counts, pairs))
    rows = t.counts.sum(-1)
    np.testing.assert_array_equal(s.counts.sum(-1), np.where(rows > 0, pairs, 0))  # exact totals, zero rows stay
    # proportions: each entry within one pair of its exact share
    exact = t.counts * pairs / np.where(rows > 0, rows, 1)[..., None]
    assert np.all(np.abs(s.counts - exact) < 1)
    assert s.meta["tokens_per_rank"] == pairs / t.top_k and s.meta["history"][-1]["op"] == "scaled"
    assert s.meta["history"][-1]["tokens_per_rank_before"] == t.meta["tokens_per_rank"]


def test_scaled_keeps_a_trace_at_its_own_scale(rng_seed):
    rng = np.random.default_rng(rng_seed)
    c = rng.multinomial(100, np.full(8, 1 / 8), size=(2, 3, 4))
    t = Trace(c, META)
    np.testing.assert_array_equal(t.scaled(100).counts, c)
    with pytest.raises(ValueError, match="positive integer"):
        t.scaled(0)
    with pytest.raises(ValueError, match="positive integer"):
        t.scaled(2.5)


# ------------------------------------------------------------------------------------- regrouped


@pytest.mark.parametrize("R", [1, 2, 3, 6, 12])
def test_regrouped_keeps_expert_totals(rng_seed, R):
    rng = np.random.default_rng(rng_seed)
    t = random_trace(rng, (3, 2, 4, 12))
    r = t.regrouped(R)
    assert r.counts.shape == (3, 2, R, 12)
    np.testing.assert_array_equal(r.counts.sum(2), t.counts.sum(2))
    # even: every rank within one pair of total / R, per expert; leftovers go to ranks e, e+1, ... (mod R)
    total = t.counts.sum(2)
    for e in range(12):
        for g in range(R):
            extra = ((g - e) % R) < total[..., e] % R
            np.testing.assert_array_equal(r.counts[:, :, g, e], total[..., e] // R + extra)
    assert r.meta["tokens_per_rank"] == t.meta["tokens_per_rank"] * 4 / R
    assert r.meta["history"][-1] == {"op": "regrouped", "num_ranks": R, "num_ranks_before": 4,
                                     "tokens_per_rank_before": 10}


def test_regrouped_needs_divisible_experts():
    t = Trace(np.ones((1, 1, 2, 12), int), META)
    with pytest.raises(ValueError, match="divisible"):
        t.regrouped(5)
    with pytest.raises(ValueError, match="positive integer"):
        t.regrouped(0)


# ------------------------------------------------------------------------------------- file format


def test_roundtrip(tmp_path, rng_seed):
    t = random_trace(np.random.default_rng(rng_seed)).scaled(77)
    p = save_trace(tmp_path / "sub" / "t.npz", t)
    back = load_trace(p)
    assert back == t and back.meta == t.meta and back.counts.dtype == np.int64
    assert [f.name for f in (tmp_path / "sub").iterdir()] == ["t.npz"]  # no temporary file left behind


def test_file_holds_the_documented_keys(tmp_path):
    t = Trace(np.arange(24).reshape(1, 2, 3, 4), META)
    p = save_trace(tmp_path / "t.npz", t)
    with np.load(p, allow_pickle=False) as z:
        assert sorted(z.files) == ["counts", "format", "meta", "sha256"]
        assert str(z["format"]) == FORMAT and z["counts"].dtype == np.dtype("<i8")
        assert json.loads(str(z["meta"])) == t.meta
        text = str(z["meta"])
    # the checksum definition of docs/simulator.md, written out here independently
    h = hashlib.sha256((FORMAT + "\n" + "1,2,3,4" + "\n" + text + "\n").encode())
    h.update(np.arange(24, dtype="<i8").tobytes())
    assert checksum(t.counts, text) == h.hexdigest()
    with np.load(p, allow_pickle=False) as z:
        assert str(z["sha256"]) == h.hexdigest()


def write_npz(path, **arrays):
    with open(path, "wb") as f:
        np.savez(f, **arrays)
    return path


def good_arrays(t):
    text = meta_json(t.meta)
    return {"format": np.array(FORMAT), "counts": t.counts, "meta": np.array(text),
            "sha256": np.array(checksum(t.counts, text))}


def corruptions(t):
    a = good_arrays(t)
    tampered = t.counts.copy()
    tampered[0, 0, 0, 0] += 1
    other_meta = meta_json(dict(t.meta, seed=123))
    yield "missing", {k: v for k, v in a.items() if k != "sha256"}
    yield "unknown", dict(a, extra=np.array(1))
    yield "format", dict(a, format=np.array("lrmoe-trace/2"))
    yield "checksum mismatch", dict(a, counts=tampered)
    yield "checksum mismatch", dict(a, meta=np.array(other_meta))
    yield "int64", dict(a, counts=t.counts.astype(np.int32))
    yield "int64", dict(a, counts=t.counts[0])
    yield "0-d string", dict(a, meta=np.array([1, 2]))
    bad_text = "{not json"
    yield "not valid JSON", dict(a, meta=np.array(bad_text), sha256=np.array(checksum(t.counts, bad_text)))
    no_source = meta_json({"top_k": 2, "tokens_per_rank": 1})
    yield "source", dict(a, meta=np.array(no_source), sha256=np.array(checksum(t.counts, no_source)))


def test_every_corruption_names_the_file(tmp_path):
    t = Trace(np.arange(24).reshape(1, 2, 3, 4), META)
    cases = list(corruptions(t))
    assert len(cases) == 10
    for i, (what, arrays) in enumerate(cases):
        p = write_npz(tmp_path / f"bad{i}.npz", **arrays)
        with pytest.raises(CorruptFileError, match=what) as info:
            load_trace(p)
        assert str(p) in str(info.value)


def test_damaged_bytes_name_the_file(tmp_path):
    t = Trace(np.random.default_rng(0).integers(0, 1000, (4, 3, 8, 16)), META)
    good = save_trace(tmp_path / "good.npz", t).read_bytes()
    cases = {"truncated": good[: len(good) // 2], "empty": b"", "random": bytes(range(256)) * 4,
             "one byte short": good[:-1]}
    # a flipped byte inside the compressed counts: the archive's CRC (or the deflate stream) catches it
    with zipfile.ZipFile(tmp_path / "good.npz") as z:
        info = z.getinfo("counts.npy")
    flipped = bytearray(good)
    flipped[info.header_offset + 30 + len(info.filename) + info.compress_size // 2] ^= 0xFF
    cases["flipped"] = bytes(flipped)
    for name, data in cases.items():
        p = tmp_path / f"{name.replace(' ', '_')}.npz"
        p.write_bytes(data)
        with pytest.raises(CorruptFileError) as e:
            load_trace(p)
        assert str(p) in str(e.value), name
    np.save(tmp_path / "plain.npy", t.counts)
    with pytest.raises(CorruptFileError, match="npy"):
        load_trace(tmp_path / "plain.npy")
    with pytest.raises(FileNotFoundError, match="absent"):
        load_trace(tmp_path / "absent.npz")


# ------------------------------------------------------------------------------------- stats


def test_trace_stats_hand_computed():
    # 2 steps, 1 layer, 2 source ranks, 4 experts (2 per rank under fixed ownership)
    c = np.array([[[[4, 0, 2, 2],
                    [2, 2, 0, 0]]],
                  [[[1, 1, 1, 1],
                    [1, 1, 1, 1]]]])
    s = trace_stats(Trace(c, META))
    per = s["per_step_layer"]
    # step 0: experts 6, 2, 2, 2 (total 12, mean 3); owners 8, 4 (mean 6); sources 8, 4
    # step 1: experts 2, 2, 2, 2; owners 4, 4; sources 4, 4
    np.testing.assert_allclose(per["rank_max_mean"][:, 0], [8 / 6, 1.0])
    np.testing.assert_allclose(per["expert_max_mean"][:, 0], [6 / 3, 1.0])
    np.testing.assert_allclose(per["source_max_mean"][:, 0], [8 / 6, 1.0])
    # Gini = sum_ij |x_i - x_j| / (2 n^2 mean): step 0 pairs |6-2| six ordered times -> 24 / (2*16*3)
    np.testing.assert_allclose(per["gini"][:, 0], [24 / 96, 0.0])
    # TV between (1/2, 1/6, 1/6, 1/6) and (1/4, ...): 0.5 * (1/4 + 3 * 1/12)
    np.testing.assert_allclose(per["drift_tv"][:, 0], [0.25])
    assert s["rank_max_mean"] == {"median": pytest.approx((8 / 6 + 1) / 2), "p95": pytest.approx(1 + 0.95 / 3),
                                  "max": pytest.approx(8 / 6)}
    assert (s["experts_per_rank"], s["owner_ranks"]) == (2, 2)
    # experts_per_rank=1: every expert its own owner -> rank max/mean equals expert max/mean
    s1 = trace_stats(Trace(c, META), experts_per_rank=1)
    np.testing.assert_allclose(s1["per_step_layer"]["rank_max_mean"], per["expert_max_mean"])
    with pytest.raises(ValueError, match="divisor"):
        trace_stats(Trace(c, META), experts_per_rank=3)


def test_trace_stats_skips_empty_steps():
    c = np.zeros((3, 1, 2, 4), int)
    c[1] = 1
    s = trace_stats(Trace(c, META))
    assert np.isnan(s["per_step_layer"]["rank_max_mean"][[0, 2], 0]).all()
    assert s["rank_max_mean"]["median"] == 1.0 and s["gini"]["max"] == 0.0
    assert np.isnan(s["drift_tv"]["median"])  # no two consecutive steps both routed something
