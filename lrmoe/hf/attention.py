"""Attention over packed documents without an S x S mask: flex attention with a document-causal BlockMask.

Packed rows (:mod:`lrmoe.data`) restart ``position_ids`` at every document. Given such position_ids
and no attention mask, transformers' sdpa path builds a 4-D ``[B, 1, S, S]`` boolean mask (its
``masking_utils.sdpa_mask``), and sdpa with a mask runs neither the flash kernel nor GQA without
``repeat_kv``: full S^2 work in every layer, and the mask is kept for the backward.

With ``attn_implementation="flex_attention"`` and the :class:`BlockMask` of
:func:`document_causal_mask` passed as ``attention_mask`` (a 4-D mask, which transformers uses as
it is), flex attention computes only the 128 x 128 blocks where a token sees an earlier token of
its own document. The BlockMask is made from each block's first and last document index:
``[B, S/128, S/128]`` block tables, never an ``[S, S]`` tensor, and no torch.compile.

Where (:func:`attention_for`): CUDA devices use flex attention; the CPU keeps sdpa, since flex
attention has no backward on the CPU (torch 2.13 raises NotImplementedError), so CPU runs compute
exactly as before. ``LRMOE_ATTENTION=sdpa`` (or ``flex_attention``) overrides the choice, without a
config field: both compute the same attention, in a different order of operations.
"""
from __future__ import annotations

import os

import torch

FLEX, SDPA = "flex_attention", "sdpa"
ATTENTION_ENV = "LRMOE_ATTENTION"
BLOCK = 128  # flex attention's default block size


def attention_for(device) -> str:
    """The attention implementation of a training run on ``device``: ``$LRMOE_ATTENTION`` when set,
    else flex attention on CUDA and sdpa elsewhere."""
    device = torch.device(device)
    choice = os.environ.get(ATTENTION_ENV) or (FLEX if device.type == "cuda" else SDPA)
    if choice not in (FLEX, SDPA):
        raise ValueError(f"{ATTENTION_ENV}={choice!r}: accepted {SDPA!r} or {FLEX!r}")
    if choice == FLEX and device.type == "cpu":
        raise ValueError(f"{ATTENTION_ENV}={FLEX}: flex attention has no backward on the CPU; use {SDPA!r}")
    return choice


def uses_flex(model) -> bool:
    return getattr(model.config, "_attn_implementation", None) == FLEX


def attention_inputs(model, position_ids: torch.Tensor) -> dict:
    """Extra keyword arguments of ``model(...)`` for packed rows: the document-causal BlockMask when
    the model runs flex attention, nothing otherwise (sdpa builds its mask from position_ids)."""
    return {"attention_mask": document_causal_mask(position_ids)} if uses_flex(model) else {}


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` index of each token's document within its row: a new document wherever the
    position does not continue the previous one by 1 (transformers' rule for packed rows, so the
    padding at the end of the last row, at positions 0, 1, ..., is a document of its own)."""
    step = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1)
    return (step != 1).cumsum(-1)


def document_causal_mask(position_ids: torch.Tensor, block: int = BLOCK):
    """The BlockMask of causal attention within each document of the packed rows ``position_ids``
    ``[B, S]``: token q sees token k iff k <= q and both are in the same document."""
    from torch.nn.attention.flex_attention import BlockMask

    B, S = position_ids.shape
    nb = -(-S // block)
    doc = document_ids(position_ids)
    # past the row: one more document, so the ids stay non-decreasing and mask_mod indexes in bounds
    doc = torch.cat([doc, (doc[:, -1:] + 1).expand(B, nb * block - S)], dim=1)
    blocks = doc.view(B, nb, block)
    first, last = blocks[..., 0], blocks[..., -1]  # the smallest and largest document of each block
    q_first, q_last = first[:, :, None], last[:, :, None]
    k_first, k_last = first[:, None, :], last[:, None, :]
    qi = torch.arange(nb, device=doc.device)
    below = qi[None, :] <= qi[:, None]  # [q block, kv block]: kv block not after the q block
    touches = below & (k_first <= q_last) & (q_first <= k_last)  # some (q, k) pair shares a document
    full = (qi[None, :] < qi[:, None]) & (q_first == q_last) & (k_first == k_last) & (q_first == k_first)
    partial = touches & ~full

    def mask_mod(b, h, q, k):
        return (doc[b, q] == doc[b, k]) & (q >= k)

    kv_num, kv_idx = _ordered(partial)
    full_num, full_idx = _ordered(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block, mask_mod=mask_mod,
                                    seq_lengths=(S, S))


def _ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, nq, nk]`` bool -> (count ``[B, 1, nq]``, kv block indices ``[B, 1, nq, nk]``, the
    selected ones first in increasing order), int32 as BlockMask takes them."""
    num = blocks.sum(-1, dtype=torch.int32)
    idx = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return num[:, None], idx[:, None]
