"""transformers integration: LRMoE as an experts implementation of Qwen3-MoE and GLM-4.5 models.

    import lrmoe.hf
    lrmoe.hf.register()                                   # adds "lrmoe" to ExpertsInterface
    model = Qwen3MoeForCausalLM.from_pretrained(path, experts_implementation="lrmoe")
    lrmoe.hf.set_policy(model, BackwardPolicy(drop_ratio=0.2))
    loss = model(**batch).loss; loss.backward()
    records = lrmoe.hf.backward_records(model)            # one BackwardRecord per MoE layer

The experts modules of transformers keep their parameters (``gate_up_proj [E, 2I, H]``,
``down_proj [E, H, I]``), so checkpoints load and save unchanged; only their forward is routed
through :func:`lrmoe.experts.lrmoe_experts`. Routers (softmax for Qwen3, sigmoid with correction
bias for GLM), shared experts and dense layers stay the transformers modules.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn

from ..experts import experts_activation, lrmoe_experts
from ..policy import BackwardPolicy, BackwardRecord

IMPLEMENTATION = "lrmoe"
# Attributes of a transformers experts module: its BackwardPolicy, and the record of its latest backward.
POLICY_ATTR, RECORD_ATTR = "lrmoe_policy", "lrmoe_last_backward"


def activation_of(experts: nn.Module):
    """The ``activation`` argument of :func:`lrmoe.experts.lrmoe_experts` for a transformers experts
    module: None (the fused SwiGLU path) when its ``act_fn`` is SiLU (``nn.SiLU``, transformers'
    ``SiLUActivation``, ``F.silu``) or absent; its ``act_fn`` itself otherwise (the general path,
    whatever transformers put there: gelu, gelu_pytorch_tanh, relu, mish, ...)."""
    act = getattr(experts, "act_fn", None)
    if type(act).__name__ == "SiLUActivation" and type(act).__module__ == "transformers.activations":
        return None  # transformers' F.silu wrapper
    return experts_activation(act)


def check_supported(experts: nn.Module) -> None:
    """ValueError unless ``experts`` is a fused, gated experts module without biases or norms, with
    transformers' default gate (act(gate) * up) and an activation without parameters."""
    problems = []
    if getattr(experts, "has_bias", False):
        problems.append("expert biases")
    if getattr(experts, "is_transposed", False):
        problems.append("transposed expert weights")
    if not getattr(experts, "has_gate", True) or not getattr(experts, "is_concatenated", True):
        problems.append("non-concatenated or non-gated experts")
    if getattr(experts, "has_post_expert_norm", False):
        problems.append("post-expert norms")
    gate_fn = getattr(type(experts), "_apply_gate", None)
    if gate_fn is not None and getattr(gate_fn, "__name__", "") != "_default_apply_gate":
        problems.append("a custom _apply_gate (only act(gate) * up)")
    try:
        activation_of(experts)
    except ValueError as e:
        problems.append(str(e))
    if problems:
        raise ValueError(f"the lrmoe experts implementation does not support {', '.join(problems)} "
                         f"in {type(experts).__name__}")


def lrmoe_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor) -> torch.Tensor:
    """``ExpertsInterface`` entry: ``fn(experts_module, hidden [T, H], top_k_index, top_k_weights) -> [T, H]``."""
    check_supported(self)
    policy = getattr(self, POLICY_ATTR, None) or BackwardPolicy()
    record = None
    if torch.compiler.is_compiling():  # a compiled backward fills no record: none is better than a stale one
        setattr(self, RECORD_ATTR, None)
    elif torch.is_grad_enabled():
        ref = weakref.ref(self)
        record = BackwardRecord(on_fill=lambda r: (m := ref()) is not None and setattr(m, RECORD_ATTR, r))
    y = lrmoe_experts(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj, policy, record,
                      activation_of(self))
    return y.to(hidden_states.dtype)


def register(name: str = IMPLEMENTATION) -> str:
    """Register the LRMoE experts implementation under ``name`` (idempotent); returns the name."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(name, lrmoe_experts_forward)
    return name


def experts_modules(model: nn.Module) -> list[nn.Module]:
    """The routed-experts modules of a model, in layer order (modules with 3-D gate_up_proj/down_proj)."""
    found = []
    for m in model.modules():
        gu, dn = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
        if isinstance(gu, torch.Tensor) and isinstance(dn, torch.Tensor) and gu.dim() == 3 and dn.dim() == 3:
            found.append(m)
    return found


def set_policy(model: nn.Module, policy: BackwardPolicy | list[BackwardPolicy]) -> None:
    """Set the backward policy of every MoE layer (one policy, or a list with one per MoE layer)."""
    mods = experts_modules(model)
    if not mods:
        raise ValueError(f"{type(model).__name__} has no routed-experts modules (gate_up_proj [E, 2I, H])")
    policies = policy if isinstance(policy, (list, tuple)) else [policy] * len(mods)
    if len(policies) != len(mods):
        raise ValueError(f"got {len(policies)} policies for {len(mods)} MoE layers")
    for m, p in zip(mods, policies):
        if not isinstance(p, BackwardPolicy):
            raise ValueError(f"policies must be BackwardPolicy instances, got {type(p).__name__}")
        setattr(m, POLICY_ATTR, p)


def get_policies(model: nn.Module) -> list[BackwardPolicy]:
    return [getattr(m, POLICY_ATTR, None) or BackwardPolicy() for m in experts_modules(model)]


def runs_lrmoe(experts: nn.Module) -> bool:
    """Whether a transformers experts module dispatches to an LRMoE forward now: its config's experts
    implementation is registered with a function of this package (``lrmoe``, or the expert-parallel
    forwards), not one of transformers' own (``eager``, ``grouped_mm``, ...), or its forward was
    replaced by one of this package (``lrmoe.hf.parallel``, the virtual EP). A module without a
    config (not dispatched by transformers) counts as LRMoE."""
    own = experts.__dict__.get("forward")
    if own is not None:
        return _from_lrmoe(getattr(own, "__func__", own))
    impl = getattr(getattr(experts, "config", None), "_experts_implementation", IMPLEMENTATION)
    if impl in (None, "eager"):
        return False
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    fn = ALL_EXPERTS_FUNCTIONS.get(impl) if impl in ALL_EXPERTS_FUNCTIONS else None
    return fn is not None and _from_lrmoe(fn)


def _from_lrmoe(fn) -> bool:
    return (getattr(fn, "__module__", None) or "").split(".")[0] == "lrmoe"


def backward_records(model: nn.Module) -> list[BackwardRecord | None]:
    """The BackwardRecord of each MoE layer from the latest backward (None for a layer not run yet, and
    for one whose experts implementation is not LRMoE now, e.g. after
    ``model.set_experts_implementation("grouped_mm")``: no record left over from an earlier one)."""
    return [getattr(m, RECORD_ATTR, None) if runs_lrmoe(m) else None for m in experts_modules(model)]


# --------------------------------------------------------------------------- model presets
@dataclass(frozen=True)
class ModelPreset:
    family: str  # "qwen3_moe" or "glm4_moe"
    config: dict
    hub_id: str | None = None  # where the real checkpoint lives (for from_pretrained)
    description: str = ""


# The paper's models, exactly as their published configurations (transformers field names).
QWEN3_30B_A3B = dict(
    hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
    num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], vocab_size=151936,
    max_position_embeddings=40960, rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
    router_aux_loss_coef=0.001, output_router_logits=False)
GLM_45_AIR = dict(
    hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=46,
    num_attention_heads=96, num_key_value_heads=8, head_dim=128, n_routed_experts=128, n_shared_experts=1,
    num_experts_per_tok=8, first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=1.0,
    n_group=1, topk_group=1, vocab_size=151552, max_position_embeddings=131072, rope_theta=1_000_000.0,
    partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=False, rms_norm_eps=1e-5,
    tie_word_embeddings=False)

MODEL_PRESETS: dict[str, ModelPreset] = {
    "qwen3-30b-a3b": ModelPreset("qwen3_moe", QWEN3_30B_A3B, "Qwen/Qwen3-30B-A3B", "the paper's Qwen3-30B-A3B"),
    "glm-4.5-air": ModelPreset("glm4_moe", GLM_45_AIR, "zai-org/GLM-4.5-Air", "the paper's GLM4.5-106B-A12B"),
    # Small members of each family: same architecture and routing, CPU-trainable widths/depths.
    "qwen3-moe-tiny": ModelPreset("qwen3_moe", dict(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, max_position_embeddings=2048, rope_theta=1_000_000.0, tie_word_embeddings=True),
        description="smoke-test Qwen3-MoE"),
    "qwen3-moe-small": ModelPreset("qwen3_moe", dict(
        hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=16, num_experts_per_tok=4,
        norm_topk_prob=True, max_position_embeddings=4096, rope_theta=1_000_000.0, tie_word_embeddings=True),
        description="CPU-scale Qwen3-MoE (16 experts, top-4)"),
    "glm4-moe-tiny": ModelPreset("glm4_moe", dict(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=1.0,
        n_group=1, topk_group=1, partial_rotary_factor=0.5, attention_bias=True, max_position_embeddings=2048,
        rope_theta=1_000_000.0, tie_word_embeddings=True), description="smoke-test GLM-4.5-style"),
    "glm4-moe-small": ModelPreset("glm4_moe", dict(
        hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, n_routed_experts=16, n_shared_experts=1,
        num_experts_per_tok=4, first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=1.0,
        n_group=1, topk_group=1, partial_rotary_factor=0.5, attention_bias=True, max_position_embeddings=4096,
        rope_theta=1_000_000.0, tie_word_embeddings=True), description="CPU-scale GLM-4.5-style (16 experts, top-4)"),
}


def model_config(preset: str, **overrides):
    """A transformers config for a model preset (``overrides`` replace fields, e.g. vocab_size)."""
    if preset not in MODEL_PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; accepted: {sorted(MODEL_PRESETS)}")
    p = MODEL_PRESETS[preset]
    fields = {**p.config, **overrides}
    if p.family == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(**fields)
    from transformers import Glm4MoeConfig

    return Glm4MoeConfig(**fields)


def moe_dims(config) -> dict:
    """The routed experts' dimensions of a Qwen3-MoE / GLM-4.5-MoE config, as a routing trace's meta
    stores them (``lrmoe.sim``'s model dimensions): hidden, intermediate (one expert's FFN),
    num_experts, top_k."""
    E = getattr(config, "num_experts", None) or getattr(config, "n_routed_experts", None)
    if E is None or not hasattr(config, "moe_intermediate_size"):
        raise ValueError(f"{type(config).__name__} has no routed experts (num_experts / n_routed_experts and "
                         f"moe_intermediate_size)")
    return {"hidden": int(config.hidden_size), "intermediate": int(config.moe_intermediate_size),
            "num_experts": int(E), "top_k": int(config.num_experts_per_tok)}


def build_model(preset: str, *, experts_implementation: str = IMPLEMENTATION, policy: BackwardPolicy | None = None,
                dtype: torch.dtype = torch.float32, seed: int = 0, **overrides) -> nn.Module:
    """A freshly initialised causal LM for ``preset`` with the given experts implementation."""
    from transformers import AutoModelForCausalLM

    if experts_implementation == IMPLEMENTATION:
        register()
    cfg = model_config(preset, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, experts_implementation=experts_implementation, dtype=dtype)
    if policy is not None:
        set_policy(model, policy)
    return model


def load_pretrained(path_or_hub_id: str, *, policy: BackwardPolicy | None = None, dtype=torch.bfloat16, **kwargs):
    """Load a real checkpoint (local folder or hub id) and its tokenizer with LRMoE experts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    register()
    model = AutoModelForCausalLM.from_pretrained(path_or_hub_id, experts_implementation=IMPLEMENTATION,
                                                 dtype=dtype, **kwargs)
    if policy is not None:
        set_policy(model, policy)
    return model, AutoTokenizer.from_pretrained(path_or_hub_id)
