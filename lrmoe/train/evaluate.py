"""Held-out evaluation (its loss is the training loss, :mod:`lrmoe.train.loss`)."""
from __future__ import annotations

import math
import warnings

import torch

from .config import TrainConfig
from .loss import causal_lm_loss, label_tokens, token_loss
from .runner import LocalRunner

__all__ = ["evaluate", "label_tokens", "token_loss"]


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
        with autocast():  # the loss inside: each chunk's logits in the autocast dtype (lrmoe.train.loss)
            loss_sum, tokens = causal_lm_loss(model, batch["input_ids"], batch["position_ids"], batch["labels"])
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

