"""transformers integration: the "lrmoe" experts implementation and the kit's model presets.

    import lrmoe.hf
    lrmoe.hf.register()                                   # adds "lrmoe" to ExpertsInterface
    model = AutoModelForCausalLM.from_config(cfg, experts_implementation="lrmoe")
    lrmoe.hf.set_policy(model, BackwardPolicy(drop_ratio=0.2))

Expert parallelism for the same models: :mod:`lrmoe.hf.parallel`.
"""
from .integration import (IMPLEMENTATION, MODEL_PRESETS, POLICY_ATTR, RECORD_ATTR, ModelPreset, activation_of,
                          backward_records, build_model, check_supported, experts_modules, get_policies,
                          load_pretrained, lrmoe_experts_forward, model_config, register, runs_lrmoe, set_policy)

__all__ = ["IMPLEMENTATION", "MODEL_PRESETS", "POLICY_ATTR", "RECORD_ATTR", "ModelPreset", "activation_of",
           "backward_records", "build_model", "check_supported", "experts_modules", "get_policies",
           "load_pretrained", "lrmoe_experts_forward", "model_config", "register", "runs_lrmoe", "set_policy"]
