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


@pytest.mark.parametrize("kw,match", [
    (dict(lr=-1.0), r"lr must be a finite number > 0, got -1.0"),
    (dict(steps=0), r"steps must be an integer >= 1, got 0"),
    (dict(eps=0.0), r"eps must be a finite number in \(0, inf\), got 0.0"),
    (dict(seq_len=1), r"seq_len must be an integer >= 2, got 1"),
    (dict(dtype="fp16"), r"unknown dtype 'fp16'; accepted: \['auto', 'fp32', 'bf16'\]"),
    (dict(device="gpu"), r"unknown device 'gpu'; accepted: auto, cpu, cuda, cuda:N"),
    (dict(model_overrides={"initializer_range": -1}), r"initializer_range .* must be a finite number >= 0, got -1"),
    (dict(model_overrides={"initializer_range": float("nan")}), r"initializer_range .* got nan"),
    (dict(ep=0), r"ep must be an integer >= 1, got 0"),
    (dict(load_concurrency=-1), r"load_concurrency must be an int >= 0"),
    (dict(sample_layers=[0, "last"]), r"sample_layers must be a list of integers"),
])
def test_bad_values_are_refused_at_construction(kw, match):
    """No need to call validate(): a config that cannot run is never built, so a bad value fails
    before data preparation and model building, not late in the run."""
    with pytest.raises(ValueError, match=match):
        TrainConfig(**kw)


def test_a_negative_initial_std_never_reaches_the_model():
    with pytest.raises(ValueError, match="initializer_range"):
        TrainConfig.from_dict({"model_overrides": {"initializer_range": -0.02}})


def test_threads_are_not_part_of_what_defines_a_run():
    """Two finished runs that differ only in runtime fields are the same run (a resume with another
    thread count is refused by the checkpoint's check instead)."""
    a, b = TrainConfig(threads=1).to_dict(), TrainConfig(threads=2, log_interval=3).to_dict()
    assert config_differences(a, b) == []
    assert config_differences(a, TrainConfig(lr=2e-3).to_dict()) == ["lr: 0.001 != 0.002"]
