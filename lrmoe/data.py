"""Alpaca instruction data: loading, prompting, tokenisation and packing.

Pipeline (each step is a plain function, usable on its own):

    records = load_alpaca_records(source)              # hub id, .json/.jsonl file or directory
    prompt, response = format_prompt(record)          # the standard Stanford Alpaca prompt
    ids, labels = tokenize_example(tok, record)       # loss on the response (+ EOS) only
    packed = pack_examples(examples, seq_len, seed)   # fixed-length rows, seeded shuffle

`build_alpaca_splits` runs all of it with a seeded held-out split by record, and
`prepare` (also `python -m lrmoe.data`) caches the result as a `.pt` file under `data/cache/`.

Conventions
-----------
* Labels follow the Hugging Face causal-LM convention: `labels` are aligned with `input_ids`
  and the model shifts them internally (logits at t predict labels at t + 1). A label is -100
  (ignored) on every prompt token, and equals the input id on response tokens and the EOS.
* Packing concatenates the shuffled documents into one token stream and cuts it into rows of
  exactly `seq_len` tokens, so a document may continue from one row into the next. Consecutive
  rows overlap by one token: a row after the first starts with the previous row's last token,
  as context only (label -100: it was that row's target), because the label at a row's first
  position is never trained (logits at t predict labels at t + 1). So every response token and
  EOS is a target exactly once; rows advance by `seq_len - 1` tokens.
* Document boundaries: `position_ids` restart at 0 at the first token of every document (a
  document continued into the next row keeps counting), and `doc_ids` holds, for every token,
  the index of its record in the list given to `pack_examples` (-1 on padding). The label of
  the first token of every document is forced to -100, so the last token of one document
  (its EOS) is never trained to predict the next document; since documents start with their
  prompt this label is -100 anyway. Attention is not masked here: a model that must not attend
  across documents builds a block-causal mask from `doc_ids`, e.g.
  `(doc[:, :, None] == doc[:, None, :]) & causal`, or passes `position_ids` to a varlen kernel.
* Tail: the last, incomplete row is padded with the tokenizer's pad id (label -100, doc id -1,
  position ids 0, 1, ...). Padding only ever sits at the end of the last row, so causal
  attention never lets a real token see it. No document is dropped by packing; documents are
  only cut when `max_doc_len` is set (counted as `truncated`, and as `dropped` when no response
  token survives the cut).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
from pathlib import Path

import torch
from torch.utils.data import Dataset
from tqdm import tqdm

from .console import is_terminal
from .files import atomic_write, write_text

IGNORE_INDEX = -100
EOS_TOKEN = "<|endoftext|>"
DEFAULT_HUB_ID = "tatsu-lab/alpaca"
REPO_ROOT = Path(__file__).resolve().parents[1]

PROMPT_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further "
    "context. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:"
)
PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:"
)

_ACCEPTED = (
    "accepted: a .json/.jsonl file of Alpaca records, a directory holding such files, "
    f"or a Hugging Face hub dataset id such as {DEFAULT_HUB_ID!r}"
)


def shared_data_dir() -> Path:
    """The offline sample data folder (`../shared/data`, or env `LRMOE_SHARED_DATA`)."""
    return Path(os.environ.get("LRMOE_SHARED_DATA", REPO_ROOT.parent / "shared" / "data"))


def default_cache_dir() -> Path:
    """Where tokenizers and packed datasets are cached (`data/cache`, or env `LRMOE_CACHE`)."""
    return Path(os.environ.get("LRMOE_CACHE", REPO_ROOT / "data" / "cache"))


# ----------------------------------------------------------------------------- records


def _datasets_cache_dir() -> str | None:
    # `datasets` reads HF_HOME once, at import; read it at call time so callers (and tests) can
    # redirect the Arrow cache by setting the environment variable.
    if "HF_DATASETS_CACHE" in os.environ:
        return os.environ["HF_DATASETS_CACHE"]
    if "HF_HOME" in os.environ:
        return str(Path(os.environ["HF_HOME"]) / "datasets")
    return None


def _validate(rows, name: str) -> list[dict]:
    records = []
    for i, row in enumerate(rows):
        for field in ("instruction", "output", "input"):
            value = row.get(field)
            if value is None and field != "input":
                raise ValueError(
                    f"{name}: record {i} is missing the required field {field!r} "
                    "(Alpaca records need 'instruction' and 'output'; 'input' is optional)"
                )
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name}: record {i} field {field!r} must be a string, got {type(value).__name__}")
        records.append({"instruction": row["instruction"], "input": row.get("input") or "", "output": row["output"]})
    return records


def load_alpaca_records(source: str | os.PathLike | None = None) -> list[dict]:
    """Load Alpaca records as dicts with `instruction`, `input` ('' when absent) and `output`.

    `source` is a local .json/.jsonl file, a directory (all its *.json and *.jsonl files, sorted
    by name) or a hub dataset id; default: env `LRMOE_ALPACA`, else `tatsu-lab/alpaca`.
    Local files are read with the standard library (a JSON array of records, or JSON lines), so
    they need no `datasets` package (machines without network often lack it); hub ids go through
    `datasets.load_dataset`, whose Arrow cache honours `HF_HOME` / `HF_DATASETS_CACHE` at call time.
    """
    source = str(source or os.environ.get("LRMOE_ALPACA") or DEFAULT_HUB_ID)
    path = Path(source).expanduser()

    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in (".json", ".jsonl"))
        if not files:
            raise FileNotFoundError(f"no .json/.jsonl files in directory {source!r}; {_ACCEPTED}")
    elif path.is_file():
        if path.suffix not in (".json", ".jsonl"):
            raise ValueError(f"{source!r} is not a .json/.jsonl file; {_ACCEPTED}")
        files = [path]
    else:
        # Anything that looks like a path rather than "owner/name" is reported as missing.
        if path.suffix in (".json", ".jsonl") or not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", source):
            raise FileNotFoundError(f"no such file or directory: {source!r}; {_ACCEPTED}")
        try:
            from datasets import load_dataset

            rows = load_dataset(source, split="train", cache_dir=_datasets_cache_dir())
        except Exception as e:  # offline, unknown id, ...: say what was tried and what is accepted
            raise FileNotFoundError(
                f"{source!r} is not a local file or directory and loading it from the hub failed "
                f"({type(e).__name__}: {e}); {_ACCEPTED}"
            ) from e
        return _validate(rows, source)

    records = []
    for f in files:
        records += _validate(_read_json_records(f), str(f))
    return records


def _read_json_records(path: Path) -> list:
    """The records of a local .json/.jsonl file: a JSON array of objects, or one object per line."""
    text = path.read_text(encoding="utf-8-sig")  # a UTF-8 byte-order mark is allowed, as datasets allows it
    try:  # either form in either suffix, as datasets' json loader reads them
        rows = json.loads(text) if text.strip() else []
        if isinstance(rows, dict):
            rows = [rows]
    except json.JSONDecodeError:
        try:
            rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: neither a JSON array nor JSON lines ({e}); {_ACCEPTED}") from None
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ValueError(f"{path}: expected a JSON array of record objects (or JSON lines, one object per line); "
                         f"{_ACCEPTED}")
    return rows


def format_prompt(record: dict) -> tuple[str, str]:
    """The standard Stanford Alpaca prompt and the response text (the output; EOS comes later).

    As in Stanford Alpaca's `train.py`, prompt and response are joined with no separator, and
    they are tokenised separately, so no token straddles the prompt/response boundary.
    """
    template = PROMPT_WITH_INPUT if record.get("input") else PROMPT_NO_INPUT
    return template.format(instruction=record["instruction"], input=record.get("input", "")), record["output"]


# -------------------------------------------------------------------------- tokenizers


def _ensure_eos(tokenizer):
    if tokenizer.eos_token_id is None:
        tokenizer.add_special_tokens({"eos_token": EOS_TOKEN})
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_bpe_tokenizer(vocab_file: str | os.PathLike, merges_file: str | os.PathLike):
    """A byte-level BPE (GPT-2/Qwen2 format `vocab.json` + `merges.txt`) as a `Qwen2Tokenizer`.

    `<|endoftext|>` is added as EOS (and pad) when the vocabulary lacks one. (transformers 5
    ignores `vocab_file=`/`merges_file=` keywords, so the files are read here.)
    """
    from transformers import Qwen2Tokenizer

    vocab = json.loads(Path(vocab_file).read_text(encoding="utf-8"))
    merges = []
    for line in Path(merges_file).read_text(encoding="utf-8").splitlines():
        if line and not line.startswith("#version"):
            a, b = line.split(" ")
            merges.append((a, b))
    return _ensure_eos(Qwen2Tokenizer(vocab=vocab, merges=merges, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN))


def _train_bpe(texts: list[str], vocab_size: int, progress: bool = False):
    """Train a byte-level BPE (GPT-2 pre-tokenisation) with `<|endoftext|>` as token 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=progress,
    )
    tok.train_from_iterator(texts, trainer, length=len(texts))
    return tok


def train_bpe_tokenizer(texts, vocab_size: int, cache_dir: str | os.PathLike | None = None, progress: bool = False):
    """Train (or load from cache) a byte-level BPE on `texts`; EOS = pad = `<|endoftext|>`.

    The trained tokenizer is saved as `<cache_dir>/bpe-<vocab_size>-<hash of texts>.json`
    (default cache dir: `data/cache/tokenizers`); a later call with the same texts and size loads
    that file instead of training. Returns a transformers fast tokenizer.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 257:
        raise ValueError(f"vocab_size must be >= 257 (256 byte tokens + EOS), got {vocab_size}")
    texts = list(texts)
    digest = hashlib.sha256()
    for t in texts:
        digest.update(t.encode("utf-8") + b"\0")
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir() / "tokenizers"
    path = cache_dir / f"bpe-{vocab_size}-{digest.hexdigest()[:16]}.json"
    if path.exists():
        tok = Tokenizer.from_file(str(path))
    else:
        tok = _train_bpe(texts, vocab_size, progress)
        write_text(path, tok.to_str(pretty=True))  # atomic: a concurrent reader sees the whole file or none
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN)
    tokenizer.cache_file = str(path)
    return tokenizer


def get_tokenizer(spec, texts=None, cache_dir: str | os.PathLike | None = None):
    """Resolve a tokenizer: an object is returned as is (it needs `encode` and `eos_token_id`);
    `"bpe:N"` trains/loads a byte-level BPE of N tokens on `texts`; `"VOCAB.json,MERGES.txt"`
    loads that BPE; any other string goes to `transformers.AutoTokenizer.from_pretrained`.
    """
    if not isinstance(spec, str):
        return spec
    if spec.startswith("bpe:"):
        if texts is None:
            raise ValueError(f"tokenizer {spec!r} is trained on texts, but none were given")
        return train_bpe_tokenizer(texts, int(spec[4:]), cache_dir)
    if "," in spec:
        return load_bpe_tokenizer(*spec.split(",", 1))
    from transformers import AutoTokenizer

    return _ensure_eos(AutoTokenizer.from_pretrained(spec))


def _encode(tokenizer, text: str) -> list[int]:
    if hasattr(tokenizer, "encode"):
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def tokenize_example(tokenizer, record: dict, max_len: int | None = None) -> tuple[list[int], list[int]]:
    """Token ids of prompt + response + EOS, and labels: -100 on the prompt, the ids elsewhere.

    With `max_len`, both lists are cut to their first `max_len` tokens (the end is lost).
    """
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("tokenizer has no eos_token_id; set one (e.g. add '<|endoftext|>')")
    prompt, response = format_prompt(record)
    p, r = _encode(tokenizer, prompt), _encode(tokenizer, response) + [eos]
    ids, labels = p + r, [IGNORE_INDEX] * len(p) + r
    if max_len is not None:
        ids, labels = ids[:max_len], labels[:max_len]
    return ids, labels


# ----------------------------------------------------------------------------- packing


def _check_seq_len(seq_len):
    if not isinstance(seq_len, int) or seq_len < 2:
        raise ValueError(f"seq_len must be an integer >= 2, got {seq_len!r}")


def pack_examples(examples, seq_len: int, seed: int = 0, pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Shuffle `examples` ((ids, labels) pairs) with `seed` and pack them into rows of `seq_len`.

    Returns int64 tensors `input_ids`, `labels`, `position_ids` and `doc_ids`, each
    [rows, seq_len]; see the module docstring for the boundary and padding conventions.
    """
    _check_seq_len(seq_len)
    if len(examples) == 0:
        raise ValueError("no examples to pack (need at least one tokenised document)")
    if any(len(ids) == 0 or len(ids) != len(labels) for ids, labels in examples):
        raise ValueError("every example needs >= 1 token and as many labels as ids")
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(examples), generator=g)
    docs = [examples[i] for i in order.tolist()]
    ids = torch.cat([torch.as_tensor(x, dtype=torch.long) for x, _ in docs])
    labels = torch.cat([torch.as_tensor(y, dtype=torch.long) for _, y in docs])
    lengths = torch.tensor([len(x) for x, _ in docs])
    starts = torch.cumsum(lengths, 0) - lengths
    labels[starts] = IGNORE_INDEX  # never predict a document's first token from the one before
    positions = torch.arange(len(ids)) - torch.repeat_interleave(starts, lengths)
    doc_ids = torch.repeat_interleave(order, lengths)

    # Rows of seq_len tokens advancing by seq_len - 1: row r covers stream positions
    # [r (L - 1), r (L - 1) + L), so its first token repeats the previous row's last one.
    stride = seq_len - 1
    n_rows = max(1, -(-(len(ids) - 1) // stride))
    pad = n_rows * stride + 1 - len(ids)
    stream = {
        "input_ids": torch.cat([ids, torch.full((pad,), pad_id)]),
        "labels": torch.cat([labels, torch.full((pad,), IGNORE_INDEX)]),
        "position_ids": torch.cat([positions, torch.arange(pad)]),
        "doc_ids": torch.cat([doc_ids, torch.full((pad,), -1)]),
    }
    index = torch.arange(n_rows).unsqueeze(1) * stride + torch.arange(seq_len)
    out = {k: v[index] for k, v in stream.items()}
    out["labels"][1:, 0] = IGNORE_INDEX  # context only: the previous row already trains it
    return out


def _empty_packed(seq_len: int) -> dict[str, torch.Tensor]:
    keys = ("input_ids", "labels", "position_ids", "doc_ids")
    return {k: torch.zeros(0, seq_len, dtype=torch.long) for k in keys}


def packed_stats(packed: dict[str, torch.Tensor]) -> dict[str, int]:
    """Counts for a packed set: rows, documents, real tokens (the one-token overlap of consecutive
    rows counted once), trained response tokens (labels a model's shifted loss reaches), padding."""
    real = packed["doc_ids"] >= 0
    overlap = int(real[1:, 0].sum()) if real.shape[0] > 1 else 0
    return {
        "rows": packed["input_ids"].shape[0],
        "docs": int(packed["doc_ids"][real].unique().numel()),
        "tokens": int(real.sum()) - overlap,
        "response_tokens": int((packed["labels"][:, 1:] != IGNORE_INDEX).sum()),
        "pad_tokens": int((~real).sum()),
    }


class AlpacaDataset(Dataset):
    """Packed rows as a map-style dataset of dicts {input_ids, labels, position_ids, doc_ids}."""

    def __init__(self, packed: dict[str, torch.Tensor], tokenizer=None):
        self.tensors = packed
        self.tokenizer = tokenizer

    def __len__(self):
        return self.tensors["input_ids"].shape[0]

    def __getitem__(self, i):
        return {k: v[i] for k, v in self.tensors.items()}


# ------------------------------------------------------------------------------ splits


def split_records(records: list, heldout_fraction: float = 0.05, seed: int = 0) -> tuple[list, list]:
    """Seeded split by record: (train, held-out), each in the original order.

    The held-out share is round(n * fraction) records drawn by the seed, at least 1 when the
    fraction is > 0, plus every exact copy of a drawn record (a duplicated record in both splits
    would put training data into the held-out loss; Alpaca samples do hold duplicates).
    """
    if not 0 <= heldout_fraction < 1:
        raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction!r}")
    n = len(records)
    if n == 0:
        raise ValueError("empty dataset: need at least one Alpaca record")
    n_held = max(1, round(n * heldout_fraction)) if heldout_fraction > 0 else 0
    if n_held >= n:
        raise ValueError(f"heldout_fraction={heldout_fraction} leaves no training record out of {n}")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    held = set(perm[:n_held].tolist())
    if held:
        keys = [json.dumps(r, sort_keys=True) for r in records]
        drawn = {keys[i] for i in held}
        held |= {i for i, k in enumerate(keys) if k in drawn}
        if len(held) >= n:
            raise ValueError(f"heldout_fraction={heldout_fraction} leaves no training record out of {n} "
                             "(the held-out records and their copies are all of them)")
    return [r for i, r in enumerate(records) if i not in held], [r for i, r in enumerate(records) if i in held]


def build_alpaca_splits(
    source,
    tokenizer,
    seq_len: int,
    heldout_fraction: float = 0.05,
    seed: int = 0,
    max_records: int | None = None,
    *,
    max_doc_len: int | None = None,
    cache_dir: str | os.PathLike | None = None,
    progress: bool = False,
) -> tuple[AlpacaDataset, AlpacaDataset, dict]:
    """Load, split (by record), tokenise and pack Alpaca: returns (train, held-out, stats).

    `source`: as for `load_alpaca_records`, or a list of records. `tokenizer`: an object or a
    spec for `get_tokenizer` (a `"bpe:N"` tokenizer is trained on the training split only).
    `max_records` keeps the first records in file order, before the split. The same seed gives
    identical tensors; the seed drives both the split and the shuffle before packing.
    """
    _check_seq_len(seq_len)
    records = source if isinstance(source, list) else load_alpaca_records(source)
    if max_records is not None:
        records = records[:max_records]
    train_recs, held_recs = split_records(records, heldout_fraction, seed)
    tokenizer = get_tokenizer(tokenizer, [p + r for p, r in map(format_prompt, train_recs)], cache_dir)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    stats = {"records": len(records), "train_records": len(train_recs), "heldout_records": len(held_recs),
             "truncated": 0, "dropped": 0}
    splits = {}
    for name, recs in (("train", train_recs), ("heldout", held_recs)):
        examples = []
        for rec in tqdm(recs, desc=f"tokenise {name}", disable=not (progress and is_terminal())):  # no bar in logs
            ids, labels = tokenize_example(tokenizer, rec)
            if max_doc_len is not None and len(ids) > max_doc_len:
                ids, labels = ids[:max_doc_len], labels[:max_doc_len]
                stats["truncated"] += 1
            if all(y == IGNORE_INDEX for y in labels):
                stats["dropped"] += 1  # the cut left no response token: nothing to learn from
                continue
            examples.append((ids, labels))
        if name == "train" and not examples:
            raise ValueError("empty dataset: no training document left after truncation")
        splits[name] = pack_examples(examples, seq_len, seed, pad_id) if examples else _empty_packed(seq_len)
        stats[name] = packed_stats(splits[name])

    stats.update(
        tokens=stats["train"]["tokens"] + stats["heldout"]["tokens"],
        response_tokens=stats["train"]["response_tokens"] + stats["heldout"]["response_tokens"],
        rows=stats["train"]["rows"] + stats["heldout"]["rows"],
        seq_len=seq_len, seed=seed, heldout_fraction=heldout_fraction,
        vocab_size=len(tokenizer), eos_id=tokenizer.eos_token_id, pad_id=pad_id,
    )
    return AlpacaDataset(splits["train"], tokenizer), AlpacaDataset(splits["heldout"], tokenizer), stats


# ----------------------------------------------------------------------------- caching


# Version of the tokenised/packed layout: part of the cache key, bumped whenever the data code
# changes what it writes (2: rows overlap by one token; 3: copies of held-out records are held
# out too), so no stale cache outlives a fix.
PACKED_FORMAT = 3


def source_fingerprint(source: str) -> str | None:
    """sha256 of a local data file's content (of every file's relative name, size and content
    under a local directory); None for a hub id (the hub's own cache is keyed by revision)."""
    path = Path(source)
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file())
    else:
        return None
    digest = hashlib.sha256()
    for f in files:
        digest.update(f"{f.relative_to(path) if path.is_dir() else ''}\0{f.stat().st_size}\0".encode())
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def prepare(
    source=None,
    tokenizer: str = "bpe:4096",
    seq_len: int = 512,
    heldout_fraction: float = 0.05,
    seed: int = 0,
    max_records: int | None = None,
    max_doc_len: int | None = None,
    out: str | os.PathLike | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Tokenise and pack Alpaca once and save {train, heldout, stats} with `torch.save`
    (``progress``: progress bars while the BPE trains and the records are tokenised).

    The default file name in `data/cache/` is derived from all arguments, so a second call with
    the same arguments returns the cached file at once (unless `overwrite`). Load it with
    `load_prepared`.
    """
    source = str(source or os.environ.get("LRMOE_ALPACA") or DEFAULT_HUB_ID)
    config = dict(source=source, tokenizer=tokenizer, seq_len=seq_len, heldout_fraction=heldout_fraction,
                  seed=seed, max_records=max_records, max_doc_len=max_doc_len)
    fingerprint = source_fingerprint(source)
    keyed = dict(config, source_fingerprint=fingerprint, format=PACKED_FORMAT)
    if out is None:
        # the source's content is part of the key: an edited or replaced file at the same path
        # gets a new cache file instead of the stale one
        key = hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()[:12]
        out = default_cache_dir() / f"alpaca-{key}.pt"
    else:
        out = Path(out)
        if out.exists() and not overwrite:  # a file the caller named: it must hold what was asked for
            stats = torch.load(out, weights_only=True).get("stats", {})
            built = dict(stats.get("config", {}), source_fingerprint=stats.get("source_fingerprint"),
                         format=stats.get("format"))
            differ = sorted(k for k in keyed if built.get(k) != keyed[k])
            if differ:
                raise ValueError(f"{out} was prepared with other arguments or data ({', '.join(differ)} differ); "
                                 f"pass overwrite=True (--overwrite) or another output file")
    out = Path(out)
    if out.exists() and not overwrite:
        return out
    train, heldout, stats = build_alpaca_splits(
        source, tokenizer, seq_len, heldout_fraction, seed, max_records,
        max_doc_len=max_doc_len, cache_dir=out.parent / "tokenizers", progress=progress,
    )
    stats["config"] = config
    stats["source_fingerprint"], stats["format"] = fingerprint, PACKED_FORMAT
    stats["tokenizer_file"] = getattr(train.tokenizer, "cache_file", None)
    atomic_write(out, lambda f: torch.save({"train": train.tensors, "heldout": heldout.tensors, "stats": stats}, f))
    return out


def load_prepared(path: str | os.PathLike) -> tuple[AlpacaDataset, AlpacaDataset, dict]:
    """Read a file written by `prepare`: (train, held-out, stats)."""
    blob = torch.load(path, weights_only=True)
    return AlpacaDataset(blob["train"]), AlpacaDataset(blob["heldout"]), blob["stats"]


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m lrmoe.data", description=prepare.__doc__.split("\n")[0])
    ap.add_argument("--data", default=None, help=f"hub id, .json/.jsonl file or directory (default: $LRMOE_ALPACA or {DEFAULT_HUB_ID})")
    ap.add_argument("--tokenizer", default="bpe:4096", help="'bpe:N', 'VOCAB.json,MERGES.txt', or a HF tokenizer dir/name")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--heldout-fraction", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-records", type=int, default=None)
    ap.add_argument("--max-doc-len", type=int, default=None)
    ap.add_argument("--out", default=None, help="output .pt file (default: data/cache/alpaca-<hash>.pt)")
    ap.add_argument("--overwrite", action="store_true")
    a = ap.parse_args(argv)
    path = prepare(a.data, a.tokenizer, a.seq_len, a.heldout_fraction, a.seed, a.max_records, a.max_doc_len,
                   a.out, a.overwrite)
    stats = load_prepared(path)[2]
    print(json.dumps({k: v for k, v in stats.items() if k != "config"}, indent=1))
    print(path)


if __name__ == "__main__":
    main()
