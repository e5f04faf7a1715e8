"""The simulator replays plans as the runtime executes them (split pieces, oom) and writes the
results `lrmoe simulate` promises."""
import dataclasses
import json
import math

import numpy as np
import pytest

from lrmoe.planning import Cluster, ModelDims
from lrmoe.planning.step import plan_layer
from lrmoe.sim.cost import layer_cost
from lrmoe.sim.hardware import get_hardware
from lrmoe.sim.scenarios import get_scenario, run_scenario, scenario_names
from lrmoe.sim.simulate import PAPER_METHODS, Method, even_pieces, run_method
from lrmoe.sim.trace import Trace, save_trace

DIMS = ModelDims(hidden=64, intermediate=32, num_experts=8, top_k=2, dtype_bytes=2, grad_bytes=4,
                 optimizer_bytes_per_param=0)
CL = Cluster(4, 4)
HW = get_hardware("h100-sxm")


def counts(seed, steps=2, layers=2, G=4, E=8, n=200):
    rng = np.random.default_rng(seed)
    p = rng.lognormal(0, 1, E)
    return np.stack([[rng.multinomial(n, p / p.sum(), size=G) for _ in range(layers)] for _ in range(steps)])


@pytest.mark.parametrize("seed", range(3))
def test_even_pieces_sum_to_the_demand(seed):
    d = np.random.default_rng(seed).integers(0, 9, (3, 5))
    for n in (1, 2, 3, 7):
        pieces = even_pieces(d, n)
        assert len(pieces) == n and np.array_equal(sum(pieces), d)
        assert all((p.max(initial=0) - q.min(initial=0)) <= d.max() for p in pieces for q in pieces)


def test_unpressured_replay_is_the_plans_cost():
    c = counts(0)
    for m in PAPER_METHODS:
        r = run_method(m, c, CL, DIMS, HW, math.inf, include_planning=False)
        state, want_b, pairs = None, [], 0
        for layer in range(2):  # the plans of plan_layer itself, step after step (SYMI's state per layer)
            state = None
            for s in range(2):
                p = plan_layer(m.placement, c[s, layer], CL, DIMS, math.inf, state=state, selects=m.selects,
                               drop_ratio=m.drop_ratio)
                state = p.state
                want_b.append(layer_cost(p, CL, DIMS, HW, selects=m.selects)["backward_s"] * 1e3)
                pairs += int(p.send_GN.sum())
        assert r["backward_ms_per_layer"] == pytest.approx(float(np.mean(want_b)))  # the mean: x plans = cumulative
        assert r["moe_seconds"] * 1e3 == pytest.approx(4 * r["total_ms_per_layer"])
        assert r["planning_included"] is False and r["phases_ms"]["forward"]["plan"] == 0.0
        assert r["pairs"]["useful"] == pairs and r["oom"] == 0 and r["fallbacks"] == {"none": 4}
        assert r["pairs"]["dropped_over_capacity"] == int(c.sum()) - pairs
        if m.placement != "symi":  # SYMI drops pairs over capacity (factor 1.0); the others are dropless
            assert pairs == int(c.sum())


def test_planning_and_layout_are_charged_at_their_median_host_times():
    c = counts(0)
    m = PAPER_METHODS[-1]
    with_p = run_method(m, c, CL, DIMS, HW, math.inf)
    without = run_method(m, c, CL, DIMS, HW, math.inf, include_planning=False)
    charge = with_p["planning_ms_measured"]["median"]
    layout = with_p["layout_ms_measured"]["median"]
    assert with_p["planning_ms_per_layer"] == charge > 0 and with_p["phases_ms"]["forward"]["plan"] == charge
    assert with_p["layout_ms_per_layer"] == layout > 0 and with_p["phases_ms"]["forward"]["layout"] == layout
    assert without["phases_ms"]["forward"]["layout"] == 0.0 and without["layout_ms_per_layer"] > 0  # measured, not charged
    assert with_p["forward_ms_per_layer"] == pytest.approx(without["forward_ms_per_layer"] + charge + layout)
    assert with_p["backward_ms_per_layer"] == without["backward_ms_per_layer"]
    assert with_p["pairs_per_s_without_planning"] == pytest.approx(without["pairs_per_s"])
    assert with_p["pairs_per_s"] < without["pairs_per_s"]


def test_split_plans_run_every_piece_and_oom_runs_nothing():
    c = counts(1, steps=1, layers=1)
    need = plan_layer("fixed", c[0, 0], CL, DIMS, math.inf).memory.peak
    base = plan_layer("fixed", np.zeros_like(c[0, 0]), CL, DIMS, math.inf).memory.peak
    budget = base + (need - base) * 0.4
    fixed = Method("fixed", "fixed")
    r = run_method(fixed, c, CL, DIMS, HW, budget, include_planning=False)
    (fb, n), = r["fallbacks"].items()
    assert fb.startswith("split_microbatch:") and n == 1
    k = int(fb.split(":")[1])
    pieces = [plan_layer("fixed", p, CL, DIMS, budget, piece=True) for p in even_pieces(c[0, 0], k)]
    want = sum(layer_cost(p, CL, DIMS, HW, selects=False)["total_s"] for p in pieces) * 1e3
    assert r["total_ms_per_layer"] == pytest.approx(want)
    assert r["memory_gib_max"]["subtotal"] * 1024**3 <= budget
    oom = run_method(dataclasses.replace(fixed, options={"fallback": "oom"}), c, CL, DIMS, HW, budget)
    assert oom["oom"] == 1 and oom["ran"] == 0 and oom["pairs_per_s"] == 0.0


def test_scenario_result_has_the_promised_keys(tmp_path):
    sc = dataclasses.replace(get_scenario("pressure-qwen3"), steps=1, layers=1, pressures=(1, 4))
    tr = Trace(counts(2, steps=1, layers=1, G=8, E=128, n=4000), {"source": "synthetic", "top_k": 8,
                                                                 "tokens_per_rank": 500})
    r = run_scenario(sc, tr, include_planning=False)
    assert r["simulated"] and r["hardware"]["name"] == "h100-sxm" and r["trace"]["shape"] == [1, 1, 8, 128]
    assert r["trace"]["tokens_per_rank"] == 32768  # the trace was scaled to the paper's tokens per rank
    assert set(r["methods"]) == {"fixed", "symi", "ultraep", "lrmoe"}
    for m in r["methods"].values():
        assert set(m["memory_gib"]) == {"base", "replicas", "tokens", "subtotal", "tokens_compacted",
                                        "subtotal_compacted"}
        assert m["memory_gib"]["subtotal_compacted"] <= m["memory_gib"]["subtotal"]
        assert {"forward_ms_per_layer", "backward_ms_per_layer", "planning_ms_per_layer", "fallbacks"} <= m.keys()
        assert set(m["throughput"]) == {"1", "4"}
        assert {"pairs_per_s", "relative"} <= m["throughput"]["4"].keys()
    assert r["methods"]["lrmoe"]["throughput"]["4"]["relative"] == 1.0
    # at 1x the budget is fixed ownership's own need: it fits without a fallback
    assert r["methods"]["fixed"]["throughput"]["1"]["fallbacks"] == {"none": 1}


def test_every_scenario_is_well_formed():
    for name in scenario_names():
        sc = get_scenario(name)
        assert sc.description and sc.cluster().num_ranks == sc.ranks and sc.dims().num_experts == 128
    with pytest.raises(ValueError, match="unknown scenario 'nope'"):
        get_scenario("nope")


def test_cli(tmp_path, capsys):
    from lrmoe.cli import main
    assert main(["simulate", "--list"]) == 0
    assert "paper-qwen3" in capsys.readouterr().out
    assert main(["simulate", "--scenario", "nope"]) == 2
    assert "unknown scenario 'nope'" in capsys.readouterr().err
    f = tmp_path / "file"
    f.write_text("x")
    assert main(["simulate", "--scenario", "paper-qwen3", "--out", str(f)]) == 2
    assert "is a file" in capsys.readouterr().err
    assert main(["simulate", "calibrate", "--out", str(f)]) == 2  # refused before any process starts
    assert "is a file" in capsys.readouterr().err
    assert main(["simulate", "--scenario", "paper-qwen3", "--trace", str(f)]) == 2
    assert "--trace" in capsys.readouterr().err
    tr = tmp_path / "t.npz"
    save_trace(tr, Trace(counts(3, steps=2, layers=2, G=8, E=128, n=800), {"source": "synthetic", "top_k": 8,
                                                                           "tokens_per_rank": 100}))
    out = tmp_path / "out"
    assert main(["simulate", "--scenario", "paper-qwen3", "--trace", str(tr), "--steps", "1", "--layers", "1",
                 "--no-planning", "--out", str(out)]) == 0
    r = json.loads((out / "simulation.json").read_text())
    assert {"scenario", "hardware", "trace", "git_rev", "methods"} <= r.keys()
    assert r["trace"]["shape"] == [1, 1, 8, 128] and r["methods"]["lrmoe"]["planning_ms_per_layer"] > 0
    assert (out / "tables" / "T4_paper-qwen3.md").read_text().count("| lrmoe |") == 1
    assert "Simulated (h100-sxm" in (out / "tables" / "T5_paper-qwen3.md").read_text()
    t4 = (out / "tables" / "T4_paper-qwen3.md").read_text()
    assert "per MoE layer" in t4 and "paper subtotal" in t4 and "5.44" in t4  # the paper's T4 is Qwen3's
    # replot: the tables again from simulation.json, simulating nothing
    (out / "tables" / "T4_paper-qwen3.md").unlink()
    assert main(["simulate", "replot", str(out)]) == 0
    assert (out / "tables" / "T4_paper-qwen3.md").read_text() == t4
    assert main(["simulate", "replot", str(tmp_path / "nothing")]) == 2
    assert "no simulation.json" in capsys.readouterr().err


def test_t4_of_another_model_shows_no_paper_numbers():
    """The paper reports T4 for Qwen3-30B-A3B only: GLM's T4 carries no paper column."""
    from paper_figures.results import paper_numbers
    from paper_figures.simulation import t4_head, t4_rows

    mem = {"base": 1.0, "replicas": 0.0, "tokens": 2.0, "subtotal": 3.0}
    result = {"scenario": {"model": "glm-4.5-air"}, "methods": {"fixed": {"memory_gib": mem, "memory_gib_max": mem}}}
    assert "paper subtotal" not in t4_head(result)
    assert t4_rows(result, paper_numbers()) == [["fixed", "1.00", "0.00", "2.00", "3.00", "3.00"]]
    result["scenario"]["model"] = "qwen3-30b-a3b"
    assert t4_rows(result, paper_numbers())[0][-1] == "12.88" and "paper subtotal" in t4_head(result)


def test_layout_time_is_the_slowest_ranks_layout_counts(monkeypatch):
    """host_layout_seconds runs the runtime's layout_counts once per rank, with the runtime's arguments,
    and keeps the slowest rank's time."""
    from lrmoe.parallel.layout import Layout
    from lrmoe.sim import simulate as sim

    plan = plan_layer("lrmoe", counts(2, steps=1, layers=1)[0, 0], CL, DIMS, math.inf, selects=True, drop_ratio=0.2)
    seen, times = [], iter([0.0, 0.003, 1.0, 1.001, 2.0, 2.007, 3.0, 3.002])
    real = sim.layout_counts

    def spy(*args):
        seen.append(args)
        return real(*args)

    monkeypatch.setattr(sim, "layout_counts", spy)
    monkeypatch.setattr(sim.time, "perf_counter", lambda: next(times))
    assert sim.host_layout_seconds(plan, selects=True) == pytest.approx(0.007)
    assert [a[5] for a in seen] == [0, 1, 2, 3] and all(a[7] for a in seen)  # every rank; compacts at C20
    monkeypatch.undo()
    for r, args in enumerate(seen):  # the same counts the runtime's Layout of rank r builds from
        lay = Layout(plan, r, DIMS.num_experts // CL.num_ranks, True, __import__("torch").device("cpu"))
        head = real(*args)[0]
        assert head[:4 * CL.num_ranks].reshape(4, -1).tolist() == [lay.send_splits, lay.kept_send_splits,
                                                                   lay.recv_splits, lay.kept_recv_splits]


def test_compacted_token_buffers_by_hand():
    """The compaction-sized reading of T4's token buffers: per rank, (3H + 6I) b per kept received
    row (backward execution) plus 2 H b per kept sent row (the backward all-to-all's send and receive)."""
    from lrmoe.sim.simulate import compacted_token_bytes

    plan = plan_layer("lrmoe", counts(4, steps=1, layers=1)[0, 0], CL, DIMS, math.inf, selects=True, drop_ratio=0.3)
    H, I, b = DIMS.hidden, DIMS.intermediate, DIMS.dtype_bytes
    q = plan.backward_quota_GN
    kept_recv = np.array([q[:, plan.rank_N == r].sum() for r in range(CL.num_ranks)])
    want = (3 * H + 6 * I) * b * kept_recv + 2 * H * b * q.sum(1)
    assert np.array_equal(compacted_token_bytes(plan, DIMS), want) and q.sum() < plan.send_GN.sum()
