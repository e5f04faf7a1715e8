"""The EP training checkpoint's full weights: gathered to rank 0 only, from rank 0's EP group only.

4 gloo processes, EP groups of 2 ({0, 1}, {2, 3}; data parallel across them): rank 0's
``full_state_dict_cpu`` must equal the unsharded model's state dict, ranks 2 and 3 must take no
part (they hold a data-parallel copy of the same shards), and rank 1 must not allocate the
gathered layer (``dist.gather``, not ``all_gather``).
"""
from __future__ import annotations

import os
import traceback
import types

import pytest
import torch
import torch.distributed as dist
from dist_helpers import spawn, torchrun_env


def _worker(rank, G, port, out_dir):
    res = {}
    try:
        import lrmoe.hf as hf
        from lrmoe import BackwardPolicy
        from lrmoe.hf import parallel as ep_hf
        from lrmoe.parallel import launch
        from lrmoe.train.ep import DistributedRunner

        torch.set_num_threads(1)
        torchrun_env(rank, G, port)
        env = launch.init_distributed(ep=2, timeout_s=30)
        model = hf.build_model("qwen3-moe-tiny", vocab_size=61, seed=5)
        eps = ep_hf.parallelize_experts(model, env.ep_group, "fixed", policy=BackwardPolicy())
        with torch.no_grad():  # make the EP groups' shards differ, to see whose are gathered
            for name, p in model.named_parameters():
                if ep_hf.is_expert_parallel_param(p):
                    p.add_(1000.0 * (rank // 2))
        calls = {"gather": 0, "all_gather": 0}
        real_gather, real_all_gather = dist.gather, dist.all_gather

        def gather(tensor, gather_list=None, *a, **k):
            calls["gather"] += 1
            res.setdefault("gather_lists", []).append(gather_list is not None)
            return real_gather(tensor, gather_list, *a, **k)

        def all_gather(*a, **k):
            calls["all_gather"] += 1
            return real_all_gather(*a, **k)

        dist.gather, dist.all_gather = gather, all_gather
        try:
            sd = DistributedRunner.full_state_dict_cpu(types.SimpleNamespace(is_main=rank == 0, eps=eps), model)
        finally:
            dist.gather, dist.all_gather = real_gather, real_all_gather
        res.update(calls=calls, sd=sd)
        launch.shutdown()
    except Exception:  # noqa: BLE001
        res["error"] = traceback.format_exc()
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    os._exit(0)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    d = tmp_path_factory.mktemp("ep_ckpt")
    spawn(_worker, 4, str(d), deadline_s=180)
    out = [torch.load(d / f"rank{r}.pt", weights_only=False) for r in range(4)]
    for r, res in enumerate(out):
        assert "error" not in res, f"rank {r}:\n{res['error']}"
    return out


def test_rank0_gets_the_unsharded_weights_of_its_own_ep_group(results):
    import lrmoe.hf as hf

    want = hf.build_model("qwen3-moe-tiny", vocab_size=61, seed=5).state_dict()
    got = results[0]["sd"]
    assert set(got) == set(want)
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=0, msg=k)  # EP group {2, 3}'s +1000 never seen


def test_only_rank0s_group_gathers_and_only_rank0_receives(results):
    n_layers = sum(1 for k in results[0]["sd"] if k.endswith("mlp.experts.gate_up_proj"))
    assert n_layers >= 1
    for r, res in enumerate(results):
        assert res["calls"]["all_gather"] == 0, r
        assert res["calls"]["gather"] == (2 * n_layers if r < 2 else 0), (r, res["calls"])
        assert res["gather_lists"] if r < 2 else "gather_lists" not in res
        if r == 1:
            assert not any(res["gather_lists"])  # rank 1 sends its shard, allocates no gathered layer
        assert (res["sd"] is None) == (r != 0)
