"""The token loss of training and evaluation, without the full fp32 logits at scale.

:func:`token_loss` is the plain loss (the reference): the model's ``[B, S, vocab]`` logits, cast
to fp32, then one cross-entropy. At the paper's scale that cast alone is 32,768 x 151,936 x 4 B =
18.5 GiB, and cross-entropy's softmax and gradient are as large again (docs/memory.md).

:func:`causal_lm_loss` runs the decoder for the hidden states and then the output layer and
cross-entropy :data:`CHUNK_TOKENS` labelled tokens at a time, each chunk's logits recomputed in
the backward (``torch.utils.checkpoint``), so no ``[tokens, vocab]`` tensor outlives its chunk.
Positions without a label (prompt tokens, the label shift's last position) skip the output layer.
Up to :data:`PLAIN_MAX` logits (tokens x vocab) it uses the plain loss instead: the same value up
to float rounding, cheaper at small sizes, and bit for bit the loss that the CPU presets' runs
were made with.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake
from torch.utils.checkpoint import checkpoint

from ..data import IGNORE_INDEX
from ..hf.attention import attention_inputs

CHUNK_TOKENS = 1024  # labelled tokens per chunk: 1024 x 151,936 fp32 logits = 0.58 GiB
PLAIN_MAX = 2 ** 26  # tokens x vocab up to which the plain loss is used (fp32 logits <= 256 MiB)


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Summed next-token cross-entropy over labelled positions (labels are aligned with inputs)."""
    shift_logits = _upcast(logits[:, :-1])
    shift_labels = labels[:, 1:]
    loss_sum = F.cross_entropy(shift_logits.reshape(-1, shift_logits.shape[-1]), shift_labels.reshape(-1),
                               ignore_index=IGNORE_INDEX, reduction="sum")
    if is_fake(shift_labels):  # a memory estimate: no values to count (every position, as the chunked loss)
        return loss_sum, shift_labels.numel()
    return loss_sum, int((shift_labels != IGNORE_INDEX).sum())


def label_tokens(labels: torch.Tensor) -> int:
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def _upcast(logits: torch.Tensor) -> torch.Tensor:
    """bf16/fp16 logits to fp32 for the cross-entropy; fp32 and float64 as they are."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def _chunk_loss(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                labels: torch.Tensor) -> torch.Tensor:
    logits = F.linear(hidden, weight, bias)  # the output layer, in the autocast dtype
    return F.cross_entropy(_upcast(logits), labels, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_token_loss(hidden: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None = None, chunk: int = CHUNK_TOKENS) -> tuple[torch.Tensor, int]:
    """:func:`token_loss` of the logits ``F.linear(hidden, weight, bias)`` (hidden ``[B, S, H]``,
    labels ``[B, S]`` aligned with the inputs), computed ``chunk`` labelled positions at a time; with
    gradients on, each chunk's logits are recomputed in the backward instead of kept."""
    if chunk < 1:
        raise ValueError(f"chunk must be a positive number of tokens, got {chunk}")
    h = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    y = labels[:, 1:].reshape(-1)
    if is_fake(y):  # a memory estimate (no label values): every position, unlabelled ones ignored by the loss
        n = y.numel()
    else:
        keep = (y != IGNORE_INDEX).nonzero().squeeze(1)
        h, y = h.index_select(0, keep), y.index_select(0, keep)
        n = int(keep.numel())
    total = None
    # at least one chunk, empty when no position has a label: the loss (0) then still reaches the
    # model's graph, so a backward runs through every layer (EP ranks run its collectives)
    for s in range(0, max(n, 1), chunk):
        args = (h[s:s + chunk], weight, bias, y[s:s + chunk])
        part = (checkpoint(_chunk_loss, *args, use_reentrant=False, preserve_rng_state=False)
                if torch.is_grad_enabled() else _chunk_loss(*args))
        total = part if total is None else total + part
    return total, n


def causal_lm_loss(model, input_ids: torch.Tensor, position_ids: torch.Tensor, labels: torch.Tensor, *,
                   chunk: int = CHUNK_TOKENS, plain_max: int | None = None) -> tuple[torch.Tensor, int]:
    """(summed next-token cross-entropy over the labelled positions, their count) of a transformers
    causal LM whose logits are ``lm_head(decoder output)`` (Qwen3-MoE, GLM-4-MoE; tied embeddings
    too) on packed rows; run it under the caller's autocast. ``use_cache=False``: with a cache,
    transformers builds a plain causal mask and packed documents would attend to each other."""
    kw = dict(input_ids=input_ids, position_ids=position_ids, use_cache=False,
              **attention_inputs(model, position_ids))  # flex attention: the document-causal BlockMask
    head = model.get_output_embeddings()
    if input_ids.numel() * head.weight.shape[0] <= (PLAIN_MAX if plain_max is None else plain_max):
        return token_loss(model(**kw).logits, labels)

    def forward(**kw):  # decoder, then the chunked output layer and loss, as the model's own forward
        hidden = model.get_decoder()(**kw).last_hidden_state
        return chunked_token_loss(hidden, labels, head.weight, head.bias, chunk)

    # through the model's call: module hooks around it see the whole loss (FSDP's root gathers the
    # embeddings, final norm and output layer for it, and again for the backward that recomputes chunks)
    own = model.__dict__.get("forward")  # an instance's own forward (e.g. a compiled one) comes back after
    model.forward = forward
    try:
        return model(**kw)
    finally:
        if own is None:
            del model.forward
        else:
            model.forward = own
