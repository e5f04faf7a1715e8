"""The cost model (lrmoe.sim.cost) against hand-computed phase times on small plans."""
import math

import numpy as np
import pytest

from lrmoe.planning import Cluster, ModelDims
from lrmoe.planning.step import plan_layer
from lrmoe.sim.cost import BACKWARD, FORWARD, layer_cost
from lrmoe.sim.hardware import Hardware, get_hardware, hardware_from_dict

# 1 FLOP/s = 1e-12 TFLOP/s; tile 1 row; no fixed costs: times are plain FLOP and byte counts
UNIT = Hardware(name="unit", gemm_tflops=1e-12, tile_rows=1, gemm_call_s=0.0, hbm_bytes_per_s=1.0,
                fast_bytes_per_s=1.0, net_bytes_per_s=0.5, a2a_latency_s=0.0, memory_bytes=1e12)
DIMS = ModelDims(hidden=4, intermediate=2, num_experts=2, top_k=1, dtype_bytes=2)


def test_fixed_ownership_by_hand():
    d = np.array([[3, 1], [2, 4]])  # rank r owns expert r
    cl = Cluster(2, 1)
    plan = plan_layer("fixed", d, cl, DIMS, math.inf)
    c = layer_cost(plan, cl, DIMS, UNIT, selects=False)
    H, I, b = 4, 2, 2
    # dispatch: rank 0 sends 1 row to rank 1 and receives 2; rank 1 the reverse: the larger is 2 rows
    assert c["forward"]["dispatch"] == 2 * H * b
    assert c["forward"]["combine"] == 2 * H * b
    # rank 0 computes 5 rows, rank 1 5 rows: 6HI FLOPs per row forward, + SwiGLU 3Ib bytes per row
    assert c["forward"]["gemm"] == 5 * 6 * H * I + 5 * 3 * I * b
    assert c["backward"]["gemm"] == 5 * 12 * H * I + 5 * 5 * I * b
    assert c["backward"]["router_grad"] == 6 * 2 * H * b  # ranks 0 and 1 route 4 and 6 pairs: the larger
    assert c["forward"]["weight_sync"] == c["backward"]["weight_grads"] == 0.0  # no replicas
    assert c["forward_s"] == pytest.approx(sum(c["forward"].values()))
    assert c["backward_s"] == pytest.approx(sum(c["backward"].values()))
    assert set(c["forward"]) == set(FORWARD) and set(c["backward"]) == set(BACKWARD)
    assert c["pairs"] == c["kept"] == 10


def test_router_grad_is_the_slowest_rank():
    d = np.array([[3, 1], [2, 4]])
    cl = Cluster(2, 1)
    c = layer_cost(plan_layer("fixed", d, cl, DIMS, math.inf), cl, DIMS, UNIT, selects=False)
    assert c["backward"]["router_grad"] == 6 * 2 * 4 * 2  # rank 1 routes 6 pairs


def test_compact_backward_runs_the_kept_rows_only():
    rng = np.random.default_rng(0)
    d = rng.integers(0, 50, (2, 2))
    cl = Cluster(2, 1)
    full = plan_layer("fixed", d, cl, DIMS, math.inf)
    c20 = plan_layer("fixed", d, cl, DIMS, math.inf, selects=True, drop_ratio=0.5)
    kept_N = c20.backward_quota_GN.sum(0)
    cf = layer_cost(full, cl, DIMS, UNIT, selects=False)
    cc = layer_cost(c20, cl, DIMS, UNIT, selects=True)
    cm = layer_cost(c20, cl, DIMS, UNIT, selects=True, compact=False)
    H, I, b = 4, 2, 2
    assert cc["backward"]["gemm"] == max(int(k) * (12 * H * I + 5 * I * b) for k in kept_N)
    assert cm["backward"]["gemm"] == cf["backward"]["gemm"]  # mask: every row enters the GEMMs
    assert cc["kept"] == int(kept_N.sum()) < cc["pairs"]
    # the kept rows cross the network with their int32 positions; the dX rows come back without
    q = c20.backward_quota_GN  # [source, expert] = [source, rank] here (rank r owns expert r)
    sent = max(int(q[0, 1]), int(q[1, 0]))  # rows each rank sends the other, the larger (UNIT: 1 B/s)
    back = max(int(q[0, 1]), int(q[1, 0]))
    assert cc["backward"]["grad_rows"] == sent * (H * b + 4)
    assert cc["backward"]["dx"] == back * H * b
    assert cc["forward"]["combine"] > cf["forward"]["combine"]  # + fp32 ||h||^2 per row when selecting


def test_domains_use_the_network_bandwidth():
    # 4 ranks in 2 domains of 2; every rank sends one row to every other rank
    dims = ModelDims(hidden=4, intermediate=2, num_experts=4, top_k=1, dtype_bytes=2)
    cl = Cluster(4, 1, ((0, 1), (2, 3)))
    d = np.ones((4, 4), dtype=np.int64)
    c = layer_cost(plan_layer("fixed", d, cl, dims, math.inf), cl, dims, UNIT, selects=False)
    row = 4 * 2
    assert c["forward"]["dispatch"] == max(1 * row / 1.0, 2 * row / 0.5)  # 1 peer in-domain, 2 across


def test_replicas_pay_weight_sync_and_gradient_return():
    d = np.array([[400, 0], [300, 0]])  # expert 0 (rank 0) is hot: UltraEP replicates it on rank 1
    cl = Cluster(2, 2)
    plan = plan_layer("ultraep", d, cl, DIMS, math.inf, options={"min_tokens": 1})
    assert plan.is_replica_N.any()
    c = layer_cost(plan, cl, DIMS, UNIT, selects=False)
    per = 3 * 4 * 2 * 2 * int(plan.is_replica_N.sum())
    assert c["forward"]["weight_sync"] == c["backward"]["weight_grads"] == per


def test_presets_and_bad_hardware():
    h = get_hardware("h100-sxm")
    assert h.gemm_tflops == 242.0 and get_hardware("h200-sxm").hbm_bytes_per_s > h.hbm_bytes_per_s
    with pytest.raises(ValueError, match="unknown hardware 'h900'"):
        get_hardware("h900")
    with pytest.raises(ValueError, match="unknown hardware fields"):
        hardware_from_dict({"name": "x", "flops": 1})
    with pytest.raises(ValueError, match="gemm_tflops must be > 0"):
        Hardware(name="x", gemm_tflops=0.0, tile_rows=1, gemm_call_s=0, hbm_bytes_per_s=1, fast_bytes_per_s=1,
                 net_bytes_per_s=1, a2a_latency_s=0, memory_bytes=1)
    # tile quantisation: 129 rows cost two 128-row tiles
    assert h.gemm_seconds([129], 1e12, calls=0) == pytest.approx(2 * 128 / 242.0)


def test_row_copies_run_at_their_own_rate_where_calibrated():
    import dataclasses
    d = np.array([[3, 1], [2, 4]])
    cl = Cluster(2, 1)
    plan = plan_layer("fixed", d, cl, DIMS, math.inf)
    base = layer_cost(plan, cl, DIMS, UNIT, selects=False)
    slow = layer_cost(plan, cl, DIMS, dataclasses.replace(UNIT, row_bytes_per_s=0.25), selects=False)
    H, b = 4, 2
    # rows: token side 5 H b per pair of the rank's own tokens, expert side 4 H b per row it computes
    assert base["forward"]["rows"] == max(5 * p + 4 * n for p, n in ((4, 5), (6, 5))) * H * b
    for part in ("forward", "backward"):
        assert slow[part]["rows"] == 4 * base[part]["rows"]  # 0.25 bytes/s instead of hbm's 1
        assert {k: v for k, v in slow[part].items() if k != "rows"} == \
            {k: v for k, v in base[part].items() if k != "rows"}


@pytest.mark.parametrize("placement", ["symi", "ultraep", "lrmoe"])
def test_weight_copies_are_the_ones_the_runtime_fetches(placement):
    """The simulator charges one weight copy (and one gradient back) per (rank, expert) the runtime's
    layout fetches: an instance off its owner rank, whatever its is_replica flag (SYMI's first
    instance of an expert can sit off the owner; two instances on one rank are one copy)."""
    import torch

    from lrmoe.parallel.layout import Layout
    from lrmoe.planning.plan import fetched_GE
    from lrmoe.sim.cost import replica_bytes_GG

    rng = np.random.default_rng(7)
    G, E = 4, 16
    dims = ModelDims(hidden=8, intermediate=4, num_experts=E, top_k=2, dtype_bytes=2)
    cl = Cluster(G, E // G + 3)
    per = 3 * 8 * 4 * 2
    flagged_off_owner = 0
    state = None
    for step in range(6):
        d = rng.lognormal(0, 1.5, (G, E)).round().astype(np.int64) * rng.integers(1, 30)
        kw = {"options": {"min_tokens": 1}} if placement == "ultraep" else {}
        if placement == "lrmoe":
            kw = {"selects": True, "drop_ratio": 0.2}
        plan = plan_layer(placement, d, cl, dims, math.inf, state=state, **kw)
        state = plan.state
        got = replica_bytes_GG(plan, dims, 2)
        fetched = fetched_GE(plan.expert_N, plan.rank_N, G, E)
        owner = plan.expert_N // (E // G)
        flagged_off_owner += int(((owner != plan.rank_N) & ~plan.is_replica_N).sum())
        for r in range(G):
            lay = Layout(plan, r, E // G, compacts=False, device=torch.device("cpu"))
            assert (got[:, r] / per).tolist() == lay.wrecv_splits, (step, r)  # what r receives, by owner
            assert (got[r] / per).tolist() == lay.wsend_splits, (step, r)  # what r sends as owner
            assert fetched[r].sum() == sum(lay.wrecv_splits)
    if placement == "symi":  # the case the old is_replica count missed
        assert flagged_off_owner > 0
