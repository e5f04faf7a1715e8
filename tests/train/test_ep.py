"""`lrmoe train` with expert parallelism, launched by torchrun: 2 gloo processes on the CPU,
qwen3-moe-tiny (8 experts, top-2, 2 MoE layers), the tiny Alpaca sample.

One module fixture runs the single-process reference in this process and four torchrun
launches (`python -m torch.distributed.run --nproc-per-node 2 -m lrmoe.cli train ... --ep 2`):
fixed placement at C0, LRMoE placement at C20 uninterrupted, and the same stopped after 3 steps
then resumed. Each launch has a deadline, so a hang fails instead of blocking the suite.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lrmoe.data import shared_data_dir
from lrmoe.quota import retained_total
from lrmoe.train import TrainConfig, read_metrics, train

TINY = shared_data_dir() / "alpaca" / "alpaca_tiny.json"
ROOT = Path(__file__).resolve().parents[2]
LAUNCH_DEADLINE_S = 180
# global batch 8 rows (2 micro-batches of 4; 2 rows per rank per micro-batch), 64 tokens per row
RUN = dict(model="qwen3-moe-tiny", tokenizer="bpe:300", seq_len=64, micro_batch=4, grad_accum=2, steps=6, lr=3e-3,
           warmup_steps=1, heldout_fraction=0.1, eval_interval=3, eval_batches=2, checkpoint_interval=2,
           load_concurrency=0)  # a tiny model: both ranks build it at once (the fixed run below takes turns)
C20 = dict(RUN, drop_ratio=0.2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def flags(d: dict) -> list[str]:
    """``lrmoe train`` flags of a config dict (booleans as --x / --no-x)."""
    out = []
    for k, v in d.items():
        flag = "--" + k.replace("_", "-")
        out += ([flag] if v else ["--no-" + flag[2:]]) if isinstance(v, bool) else [flag, str(v)]
    return out


def launch_env(base: Path) -> dict:
    """The environment of a torchrun launch: no inherited rank variables, caches under ``base``."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "HF_DATASETS_CACHE")}
    env.update(HF_HOME=str(base / "hf"), LRMOE_CACHE=str(base / "cache"), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    return env


def torchrun(out: Path, config: dict, *extra: str, env: dict, nproc: int = 2,
             deadline_s: float = LAUNCH_DEADLINE_S) -> float:
    """Launch `lrmoe train` on ``nproc`` processes; returns the wall time. Fails with the output on error/hang."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "-m", "lrmoe.cli", "train", "--out", str(out), "--no-progress",
           *flags(config), *extra]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=deadline_s)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"torchrun did not finish within {deadline_s} s (hang?):\n{e.stderr or ''}")
    if p.returncode:
        pytest.fail(f"torchrun exited with {p.returncode}:\n{p.stdout[-4000:]}\n{p.stderr[-8000:]}")
    return time.perf_counter() - t0


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    if not TINY.exists():
        pytest.skip(f"offline Alpaca sample not found at {TINY} (set LRMOE_SHARED_DATA to the shared/data folder)")
    base = tmp_path_factory.mktemp("train_ep")
    env = launch_env(base)
    data = {"data": str(TINY)}
    walls = {}
    with pytest.MonkeyPatch.context() as mp:
        for k in ("HF_HOME", "LRMOE_CACHE"):
            mp.setenv(k, env[k])
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            mp.delenv(k, raising=False)
        t0 = time.perf_counter()
        train(TrainConfig(**RUN, **data, threads=1), base / "single", progress=False)  # also prepares the data
        walls["single"] = time.perf_counter() - t0
    # the default: the ranks build the model in turns (lrmoe.parallel.launch.in_turns)
    walls["fixed"] = torchrun(base / "fixed", dict(RUN, **data, ep=2, placement="fixed", load_concurrency=1), env=env)
    lrm = dict(C20, **data, ep=2, placement="lrmoe")
    walls["lrmoe"] = torchrun(base / "lrmoe", dict(lrm, record_trace=str(base / "lrmoe.trace.npz")), env=env)
    lrm = dict(lrm, record_trace=str(base / "resumed.trace.npz"))
    walls["stop"] = torchrun(base / "resumed", lrm, "--stop-after", "3", env=env)
    # the set of step 3 in the layout of older versions of the kit (rank files not named by step,
    # the matching one kept as checkpoint.rank{r}.prev.pt by a kill inside that layout's commit window)
    # still resumes
    main = torch.load(base / "resumed" / "checkpoint.pt", weights_only=False)
    assert main["step"] == 3 and main["rank_files"] == "checkpoint.step3.rank{r}.pt"
    main["rank_files"] = "checkpoint.rank{r}.pt"
    torch.save(main, base / "resumed" / "checkpoint.pt")
    for r in (0, 1):
        os.replace(base / "resumed" / f"checkpoint.step3.rank{r}.pt", base / "resumed" / f"checkpoint.rank{r}.prev.pt")
    walls["resume"] = torchrun(base / "resumed", lrm, env=env)
    print("wall seconds:", {k: round(v, 1) for k, v in walls.items()})
    yield base
    shutil.rmtree(base, ignore_errors=True)


def metrics(d: Path) -> list[dict]:
    return read_metrics(d / "metrics.jsonl")


def test_ep_fixed_c0_matches_single_process(runs):
    single, ep = metrics(runs / "single"), metrics(runs / "fixed")
    assert [r["step"] for r in ep] == list(range(1, 7))
    diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(single, ep)]
    print("per-step |loss EP - loss single|:", ["%.1e" % d for d in diffs])
    assert max(diffs) < 1e-5
    for a, b in zip(single, ep):
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
        assert b.get("eval_loss", 0.0) == pytest.approx(a.get("eval_loss", 0.0), abs=1e-5)
        assert (b["tokens"], b["label_tokens"], b["lr"], b["epoch"]) == (a["tokens"], a["label_tokens"], a["lr"],
                                                                         a["epoch"])
        assert b["layers"] == a["layers"]  # global demand/quota/kept per expert (all-reduced) = single process
        assert b["kept_fraction"] == 1.0 and b["comm_bytes"]["bwd_grad_rows"] > 0
    assert [r["step"] for r in ep if "eval_loss" in r] == [3, 6]


def test_ep_lrmoe_c20_metrics_summary_and_files(runs):
    import json

    rows = metrics(runs / "lrmoe")
    assert len(rows) == 6
    for r in rows:
        assert r["kept_fraction"] == pytest.approx(0.8, abs=0.01)
        assert r["comm_bytes_total"] == sum(r["comm_bytes"].values()) > 0
        assert r["comm_bytes"]["bwd_grad_rows"] > 0 and r["comm_bytes"]["fwd_dispatch"] > 0
        # compact backward: fewer gradient rows cross the network than forward rows
        assert r["comm_bytes"]["bwd_grad_rows"] < r["comm_bytes"]["fwd_dispatch"]
        for st in r["layers"].values():
            assert sum(st["demand"]) == 8 * 64 * 2  # the whole global batch, top-2
            # the single-process n_keep of each micro-batch (4 rows x 64 tokens x top-2), summed over 2
            assert st["kept"] == st["quota"] and sum(st["kept"]) == 2 * retained_total(4 * 64 * 2, 0.2)
    s = json.loads((runs / "lrmoe" / "summary.json").read_text())
    assert s["status"] == "done" and s["steps_done"] == 6
    assert s["model"]["experts"] == 8 and s["model"]["parameters"] > 0
    assert s["distributed"]["world_size"] == 2 and s["distributed"]["ep"] == 2
    assert s["distributed"]["placement"] == "lrmoe" and s["config"]["ep"] == 2
    assert s["final"]["kept_fraction_mean"] == pytest.approx(0.8, abs=0.01)
    names = sorted(p.name for p in (runs / "lrmoe").iterdir() if p.name != ".lrmoe.lock")  # the run-folder lock
    # the last set only (step 6): the sets of steps 2 and 4 were deleted once a later one was committed
    assert names == ["checkpoint.pt", "checkpoint.step6.dcp", "checkpoint.step6.rank0.pt",
                     "checkpoint.step6.rank1.pt", "metrics.jsonl", "summary.json"]
    # the weights are in the step's DCP folder: each rank's block of 4 experts under its own name
    import torch
    from torch.distributed.checkpoint import FileSystemReader

    ck = torch.load(runs / "lrmoe" / "checkpoint.pt", map_location="cpu", weights_only=False)
    assert "model" not in ck and (ck["world_size"], ck["ep_size"], ck["step"]) == (2, 2, 6)
    meta = FileSystemReader(str(runs / "lrmoe" / ck["dcp"])).read_metadata().state_dict_metadata
    gu = sorted(k for k in meta if k.startswith("model.") and "experts.gate_up_proj" in k)
    assert len(gu) == 4 and all(meta[k].size[0] == 4 for k in gu)


def test_ep_rows_carry_the_planning_time(runs):
    """EP rows carry ``moe_plan_s`` and ``moe_layout_s`` (the step's planning and index layouts over
    all MoE layers, > 0 and finite) with the other EP keys; the single-process run has no planner and no such key."""
    import math

    from lrmoe.train.metrics import EP_METRIC_KEYS

    for name in ("fixed", "lrmoe", "resumed"):
        rows = metrics(runs / name)
        assert len(rows) == 6, name
        for r in rows:
            assert set(EP_METRIC_KEYS) <= set(r), (name, set(EP_METRIC_KEYS) - set(r))
            for key in ("moe_plan_s", "moe_layout_s"):
                assert isinstance(r[key], float) and math.isfinite(r[key]) and r[key] > 0, (name, r["step"], key, r[key])
    assert all("moe_plan_s" not in r and "moe_layout_s" not in r for r in metrics(runs / "single"))
    # the summary's timings total it (a resumed run adds its own steps to the checkpointed total)
    import json

    for name in ("fixed", "lrmoe"):
        t = json.loads((runs / name / "summary.json").read_text())["timings"]
        for key in ("moe_plan_s", "moe_layout_s"):
            assert math.isclose(t[key], sum(r[key] for r in metrics(runs / name)), rel_tol=1e-9), (name, key, t)
    assert "moe_layout_s" not in json.loads((runs / "single" / "summary.json").read_text())["timings"]
    assert "moe_plan_s" not in json.loads((runs / "single" / "summary.json").read_text())["timings"]


def test_ep_resume_reproduces_the_uninterrupted_run(runs):
    import json

    full, resumed = metrics(runs / "lrmoe"), metrics(runs / "resumed")
    assert [r["step"] for r in resumed] == list(range(1, 7))
    for key in ("loss", "grad_norm", "lr", "epoch", "kept_fraction", "layers", "eval_loss", "comm_bytes"):
        assert [r.get(key) for r in full] == [r.get(key) for r in resumed], key
    s = json.loads((runs / "resumed" / "summary.json").read_text())
    assert s["status"] == "done" and s["resumed_from"] == [3]
    # the old layout's files were removed once a new set was committed
    assert sorted(p.name for p in (runs / "resumed").glob("checkpoint.*rank*.pt")) == [
        "checkpoint.step6.rank0.pt", "checkpoint.step6.rank1.pt"]


def test_launch_errors(tmp_path, monkeypatch, capsys):
    from lrmoe.cli import main
    from lrmoe.train.ep import check_launch

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    assert main(["train", "--out", str(tmp_path / "a"), "--ep", "2"]) == 2
    assert "torchrun --nproc-per-node 2 -m lrmoe.cli train" in capsys.readouterr().err
    assert main(["train", "--out", str(tmp_path / "b"), "--ep", "2", "--micro-batch", "3"]) == 2
    assert "micro_batch (3) must be divisible by ep (2)" in capsys.readouterr().err
    assert main(["train", "--out", str(tmp_path / "c"), "--ep", "2", "--placement", "nope"]) == 2
    assert "unknown placement 'nope'" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"micro_batch \(6\) must be divisible by the number of processes \(4\)"):
        check_launch(TrainConfig(micro_batch=6, ep=2), world=4)
    with pytest.raises(ValueError, match=r"ep \(4\) must divide the number of processes \(6\)"):
        check_launch(TrainConfig(micro_batch=12, ep=4), world=6)
    with pytest.raises(ValueError, match="ep_budget_mib must be a number > 0"):
        TrainConfig(ep_budget_mib=0).validate()
    with pytest.raises(ValueError, match=r"load_concurrency must be an int >= 0 \(0: all ranks at once\), got -1"):
        TrainConfig(load_concurrency=-1).validate()


def test_cli_ep_flags():
    import argparse

    from lrmoe.train.cli import config_from_args, register_cli

    ap = argparse.ArgumentParser()
    register_cli(ap.add_subparsers(dest="command"))
    a = ap.parse_args(["train", "--out", "x", "--ep", "8", "--placement", "ultraep", "--ep-budget-mib", "512",
                       "--ep-option", "min_tokens=64", "--ep-option", "fallback=split",
                       "--micro-batch", "32", "--load-concurrency", "2"])
    c = config_from_args(a).validate()
    assert (c.ep, c.placement, c.ep_budget_mib, c.load_concurrency) == (8, "ultraep", 512.0, 2)
    assert c.ep_options == {"min_tokens": 64, "fallback": "split"}


def test_paper_commands_rebuild_each_run_config():
    import argparse
    import shlex

    from lrmoe.reproduce import plan, torchrun_command
    from lrmoe.train.cli import config_from_args, register_cli

    ap = argparse.ArgumentParser()
    register_cli(ap.add_subparsers(dest="command"))
    pl = plan("paper", "/tmp/results-paper", data="alpaca.json")
    assert len(pl["runs"]) == 44  # E1/E2: 34; E3: fixed, SYMI x 3, UltraEP per family (LRMoE C20 is E1's run)
    e3 = {r.name: r for r in pl["runs"] if "E3" in r.experiments}
    assert sorted(e3) == sorted([f"{f}-E3-{m}-s0" for f in ("qwen3", "glm4")
                                 for m in ("fixed", "symi", "symi-cf125", "symi-dropless", "ultraep")]
                                + ["qwen3-C20-lrm-s0", "glm4-C20-lrm-s0"])
    for r in pl["runs"]:
        cmd = torchrun_command(r, pl["out"] / r.name, 8)
        assert cmd[:6] == ["torchrun", "--standalone", "--nproc-per-node", "8", "-m", "lrmoe.cli"]
        assert shlex.split(shlex.join(cmd)) == cmd
        args = ap.parse_args(cmd[6:])
        assert args.out == str(pl["out"] / r.name)
        cfg = config_from_args(args)
        assert cfg.to_dict() == r.train_config(pl["out"] / r.name).to_dict(), r.name
        # every E3 run records its routing in its own folder, the file T3 replays; no other run does
        assert cfg.record_trace == (str(pl["out"] / r.name / "routing_trace.npz") if r.name in e3 else None), r.name
        placement = r.name.split("-")[2] if "-E3-" in r.name else "lrmoe"
        assert (cfg.ep, cfg.placement, cfg.micro_batch // cfg.ep) == (8, placement, 4)  # 4 rows per GPU
        assert cfg.drop_ratio == (0.0 if placement in ("fixed", "symi", "ultraep") else cfg.drop_ratio)


def test_reproduce_runs_a_torchrun_preset(tmp_path, monkeypatch, capsys):
    """A 2-process torchrun preset on the CPU: reproduce prints and runs one torchrun launch per run."""
    import json

    from lrmoe.reproduce import Preset, reproduce

    if not TINY.exists():
        pytest.skip(f"offline Alpaca sample not found at {TINY}")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LRMOE_ALPACA"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("LRMOE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.chdir(ROOT)
    base = dict(tokenizer="bpe:300", seq_len=64, micro_batch=4, steps=2, warmup_steps=1, heldout_fraction=0.1,
                eval_batches=1, threads=1, device="cpu", ep=2, placement="lrmoe")
    # with E3 (recording traces), whose LRMoE run is this E1 run: only that one is run here (the
    # other methods' launches are the same command with another --placement)
    preset = Preset("ep-tiny", "2-process EP check", {"qwen3": "qwen3-moe-tiny"}, base, "alpaca/alpaca_tiny.json",
                    families=("qwen3",), e1_drops=(0.2,), e2_seeds=(), launcher="torchrun", nproc=2,
                    e3=dict(seeds=(0,), record_trace=True))
    out = tmp_path / "out"
    assert reproduce(preset, out, only="C20", figures=False, progress=False) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert len(printed) == 1 and printed[0].startswith("torchrun --standalone --nproc-per-node 2 -m lrmoe.cli train")
    assert "--ep 2 --placement lrmoe" in printed[0]
    run = out / "qwen3-C20-lrm-s0"
    assert printed[0].endswith(f"--record-trace {run / 'routing_trace.npz'}")
    s = json.loads((run / "summary.json").read_text())
    assert s["status"] == "done" and s["distributed"]["ep"] == 2
    from lrmoe.sim.trace import load_trace

    tr = load_trace(run / "routing_trace.npz")  # 2 steps, 2 MoE layers, 2 ranks, 8 experts
    assert tr.counts.shape == (2, 2, 2, 8) and tr.meta["placement"] == "lrmoe" and "virtual" not in tr.meta
    assert json.loads((out / "reproduce.json").read_text())["failed"] == []
    assert reproduce(preset, out, only="C20", figures=False, progress=False) == 0  # nothing left to run
    assert capsys.readouterr().out == ""


def test_random_scorer_streams_differ_per_rank():
    """Every rank seeding the random scorer with the same seed would draw the same sequence; the
    distributed runner offsets it per rank (rank 0 keeps the configured seed)."""
    from lrmoe import BackwardPolicy
    import torch

    from lrmoe.train.ep import DistributedRunner, rank_seed

    seeds = [rank_seed(5, r) for r in range(8)]
    assert seeds[0] == 5 and len(set(seeds)) == 8 and seeds == [rank_seed(5, r) for r in range(8)]
    runner = object.__new__(DistributedRunner)  # no process group needed for this method
    runner.world = 4
    draws = []
    for rank in range(4):
        runner.rank = rank
        p = runner.policy_for_rank(BackwardPolicy(0.2, scorer="random", seed=5))
        assert p.seed == rank_seed(5, rank) and (p.drop_ratio, p.scorer) == (0.2, "random")
        draws.append(torch.rand(6, generator=p.generator("cpu")))
    assert all(not torch.equal(draws[0], d) for d in draws[1:])
    unseeded = BackwardPolicy(0.2, scorer="random")
    assert runner.policy_for_rank(unseeded) is unseeded


def test_ep_records_the_routing_trace_the_simulator_replans(runs):
    """--record-trace writes what the runtime all-gathered (per micro-batch and MoE layer); the
    planner the simulator calls (plan_layer) gives, on those counts, the quotas the run logged."""
    import math

    import numpy as np

    from lrmoe.hf import model_config
    from lrmoe.planning import Cluster, ModelDims
    from lrmoe.planning.step import plan_layer
    from lrmoe.sim.trace import load_trace

    tr = load_trace(runs / "lrmoe.trace.npz")
    assert tr.counts.shape == (6 * 2, 2, 2, 8)  # micro-batches, MoE layers, ranks, experts
    assert tr.meta["source"] == "runtime" and tr.meta["top_k"] == 2 and tr.meta["placement"] == "lrmoe"
    assert (tr.counts.sum((2, 3)) == 4 * 64 * 2).all()  # every micro-batch: 4 rows x 64 tokens x top-2
    cfg = model_config("qwen3-moe-tiny")
    assert tr.meta["dims"] == {"hidden": cfg.hidden_size, "intermediate": cfg.moe_intermediate_size,
                               "num_experts": 8, "top_k": 2}  # replays at the run's own model (--at-trace)
    dims = ModelDims(cfg.hidden_size, cfg.moe_intermediate_size, 8, 2, 4, 4, 12)
    rows = metrics(runs / "lrmoe")
    for step, row in enumerate(rows):
        for li, st in row["layers"].items():
            mbs = tr.counts[2 * step:2 * step + 2, int(li)]
            assert np.array_equal(mbs.sum((0, 1)), st["demand"])
            quota = sum(plan_layer("lrmoe", d, Cluster(2, 6), dims, math.inf, selects=True, drop_ratio=0.2)
                        .kept_E for d in mbs)
            assert quota.tolist() == st["quota"], (step, li)
    # the resumed run extended its trace from its checkpoint: the same routing as the uninterrupted run
    assert np.array_equal(load_trace(runs / "resumed.trace.npz").counts, tr.counts)
