"""The chunked token loss (lrmoe.train.loss) against the plain one (token_loss, the reference):
values and gradients, chunk sizes that do and do not divide the tokens, one-token chunks, rows
without labels, tied embeddings, autocast, and that no [tokens, vocab] tensor is kept."""
import pytest
import torch
import torch.nn.functional as F

from lrmoe import hf
from lrmoe.data import IGNORE_INDEX
from lrmoe.train import loss as tl

CUDA = pytest.mark.cuda  # run by scripts/gpu_check.sh (pytest -m cuda); skipped without a GPU (conftest)


def _case(dtype, B=3, S=9, H=5, V=11, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, S, H, generator=g, dtype=dtype).requires_grad_()
    weight = torch.randn(V, H, generator=g, dtype=dtype).requires_grad_()
    b = torch.randn(V, generator=g, dtype=dtype).requires_grad_() if bias else None
    labels = torch.randint(0, V, (B, S), generator=g)
    labels[0, :4] = IGNORE_INDEX  # a prompt
    labels[1] = IGNORE_INDEX  # a row without labels
    labels[2, 3] = IGNORE_INDEX
    return hidden, weight, b, labels


def _grads(loss, tensors):
    return torch.autograd.grad(loss, [t for t in tensors if t is not None])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("chunk", [1, 5, 7, 12, 1024])  # 12 labelled tokens: 5 and 7 do not divide them
def test_equals_token_loss(dtype, chunk):
    hidden, weight, bias, labels = _case(dtype)
    ref, n_ref = tl.token_loss(F.linear(hidden, weight, bias), labels)
    got, n = tl.chunked_token_loss(hidden, labels, weight, bias, chunk=chunk)
    assert n == n_ref == 12 and got.dtype == dtype
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got, ref, **tol)
    for a, b in zip(_grads(got, (hidden, weight, bias)), _grads(ref, (hidden, weight, bias))):
        torch.testing.assert_close(a, b, **tol)


def test_gradcheck_float64():
    hidden, weight, bias, labels = _case(torch.float64, B=3, S=5, H=3, V=4, seed=1)

    def f(h, w, b):
        return tl.chunked_token_loss(h, labels, w, b, chunk=2)[0]

    assert torch.autograd.gradcheck(f, (hidden, weight, bias))


def test_no_labels_gives_zero_connected_to_the_graph():
    """No labelled position: loss 0 and count 0, and the backward still reaches the hidden states
    (zero gradients), as the plain loss does: every rank of an EP run runs its backward."""
    hidden, weight, _, labels = _case(torch.float32, bias=False)
    labels[:] = IGNORE_INDEX
    got, n = tl.chunked_token_loss(hidden, labels, weight, chunk=4)
    assert n == 0 and float(got.detach()) == 0.0
    gh, gw = _grads(got, (hidden, weight))
    assert not gh.any() and not gw.any()


def test_no_chunk_sized_tensor_kept_for_backward():
    """What the loss keeps for its backward outside the checkpointed chunks: nothing of [chunk, vocab]."""
    hidden, weight, bias, labels = _case(torch.float32, B=3, S=40, H=4, V=64, bias=True)
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        got, _ = tl.chunked_token_loss(hidden, labels, weight, bias, chunk=8)
    assert shapes and all(64 not in s or s == (64, 4) or s == (64,) for s in shapes), shapes  # weight, bias only
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        tl.token_loss(F.linear(hidden, weight, bias), labels)
    assert any(len(s) >= 2 and s[-1] == 64 for s in shapes)  # the control: the plain loss keeps logits


def test_bad_chunk():
    hidden, weight, _, labels = _case(torch.float32, bias=False)
    with pytest.raises(ValueError, match="chunk"):
        tl.chunked_token_loss(hidden, labels, weight, chunk=0)


def _packed_batch(vocab, B=2, S=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, S), generator=g)
    pos = torch.cat([torch.arange(3, 13), torch.arange(14)]).repeat(B, 1)  # a continued document, then one more
    labels = ids.clone()
    labels[:, 10:16] = IGNORE_INDEX  # the second document's prompt
    labels[1] = IGNORE_INDEX  # a row without labels
    return ids, pos, labels


@pytest.mark.parametrize("preset", ["qwen3-moe-tiny", "glm4-moe-tiny"])  # both tie their embeddings
def test_model_loss_chunked_equals_plain(preset):
    """causal_lm_loss through the decoder and chunks (plain_max=0) against the model's own logits and
    token_loss: the loss, every parameter's gradient (the tied embedding's too), and evaluation
    (no gradients, no checkpoint)."""
    model = hf.build_model(preset, vocab_size=97, seed=3)
    assert model.config.tie_word_embeddings and model.get_output_embeddings().weight is model.get_input_embeddings().weight
    ids, pos, labels = _packed_batch(97)
    params = [p for p in model.parameters() if p.requires_grad]
    out = {}
    for name, plain_max in (("plain", 10 ** 12), ("chunked", 0)):
        loss, n = tl.causal_lm_loss(model, ids, pos, labels, chunk=5, plain_max=plain_max)
        out[name] = (loss, n, torch.autograd.grad(loss, params, allow_unused=True))
    (lp, np_, gp), (lc, nc, gc) = out["plain"], out["chunked"]
    assert np_ == nc == 17
    torch.testing.assert_close(lc, lp, rtol=1e-6, atol=1e-6)
    for a, b in zip(gc, gp):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    torch.testing.assert_close(lp, tl.token_loss(logits, labels)[0], rtol=0, atol=0)  # the plain path is today's
    with torch.no_grad():
        ev, _ = tl.causal_lm_loss(model, ids, pos, labels, chunk=4, plain_max=0)
    torch.testing.assert_close(ev, lp.detach(), rtol=1e-6, atol=1e-6)


def test_model_loss_under_bf16_autocast():
    """Under autocast each chunk's logits come out of the output layer in bf16 and are upcast per
    chunk, as the plain path upcasts the model's bf16 logits."""
    model = hf.build_model("qwen3-moe-tiny", vocab_size=97, seed=3)
    ids, pos, labels = _packed_batch(97)
    seen = []
    orig = tl._chunk_loss

    def spy(h, w, b, y):
        seen.append(F.linear(h, w, b).dtype)
        return orig(h, w, b, y)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain, _ = tl.causal_lm_loss(model, ids, pos, labels, plain_max=10 ** 12)
        tl._chunk_loss, saved = spy, tl._chunk_loss
        try:
            chunked, _ = tl.causal_lm_loss(model, ids, pos, labels, chunk=4, plain_max=0)
        finally:
            tl._chunk_loss = saved
    assert seen and set(seen) == {torch.bfloat16} and chunked.dtype == torch.float32
    torch.testing.assert_close(chunked, plain, rtol=2e-3, atol=2e-3)


@CUDA
def test_cuda_bf16_chunked_loss_memory():
    """On a GPU, at a vocabulary of 151,936: the chunked loss equals the plain one under bf16 autocast
    (loss and gradients) and its peak memory stays far below the plain loss's."""
    torch.manual_seed(0)
    dev = torch.device("cuda")
    T, H, V = 8192, 1024, 151936
    hidden = torch.randn(1, T, H, device=dev, requires_grad=True)
    weight = (torch.randn(V, H, device=dev) * 0.02).requires_grad_()
    labels = torch.randint(0, V, (1, T), device=dev)
    labels[:, : T // 3] = IGNORE_INDEX
    res = {}
    for name in ("plain", "chunked"):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if name == "plain":
                loss, _ = tl.token_loss(F.linear(hidden, weight), labels)
            else:
                loss, _ = tl.chunked_token_loss(hidden, labels, weight)
        gh, gw = torch.autograd.grad(loss, (hidden, weight))
        torch.cuda.synchronize()
        res[name] = (loss.detach(), gh, gw, torch.cuda.max_memory_allocated() - base)
        del loss, gh, gw
    (lp, ghp, gwp, mp), (lc, ghc, gwc, mc) = res["plain"], res["chunked"]
    print(f"peak above inputs: plain {mp / 2**30:.2f} GiB, chunked {mc / 2**30:.2f} GiB")
    torch.testing.assert_close(lc, lp, rtol=1e-4, atol=1e-2)
    torch.testing.assert_close(ghc, ghp, rtol=2e-2, atol=1e-5)
    torch.testing.assert_close(gwc, gwp, rtol=2e-2, atol=1e-5)
    assert mc < mp / 2


def test_training_run_on_the_chunked_path(data_path, tmp_path, monkeypatch):
    """A short run whose loss takes the chunked path (PLAIN_MAX 0), training and evaluation, logs the
    losses of the default (plain) run within fp32 rounding; the run records sdpa attention on the CPU."""
    from lrmoe.train import train

    from .helpers import cfg, losses

    runs, calls, orig = {}, [], tl._chunk_loss
    monkeypatch.setattr(tl, "_chunk_loss", lambda *a: calls.append(1) or orig(*a))
    for name, plain_max in (("plain", tl.PLAIN_MAX), ("chunked", 0)):
        monkeypatch.setattr(tl, "PLAIN_MAX", plain_max)
        calls.clear()
        s = train(cfg(data_path, steps=3, eval_interval=3), tmp_path / name, progress=False)
        assert s["model"]["attention"] == "sdpa"
        runs[name] = (losses(tmp_path / name), s["final"], len(calls))
    (lp, fp, n_plain), (lc, fc, n_chunked) = runs["plain"], runs["chunked"]
    assert n_plain == 0 and n_chunked > 3 and len(lp) == 3
    assert lc == pytest.approx(lp, rel=1e-4)
    assert fc["eval_loss"] == pytest.approx(fp["eval_loss"], rel=1e-4)
