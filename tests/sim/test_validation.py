"""A small version of `lrmoe bench simulator`: the real EP runtime (2 gloo processes) and the
simulator make the same plans (instances, send, quotas and every rank's memory) and move the same token-row bytes on the same demands (asserted
exactly); times are reported by the benchmark, never asserted."""
import json

import numpy as np
import pytest

from lrmoe.bench import simulator


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
        assert r["dispatch_bytes_equal"] == 1, r
    hw = json.loads(cal.read_text())["hardware"]
    assert hw["name"] == "cpu-local" and hw["gemm_tflops"] > 0 and hw["fast_bytes_per_s"] > 0
    from lrmoe.sim.hardware import get_hardware
    assert get_hardware(str(cal)).gemm_tflops == hw["gemm_tflops"]  # a calibration file is a hardware preset
    with pytest.raises(ValueError, match="lrmoe simulate calibrate"):
        get_hardware(str(tmp_path / "missing.json"))
