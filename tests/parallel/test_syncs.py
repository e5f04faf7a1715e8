"""Device->host synchronisations per MoE layer, counted on the CPU as if on an accelerator
(:mod:`sync_counter`): none in the single-process layer's forward and backward; exactly one per
expert-parallel layer forward (the demand the planner reads) and none in its backward, on 2 gloo
ranks. The counter is tested first on every kind of synchronisation it claims to see."""
from __future__ import annotations

import datetime
import os
import traceback

import pytest
import torch
import torch.distributed as dist

from dist_helpers import spawn
from sync_counter import SyncCounter

from lrmoe import BackwardPolicy, LRMoELayer
from lrmoe.kernels.routing import count_by_value, sum_rows_by_token

H, I, E, K = 16, 8, 8, 2  # float32 rows 16-byte aligned: the grouped GEMMs run F.grouped_mm ("torch"), sync-free


def counted(fn) -> SyncCounter:
    with SyncCounter() as c:
        fn()
    return c


# ----------------------------------------------------------------------------- the counter itself
SYNCS = {
    "item": lambda t, m: t.sum().item(),
    "int": lambda t, m: int(t.max()),
    "bool": lambda t, m: bool(t.any()),
    "if": lambda t, m: 1 if (t > 0).all() else 0,
    "tolist": lambda t, m: t.tolist(),
    "numpy": lambda t, m: t.numpy(),
    "cpu": lambda t, m: t.cpu(),
    "to cpu": lambda t, m: t.to("cpu"),
    "nonzero": lambda t, m: torch.nonzero(m),
    "where(cond)": lambda t, m: torch.where(m),
    "bool mask index": lambda t, m: t[m],
    "bool mask write": lambda t, m: t.clone().__setitem__(m, 0),
    "masked_select": lambda t, m: torch.masked_select(t, m),
    "unique": lambda t, m: torch.unique(t),
    "bincount": lambda t, m: torch.bincount(t, minlength=16),
    "repeat_interleave": lambda t, m: torch.repeat_interleave(t),
    "repeat_interleave(self, repeats)": lambda t, m: torch.repeat_interleave(t, t),
    "segment_reduce": lambda t, m: torch.segment_reduce(t.float(), "sum", lengths=torch.tensor([2, 2])),
    "equal": lambda t, m: torch.equal(t, t),
    "tensor(list, device)": lambda t, m: torch.tensor([1, 2], device=t.device),
    "as_tensor(list, device)": lambda t, m: torch.as_tensor([1, 2], device=t.device),
}
FREE = {
    "count_by_value": lambda t, m: count_by_value(t, 16),
    "nonzero_static": lambda t, m: torch.nonzero_static(m, size=2),
    "repeat_interleave(output_size)": lambda t, m: torch.repeat_interleave(t, t, output_size=int(6)),
    "segment_reduce(unsafe)": lambda t, m: torch.segment_reduce(t.float(), "sum", lengths=t.new_full((2,), 2),
                                                                 unsafe=True),
    "long index": lambda t, m: t[t],
    "where(cond, a, b)": lambda t, m: torch.where(m, t, 0),
    "arithmetic": lambda t, m: (t * 2 + 1).cumsum(0).argsort(stable=True),
    "cpu copy read": lambda t, m: t.cpu().tolist(),  # one sync: the copy; reading the copy is free
}


@pytest.mark.parametrize("name", sorted(SYNCS))
def test_counter_sees(name):
    t, m = torch.tensor([0, 1, 2, 3]), torch.tensor([True, False, True, False])
    c = counted(lambda: SYNCS[name](t, m))
    assert c.count >= 1, name


@pytest.mark.parametrize("name", sorted(FREE))
def test_counter_passes(name):
    t, m = torch.tensor([0, 1, 2, 3]), torch.tensor([True, False, True, False])
    c = counted(lambda: FREE[name](t, m))
    assert c.count == (1 if name == "cpu copy read" else 0), (name, c.report())


def test_sum_rows_by_token_methods_are_sync_free():
    rows, pairs = torch.randn(10, 4), torch.randperm(12)[:10]
    for method in ("index_add", "segment_reduce"):
        c = counted(lambda: sum_rows_by_token(rows, pairs, 6, 2, method=method))
        assert c.count == 0, (method, c.report())


# ----------------------------------------------------------------------------- single-process layer
POLICIES = {
    "c20-compact-top": BackwardPolicy(drop_ratio=0.2, backend="torch"),
    "c20-compact-sample": BackwardPolicy(drop_ratio=0.2, selection="sample", seed=3, backend="torch"),
    "c20-mask-proportional": BackwardPolicy(drop_ratio=0.2, mode="mask", quota="proportional", backend="torch"),
    "c0": BackwardPolicy(drop_ratio=0.0, backend="torch"),
}


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_single_process_layer_makes_no_sync(name):
    torch.manual_seed(0)
    layer = LRMoELayer(H, I, E, K, policy=POLICIES[name])
    x = torch.randn(3, 11, H, requires_grad=True)  # an odd number of tokens
    g = torch.randn(3, 11, H)
    with SyncCounter() as fwd:
        y = layer(x)
    with SyncCounter() as bwd:
        y.backward(g)
    assert layer.last_backward is not None and layer.last_backward.filled
    assert fwd.count == 0, f"forward:\n{fwd.report()}"
    assert bwd.count == 0, f"backward:\n{bwd.report()}"


# ----------------------------------------------------------------------------- expert parallelism (2 gloo ranks)
EP_CASES = {  # name: (placement, planner options, drop ratio, mode)
    "fixed-c0": ("fixed", {}, 0.0, "compact"),
    "lrmoe-c20": ("lrmoe", {}, 0.2, "compact"),  # replicas and compacted backward rows
    "ultraep-c20-mask": ("ultraep", {"min_tokens": 1}, 0.2, "mask"),
    "symi-c0": ("symi", {"capacity_factor": None}, 0.0, "compact"),
}
LAYERS = 2  # two MoE layers in a row: the counts are per model call


def ep_worker(rank, G, port, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=G,
                            timeout=datetime.timedelta(seconds=60))
    from lrmoe.parallel.runtime import ExpertParallel, ExpertParallelExperts

    res = {}
    try:
        for name, (placement, options, drop, mode) in EP_CASES.items():
            gen = torch.Generator().manual_seed(11)
            mods = []
            for _ in range(LAYERS):
                ep = ExpertParallel(E, None, placement, **options)
                gu = torch.randn(E, 2 * I, H, generator=gen) / H**0.5
                dn = torch.randn(E, H, I, generator=gen) / I**0.5
                mods.append(ExpertParallelExperts.from_full(gu, dn, ep, BackwardPolicy(drop, mode=mode,
                                                                                       backend="torch")))
            T = 9 + 4 * rank  # different token counts per rank
            x = torch.randn(T, H, generator=gen)
            idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
            idx[: T // 2, 0] = 1  # a hot expert
            w = torch.rand(T, K, generator=gen)

            def step():
                xl = x.clone().requires_grad_()
                h = xl
                for m in mods:
                    h = m(h, idx, w)
                return xl, h

            xl, y = step()  # the first call of each layer also checks the ranks' sizes (one more gather)
            y.sum().backward()
            with SyncCounter() as fwd:
                xl, y = step()
            with SyncCounter() as bwd:
                y.sum().backward()
            res[name] = {"forward": fwd.count, "backward": bwd.count, "forward_events": fwd.events,
                         "backward_events": bwd.events, "filled": all(m.last_backward is not None for m in mods)}
    except Exception:
        res["error"] = traceback.format_exc()
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ep_counts(tmp_path_factory):
    out = tmp_path_factory.mktemp("syncs")
    spawn(ep_worker, 2, str(out), deadline_s=180)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.parametrize("name", sorted(EP_CASES))
def test_ep_layer_one_sync_per_forward(ep_counts, name):
    for rank, res in enumerate(ep_counts):
        assert "error" not in res, res["error"]
        r = res[name]
        fwd = "\n".join(f"  {w} at {a}" for w, a in r["forward_events"])
        bwd = "\n".join(f"  {w} at {a}" for w, a in r["backward_events"])
        assert r["filled"]
        assert r["forward"] == LAYERS, f"rank {rank}: {r['forward']} syncs in the forward of {LAYERS} layers:\n{fwd}"
        assert r["backward"] == 0, f"rank {rank}: {r['backward']} syncs in the backward:\n{bwd}"
