"""Under torch.autocast the experts run in the autocast dtype, like the model's linear layers.

Training on GPU uses bf16 autocast with fp32 parameters (``lrmoe train --dtype auto``). The experts
functions are custom autograd Functions, which autocast does not reach: without an explicit cast
their grouped GEMMs would run in fp32 (on CUDA: IEEE fp32, no tensor cores) while the rest of the
model runs in bf16. Here (CPU autocast, bf16) the result under autocast must equal, bit for bit,
the same call made outside autocast on inputs cast to bf16 by hand: that shows the inputs are cast
and that nothing inside the function is autocast (its combine ``bmm`` would otherwise run in bf16).
"""
from __future__ import annotations

import pytest
import torch

from dist_helpers import spawn, torchrun_env
from lrmoe import BackwardPolicy
from lrmoe.experts import autocast_dtype, lrmoe_experts


def _case(seed, T=37, H=24, I=20, E=6, K=2, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g, dtype=dtype)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g, dtype=dtype)
    w_gu = torch.randn(E, 2 * I, H, generator=g, dtype=dtype) * 0.2
    w_d = torch.randn(E, H, I, generator=g, dtype=dtype) * 0.2
    dy = torch.randn(T, H, generator=g, dtype=dtype)
    return x, idx, w, w_gu, w_d, dy


def _run(x, idx, w, w_gu, w_d, dy, policy, cast=None, autocast=False):
    leaves = [t.clone().requires_grad_() for t in (x, w, w_gu, w_d)]
    xx, ww, gu, d = leaves
    if cast is not None:
        xx, gu, d = xx.to(cast), gu.to(cast), d.to(cast)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = lrmoe_experts(xx, idx, ww, gu, d, policy)
    y.backward(dy.to(y.dtype))
    return y.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("mode,rho", [("full", 0.0), ("compact", 0.3), ("mask", 0.3)])
def test_autocast_equals_explicit_bf16_inputs(mode, rho):
    args = _case(seed=hash(mode) % 1000)
    policy = BackwardPolicy(drop_ratio=rho, mode=mode, backend="loop")
    y_auto, g_auto = _run(*args, policy, autocast=True)
    y_ref, g_ref = _run(*args, policy, cast=torch.bfloat16)
    assert y_auto.dtype == torch.bfloat16
    assert torch.equal(y_auto, y_ref)
    for a, b, name in zip(g_auto, g_ref, ("x", "routing weights", "gate_up_proj", "down_proj")):
        assert a.dtype == b.dtype == torch.float32, name  # fp32 parameters get fp32 gradients
        assert torch.equal(a, b), name
    # and bf16 differs from fp32 (the cast did happen)
    y32, _ = _run(*args, policy)
    assert not torch.equal(y_auto.float(), y32)


@pytest.mark.cuda
@pytest.mark.parametrize("mode,rho", [("full", 0.0), ("compact", 0.2)])
def test_cuda_autocast_runs_the_bf16_triton_path(mode, rho):
    """On a GPU, under bf16 autocast with fp32 parameters (how `lrmoe train` runs), the experts
    take the bf16 Triton path: equal to inputs cast by hand, and fp32 gradients for the weights."""
    dev = torch.device("cuda")
    x, idx, w, w_gu, w_d, dy = (t.to(dev) for t in _case(seed=5, T=300, H=256, I=128, E=16, K=4))
    policy = BackwardPolicy(drop_ratio=rho, mode=mode)  # backend auto: triton on CUDA

    def run(cast, auto):
        leaves = [t.clone().requires_grad_() for t in (x, w, w_gu, w_d)]
        xx, ww, gu, d = leaves
        if cast:
            xx, gu, d = xx.bfloat16(), gu.bfloat16(), d.bfloat16()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=auto):
            y = lrmoe_experts(xx, idx, ww, gu, d, policy)
        y.backward(dy.to(y.dtype))
        return y.detach(), [t.grad for t in leaves]

    y_auto, g_auto = run(False, True)
    y_ref, g_ref = run(True, False)
    assert y_auto.dtype == torch.bfloat16 and torch.equal(y_auto, y_ref)
    for a, b in zip(g_auto, g_ref):
        assert a.dtype == torch.float32 and torch.equal(a, b)


def test_float64_is_not_cast_under_autocast():
    args = _case(seed=3, dtype=torch.float64)
    policy = BackwardPolicy(drop_ratio=0.25, backend="loop")
    y_auto, g_auto = _run(*args, policy, autocast=True)
    y_ref, g_ref = _run(*args, policy)
    assert y_auto.dtype == torch.float64 and torch.equal(y_auto, y_ref)
    assert all(torch.equal(a, b) for a, b in zip(g_auto, g_ref))


def test_float64_states_into_float32_weights_are_refused_under_autocast(rng_seed):
    """Autocast casts the float32 weights to bf16 and leaves float64 states alone: refused, naming
    the autocast dtype, rather than computed in bf16 and returned as float64."""
    x, idx, w, w_gu, w_d, _ = _case(seed=rng_seed)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(ValueError, match=r"hidden_TH is torch.float64 but the experts compute in "
                                             r"torch.bfloat16 \(the autocast dtype\)"):
            lrmoe_experts(x.double(), idx, w, w_gu, w_d, BackwardPolicy())


def test_autocast_dtype_outside_and_inside():
    assert autocast_dtype(torch.device("cpu")) is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert autocast_dtype(torch.device("cpu")) == torch.bfloat16
    assert autocast_dtype(torch.device("meta")) is None


# ----------------------------------------------------------------------------- expert parallel
def _ep_worker(rank, G, port, out_dir):
    import os
    import traceback

    res = {}
    try:
        from lrmoe.parallel import launch
        from lrmoe.parallel.runtime import ExpertParallel, ExpertParallelExperts

        torch.set_num_threads(1)
        torchrun_env(rank, G, port)
        launch.init_distributed(ep=G, timeout_s=30)
        x, idx, w, w_gu, w_d, dy = _case(seed=11, T=30, E=4)
        lo, hi = (0, 17) if rank == 0 else (17, 30)
        for label, cast, auto in (("autocast", None, True), ("explicit", torch.bfloat16, False)):
            m = ExpertParallelExperts.from_full(w_gu, w_d, ExpertParallel(4, None, "lrmoe"),
                                                BackwardPolicy(drop_ratio=0.25))
            xl, wl = x[lo:hi].clone().requires_grad_(), w[lo:hi].clone().requires_grad_()
            if cast is not None:
                with torch.no_grad():  # bf16 weights by hand (parameters of the module)
                    m.gate_up_proj.data = m.gate_up_proj.data.to(cast)
                    m.down_proj.data = m.down_proj.data.to(cast)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=auto):
                y = m(xl if cast is None else xl.to(cast), idx[lo:hi], wl)
            y.backward(dy[lo:hi].to(y.dtype))
            res[label] = {"y": y.detach(), "dx": xl.grad, "dw": wl.grad, "dgu": m.gate_up_proj.grad.float(),
                          "dd": m.down_proj.grad.float(), "dtype": y.dtype}
        launch.shutdown()
    except Exception:  # noqa: BLE001
        res["error"] = traceback.format_exc()
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    os._exit(0)


def test_expert_parallel_layer_under_autocast_equals_explicit_bf16(tmp_path):
    spawn(_ep_worker, 2, str(tmp_path), deadline_s=120)
    for r in range(2):
        res = torch.load(tmp_path / f"rank{r}.pt", weights_only=False)
        assert "error" not in res, res["error"]
        a, b = res["autocast"], res["explicit"]
        assert a["dtype"] == torch.bfloat16
        for k in ("y", "dx", "dw", "dgu", "dd"):
            # the same bf16 computation; gradients of the fp32 parameters are the bf16 ones upcast
            assert torch.equal(a[k].float(), b[k].float()), (r, k)
