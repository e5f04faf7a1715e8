"""No CPU-only assumptions and no host synchronisation, checked on PyTorch's ``meta`` device.

A meta tensor has a shape, dtype and device but no data, so anything that reads values on the
host (``.item()``, ``.tolist()``, ``bool(tensor)``, ``torch.nonzero``, ``torch.bincount``) raises,
and so does mixing in a tensor created without ``device=`` (it lands on the CPU). Running the
forward and backward of every mode on meta therefore checks what a CUDA run needs without a GPU:
every tensor follows the input's device, and the backward never waits for the device (the
quota total is host-known, selection and compaction use fixed-size ops). bf16, because the meta
kernel of ``F.grouped_mm`` checks CUDA's dtype rule. The random scorer is left out: its seeded
``torch.Generator`` needs a real device (the CUDA tests cover it).
"""
from __future__ import annotations

import pytest
import torch

from lrmoe import BackwardPolicy, BackwardRecord, LRMoELayer, hf
from lrmoe.experts import lrmoe_experts
from lrmoe.kernels.routing import count_by_value, kept_positions, select_top_quota, sort_pairs_by_expert, \
    sum_rows_by_token

META = torch.device("meta")
BF16 = torch.bfloat16


def test_meta_device_rejects_host_reads():
    """The premise of this file: a host read of a meta tensor raises."""
    t = torch.ones(4, device=META)
    for read in (lambda: t.sum().item(), lambda: t.tolist(), lambda: bool(t.sum() > 0), lambda: t.nonzero()):
        with pytest.raises((RuntimeError, NotImplementedError)):
            read()


@pytest.mark.parametrize("mode,rho", [("full", 0.0), ("compact", 0.3), ("mask", 0.3), ("compact", 0.0)])
@pytest.mark.parametrize("router,shared", [("softmax", 0), ("sigmoid", 1)])
def test_layer_forward_backward_on_meta(mode, rho, router, shared):
    layer = LRMoELayer(64, 48, 8, 2, router=router, n_shared_experts=shared,
                       policy=BackwardPolicy(rho, mode=mode)).to(META, BF16)
    x = torch.randn(37, 64, device=META, dtype=BF16, requires_grad=True)
    y = layer(x)
    y.sum().backward()
    assert y.device == META and y.shape == (37, 64)
    assert x.grad.device == META and x.grad.shape == x.shape
    for p in (layer.gate.weight, layer.experts.gate_up_proj, layer.experts.down_proj):
        assert p.grad is not None and p.grad.device == META and p.grad.shape == p.shape
    rec = layer.last_backward
    assert rec.kept.device == META and rec.kept_mask.shape == (37, 2)


@pytest.mark.parametrize("scorer", ["lrm", "lrm_input", "grad_norm", "abs_grad"])
@pytest.mark.parametrize("quota", ["waterfill", "proportional"])
@pytest.mark.parametrize("fuse_gather", [None, True])
def test_functional_core_on_meta(scorer, quota, fuse_gather):
    T, H, I, E, K = 29, 32, 24, 6, 3
    x = torch.randn(T, H, device=META, dtype=BF16, requires_grad=True)
    idx = torch.randint(0, E, (T, K), device=META)
    w = torch.rand(T, K, device=META, dtype=torch.float32, requires_grad=True)
    gu = torch.randn(E, 2 * I, H, device=META, dtype=BF16, requires_grad=True)
    dn = torch.randn(E, H, I, device=META, dtype=BF16, requires_grad=True)
    rec = BackwardRecord()
    policy = BackwardPolicy(0.25, scorer=scorer, quota=quota, mode="compact", fuse_gather=fuse_gather)
    y = lrmoe_experts(x, idx, w, gu, dn, policy, rec)
    y.sum().backward()
    for t in (x, w, gu, dn):
        assert t.grad is not None and t.grad.device == META and t.grad.shape == t.shape
    assert rec.scores.shape == (T, K) and rec.quota.device == META


def test_pair_ops_on_meta():
    T, K, E, H = 23, 2, 5, 16
    idx = torch.randint(0, E, (T, K), device=META)
    perm, demand, offs = sort_pairs_by_expert(idx, E)
    assert perm.device == demand.device == offs.device == META
    keep = select_top_quota(torch.rand(T * K, device=META), idx.reshape(-1), demand - 1)
    pos = kept_positions(keep, perm, T * K - E)
    assert pos.shape == (T * K - E,)
    assert count_by_value(idx.reshape(-1), E, weights=keep).device == META
    rows = torch.randn(T * K - E, H, device=META)
    for method in ("index_add", "segment_reduce"):
        assert sum_rows_by_token(rows, perm[pos], T, K, method=method).shape == (T, H)


@pytest.mark.parametrize("preset", ["qwen3-moe-tiny", "glm4-moe-tiny"])
def test_transformers_model_on_meta(preset):
    """The registered "lrmoe" experts inside a whole transformers model, loss and backward."""
    with torch.device(META):
        model = hf.build_model(preset, policy=BackwardPolicy(0.2), seed=0)
    model = model.to(BF16)
    ids = torch.zeros(2, 16, dtype=torch.long, device=META)
    model(input_ids=ids, labels=ids).loss.backward()
    records = hf.backward_records(model)
    assert records and all(r is not None and r.kept.device == META for r in records)
