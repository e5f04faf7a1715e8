"""Routers (token -> top-k experts and weights) and router-balancing helpers.

``softmax`` is Qwen3-MoE's router; ``sigmoid`` is GLM-4.5's (DeepSeek-V3 style). Both hold
``weight [E, H]`` and return ``(router_logits [T, E], top_k_weights [T, K], top_k_index [T, K])``,
exactly as the transformers modules do, so Hugging Face checkpoints load unchanged.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .kernels.routing import count_by_value

ROUTERS = ("softmax", "sigmoid")


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float32 for 16-bit inputs; the input precision for float32/float64 (exact float64 checks)."""
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


class SoftmaxTopKRouter(nn.Module):
    """Qwen3-MoE: softmax over all experts, top-k, optional renormalisation of the k weights."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, norm_topk_prob: bool = True):
        super().__init__()
        self.top_k, self.num_experts, self.norm_topk_prob = top_k, num_experts, norm_topk_prob
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))

    def forward(self, x_TH: torch.Tensor):
        # x in the router's dtype (a float32 router on bf16 activations), as the experts cast
        # theirs; under autocast F.linear then casts both to the autocast dtype, as before.
        logits = F.linear(x_TH.to(self.weight.dtype), self.weight)
        probs = torch.softmax(logits, dim=-1, dtype=_compute_dtype(logits))
        top_value, top_index = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_value = top_value / top_value.sum(dim=-1, keepdim=True)
        return logits, top_value.to(logits.dtype), top_index


class SigmoidTopKRouter(nn.Module):
    """GLM-4.5: sigmoid scores; experts chosen on score + ``e_score_correction_bias`` (aux-loss-free
    balancing), optionally inside the best ``topk_group`` of ``n_group`` groups; weights are the
    unbiased scores, renormalised when ``norm_topk_prob``, times ``routed_scaling_factor``."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, norm_topk_prob: bool = True,
                 routed_scaling_factor: float = 1.0, n_group: int = 1, topk_group: int = 1):
        super().__init__()
        for name, v in (("n_group", n_group), ("topk_group", topk_group)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if num_experts % n_group or not (1 <= topk_group <= n_group):
            raise ValueError(f"n_group must divide num_experts and 1 <= topk_group <= n_group, got "
                             f"num_experts={num_experts}, n_group={n_group}, topk_group={topk_group}")
        if top_k > topk_group * (num_experts // n_group):
            raise ValueError(f"top_k={top_k} exceeds the experts of the topk_group={topk_group} selected groups "
                             f"({topk_group} x {num_experts // n_group})")
        self.top_k, self.num_experts, self.norm_topk_prob = top_k, num_experts, norm_topk_prob
        self.routed_scaling_factor, self.n_group, self.topk_group = routed_scaling_factor, n_group, topk_group
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts))

    def _apply(self, fn, recurse=True):
        # The bias accumulates steps of size ``rate`` (1e-3): in bf16 they round away once |b| >=
        # 0.25, so it stays in float32 when the module is cast to a 16-bit dtype (transformers
        # keeps GLM's bias in float32 too); moving devices and float64 apply as usual.
        before = self.e_score_correction_bias
        super()._apply(fn, recurse)
        after = self.e_score_correction_bias
        if after.dtype in (torch.float16, torch.bfloat16) and before.dtype not in (torch.float16, torch.bfloat16):
            self.e_score_correction_bias = before.to(after.device)  # the unrounded values, moved only
        elif after.dtype in (torch.float16, torch.bfloat16):
            self.e_score_correction_bias = after.float()
        return self

    def forward(self, x_TH: torch.Tensor):
        dt = _compute_dtype(x_TH)
        logits = F.linear(x_TH.to(dt), self.weight.to(dt))
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias.to(dt)
        if self.n_group > 1:
            grouped = choice.view(-1, self.n_group, self.num_experts // self.n_group)
            group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(-1)
            group_idx = torch.topk(group_scores, self.topk_group, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1).bool()
            choice = grouped.masked_fill(~group_mask.unsqueeze(-1), float("-inf")).view_as(choice)
        top_index = torch.topk(choice, self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, top_index)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return logits, weights * self.routed_scaling_factor, top_index

    @torch.no_grad()
    def update_bias(self, demand_E: torch.Tensor, rate: float = 1e-3) -> None:
        """Aux-loss-free balancing step (DeepSeek-V3): ``b_i += rate * sign(mean(f) - f_i)``."""
        update_correction_bias(self.e_score_correction_bias, demand_E, rate)


def update_correction_bias(bias_E: torch.Tensor, demand_E: torch.Tensor, rate: float = 1e-3) -> torch.Tensor:
    """In place: raise the bias of under-loaded experts, lower it for over-loaded ones."""
    f = demand_E.to(bias_E.dtype)
    bias_E.add_(rate * torch.sign(f.mean() - f))
    return bias_E


def load_balancing_loss(router_logits_TE: torch.Tensor, top_k_index_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Switch-style auxiliary loss ``E * sum_i f_i * P_i`` (multiply by your coefficient).

    f_i: fraction of routed pairs sent to expert i; P_i: mean router probability of expert i.
    Equals Megatron's ``E / (k T^2) * sum_i (sum_t p_ti) * count_i``; 1.0 under perfect balance."""
    if top_k_index_TK.numel() == 0:  # no tokens (e.g. an expert-parallel rank): 0, still in the graph
        return router_logits_TE.float().sum() * 0.0
    probs = torch.softmax(router_logits_TE.float(), dim=-1)
    counts = count_by_value(top_k_index_TK.reshape(-1), num_experts).to(probs.dtype)
    f = counts / top_k_index_TK.numel()
    return num_experts * (f * probs.mean(0)).sum()


def make_router(kind: str, hidden_size: int, num_experts: int, top_k: int, **kwargs) -> nn.Module:
    if kind == "softmax":
        unknown = set(kwargs) - {"norm_topk_prob"}
        if unknown:
            raise ValueError(f"softmax router does not take {sorted(unknown)}; its option: norm_topk_prob")
        return SoftmaxTopKRouter(hidden_size, num_experts, top_k, **kwargs)
    if kind == "sigmoid":
        unknown = set(kwargs) - {"norm_topk_prob", "routed_scaling_factor", "n_group", "topk_group"}
        if unknown:
            raise ValueError(f"sigmoid router does not take {sorted(unknown)}; its options: norm_topk_prob, "
                             f"routed_scaling_factor, n_group, topk_group")
        return SigmoidTopKRouter(hidden_size, num_experts, top_k, **kwargs)
    raise ValueError(f"unknown router {kind!r}; accepted: {list(ROUTERS)}")
