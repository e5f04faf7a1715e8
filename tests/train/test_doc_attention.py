"""Document-causal flex attention over packed rows (lrmoe.hf.attention) against transformers' sdpa
path with its 4-D mask: the BlockMask itself, the models' outputs and gradients, and that no 4-D
mask is built.

Flex attention has no backward on the CPU (torch refuses), and transformers compiles it; on the
CPU these tests run torch's eager flex attention (its reference implementation) with the refusal
lifted, through transformers' own flex attention forward. The CUDA test runs the compiled kernel."""
import copy

import pytest
import torch
import transformers.integrations.flex_attention as hf_flex
import transformers.masking_utils as mu
from torch.nn.attention import flex_attention as fa

from lrmoe import hf
from lrmoe.data import IGNORE_INDEX
from lrmoe.hf import attention as att
from lrmoe.train.loss import causal_lm_loss

CUDA = pytest.mark.cuda  # run by scripts/gpu_check.sh (pytest -m cuda); skipped without a GPU (conftest)


def _positions(*rows):
    """position_ids [B, S] from each row's documents, given as (first position, length)."""
    return torch.stack([torch.cat([torch.arange(p, p + n) for p, n in docs]) for docs in rows])


# rows as lrmoe.data packs them: a document continued from the previous row (first position > 0), several
# documents, a row with one document, and the last row's padding (positions 0, 1, ... after the last document)
S = 300
ROWS = _positions([(37, 90), (0, 130), (0, 1), (0, 79)],
                  [(0, S)],
                  [(5, 120), (0, 128), (0, 12), (0, 40)])


@pytest.fixture
def eager_flex(monkeypatch):
    """transformers' flex attention forward, running torch's eager flex attention, backward on the CPU allowed;
    records the block_mask each call gets."""
    seen = []

    def flex(query, key, value, training=False, **kw):
        seen.append(kw.get("block_mask"))
        return fa.flex_attention(query, key, value, **kw)

    monkeypatch.setattr(hf_flex, "compile_friendly_flex_attention", flex)
    monkeypatch.setattr(fa, "_validate_device", lambda *a: None)
    return seen


def _dense(bm, doc_len):
    """The element mask [B, S, S] that a BlockMask stands for: its full blocks, and mask_mod inside its partial ones."""
    B, S_ = bm.shape[0], bm.seq_lengths[0]
    qb, kb = bm.BLOCK_SIZE
    out = torch.zeros(B, S_, S_, dtype=torch.bool)
    q, k = torch.arange(S_)[:, None], torch.arange(S_)[None, :]
    for b in range(B):
        for nums, idx, full in ((bm.kv_num_blocks, bm.kv_indices, False),
                                (bm.full_kv_num_blocks, bm.full_kv_indices, True)):
            for i in range(nums.shape[-1]):
                for j in idx[b, 0, i, : nums[b, 0, i]].tolist():
                    rq, rk = slice(i * qb, (i + 1) * qb), slice(j * kb, (j + 1) * kb)
                    block = torch.ones_like(out[b, rq, rk]) if full else bm.mask_mod(
                        torch.tensor(b), torch.tensor(0), q[rq], k[:, rk])
                    assert not (out[b, rq, rk] & block).any()  # every block listed once
                    out[b, rq, rk] |= block
    return out


def test_document_ids_follow_transformers():
    torch.testing.assert_close(att.document_ids(ROWS), mu.find_packed_sequence_indices(ROWS))
    assert att.document_ids(ROWS)[1].eq(0).all()


@pytest.mark.parametrize("block", [16, 128])
def test_block_mask_is_document_causal(block):
    """The BlockMask stands for (same document) & (k <= q), element by element, and has the block
    tables of torch's own create_block_mask for that mask_mod (which evaluates it on every pair)."""
    doc = att.document_ids(ROWS)
    want = (doc[:, :, None] == doc[:, None, :]) & torch.ones(S, S, dtype=torch.bool).tril()
    bm = att.document_causal_mask(ROWS, block=block)
    assert bm.shape == (3, 1, S, S)
    assert torch.equal(_dense(bm, S), want)

    def mask_mod(b, h, q, k):
        return (doc[b, q] == doc[b, k]) & (q >= k)

    ref = fa.create_block_mask(mask_mod, 3, None, S, S, device="cpu", BLOCK_SIZE=block)
    for name in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks"):
        assert torch.equal(getattr(bm, name), getattr(ref, name)), name
    for nums, name in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices")):
        n, a, r = getattr(ref, nums), getattr(bm, name), getattr(ref, name)
        for b in range(3):
            for i in range(n.shape[-1]):
                assert sorted(a[b, 0, i, : n[b, 0, i]].tolist()) == sorted(r[b, 0, i, : n[b, 0, i]].tolist())


def _labels(ids):
    labels = ids.clone()
    labels[:, :20] = IGNORE_INDEX
    labels[2, 248:] = IGNORE_INDEX  # the padding
    return labels


@pytest.mark.parametrize("preset", ["qwen3-moe-tiny", "glm4-moe-tiny"])
def test_flex_equals_sdpa_outputs_and_gradients(preset, eager_flex):
    """The same model with flex attention and the document BlockMask, and with transformers' sdpa and its
    4-D mask from position_ids, in float64: logits, loss and every parameter's gradient."""
    sdpa = hf.build_model(preset, vocab_size=97, seed=5, dtype=torch.float64)
    assert sdpa.config._attn_implementation == "sdpa"
    flex = copy.deepcopy(sdpa)
    flex.set_attn_implementation(att.FLEX)
    assert att.uses_flex(flex) and not att.uses_flex(sdpa)
    ids = torch.randint(0, 97, ROWS.shape, generator=torch.Generator().manual_seed(0))
    labels = _labels(ids)
    with torch.no_grad():
        ref = sdpa(input_ids=ids, position_ids=ROWS, use_cache=False).logits
        got = flex(input_ids=ids, position_ids=ROWS, use_cache=False, **att.attention_inputs(flex, ROWS)).logits
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)
    n_layers = flex.config.num_hidden_layers
    assert len(eager_flex) == n_layers and all(isinstance(m, fa.BlockMask) for m in eager_flex)
    grads = []
    for model in (sdpa, flex):
        loss, n = causal_lm_loss(model, ids, ROWS, labels)
        loss.backward()
        grads.append({k: p.grad for k, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 10
    for k in grads[0]:
        torch.testing.assert_close(grads[1][k], grads[0][k], rtol=1e-9, atol=1e-11, msg=k)


def test_no_4d_mask_is_built(eager_flex, monkeypatch):
    """With flex attention the model gets the BlockMask and transformers builds no mask at all; with sdpa
    (the control) transformers builds a [B, 1, S, S] tensor from the packed position_ids."""
    built = []

    def spy(name, fn):
        def wrapped(*a, **kw):
            m = fn(*a, **kw)
            built.append((name, None if m is None else tuple(m.shape)))
            return m
        return wrapped

    for name, fn in list(mu.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.items()):
        monkeypatch.setitem(mu.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, name, spy(name, fn))
    sdpa = hf.build_model("qwen3-moe-tiny", vocab_size=97, seed=5)
    flex = copy.deepcopy(sdpa)
    flex.set_attn_implementation(att.FLEX)
    ids = torch.randint(0, 97, ROWS.shape)
    with torch.no_grad():
        causal_lm_loss(flex, ids, ROWS, _labels(ids))
        assert built == [] and eager_flex and all(isinstance(m, fa.BlockMask) for m in eager_flex)
        causal_lm_loss(sdpa, ids, ROWS, _labels(ids))
    assert built == [("sdpa", (3, 1, S, S))]


def test_attention_for(monkeypatch):
    monkeypatch.delenv(att.ATTENTION_ENV, raising=False)
    assert att.attention_for("cpu") == "sdpa" and att.attention_for("cuda:3") == "flex_attention"
    monkeypatch.setenv(att.ATTENTION_ENV, "sdpa")
    assert att.attention_for("cuda") == "sdpa"
    monkeypatch.setenv(att.ATTENTION_ENV, "flex_attention")
    with pytest.raises(ValueError, match="no backward on the CPU"):
        att.attention_for("cpu")
    monkeypatch.setenv(att.ATTENTION_ENV, "flash")
    with pytest.raises(ValueError, match="accepted"):
        att.attention_for("cuda")


@CUDA
@pytest.mark.parametrize("preset", ["qwen3-moe-tiny", "glm4-moe-tiny"])
def test_cuda_compiled_flex_equals_sdpa(preset):
    """On a GPU, transformers' compiled flex attention with the document BlockMask against sdpa with its
    4-D mask, fp32, rows of 1,000 tokens: logits, loss and gradients."""
    dev = torch.device("cuda")
    rows = _positions([(37, 290), (0, 530), (0, 1), (0, 179)], [(0, 1000)],
                      [(5, 420), (0, 328), (0, 12), (0, 240)]).to(dev)
    sdpa = hf.build_model(preset, vocab_size=97, seed=5).to(dev)
    flex = copy.deepcopy(sdpa)
    flex.set_attn_implementation(att.FLEX)
    ids = torch.randint(0, 97, rows.shape, device=dev)
    labels = ids.clone()
    labels[:, :20] = IGNORE_INDEX
    grads, losses = [], []
    for model in (sdpa, flex):
        loss, _ = causal_lm_loss(model, ids, rows, labels)
        loss.backward()
        losses.append(loss.detach())
        grads.append({k: p.grad for k, p in model.named_parameters() if p.grad is not None})
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-4, atol=1e-4)
    for k in grads[0]:
        torch.testing.assert_close(grads[1][k], grads[0][k], rtol=2e-3, atol=2e-5, msg=k)
