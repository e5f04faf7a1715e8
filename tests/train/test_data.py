"""Tests for lrmoe.data: Alpaca loading, prompts, label masks, packing, splits, BPE cache."""

import json
import os
import random
import re
import sys
from pathlib import Path

import pytest
import torch

from lrmoe import data
from lrmoe.data import IGNORE_INDEX

SHARED = Path(os.environ.get("LRMOE_SHARED_DATA", Path(__file__).resolve().parents[2].parent / "shared" / "data"))
TINY = SHARED / "alpaca" / "alpaca_tiny.json"
DEMO = SHARED / "alpaca" / "alpaca_en_demo.json"
VOCAB, MERGES = SHARED / "tiny_bpe" / "tiny_bpe_vocab.json", SHARED / "tiny_bpe" / "tiny_bpe_merges.txt"


@pytest.fixture(autouse=True)
def _isolated_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("LRMOE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("HF_DATASETS_CACHE", raising=False)


@pytest.fixture(scope="module")
def shared():
    if not (TINY.exists() and DEMO.exists() and VOCAB.exists()):
        pytest.skip(f"offline Alpaca samples not found at {SHARED} (set LRMOE_SHARED_DATA to the shared/data folder)")
    return SHARED


@pytest.fixture(scope="module")
def tiny_records(shared):
    return json.loads(TINY.read_text())


@pytest.fixture(scope="module")
def tok(shared):
    return data.load_bpe_tokenizer(VOCAB, MERGES)


def _readme_templates():
    text = (SHARED / "README.md").read_text()
    with_input = re.search(r"- with input: `(.*?)`\n", text).group(1).replace("\\n", "\n")
    no_input = re.search(r"- without input: `(.*?)`\n", text).group(1).replace("\\n", "\n")
    return with_input, no_input


# ------------------------------------------------------------------------------ records


def test_prompts_match_readme_templates(tiny_records):
    with_input, no_input = _readme_templates()
    rec_in = random.choice([r for r in tiny_records if r["input"]])
    rec_no = random.choice([r for r in tiny_records if not r["input"]])
    assert data.format_prompt(rec_in) == (with_input.format(**rec_in), rec_in["output"])
    assert data.format_prompt(rec_no) == (no_input.format(**rec_no), rec_no["output"])
    # Stanford's `text` field is prompt + "\n" + output: the prompt text must agree with it.
    for r in (rec_in, rec_no):
        prompt, response = data.format_prompt(r)
        assert r["text"] == prompt + "\n" + response


def test_json_jsonl_and_directory_load(tmp_path, tiny_records):
    recs = random.sample(tiny_records, 17)
    del recs[3]["input"]  # 'input' is optional
    (tmp_path / "a.json").write_text(json.dumps(recs[:9]))
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs[9:]))
    want = [{"instruction": r["instruction"], "input": r.get("input", ""), "output": r["output"]} for r in recs]
    assert data.load_alpaca_records(tmp_path / "a.json") == want[:9]
    assert data.load_alpaca_records(str(tmp_path / "b.jsonl")) == want[9:]
    assert data.load_alpaca_records(tmp_path) == want  # directory: files sorted by name
    assert not (tmp_path / "hf").exists()  # local files are read directly: no Arrow cache anywhere


def test_local_files_load_without_the_datasets_package(tmp_path, tiny_records, monkeypatch):
    """The lent GPU machine has no `datasets` (and no network): local files must not need it."""
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` now raises ImportError
    recs = random.sample(tiny_records, 5)
    (tmp_path / "a.json").write_text(json.dumps(recs))
    assert [r["output"] for r in data.load_alpaca_records(tmp_path / "a.json")] == [r["output"] for r in recs]
    (tmp_path / "b.jsonl").write_text("{not json\n")
    with pytest.raises(ValueError, match="neither a JSON array nor JSON lines"):
        data.load_alpaca_records(tmp_path / "b.jsonl")
    (tmp_path / "bom.json").write_bytes(b"\xef\xbb\xbf" + json.dumps(recs).encode())  # datasets accepted a BOM
    assert len(data.load_alpaca_records(tmp_path / "bom.json")) == len(recs)
    (tmp_path / "c.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="expected a JSON array of record objects"):
        data.load_alpaca_records(tmp_path / "c.json")


def test_env_var_source(monkeypatch, shared):
    monkeypatch.setenv("LRMOE_ALPACA", str(TINY))
    assert len(data.load_alpaca_records()) == 100


def test_bad_records_and_paths(tmp_path, tiny_records):
    recs = [dict(r) for r in random.sample(tiny_records, 8)]
    k = random.randrange(len(recs))
    field = random.choice(["instruction", "output"])
    del recs[k][field]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps(r) + "\n" for r in recs))
    with pytest.raises(ValueError, match=rf"bad\.jsonl.*record {k}\b.*'{field}'"):
        data.load_alpaca_records(bad)
    recs[k][field] = 3
    bad.write_text(json.dumps(recs))
    with pytest.raises(ValueError, match=rf"record {k}\b.*'{field}'.*string"):
        data.load_alpaca_records(bad)
    for missing in (tmp_path / "nope.json", "./no/such/dir", tmp_path / "empty_dir"):
        (tmp_path / "empty_dir").mkdir(exist_ok=True)
        with pytest.raises(FileNotFoundError, match="accepted: .*json.*hub"):
            data.load_alpaca_records(missing)


# ---------------------------------------------------------------------------- tokenise


def test_labels_mask_prompt_only(tok, tiny_records):
    for rec in random.sample(tiny_records, 10):
        prompt, response = data.format_prompt(rec)
        ids, labels = data.tokenize_example(tok, rec)
        n_prompt = len(tok.encode(prompt, add_special_tokens=False))
        assert len(ids) == len(labels) == n_prompt + len(tok.encode(response, add_special_tokens=False)) + 1
        assert labels[:n_prompt] == [IGNORE_INDEX] * n_prompt
        assert labels[n_prompt:] == ids[n_prompt:] and IGNORE_INDEX not in labels[n_prompt:]
        assert ids[-1] == tok.eos_token_id
        cut = random.randint(1, len(ids))
        assert data.tokenize_example(tok, rec, max_len=cut) == (ids[:cut], labels[:cut])


def test_trained_bpe_roundtrip_and_cache(tmp_path, tiny_records, monkeypatch):
    texts = ["".join(data.format_prompt(r)) for r in tiny_records]
    t1 = data.train_bpe_tokenizer(texts, 400, tmp_path)
    files = list(tmp_path.glob("bpe-400-*.json"))
    assert len(files) == 1 and t1.cache_file == str(files[0])
    assert t1.eos_token == t1.pad_token == "<|endoftext|>" and t1.eos_token_id is not None

    rec = random.choice(tiny_records)
    ids, labels = data.tokenize_example(t1, rec)
    n_prompt = labels.count(IGNORE_INDEX)
    assert t1.decode(ids[:n_prompt]) == data.format_prompt(rec)[0]
    assert t1.decode(ids[n_prompt:-1]) == rec["output"] and ids[-1] == t1.eos_token_id

    def no_training(*a, **k):
        raise AssertionError("trained again instead of loading the cache")

    monkeypatch.setattr(data, "_train_bpe", no_training)
    mtime = files[0].stat().st_mtime_ns
    t2 = data.train_bpe_tokenizer(texts, 400, tmp_path)
    assert files[0].stat().st_mtime_ns == mtime and t2.get_vocab() == t1.get_vocab()
    assert data.tokenize_example(t2, rec) == (ids, labels)
    with pytest.raises(AssertionError, match="trained again"):  # other texts: another cache key
        data.train_bpe_tokenizer(texts[1:], 400, tmp_path)


def test_duck_typed_tokenizer():
    class CharTok:  # any object with encode() and eos_token_id
        eos_token_id = 0

        def encode(self, text, add_special_tokens=True):
            return [1 + ord(c) % 97 for c in text]

    rec = {"instruction": "Add.", "input": "", "output": "ok"}
    ids, labels = data.tokenize_example(CharTok(), rec)
    n = len(data.format_prompt(rec)[0])
    assert ids[n:] == [1 + ord("o") % 97, 1 + ord("k") % 97, 0] and labels == [IGNORE_INDEX] * n + ids[n:]


# ------------------------------------------------------------------------------ packing


def _random_examples(n, rng):
    examples = []
    for i in range(n):  # example 0 has no prompt: packing must still mask its first label
        n_prompt, n_resp = (rng.randint(1, 40) if i else 0), rng.randint(1, 40)
        ids = [rng.randrange(1, 1000) for _ in range(n_prompt + n_resp)]
        examples.append((ids, [IGNORE_INDEX] * n_prompt + ids[n_prompt:]))
    return examples


def test_packing_preserves_documents():
    rng = random.Random()
    examples = _random_examples(rng.randint(5, 60), rng)
    seq_len = rng.randint(2, 50)
    p = data.pack_examples(examples, seq_len, seed=rng.randrange(1000), pad_id=-7)
    assert set(p) == {"input_ids", "labels", "position_ids", "doc_ids"}
    assert all(v.dtype == torch.long and v.shape == (p["input_ids"].shape[0], seq_len) for v in p.values())

    # Consecutive rows overlap by one token (the first token of a row repeats the previous row's
    # last, as context with label -100): drop that column of every later row to get the stream.
    rows = p["input_ids"].shape[0]
    for r in range(1, rows):
        assert p["input_ids"][r, 0] == p["input_ids"][r - 1, -1] and p["labels"][r, 0] == IGNORE_INDEX
        assert p["position_ids"][r, 0] == p["position_ids"][r - 1, -1] and p["doc_ids"][r, 0] == p["doc_ids"][r - 1, -1]
    stream = {k: torch.cat([p[k][0]] + [p[k][r, 1:] for r in range(1, rows)]) for k in p}
    ids, labels, pos, doc = (stream[k].tolist() for k in ("input_ids", "labels", "position_ids", "doc_ids"))
    n_real = sum(len(x) for x, _ in examples)
    # only the tail is padded, up to the next row boundary (rows advance by seq_len - 1)
    assert len(ids) - n_real == (-(n_real - 1) % (seq_len - 1) if n_real > 1 else seq_len - 1)
    # every label of the stream is a target of the shifted loss (none sits at a row's first column)
    trained = int((p["labels"][:, 1:] != IGNORE_INDEX).sum())
    assert trained == sum(1 for x in labels if x != IGNORE_INDEX)
    assert data.packed_stats(p)["response_tokens"] == trained and data.packed_stats(p)["tokens"] == n_real
    assert doc[n_real:] == [-1] * (len(ids) - n_real) and ids[n_real:] == [-7] * (len(ids) - n_real)
    assert set(labels[n_real:]) <= {IGNORE_INDEX} and -1 not in doc[:n_real]

    # Reconstruct documents in stream order: each is contiguous, complete and in order.
    order = [d for i, d in enumerate(doc[:n_real]) if i == 0 or doc[i - 1] != d]
    assert sorted(order) == list(range(len(examples)))  # every document exactly once
    at = 0
    for d in order:
        x, y = examples[d]
        assert ids[at : at + len(x)] == x
        assert pos[at : at + len(x)] == list(range(len(x)))  # restarts at each document
        assert labels[at] == IGNORE_INDEX  # never predicted from the previous document
        assert labels[at + 1 : at + len(x)] == y[1:]
        at += len(x)


def test_packing_seed_determinism():
    rng = random.Random()
    examples = _random_examples(40, rng)
    seed = rng.randrange(10**6)
    a, b = data.pack_examples(examples, 32, seed), data.pack_examples(examples, 32, seed)
    c = data.pack_examples(examples, 32, seed + 1)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["doc_ids"], c["doc_ids"])


@pytest.mark.parametrize("kwargs, match", [
    (dict(seq_len=1), "seq_len must be an integer >= 2"),
    (dict(heldout_fraction=1.0), r"heldout_fraction must be in \[0, 1\)"),
    (dict(heldout_fraction=-0.1), r"heldout_fraction must be in \[0, 1\)"),
    (dict(source=[]), "empty dataset"),
])
def test_bad_arguments(kwargs, match):
    args = dict(source=[{"instruction": "a", "input": "", "output": "b"}] * 3, seq_len=8, heldout_fraction=0.0)
    args.update(kwargs)

    class Tok:
        eos_token_id = pad_token_id = 0

        def encode(self, text, add_special_tokens=False):
            return [1] * len(text)

    with pytest.raises(ValueError, match=match):
        data.build_alpaca_splits(args.pop("source"), Tok(), **args)
    with pytest.raises(ValueError, match="no examples"):
        data.pack_examples([], 8, 0)


# ------------------------------------------------------------------------------- splits


def test_splits_deterministic_and_disjoint(tok, shared):
    records = data.load_alpaca_records(DEMO)
    seed, n = random.randrange(1000), random.randint(150, 300)
    train, held, stats = data.build_alpaca_splits(DEMO, tok, 128, 0.1, seed, max_records=n)
    train2, held2, stats2 = data.build_alpaca_splits(DEMO, tok, 128, 0.1, seed, max_records=n)
    assert stats == stats2 and len(train) == stats["train"]["rows"] and len(held) == stats["heldout"]["rows"]
    for a, b in ((train, train2), (held, held2)):
        assert all(torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors)
    assert stats["records"] == n and stats["heldout_records"] >= round(0.1 * n)
    assert stats["train"]["docs"] + stats["heldout"]["docs"] == n and stats["dropped"] == 0

    tr_recs, he_recs = data.split_records(records[:n], 0.1, seed)
    # Disjoint by position and by content: the sample holds duplicated records, and every copy of a
    # held-out record is held out too.
    assert not {id(r) for r in tr_recs} & {id(r) for r in he_recs}
    assert not {json.dumps(r, sort_keys=True) for r in tr_recs} & {json.dumps(r, sort_keys=True) for r in he_recs}
    assert len(tr_recs) + len(he_recs) == n and len(he_recs) == stats["heldout_records"]
    assert data.split_records(records[:n], 0.1, seed + 1)[1] != he_recs

    other, _, _ = data.build_alpaca_splits(DEMO, tok, 128, 0.1, seed + 1, max_records=n)
    assert not torch.equal(other.tensors["input_ids"][:5], train.tensors["input_ids"][:5])

    row = train[random.randrange(len(train))]
    assert set(row) == {"input_ids", "labels", "position_ids", "doc_ids"} and row["input_ids"].shape == (128,)
    batch = next(iter(torch.utils.data.DataLoader(train, batch_size=4)))
    assert batch["labels"].shape == (4, 128)


def test_truncation_is_counted(tok, tiny_records):
    recs = tiny_records[:30]
    longest = max(len(data.tokenize_example(tok, r)[0]) for r in recs)
    cut = longest - 1
    n_long = sum(len(data.tokenize_example(tok, r)[0]) > cut for r in recs)
    _, _, s = data.build_alpaca_splits(recs, tok, 64, 0.0, max_doc_len=cut)
    assert s["truncated"] == n_long >= 1 and s["dropped"] == 0
    # A cut inside a prompt leaves no response token: that document is dropped, and said so.
    cut = max(data.tokenize_example(tok, r)[1].count(IGNORE_INDEX) for r in recs) + 1
    long_prompt = {"instruction": "word " * 2 * cut, "output": "y"}
    _, _, s = data.build_alpaca_splits(recs + [long_prompt], tok, 64, 0.0, max_doc_len=cut)
    assert s["dropped"] == 1 and s["train"]["docs"] == 30
    with pytest.raises(ValueError, match="empty dataset"):
        data.build_alpaca_splits([long_prompt], tok, 64, 0.0, max_doc_len=cut)


def test_prepare_caches_and_loads(tmp_path, shared, monkeypatch):
    out = data.prepare(TINY, "bpe:300", seq_len=64, heldout_fraction=0.1, seed=3, max_records=40)
    assert out.parent == tmp_path / "cache" and out.suffix == ".pt"
    train, held, stats = data.load_prepared(out)
    ref_train, ref_held, ref_stats = data.build_alpaca_splits(TINY, "bpe:300", 64, 0.1, 3, 40, cache_dir=tmp_path)
    assert all(torch.equal(train.tensors[k], ref_train.tensors[k]) for k in ref_train.tensors)
    assert all(torch.equal(held.tensors[k], ref_held.tensors[k]) for k in ref_held.tensors)
    assert stats["train"] == ref_stats["train"] and stats["config"]["seq_len"] == 64
    assert Path(stats["tokenizer_file"]).exists()

    monkeypatch.setattr(data, "build_alpaca_splits", lambda *a, **k: pytest.fail("rebuilt a cached file"))
    assert data.prepare(TINY, "bpe:300", seq_len=64, heldout_fraction=0.1, seed=3, max_records=40) == out
    data.main(["--data", str(TINY), "--tokenizer", "bpe:300", "--seq-len", "64", "--heldout-fraction", "0.1",
               "--seed", "3", "--max-records", "40"])  # same arguments: same cached file, no rebuild


def test_prepare_shows_progress_bars_only_when_asked(tmp_path, shared, capfd, monkeypatch):
    """``progress=False`` (a probe or a pool run with --no-progress) tokenises silently; with
    progress, the bars are drawn on a terminal only (a log gets no redrawn bars)."""
    data.prepare(TINY, "bpe:300", seq_len=64, heldout_fraction=0.1, seed=3, max_records=40, progress=False)
    assert "tokenise" not in capfd.readouterr().err
    data.prepare(TINY, "bpe:300", seq_len=64, heldout_fraction=0.1, seed=4, max_records=40, progress=True)
    assert "tokenise" not in capfd.readouterr().err  # stderr is not a terminal here
    monkeypatch.setattr(data, "is_terminal", lambda: True)
    data.prepare(TINY, "bpe:300", seq_len=64, heldout_fraction=0.1, seed=5, max_records=40, progress=True)
    assert "tokenise train" in capfd.readouterr().err


def test_prepare_cache_follows_the_file_content(tmp_path, shared):
    """A data file edited (or replaced) at the same path gets a new cache file, not the stale one."""
    src = tmp_path / "alpaca.json"
    records = json.loads(TINY.read_text())
    src.write_text(json.dumps(records[:30]))
    first = data.prepare(src, "bpe:300", seq_len=64, heldout_fraction=0.1, seed=3)
    assert data.prepare(src, "bpe:300", seq_len=64, heldout_fraction=0.1, seed=3) == first
    src.write_text(json.dumps(records[5:35]))
    second = data.prepare(src, "bpe:300", seq_len=64, heldout_fraction=0.1, seed=3)
    assert second != first
    a, b = data.load_prepared(first)[0], data.load_prepared(second)[0]
    assert not torch.equal(a.tensors["input_ids"], b.tensors["input_ids"])
    assert data.source_fingerprint("tatsu-lab/alpaca") is None  # a hub id: the hub's cache decides
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "a.json").write_text("[]")
    fp = data.source_fingerprint(str(folder))
    (folder / "a.json").write_text("[ ]")
    assert data.source_fingerprint(str(folder)) != fp


def test_prepare_refuses_a_named_file_built_otherwise(shared, tmp_path):
    out = tmp_path / "x.pt"
    data.prepare(str(TINY), "bpe:300", 64, out=out)
    assert data.load_prepared(out)[2]["config"]["seq_len"] == 64
    assert data.prepare(str(TINY), "bpe:300", 64, out=out) == out  # same arguments: reused
    with pytest.raises(ValueError, match="seq_len differ"):
        data.prepare(str(TINY), "bpe:300", 128, out=out)
    data.prepare(str(TINY), "bpe:300", 128, out=out, overwrite=True)
    assert data.load_prepared(out)[2]["config"]["seq_len"] == 128
