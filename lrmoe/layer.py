"""nn.Modules: the LRMoE experts container and the full MoE layer (router + experts + shared expert)."""
from __future__ import annotations

import math
import numbers
import weakref

import torch
from torch import nn

from .experts import check_hidden, experts_activation, lrmoe_experts
from .policy import BackwardPolicy, BackwardRecord, check_policy
from .router import load_balancing_loss, make_router


def check_std(std, name: str) -> None:
    """ValueError unless ``std`` is None (1/sqrt(fan_in)) or a finite real number >= 0 (0: zeros)."""
    if std is not None and (isinstance(std, bool) or not isinstance(std, numbers.Real) or not math.isfinite(std)
                            or std < 0):
        raise ValueError(f"{name} must be a finite number >= 0 (0 initialises to zeros), or None for "
                         f"1/sqrt(fan_in), got {std!r}")


class LRMoEExperts(nn.Module):
    """Gated experts (SwiGLU by default) in the transformers layout with LRMoE's selective backward.

    gate_up_proj [E, 2I, H] (gate half first), down_proj [E, H, I]; h = act(gate) * up with
    ``activation`` (None or SiLU: the fused SwiGLU path; any other elementwise activation without
    parameters, e.g. ``nn.GELU()``: the general path, see :func:`lrmoe.experts.gated`).
    ``last_backward`` holds the :class:`BackwardRecord` of the latest backward through this module."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, policy: BackwardPolicy | None = None,
                 activation=None):
        super().__init__()
        self.activation = activation
        experts_activation(activation)
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.policy = check_policy(policy)
        self.last_backward: BackwardRecord | None = None

    def __getstate__(self):  # copies and pickles carry the configuration, not the last call's record
        return {**super().__getstate__(), "last_backward": None}

    def _on_backward(self, record: BackwardRecord) -> None:
        self.last_backward = record

    def forward(self, hidden_TH: torch.Tensor, top_k_index_TK: torch.Tensor, top_k_weights_TK: torch.Tensor) -> torch.Tensor:
        record = None
        if torch.compiler.is_compiling():  # a compiled backward fills no record: none rather than a stale one
            self.last_backward = None
        elif torch.is_grad_enabled():
            ref = weakref.ref(self)  # the autograd graph must not keep the module alive
            record = BackwardRecord(on_fill=lambda r: (m := ref()) is not None and m._on_backward(r))
        return lrmoe_experts(hidden_TH, top_k_index_TK, top_k_weights_TK, self.gate_up_proj, self.down_proj,
                             self.policy, record, experts_activation(self.activation))


class SwiGLUMLP(nn.Module):
    """Dense SwiGLU MLP (the shared expert; transformers' naming: gate_proj, up_proj, down_proj)."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class LRMoELayer(nn.Module):
    """A sparse MoE layer: router -> SwiGLU experts (LRMoE backward) [+ shared expert].

    ``router="softmax"`` is Qwen3-MoE's router, ``router="sigmoid"`` GLM-4.5's (extra keyword
    arguments ``routed_scaling_factor``, ``n_group``, ``topk_group``); ``n_shared_experts`` adds
    GLM's shared expert of width ``n_shared_experts * intermediate_size``."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, *,
                 router: str = "softmax", norm_topk_prob: bool = True, n_shared_experts: int = 0,
                 policy: BackwardPolicy | None = None, init_std: float | None = None, **router_kwargs):
        super().__init__()
        for name, v in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size),
                        ("num_experts", num_experts)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not (1 <= top_k <= num_experts):
            raise ValueError(f"top_k must be an int in [1, num_experts={num_experts}], got {top_k!r}")
        if isinstance(n_shared_experts, bool) or not isinstance(n_shared_experts, int) or n_shared_experts < 0:
            raise ValueError(f"n_shared_experts must be an int >= 0, got {n_shared_experts!r}")
        check_std(init_std, "init_std")
        self.hidden_size, self.num_experts, self.top_k = hidden_size, num_experts, top_k
        self.gate = make_router(router, hidden_size, num_experts, top_k, norm_topk_prob=norm_topk_prob, **router_kwargs)
        self.experts = LRMoEExperts(num_experts, hidden_size, intermediate_size, policy)
        self.shared_experts = SwiGLUMLP(hidden_size, intermediate_size * n_shared_experts) if n_shared_experts else None
        self.last_router_logits: torch.Tensor | None = None
        self.last_top_k_index: torch.Tensor | None = None
        self.reset_parameters(init_std)

    def __getstate__(self):  # the last call's router outputs belong to its autograd graph, not to copies
        return {**super().__getstate__(), "last_router_logits": None, "last_top_k_index": None}

    @torch.no_grad()
    def reset_parameters(self, std: float | None = None) -> None:
        """Normal init with ``std`` (default 1/sqrt(fan_in) per projection, like nn.Linear's scale)."""
        check_std(std, "std")
        H, I = self.hidden_size, self.experts.intermediate_size
        scale = (lambda fan_in: 1 / math.sqrt(fan_in)) if std is None else (lambda fan_in: std)  # noqa: E731
        self.gate.weight.normal_(0.0, scale(H))
        self.experts.gate_up_proj.normal_(0.0, scale(H))
        self.experts.down_proj.normal_(0.0, scale(I))
        if self.shared_experts is not None:
            for lin in (self.shared_experts.gate_proj, self.shared_experts.up_proj, self.shared_experts.down_proj):
                lin.weight.normal_(0.0, scale(lin.in_features))

    @property
    def policy(self) -> BackwardPolicy:
        return self.experts.policy

    @policy.setter
    def policy(self, policy: BackwardPolicy) -> None:
        if policy is None:
            raise ValueError("policy must be a BackwardPolicy (lrmoe.BackwardPolicy), got None")
        self.experts.policy = check_policy(policy)

    @property
    def last_backward(self) -> BackwardRecord | None:
        """The :class:`BackwardRecord` of the latest backward through this layer."""
        return self.experts.last_backward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 0 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"input's last dimension must be hidden_size={self.hidden_size}, got shape {tuple(x.shape)}")
        check_hidden(x, self.experts.gate_up_proj, name="the layer's input")  # before the router casts it
        x_TH = x.reshape(-1, self.hidden_size)
        logits, weights, index = self.gate(x_TH)
        self.last_router_logits, self.last_top_k_index = logits, index
        y = self.experts(x_TH, index, weights)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x_TH)
        return y.view(x.shape)

    def aux_loss(self) -> torch.Tensor:
        """Switch-style load-balancing loss of the latest forward (see :func:`lrmoe.router.load_balancing_loss`)."""
        if self.last_router_logits is None:
            raise RuntimeError("aux_loss() needs a forward pass first")
        return load_balancing_loss(self.last_router_logits, self.last_top_k_index, self.num_experts)
