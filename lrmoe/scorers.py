"""Pair scorers: how important a routed pair (t, e) is for its expert's weight gradient.

A scorer is ``fn(inputs: ScoreInputs, **kwargs) -> scores_TK`` (float, higher = keep first).
For the protected projection (the expert's down projection, input phi_u = h_u) the pair's weight
gradient is the rank-one ``(alpha_u g_t) phi_u^T``, whose squared Frobenius norm is the Load
Recalibration Metric ``R_u = alpha_u^2 * ||g_t||^2 * ||phi_u||^2`` (scorer ``lrm``).

Which activation norm phi the LRM score uses is the policy's ``phi`` (:data:`PHIS`, passed to
scorers as ``ScoreInputs.phi``): ``h`` (the down-projection input, the paper's phi), ``x`` (the
expert input x_t: the gate/up projection's input) or ``both`` (R_u^h + R_u^x, the sum of both
projections' rank-one norms, each with alpha_u g_t as the output gradient; see docs/method.md).

Built-in scorers: ``lrm`` (reads ``phi``), ``lrm_input`` (the alias of ``lrm`` with phi = x, kept
so that configs and results that name it do not change), ``grad_norm`` (||g_t||^2), ``abs_grad``
(||g_t||_1), ``random`` (uniform, seeded), listed in the registry at the end of this module.
Register your own with :func:`register_scorer` (a name that
exists raises unless ``override=True``) and remove it with :func:`unregister_scorer`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable

import torch

from .registry import Registry

ScorerFn = Callable[..., torch.Tensor]
#: Values of ``BackwardPolicy.phi``: which activation norm enters the LRM score.
PHIS = ("h", "x", "both")
#: Built-in scorers that read ``phi``; the other built-ins ignore it, so a policy refuses a phi other
#: than the default with them (user-registered scorers may read ``ScoreInputs.phi``).
PHI_SCORERS = ("lrm",)


def row_norm2(x_NH: torch.Tensor) -> torch.Tensor:
    """||x_n||^2 per row as float32 (one fused reduction, no [N, H] temporary; NaN/Inf rows give NaN/Inf)."""
    acc = torch.promote_types(x_NH.dtype, torch.float32)  # fp32 for 16-bit inputs, fp64 stays exact
    return torch.linalg.vector_norm(x_NH, dim=-1, dtype=acc).float().square()


@dataclass
class ScoreInputs:
    """Everything a scorer may look at, in pair layout [T, K] (norms in fp32; ``grad_norm2_T`` is
    filled on construction, ``input_norm2_T`` on first use)."""

    alpha_TK: torch.Tensor  # routing weights
    grad_TH: torch.Tensor  # dL/dy at the MoE output
    phi_norm2_TK: torch.Tensor  # ||h_u||^2, the down-projection input, recorded in forward
    hidden_TH: torch.Tensor  # expert input x_t
    top_k_index_TK: torch.Tensor
    generator: torch.Generator | None = None
    extras: dict = field(default_factory=dict)
    grad_norm2_T: torch.Tensor | None = None  # ||g_t||^2 (fp32); computed here when not given
    phi: str = "h"  # the policy's phi (PHIS): which activation norm the LRM score uses

    def __post_init__(self):
        if self.grad_norm2_T is None:
            self.grad_norm2_T = row_norm2(self.grad_TH)

    @cached_property
    def input_norm2_T(self) -> torch.Tensor:
        x = self.hidden_TH.float()
        return (x * x).sum(-1)


def lrm_score(inp: ScoreInputs) -> torch.Tensor:
    """R_u = alpha_u^2 ||g_t||^2 ||phi_u||^2 with phi = h_u (``phi="h"``), x_t (``"x"``), or the sum
    of both terms (``"both"``)."""
    if inp.phi == "x":
        return lrm_input_score(inp)
    a = inp.alpha_TK.float()
    if inp.phi == "both":
        return a * a * inp.grad_norm2_T[:, None] * (inp.phi_norm2_TK.float() + inp.input_norm2_T[:, None])
    return a * a * inp.grad_norm2_T[:, None] * inp.phi_norm2_TK.float()


def lrm_input_score(inp: ScoreInputs) -> torch.Tensor:
    """``lrm`` with phi = x_t (the expert input), whatever ``inp.phi`` says (the policy refuses ``both`` with it)."""
    a = inp.alpha_TK.float()
    return a * a * (inp.grad_norm2_T * inp.input_norm2_T)[:, None]


def grad_norm_score(inp: ScoreInputs) -> torch.Tensor:
    return inp.grad_norm2_T[:, None].expand(inp.alpha_TK.shape)


def abs_grad_score(inp: ScoreInputs) -> torch.Tensor:
    return inp.grad_TH.float().abs().sum(-1)[:, None].expand(inp.alpha_TK.shape)


def random_score(inp: ScoreInputs) -> torch.Tensor:
    return torch.rand(inp.alpha_TK.shape, generator=inp.generator, device=inp.alpha_TK.device)


_SCORERS = Registry("scorer", builtins={"lrm": lrm_score, "lrm_input": lrm_input_score, "grad_norm": grad_norm_score,
                                        "abs_grad": abs_grad_score, "random": random_score})
#: ``register_scorer(name, fn, *, override=False)`` or ``@register_scorer(name)``:
#: ``fn(inputs: ScoreInputs, **kw) -> scores [T, K]``; a name that exists raises unless ``override=True``.
register_scorer = _SCORERS.register
#: ``unregister_scorer(name)``: remove a registered scorer (e.g. a test's temporary one).
unregister_scorer = _SCORERS.unregister
#: Names of the registered scorers.
scorers = _SCORERS.names
get_scorer = _SCORERS.get
