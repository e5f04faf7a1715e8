"""Held-out evaluation (lrmoe.train.evaluate): packed documents kept apart, no response tokens."""
import pytest
import torch

import lrmoe.hf as hf
from lrmoe.data import AlpacaDataset, pack_examples
from lrmoe.train import TrainConfig, evaluate


def test_evaluate_loss_does_not_mix_packed_documents():
    """evaluate() on one packed row of two documents must equal the token-weighted loss of the two
    documents evaluated on their own (no cross-document attention, docs/reproduce.md 'Data')."""
    model = hf.build_model("qwen3-moe-tiny", vocab_size=97, seed=1)
    g = torch.Generator().manual_seed(0)
    d1 = torch.randint(1, 97, (10,), generator=g).tolist()
    d2 = torch.randint(1, 97, (14,), generator=g).tolist()
    ex = [(d1, [-100] * 4 + d1[4:]), (d2, [-100] * 5 + d2[5:])]
    c = TrainConfig(micro_batch=1)
    noop = lambda: torch.autocast("cpu", enabled=False)  # noqa: E731
    together = evaluate(model, AlpacaDataset(pack_examples(ex, 24, seed=0)), c, torch.device("cpu"), noop)
    sep = [evaluate(model, AlpacaDataset(pack_examples([e], len(e[0]), seed=0)), c, torch.device("cpu"), noop)
           for e in ex]
    assert together["eval_tokens"] == sum(s["eval_tokens"] for s in sep)
    expect = sum(s["eval_loss"] * s["eval_tokens"] for s in sep) / together["eval_tokens"]
    assert together["eval_loss"] == pytest.approx(expect, rel=1e-5)


def test_evaluation_without_response_tokens_warns():
    model = hf.build_model("qwen3-moe-tiny", vocab_size=97, seed=1)
    ids = list(range(1, 13))
    held = AlpacaDataset(pack_examples([(ids, [-100] * len(ids))], 12, seed=0))  # prompt only
    noop = lambda: torch.autocast("cpu", enabled=False)  # noqa: E731
    with pytest.warns(UserWarning, match="no response tokens"):
        assert evaluate(model, held, TrainConfig(micro_batch=1), torch.device("cpu"), noop) == {}
