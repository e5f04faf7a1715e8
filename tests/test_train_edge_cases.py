"""Edge cases of the transformers integration and the training loop (from a review pass):
the "lrmoe" experts against transformers' eager experts, the block-causal mask over packed
documents, Ctrl-C at and inside a step, the policy generator's device key, config validation,
the end of the cosine schedule, the family of an ``init_from`` checkpoint, caption scale."""
import math
import os
import signal

import pytest
import torch

import lrmoe.hf as hf
from lrmoe import BackwardPolicy
from lrmoe.train import TrainConfig, read_metrics, train

# the offline data, the cache isolation (autouse) and the small run config of the training tests
from test_train import _isolated_caches, cfg, data_path  # noqa: E402,F401


# ----------------------------------------------------------------------------- hf: experts forward


def _compare(preset, dtype, impl="eager", **over):
    ref = hf.build_model(preset, experts_implementation=impl, vocab_size=97, seed=3, dtype=dtype, **over)
    ours = hf.build_model(preset, vocab_size=97, seed=3, dtype=dtype, policy=BackwardPolicy(0.0), **over)
    # a non-zero GLM correction bias (changes which experts are chosen, not the weights)
    for m in ref.modules():
        if hasattr(m, "e_score_correction_bias"):
            m.e_score_correction_bias.copy_(torch.linspace(-0.3, 0.3, m.e_score_correction_bias.numel()))
    ours.load_state_dict(ref.state_dict())
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(0))
    la = ref(input_ids=ids, labels=ids)
    lb = ours(input_ids=ids, labels=ids)
    la.loss.backward()
    lb.loss.backward()
    return ref, ours, la, lb


@pytest.mark.parametrize("preset,over", [
    ("qwen3-moe-tiny", dict(norm_topk_prob=False)),
    ("glm4-moe-tiny", dict(norm_topk_prob=False, routed_scaling_factor=2.5)),
    ("glm4-moe-tiny", dict()),
])
def test_forward_matches_eager_fp32(preset, over):
    ref, ours, la, lb = _compare(preset, torch.float32, **over)
    torch.testing.assert_close(lb.logits, la.logits, rtol=1e-4, atol=1e-5)
    gr = dict(ref.named_parameters())
    for n, p in ours.named_parameters():
        if gr[n].grad is None:
            assert p.grad is None, n
            continue
        torch.testing.assert_close(p.grad, gr[n].grad, rtol=1e-3, atol=1e-5, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("preset", ["qwen3-moe-tiny", "glm4-moe-tiny"])
def test_forward_matches_eager_bf16(preset):
    ref, ours, la, lb = _compare(preset, torch.bfloat16)
    assert lb.logits.dtype == la.logits.dtype
    torch.testing.assert_close(lb.logits.float(), la.logits.float(), rtol=3e-2, atol=3e-2)
    assert abs(float(lb.loss) - float(la.loss)) < 2e-2


def test_forward_under_cpu_autocast_matches_eager():
    ref = hf.build_model("qwen3-moe-tiny", experts_implementation="eager", vocab_size=97, seed=3)
    ours = hf.build_model("qwen3-moe-tiny", vocab_size=97, seed=3)
    ours.load_state_dict(ref.state_dict())
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a = ref(input_ids=ids).logits
        b = ours(input_ids=ids).logits
    torch.testing.assert_close(b.float(), a.float(), rtol=5e-2, atol=5e-2)


# ----------------------------------------------------------------------------- packed documents


def test_packed_documents_do_not_attend_to_each_other():
    """With use_cache=False (as train() and evaluate() call the model) the mask follows
    position_ids: document 2 packed after document 1 gives the logits of document 2 alone.
    With transformers' default cache the mask would be plainly causal (the control)."""
    model = hf.build_model("qwen3-moe-tiny", vocab_size=97, seed=1)
    model.train()
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(0, 97, (1, 7), generator=g), torch.randint(0, 97, (1, 9), generator=g)
    packed = torch.cat([a, b], 1)
    pos = torch.cat([torch.arange(7), torch.arange(9)]).unsqueeze(0)
    with torch.no_grad():
        alone = model(input_ids=b, position_ids=torch.arange(9).unsqueeze(0), use_cache=False).logits
        together = model(input_ids=packed, position_ids=pos, use_cache=False).logits[:, 7:]
        cached = model(input_ids=packed, position_ids=pos).logits[:, 7:]
    torch.testing.assert_close(together, alone, rtol=1e-4, atol=1e-5)
    assert (cached - alone).abs().max() > 1e-2  # the control: the cache's causal mask mixes them


def test_evaluate_loss_does_not_mix_packed_documents():
    """evaluate() on one packed row of two documents must equal the token-weighted loss of the two
    documents evaluated on their own (no cross-document attention, docs/reproduce.md 'Data')."""
    from lrmoe.data import AlpacaDataset, pack_examples
    from lrmoe.train import evaluate

    model = hf.build_model("qwen3-moe-tiny", vocab_size=97, seed=1)
    g = torch.Generator().manual_seed(0)
    d1 = torch.randint(1, 97, (10,), generator=g).tolist()
    d2 = torch.randint(1, 97, (14,), generator=g).tolist()
    ex = [(d1, [-100] * 4 + d1[4:]), (d2, [-100] * 5 + d2[5:])]
    c = TrainConfig(micro_batch=1)
    noop = lambda: torch.autocast("cpu", enabled=False)  # noqa: E731
    together = evaluate(model, AlpacaDataset(pack_examples(ex, 24, seed=0)), c, torch.device("cpu"), noop)
    sep = [evaluate(model, AlpacaDataset(pack_examples([e], len(e[0]), seed=0)), c, torch.device("cpu"), noop)
           for e in ex]
    assert together["eval_tokens"] == sum(s["eval_tokens"] for s in sep)
    expect = sum(s["eval_loss"] * s["eval_tokens"] for s in sep) / together["eval_tokens"]
    assert together["eval_loss"] == pytest.approx(expect, rel=1e-5)


# ----------------------------------------------------------------------------- Ctrl-C


def _on_call(monkeypatch, target, name, n, action):
    """Run ``action()`` on the n-th call (1-based) of target.name, before the call."""
    orig = getattr(target, name)
    calls = {"n": 0}

    def wrapper(*a, **k):
        calls["n"] += 1
        if calls["n"] == n:
            action()
        return orig(*a, **k)

    monkeypatch.setattr(target, name, wrapper)


def _raise():
    raise KeyboardInterrupt


def _sigint():
    os.kill(os.getpid(), signal.SIGINT)


@pytest.fixture
def sigint_handler(request):
    """SIGINT set to ``request.param`` (default: Python's own handler, whatever this process
    inherited: a background job starts with SIGINT ignored) for the test, restored after."""
    handler = getattr(request, "param", signal.default_int_handler)
    before = signal.signal(signal.SIGINT, handler)
    yield handler
    signal.signal(signal.SIGINT, before)


@pytest.mark.parametrize("how", ["signal", "exception"])
def test_ctrl_c_inside_a_step_resumes_exactly(data_path, tmp_path, monkeypatch, how, sigint_handler):
    """Ctrl-C while step 3's second micro-batch runs (grad_accum 2, random scorer). A real SIGINT
    lets step 3 finish and checkpoints at its end; a KeyboardInterrupt raised inside the step
    (no consistent state) writes no checkpoint. Either way the resumed run equals an
    uninterrupted one: same rows, epochs and losses."""
    c = cfg(data_path, steps=5, grad_accum=2, drop_ratio=0.3, scorer="random")
    full, part = tmp_path / "full", tmp_path / "part"
    train(c, full, progress=False)
    with monkeypatch.context() as mp:  # backward_records: once per micro-batch; call 6 = step 3, micro-batch 2
        _on_call(mp, hf, "backward_records", 6, _sigint if how == "signal" else _raise)
        with pytest.raises(KeyboardInterrupt):
            train(c, part, progress=False)
    rows = read_metrics(part / "metrics.jsonl")
    assert [r["step"] for r in rows] == ([1, 2, 3] if how == "signal" else [1, 2])
    assert (part / "checkpoint.pt").exists() == (how == "signal")
    assert signal.getsignal(signal.SIGINT) is sigint_handler  # the handler was restored
    train(c, part, progress=False)
    a, b = read_metrics(full / "metrics.jsonl"), read_metrics(part / "metrics.jsonl")
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5]
    assert [r["epoch"] for r in b] == [r["epoch"] for r in a]
    assert [r["loss"] for r in b] == [r["loss"] for r in a]


@pytest.mark.parametrize("sigint_handler", [signal.SIG_IGN], indirect=True)
def test_an_ignored_sigint_stays_ignored(data_path, tmp_path, monkeypatch, sigint_handler):
    """A process started with SIGINT ignored (a background job, nohup) keeps ignoring it: training
    installs no Ctrl-C handler, and a SIGINT in the middle of a step changes nothing."""
    c = cfg(data_path, steps=3, warmup_steps=1, eval_batches=None)
    seen = []
    with monkeypatch.context() as mp:
        _on_call(mp, hf, "backward_records", 2, lambda: (seen.append(signal.getsignal(signal.SIGINT)), _sigint()))
        try:
            train(c, tmp_path / "run", progress=False)
        except KeyboardInterrupt:  # not let through to pytest, which would end the whole session
            pytest.fail("training stopped on a SIGINT that the process ignores")
    assert seen == [signal.SIG_IGN]
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3]
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def test_ctrl_c_during_evaluation_keeps_every_metrics_row(data_path, tmp_path, monkeypatch, sigint_handler):
    """Ctrl-C during the evaluation of step 2: the step (with its eval) completes, its row is
    written, the checkpoint is at step 2, and the resumed file has one row per step."""
    import lrmoe.train.loop as T

    c = cfg(data_path, steps=4, eval_interval=2)
    with monkeypatch.context() as mp:
        _on_call(mp, T, "evaluate", 1, _sigint)
        with pytest.raises(KeyboardInterrupt):
            train(c, tmp_path, progress=False)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and "eval_loss" in rows[-1]
    train(c, tmp_path, progress=False)
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]


# ----------------------------------------------------------------------------- policy generator device key


def test_generator_key_normalises_the_cuda_index(monkeypatch):
    """train() saves policy.generator(runner.device) while the experts draw from
    policy.generator(tensor.device): "cuda" and "cuda:0" must be one generator. (CPU machine: the
    CUDA generator and current device are stood in for.)"""
    real = torch.Generator

    class FakeGen:
        def __init__(self, device=None):
            self.device, self.g = device, real()

        def manual_seed(self, s):
            self.g.manual_seed(s)
            return self

    monkeypatch.setattr(torch, "Generator", FakeGen)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    policy = BackwardPolicy(0.2, scorer="random", seed=5)
    assert policy.generator(torch.device("cuda")) is policy.generator(torch.device("cuda", 0))
    assert policy.generator("cpu") is not policy.generator(torch.device("cuda", 0))


def test_changing_the_seed_starts_the_new_seed_stream():
    policy = BackwardPolicy(0.2, scorer="random", seed=1)
    first = torch.rand(4, generator=policy.generator("cpu"))
    policy.seed = 2
    assert torch.equal(torch.rand(4, generator=policy.generator("cpu")),
                       torch.rand(4, generator=torch.Generator().manual_seed(2)))
    policy.seed = 1  # back to seed 1: its stream continues where it was
    assert not torch.equal(torch.rand(4, generator=policy.generator("cpu")), first)


# ----------------------------------------------------------------------------- config validation


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


# ----------------------------------------------------------------------------- LR schedule end


def test_cosine_reaches_min_lr_on_the_last_step():
    """'cosine decay ends at min_lr_ratio * lr': the last optimizer step (0-based steps-1) should use
    min_lr_ratio * lr. With steps=10, warmup=2 it uses 0.134 * lr instead of 0.1 * lr."""
    from lrmoe.train import lr_factor

    c = TrainConfig(steps=10, warmup_steps=2, lr=1.0, min_lr_ratio=0.1)
    f = [lr_factor(s, c) for s in range(10)]
    assert f[-1] == pytest.approx(0.1, abs=1e-6), f


# ----------------------------------------------------------------------------- init_from family


def test_init_from_a_glm_checkpoint_reports_the_glm_family(data_path, tmp_path):
    """summary.json's model.family (used by paper_figures to group runs into tables) comes from the
    cfg.model preset even when the weights come from init_from: a GLM checkpoint trained with the
    default model preset is reported (and tabulated) as qwen3_moe."""
    src = hf.build_model("glm4-moe-tiny", vocab_size=320, seed=7)
    src.save_pretrained(tmp_path / "ckpt")
    c = cfg(data_path, steps=1, warmup_steps=0, init_from=str(tmp_path / "ckpt"), eval_batches=1)
    s = train(c, tmp_path / "run", progress=False)
    assert s["model"]["moe_layers"] == 1  # the GLM checkpoint's layers were indeed used
    assert s["model"]["family"] == "glm4_moe"


# ----------------------------------------------------------------------------- paper_figures scale line


@pytest.mark.parametrize("config,rows", [({"micro_batch": 1, "grad_accum": 4}, 4), ({"micro_batch": 8}, 8),
                                         ({"micro_batch": 2, "global_batch": 16, "grad_accum": 8}, 16), ({}, "?")])
def test_caption_rows_per_step_count_accumulation(config, rows):
    from paper_figures import _rows_per_step

    assert _rows_per_step(config) == rows


def test_bf16_autocast_on_cpu_tracks_fp32(data_path, tmp_path):
    a = cfg(data_path, steps=2, warmup_steps=1, eval_batches=None)
    b = cfg(data_path, steps=2, warmup_steps=1, eval_batches=None, dtype="bf16")
    train(a, tmp_path / "a", progress=False)
    train(b, tmp_path / "b", progress=False)
    ra, rb = read_metrics(tmp_path / "a" / "metrics.jsonl"), read_metrics(tmp_path / "b" / "metrics.jsonl")
    assert rb[0]["loss"] == pytest.approx(ra[0]["loss"], rel=2e-2)
    assert math.isfinite(rb[-1]["eval_loss"])


def test_evaluation_without_response_tokens_warns():
    from lrmoe.data import AlpacaDataset, pack_examples
    from lrmoe.train import evaluate

    model = hf.build_model("qwen3-moe-tiny", vocab_size=97, seed=1)
    ids = list(range(1, 13))
    held = AlpacaDataset(pack_examples([(ids, [-100] * len(ids))], 12, seed=0))  # prompt only
    noop = lambda: torch.autocast("cpu", enabled=False)  # noqa: E731
    with pytest.warns(UserWarning, match="no response tokens"):
        assert evaluate(model, held, TrainConfig(micro_batch=1), torch.device("cpu"), noop) == {}
