"""Held-out evaluation and the token loss shared with training."""
from __future__ import annotations

import math
import warnings

import torch

from ..data import IGNORE_INDEX
from .config import TrainConfig
from .runner import LocalRunner


@torch.no_grad()
def evaluate(model, heldout, cfg: TrainConfig, device, autocast, runner=None) -> dict:
    """Mean response-token cross-entropy and perplexity on the held-out split (with a distributed
    ``runner``: every rank evaluates its share of each micro-batch; sums over the ranks)."""
    runner = runner or LocalRunner  # its eval_rows/sum_eval are static
    n = len(heldout)
    if n == 0:
        return {}
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    starts = list(range(0, n, cfg.micro_batch))
    if cfg.eval_batches is not None:
        starts = starts[: cfg.eval_batches]
    for s in starts:
        idx = torch.arange(s, min(n, s + cfg.micro_batch))
        batch = {k: heldout.tensors[k][idx].to(device) for k in ("input_ids", "labels", "position_ids")}
        batch, counted = runner.eval_rows(batch)
        with autocast():
            # use_cache=False: with a cache, transformers builds a plain causal mask and packed
            # documents would attend to each other; without one the mask follows position_ids.
            logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        loss_sum, tokens = token_loss(logits, batch["labels"])
        if counted:
            total += float(loss_sum)
            count += tokens
    total, count = runner.sum_eval(total, count)
    model.train(was_training)
    if count == 0:
        if runner.is_main:
            warnings.warn(f"evaluation found no response tokens in the {len(starts)} held-out micro-batch(es) "
                          f"evaluated (of {n} rows): no eval_loss this step; raise eval_batches or heldout_fraction",
                          stacklevel=2)
        return {}
    loss = total / count
    return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 700.0)), "eval_tokens": count}


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Summed next-token cross-entropy over labelled positions (labels are aligned with inputs)."""
    shift_logits = logits[:, :-1].float()
    shift_labels = labels[:, 1:]
    loss_sum = torch.nn.functional.cross_entropy(shift_logits.reshape(-1, shift_logits.shape[-1]),
                                                 shift_labels.reshape(-1), ignore_index=IGNORE_INDEX,
                                                 reduction="sum")
    return loss_sum, int((shift_labels != IGNORE_INDEX).sum())


def label_tokens(labels: torch.Tensor) -> int:
    return int((labels[:, 1:] != IGNORE_INDEX).sum())

