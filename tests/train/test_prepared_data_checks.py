"""Checks of the prepared training data: packing makes every response label a target of the
shifted loss (rows overlap by one token), Stanford Alpaca's prompt templates, and the held-out
split (disjoint, covering, copies of held-out records held out). The check on the cpu preset's
data skips (saying why) when the shared sample is absent."""

import os
from pathlib import Path

import pytest

from lrmoe import data
from lrmoe.data import IGNORE_INDEX

REPO = Path(__file__).resolve().parents[2]
SHARED = Path(os.environ.get("LRMOE_SHARED_DATA", REPO.parent / "shared" / "data"))
DEMO = SHARED / "alpaca" / "alpaca_en_demo.json"


pytestmark = pytest.mark.usefixtures("isolated_caches")


def _need(*paths):
    for p in paths:
        if not Path(p).exists():
            pytest.skip(f"{p} not found")


# ------------------------------------------------------------------------------------ packing


def _trained_targets(packed):
    """Label positions that reach the loss under the training loop's convention
    (lrmoe/train/::_token_loss: logits[:, :-1] vs labels[:, 1:], i.e. label at row position 0 is
    never used)."""
    return int((packed["labels"][:, 1:] != IGNORE_INDEX).sum())


def test_packing_trains_every_response_label():
    """docs: 'loss on the response and EOS only' -> every response token and the EOS of every
    document is a training target. Packing cuts documents across rows; the continuation's first
    token sits at row position 0, whose label the (HF-convention) shift discards, so that response
    token is never trained."""
    # 3 documents of 2 prompt + 6 response tokens; seq_len 5 puts row boundaries inside responses.
    examples = []
    for d in range(3):
        ids = [100 * (d + 1) + i for i in range(8)]
        examples.append((ids, [IGNORE_INDEX] * 2 + ids[2:]))
    p = data.pack_examples(examples, seq_len=5, seed=0)
    want = sum(sum(y != IGNORE_INDEX for y in lab) for _, lab in examples)  # 18 response+EOS tokens
    assert int((p["labels"] != IGNORE_INDEX).sum()) == want  # labels are all there ...
    assert _trained_targets(p) == want, (  # ... but some can never reach the loss
        f"{want - _trained_targets(p)} of {want} response labels sit at row position 0 and are never trained")


def test_cpu_preset_split_trains_every_response_label(shared_demo):
    """The same on the cpu preset's real data (first 16 records of alpaca_en_demo, 14 train /
    2 held-out, bpe:1024, seq 256, data_seed 0): count response labels dropped at row starts."""
    train, held, stats = data.build_alpaca_splits(DEMO, "bpe:1024", 256, 0.125, 0, 16)
    lost_train = stats["train"]["response_tokens"] - _trained_targets(train.tensors)
    lost_held = stats["heldout"]["response_tokens"] - _trained_targets(held.tensors)
    # also: how many rows start in the middle of a document (position id != 0)
    mid = int((train.tensors["position_ids"][:, 0] != 0).sum())
    assert (lost_train, lost_held) == (0, 0), (
        f"train: {lost_train} of {stats['train']['response_tokens']} response labels never trained "
        f"({mid} of {len(train)} rows start mid-document); held-out: {lost_held} of "
        f"{stats['heldout']['response_tokens']} never evaluated")


@pytest.fixture
def shared_demo():
    _need(DEMO)
    return DEMO


# ------------------------------------------------------------------------------- prompt/labels


def test_prompt_templates_are_stanford_alpaca():
    """Passed: the two templates equal Stanford Alpaca's train.py PROMPT_DICT verbatim."""
    stanford_input = (
        "Below is an instruction that describes a task, paired with an input that provides further context. "
        "Write a response that appropriately completes the request.\n\n"
        "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:"
    )
    stanford_no_input = (
        "Below is an instruction that describes a task. "
        "Write a response that appropriately completes the request.\n\n"
        "### Instruction:\n{instruction}\n\n### Response:"
    )
    assert data.PROMPT_WITH_INPUT == stanford_input and data.PROMPT_NO_INPUT == stanford_no_input
    r = {"instruction": "I", "input": "X", "output": "O"}
    assert data.format_prompt(r) == (stanford_input.format(instruction="I", input="X"), "O")
    r = {"instruction": "I", "input": "", "output": "O"}
    assert data.format_prompt(r) == (stanford_no_input.format(instruction="I"), "O")


def test_split_is_disjoint_and_covers_records():
    """Passed: the held-out split is disjoint by position, covers all records, keeps order, and
    is independent of everything but (n, fraction, seed)."""
    recs = [{"instruction": str(i), "input": "", "output": "o"} for i in range(50)]
    tr, he = data.split_records(recs, 0.2, 7)
    assert len(he) == 10 and len(tr) == 40
    ti, hi = [int(r["instruction"]) for r in tr], [int(r["instruction"]) for r in he]
    assert sorted(ti + hi) == list(range(50)) and ti == sorted(ti) and hi == sorted(hi)
    assert not set(ti) & set(hi)


def test_copies_of_held_out_records_are_held_out():
    """A record duplicated across the splits put training data into the held-out loss."""
    recs = [{"instruction": str(i % 20), "input": "", "output": "o"} for i in range(50)]  # 2-3 copies each
    tr, he = data.split_records(recs, 0.1, 3)
    assert len(he) > 5 and len(tr) + len(he) == 50  # 5 drawn, plus their copies
    assert not {r["instruction"] for r in tr} & {r["instruction"] for r in he}
