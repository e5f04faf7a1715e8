"""TrainConfig (lrmoe.train.config): values refused at construction or by validate, with messages
that name the value and what is accepted; what two configs of the same run may differ in."""
import pytest

from lrmoe.train import TrainConfig, config_differences


@pytest.mark.parametrize("kw, match", [
    (dict(micro_batch=0), "micro_batch must be an integer >= 1"),
    (dict(micro_batch=3, global_batch=8), r"global_batch \(8\) must be a multiple of micro_batch \(3\)"),
    (dict(micro_batch=2, global_batch=8, grad_accum=2), r"must equal micro_batch \(2\) \* grad_accum \(2\)"),
    (dict(steps=0), "steps must be an integer >= 1"),
    (dict(steps=5, warmup_steps=6), r"warmup_steps \(6\) must be <= steps \(5\)"),
    (dict(lr=-1.0), "lr must be a finite number > 0"),
    (dict(drop_ratio=1.5), r"drop_ratio must be a number in \[0, 1\)"),
    (dict(scorer="nope"), "unknown scorer 'nope'"),
    (dict(quota="nope"), "unknown quota policy 'nope'"),
    (dict(mode="nope"), "unknown backward mode 'nope'"),
    (dict(model="gpt2"), "unknown model preset 'gpt2'"),
    (dict(dtype="fp8"), "unknown dtype 'fp8'"),
    (dict(device="tpu"), "device"),
    (dict(min_lr_ratio=2.0), r"min_lr_ratio must be a finite number in \[0, 1\]"),
    (dict(clip=-1.0), r"clip must be a finite number in \[0, inf\)"),
])
def test_bad_config_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**kw).validate()


@pytest.mark.parametrize("kw,match", [
    (dict(eps=-1.0), r"eps must be a finite number in \(0, inf\)"),
    (dict(eps=float("nan")), "eps must be a finite number"),
    (dict(weight_decay=float("nan")), "weight_decay must be a finite number"),
    (dict(clip=float("nan")), r"clip must be a finite number in \[0, inf\) \(0 turns clipping off\)"),
    (dict(beta2=1.0), r"beta2 must be a finite number in \[0, 1\)"),
    (dict(threads=1.5), "threads must be an integer >= 1 or None"),
    (dict(max_records=2.5), "max_records must be an integer >= 1 or None"),
    (dict(eval_batches=True), "eval_batches must be an integer >= 1 or None"),
    (dict(model_overrides={"num_hiden_layers": 1}), r"model_overrides \['num_hiden_layers'\] are not fields"),
])
def test_bad_values_rejected_by_validate(kw, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**kw).validate()


def test_known_model_overrides_accepted():
    TrainConfig(model_overrides={"num_hidden_layers": 1, "vocab_size": 300}).validate()


@pytest.mark.parametrize("kw,match", [
    (dict(model_overrides={"output_router_logits": True}), "auxiliary loss"),
    (dict(mode="full", drop_ratio=0.2), "mode 'full' keeps every pair"),
    (dict(placement="symi"), "placement applies only to expert parallelism"),
    (dict(ep_budget_mib=1, ep_options={"min_tokens": 2}), "ep_budget_mib, ep_options apply only"),
    (dict(tokenizer="bpe:abc"), "'bpe:N' with N a positive integer"),
    (dict(tokenizer="bpe:0"), "'bpe:N' with N a positive integer"),
])
def test_config_checks(kw, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**kw).validate()


def test_rope_overrides_are_accepted():
    """rope_theta lives under rope_parameters in transformers 5; the presets set it themselves."""
    TrainConfig(model="qwen3-moe-tiny", model_overrides={"rope_theta": 1e4}).validate()
