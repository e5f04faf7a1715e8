"""A small version of `lrmoe bench simulator`: the real EP runtime (2 gloo processes) and the
simulator make the same plans (instances, send, quotas and every rank's memory), move the same bytes
in every all-to-all kind on every rank and keep the same pairs on the same demands (asserted
exactly); times are reported by the benchmark, never asserted."""
import json

import numpy as np
import pytest

from lrmoe.bench import simulator
from lrmoe.sim.cost import COMM_KINDS, comm_bytes_G


def test_indices_from_counts_reproduce_the_counts():
    rng = np.random.default_rng(0)
    for K in (1, 2, 4):
        c = simulator.routing_counts("lognormal", 8, K, 37, 1, 1, seed=int(rng.integers(100)))[0, 0]
        idx = simulator.indices_from_counts(c, K, seed=1).numpy()
        assert idx.shape == (37, K)
        assert np.array_equal(np.bincount(idx.ravel(), minlength=8), c)
        assert all(len(set(row)) == K for row in idx.tolist())  # K distinct experts per token


@pytest.mark.timeout(300)
def test_runtime_and_simulator_make_the_same_plans(tmp_path):
    out, cal = tmp_path / "v.json", tmp_path / "cpu-local.json"
    simulator.main(["--quick", "--steps", "1", "--tokens", "128", "--hidden", "16", "--intermediate", "16",
                    "--experts", "4", "--out", str(out), "--calibration", str(cal)])
    v = json.loads(out.read_text())
    assert len(v["rows"]) == 2 * 5  # two routings x fixed/lrmoe at C0/C20 and symi (stateful) at C0
    assert {r["method"] for r in v["rows"]} == {"fixed C0", "fixed C20", "lrmoe C0", "lrmoe C20", "symi C0"}
    for r in v["rows"]:
        assert r["steps"] == 1 and r["same_plans"] == r["plans"] == 2, r  # the warm-up's plan is compared too
        assert r["same_memory"] == 2, r  # every memory component of every rank, runtime's plan vs simulator's
        # every all-to-all kind on every rank, and each rank's backward quota and kept pairs per expert
        assert r["bytes_equal"] == 1 and r["kept_and_quota_equal"] == 1 and r["mismatches"] == [], r
        assert set(r["bytes_by_kind_equal"]) == set(COMM_KINDS) and all(v == 1 for v in r["bytes_by_kind_equal"].values())
    # the kinds a C20 LRMoE step with replicas exercises: weights, phi and positions moved
    assert any(r["method"] == "lrmoe C20" for r in v["rows"])
    hw = json.loads(cal.read_text())["hardware"]
    assert hw["name"] == "cpu-local" and hw["gemm_tflops"] > 0 and hw["fast_bytes_per_s"] > 0
    from lrmoe.sim.hardware import get_hardware
    assert get_hardware(str(cal)).gemm_tflops == hw["gemm_tflops"]  # a calibration file is a hardware preset
    with pytest.raises(ValueError, match="lrmoe simulate calibrate"):
        get_hardware(str(tmp_path / "missing.json"))


def test_compare_step_sees_every_kind_and_the_kept_pairs():
    """The comparison itself fails on a wrong byte count of any kind, a wrong quota or wrong kept pairs."""
    import math

    from lrmoe.planning import Cluster, ModelDims
    from lrmoe.planning.plan import expert_sum_kernel
    from lrmoe.planning.step import plan_layer
    from lrmoe.sim.simulate import Method

    dims = ModelDims(hidden=16, intermediate=16, num_experts=4, top_k=2, dtype_bytes=4)
    rng = np.random.default_rng(5)
    d = np.stack([rng.multinomial(128, [0.7, 0.1, 0.1, 0.1]) for _ in range(2)])  # one hot expert: replicas
    m = Method("lrmoe", "lrmoe", {}, drop_ratio=0.2)
    plan = plan_layer("lrmoe", d, Cluster(2, 4), dims, math.inf, selects=True, drop_ratio=0.2)
    sim = comm_bytes_G(plan, dims, selects=True)
    comm = [{k: int(sim[k][g]) for k in COMM_KINDS} for g in range(2)]
    q = expert_sum_kernel(plan.backward_quota_GN, plan.expert_N, 4).tolist()
    ok = simulator.compare_step(plan, dims, m, comm, q, q)
    assert all(ok["kinds"].values()) and ok["quota"] and ok["kept"] and ok["mismatch"] == []
    assert sim["fwd_weights"].sum() > 0 and sim["bwd_grad_index"].sum() > 0 and sim["fwd_phi"].sum() > 0
    for kind in COMM_KINDS:
        bad = [dict(c) for c in comm]
        bad[1][kind] += 4
        r = simulator.compare_step(plan, dims, m, bad, q, q)
        assert not r["kinds"][kind] and sum(not v for v in r["kinds"].values()) == 1 and kind in r["mismatch"][0]
    worse = [list(row) for row in q]
    worse[0][0] -= 1
    assert not simulator.compare_step(plan, dims, m, comm, q, worse)["kept"]
    assert not simulator.compare_step(plan, dims, m, comm, worse, q)["quota"]
