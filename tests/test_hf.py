"""transformers integration: the "lrmoe" experts implementation in Qwen3-MoE and GLM-4.5 models."""
import pytest
import torch

import lrmoe.hf as hf
from lrmoe import BackwardPolicy


def train_steps(model, batches):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses, grads = [], []
    for ids in batches:
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
    return losses, grads


@pytest.mark.parametrize("preset", ["qwen3-moe-tiny", "glm4-moe-tiny"])
def test_drop0_matches_grouped_mm_over_optimizer_steps(preset):
    ref = hf.build_model(preset, experts_implementation="grouped_mm", vocab_size=97, seed=3)
    ours = hf.build_model(preset, vocab_size=97, seed=3, policy=BackwardPolicy(0.0))
    ours.load_state_dict(ref.state_dict())
    batches = [torch.randint(0, 97, (2, 12)) for _ in range(3)]
    (l1, g1), (l2, g2) = train_steps(ref, batches), train_steps(ours, batches)
    for step, (a, b, ga, gb) in enumerate(zip(l1, l2, g1, g2)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=lambda m: f"loss at step {step}: {m}")
        assert ga.keys() == gb.keys()
        for n in ga:
            torch.testing.assert_close(gb[n], ga[n], rtol=1e-4, atol=1e-6, msg=lambda m: f"step {step} {n}: {m}")


def test_policies_and_records_per_layer():
    model = hf.build_model("qwen3-moe-tiny", vocab_size=50)
    n = len(hf.experts_modules(model))
    assert n == 2
    hf.set_policy(model, [BackwardPolicy(0.0), BackwardPolicy(0.5, scorer="grad_norm")])
    assert [p.drop_ratio for p in hf.get_policies(model)] == [0.0, 0.5]
    assert hf.backward_records(model) == [None, None]
    ids = torch.randint(0, 50, (2, 10))
    model(input_ids=ids, labels=ids).loss.backward()
    r0, r1 = hf.backward_records(model)
    assert r0.kept_fraction == 1.0 and r1.kept_fraction == 0.5
    assert r1.kept_mask.shape == (20, 2)


def test_set_policy_errors():
    model = hf.build_model("glm4-moe-tiny", vocab_size=50)
    with pytest.raises(ValueError, match="got 3 policies for 1 MoE layers"):
        hf.set_policy(model, [BackwardPolicy()] * 3)
    with pytest.raises(ValueError, match="no routed-experts modules"):
        hf.set_policy(torch.nn.Linear(2, 2), BackwardPolicy())
    with pytest.raises(ValueError, match="unknown model preset 'gpt2'"):
        hf.model_config("gpt2")


def test_paper_configs_have_the_published_dimensions():
    q = hf.model_config("qwen3-30b-a3b")
    assert (q.hidden_size, q.moe_intermediate_size, q.num_experts, q.num_experts_per_tok, q.num_hidden_layers) == (
        2048, 768, 128, 8, 48)
    g = hf.model_config("glm-4.5-air")
    assert (g.hidden_size, g.moe_intermediate_size, g.n_routed_experts, g.num_experts_per_tok) == (4096, 1408, 128, 8)
    assert g.rope_parameters["rope_theta"] == 1e6 if hasattr(g, "rope_parameters") else g.rope_theta == 1e6
