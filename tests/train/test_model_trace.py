"""The simulator's source-2 trace: a trained model's routing on its data (lrmoe.train.model_trace),
checked against the routers' own logits (transformers' output_router_logits)."""
import json

import numpy as np
import pytest
import torch

from lrmoe.sim.trace import Trace, load_trace
from lrmoe.train import train
from lrmoe.train.model_trace import load_run_model, record_model_trace

from .helpers import TINY, cfg


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    train(cfg(TINY, steps=2, warmup_steps=1, eval_batches=1), out, progress=False)
    return out


def test_counts_are_the_routers_top_k(run_dir):
    tr = record_model_trace(run_dir, num_ranks=2, steps=3, rows_per_rank=2)
    model, c, train_set, _, step = load_run_model(run_dir)
    assert step == 2 and tr.counts.shape == (3, 2, 2, 8)  # steps, MoE layers, ranks, experts
    assert tr.meta["source"] == "model" and tr.meta["top_k"] == 2 and tr.meta["tokens_per_rank"] == 2 * 64
    ids = train_set.tensors["input_ids"]
    for s in range(3):
        with torch.no_grad():
            out = model(input_ids=ids[4 * s:4 * s + 4], output_router_logits=True)
        for layer, logits in enumerate(out.router_logits):
            top = logits.reshape(4, 64, -1).topk(2, dim=-1).indices
            for r in range(2):
                want = np.bincount(top[2 * r:2 * r + 2].reshape(-1).numpy(), minlength=8)
                assert np.array_equal(tr.counts[s, layer, r], want)
    assert (tr.counts.sum(-1) == 2 * 64 * 2).all()  # every token's top-2 pairs, padding included


def test_cli_and_bad_input(run_dir, tmp_path, capsys):
    from lrmoe.cli import main
    out = tmp_path / "t.npz"
    assert main(["simulate", "record-trace", "--run", str(run_dir), "--out", str(out), "--ranks", "2",
                 "--steps", "2"]) == 0
    assert load_trace(out).counts.shape == (2, 2, 2, 8)
    assert main(["simulate", "trace-stats", str(out), "balanced", "--steps", "2", "--layers", "2",
                 "--out", str(tmp_path / "st")]) == 0
    assert "| " + str(out) in capsys.readouterr().out and (tmp_path / "st" / "trace_stats.json").exists()
    # the run's own trace (8 experts, 2 ranks): refused at the paper model's 128 experts before any
    # planning, with the way out; replayed at the run's own configuration with --at-trace
    tr = load_trace(out)
    assert tr.meta["dims"] == {"hidden": 64, "intermediate": 32, "num_experts": 8, "top_k": 2}
    assert main(["simulate", "--scenario", "paper-qwen3", "--trace", str(out), "--out", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err
    assert "routes over 8 experts, top-2" in err and "--at-trace" in err and not (tmp_path / "s").exists()
    assert main(["simulate", "--at-trace", "--scenario", "paper-qwen3"]) == 2
    assert "--at-trace needs --trace" in capsys.readouterr().err
    sim_out = tmp_path / "own"
    assert main(["simulate", "--scenario", "paper-qwen3", "--trace", str(out), "--at-trace",
                 "--out", str(sim_out)]) == 0
    r = json.loads((sim_out / "simulation.json").read_text())
    assert r["scenario"]["model_dims"] == [64, 32, 8, 2, 2] and r["scenario"]["ranks"] == 2
    assert r["scenario"]["tokens_per_rank"] == 64 and r["trace"]["shape"] == [2, 2, 2, 8]
    assert {"fixed", "lrmoe"} <= r["methods"].keys()
    assert all(m["pairs"]["routed"] == 2 * 2 * 2 * 64 * 2 for m in r["methods"].values())  # every step and layer
    assert "5.44" not in (sim_out / "tables" / "T4_paper-qwen3@trace.md").read_text()  # no paper number as its own
    # an older trace without "dims": resolved from its model preset and overrides
    old = Trace(tr.counts, {k: v for k, v in tr.meta.items() if k != "dims"})
    from lrmoe.sim.cli import trace_dims
    assert trace_dims(old, out) == tr.meta["dims"]
    with pytest.raises(ValueError, match="no 'dims'"):
        trace_dims(Trace(tr.counts, {"source": "model", "top_k": 2, "tokens_per_rank": 64}), tmp_path / "x.npz")
    assert main(["simulate", "record-trace", "--run", str(tmp_path), "--out", str(out)]) == 2
    assert "checkpoint.pt" in capsys.readouterr().err
    assert main(["simulate", "record-trace", "--run", str(run_dir), "--out", str(tmp_path / "t.json")]) == 2
    assert main(["simulate", "record-trace", "--run", str(run_dir), "--out", str(out), "--steps", "100000"]) == 2
    assert "packed rows" in capsys.readouterr().err
    assert main(["simulate", "trace-stats", "nope"]) == 2
    assert "workloads:" in capsys.readouterr().err
