"""The `paper` preset's launch: its scale options, the torchrun commands it prints (parsed back by
`lrmoe train` to the same config), and the memory check that refuses runs estimated not to fit
(lrmoe.reproduce.memory_check), with the estimator replaced by a stand-in that counts its calls."""
from __future__ import annotations

import json
import os

import pytest

from lrmoe.cli import build_parser
from lrmoe.reproduce import memory_check
from lrmoe.reproduce.presets import PRESETS
from lrmoe.runs import torchrun
from lrmoe.train.cli import config_from_args

GIB = 2 ** 30


def test_paper_preset_turns_on_the_scale_options():
    for r in PRESETS["paper"].runs():
        c = r.config
        assert (c["fsdp"], c["activation_checkpointing"], c["offload"], c["ep"]) == (True, True, "experts", 8), r.name


def test_paper_torchrun_commands_parse_back_to_the_runs_config(tmp_path):
    for r in PRESETS["paper"].runs():
        cmd = torchrun.torchrun_command(r, tmp_path / r.name, 8)
        argv = cmd[cmd.index("lrmoe.cli") + 1:]
        args = build_parser(argv).parse_args(argv)
        assert config_from_args(args).to_dict() == r.train_config(tmp_path / r.name).to_dict(), r.name


class _Estimator:
    def __init__(self, peak_of):
        self.peak_of, self.calls = peak_of, []

    def __call__(self, config, world):
        self.calls.append((config["drop_ratio"], config["scorer"], config["seed"]))
        peak, host = self.peak_of(config)
        return {"peak_gib": peak, "counted_peak_gib": peak - 3, "offloaded_to_host_gib": host, "overhead_gib": 3.0,
                "categories_gib": {"Param": 1.0}, "demand": "balanced"}


def _runs(family="qwen3"):
    return [r for r in PRESETS["paper"].runs() if r.name.startswith(family)]


def test_memory_check_estimates_each_memory_config_once_and_refuses_what_does_not_fit(tmp_path, monkeypatch):
    monkeypatch.setattr(memory_check, "COMMITTED", tmp_path / "none.json")  # not the kit's stored estimates
    runs = _runs()
    est = _Estimator(lambda c: (90.0 if c["drop_ratio"] == 0.0 else 40.0, 10.0))
    lines = memory_check.check(runs, 8, tmp_path, 80 * GIB, 2000 * GIB, estimate=est, say=lambda s: None)
    keys = {memory_check.memory_key(r.config, 8) for r in runs}
    assert len(est.calls) == len(keys) < len(runs)  # scorers and seeds share an estimate
    c0 = [r.name for r in runs if r.config["drop_ratio"] == 0.0 and r.config["placement"] == "lrmoe"]
    assert c0 and all(any(line.strip().startswith(n + ":") for line in lines) for n in c0)
    assert all("90.0 GiB per GPU" in line or "as " in line for line in lines)
    assert not any("C20-lrm" in line for line in lines)
    stored = json.loads((tmp_path / memory_check.LOCAL).read_text())
    assert len(stored) == len(keys)
    # a second check reads the stored estimates: nothing is computed again
    est2 = _Estimator(lambda c: pytest.fail("estimated again"))
    assert memory_check.check(runs, 8, tmp_path, 80 * GIB, 2000 * GIB, estimate=est2, say=lambda s: None) == lines
    # the host: 10 GiB per GPU x 8 ranks = 80 GiB > 64 GiB
    host = memory_check.check(runs, 8, tmp_path, 141 * GIB, 64 * GIB, estimate=est2, say=lambda s: None)
    assert host and all("host memory" in line or "as " in line for line in host)
    assert len([line for line in host if "as " not in line]) == len(keys)
    # each process needs more than its offloaded state: (10 + 6) GiB x 8 = 128 GiB > 100 GiB
    assert memory_check.host_need_gib(10.0, 8) == (10.0 + memory_check.HOST_PER_PROCESS_GIB) * 8
    tight = memory_check.check(runs, 8, tmp_path, 141 * GIB, 100 * GIB, estimate=est2, say=lambda s: None)
    assert tight and "per process" in tight[0] and tight[0].endswith(memory_check.NO_ALTERNATIVE)
    assert not memory_check.check(runs, 8, tmp_path, 141 * GIB, 129 * GIB, estimate=est2, say=lambda s: None)


def test_host_memory_available_and_threads_per_rank():
    assert 0 < memory_check.host_available_bytes() <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    from lrmoe.train.ep import host_threads

    assert host_threads(16, 8) == 2 and host_threads(192, 8) == 24
    assert host_threads(4, 8) == 1 and host_threads(None, 8) == 1 and host_threads(16, 0) == 16


def test_dry_run_column(tmp_path):
    r = _runs()[0]
    assert "not estimated yet" in memory_check.column(r, 8, {})
    memory_check.save(tmp_path / "e.json", r.config, 8, {"peak_gib": 19.8, "counted_peak_gib": 16.8,
                                                         "offloaded_to_host_gib": 54.0, "overhead_gib": 3.0,
                                                         "categories_gib": {}, "demand": "balanced"}, r.name)
    got = json.loads((tmp_path / "e.json").read_text())
    assert memory_check.column(r, 8, got) == "memory: 19.8 GiB/GPU estimated, host 54 GiB/GPU"
    # the key ignores what memory does not depend on (seed, scorer), not what it does (drop ratio, world)
    other_seed = dict(r.config, seed=7, scorer="random")
    assert memory_check.memory_key(other_seed, 8) == memory_check.memory_key(r.config, 8)
    assert memory_check.memory_key(dict(r.config, drop_ratio=0.5), 8) != memory_check.memory_key(r.config, 8)
    assert memory_check.memory_key(r.config, 16) != memory_check.memory_key(r.config, 8)


def test_committed_estimates_are_the_paper_presets():
    """results/memory/estimates.json holds estimates of the paper preset's own memory configs (each
    keyed as its config says), for the dry run's column and the preflight."""
    from lrmoe.reproduce.presets import PRESETS

    stored = json.loads(memory_check.COMMITTED.read_text())
    paper = {memory_check.memory_key(r.config, 8) for r in PRESETS["paper"].runs()}
    gpu1 = {memory_check.memory_key(r.config, 1) for r in PRESETS["gpu1"].runs()}

    def experiment(cfg):  # what a refusal's alternative keeps: all but the world, EP size and offload
        return json.dumps({k: v for k, v in cfg.items() if k not in memory_check.SCALE_FIELDS}, sort_keys=True)

    paper_experiments = {experiment(memory_check.memory_config(r.config, 8)) for r in PRESETS["paper"].runs()}
    alternatives = {k for k, e in stored.items()
                    if k not in paper | gpu1 and experiment(e["config"]) in paper_experiments}
    assert stored and set(stored) <= paper | gpu1 | alternatives and set(stored) & gpu1
    for key, e in stored.items():
        cfg = dict(e["config"])
        assert memory_check.memory_key(cfg, cfg.pop("world")) == key
        assert "not measured" in e["estimated"] and (e["peak_gib"] <= 72 if key not in gpu1 else e["peak_gib"] > 0)
    # every GLM-4.5-Air paper run has one without offload (EP32) for a node without 1.5 TiB of host memory
    for r in PRESETS["paper"].runs():
        if r.name.startswith("glm4"):
            alt = memory_check.alternative(r.config, 8, 80.0, 512.0, stored)
            assert alt and alt.startswith("the smallest stored configuration that fits: 32 GPUs "
                                          "(--ep 32 --offload none)"), (r.name, alt)


def test_gpu1_runs_are_checked_on_an_80_gib_gpu(tmp_path):
    """The gpu1 preset trains from scratch with its 32,768-token BPE: by the committed estimates its
    Qwen3 runs fit an 80 GiB GPU and its GLM-4.5-Air runs do not (they need an H200)."""
    runs = [r for r in PRESETS["gpu1"].runs() if r.name in ("qwen3-C20-lrm-s0", "glm4-C20-lrm-s0")]

    def never(config, world):
        raise AssertionError("the committed estimates cover these runs")

    lines = memory_check.check(runs, 1, tmp_path, 80 * GIB, 512 * GIB, estimate=never, say=lambda s: None)
    assert len(lines) == 1 and lines[0].startswith("  glm4-C20-lrm-s0:")
    assert memory_check.check(runs, 1, tmp_path, 141e9, 512 * GIB, estimate=never, say=lambda s: None) == []


def test_a_refusal_names_the_smallest_stored_configuration_that_fits(tmp_path, monkeypatch):
    """GLM-4.5-Air's C20 run with its experts offloaded needs more host memory than this node has:
    the refusal names the stored estimate of the same experiment that fits (the fewest GPUs, then no
    offload), and none when no stored configuration fits."""
    monkeypatch.setattr(memory_check, "COMMITTED", tmp_path / "none.json")
    run = next(r for r in _runs("glm4") if r.name == "glm4-C20-lrm-s0")
    path = tmp_path / memory_check.LOCAL

    def store(world, ep, offload, peak, host):
        c = dict(run.config, ep=ep, offload=offload)
        memory_check.save(path, c, world, {"peak_gib": peak, "counted_peak_gib": peak - 3, "overhead_gib": 3.0,
                                           "offloaded_to_host_gib": host, "categories_gib": {}, "demand": "balanced"})

    store(8, 8, "experts", 44.2, 185.6)   # the preset's own: needs (185.6 + 6) x 8 GiB of host memory
    store(8, 8, "none", 229.8, 0.0)       # does not fit an 80 GiB GPU
    store(64, 32, "none", 40.0, 0.0)      # fits, but more GPUs than the one below (EP32 x 2 replicas)
    store(32, 32, "none", 63.2, 0.0)      # fits
    store(32, 32, "experts", 20.0, 50.0)  # fits too, but with offload: the same GPUs without it come first
    other = dict(run.config, drop_ratio=0.3)  # another experiment: never named for this one
    memory_check.save(path, dict(other, ep=16, offload="none"), 16, {
        "peak_gib": 70.0, "counted_peak_gib": 67.0, "overhead_gib": 3.0, "offloaded_to_host_gib": 0.0,
        "categories_gib": {}, "demand": "balanced"})
    est = _Estimator(lambda c: pytest.fail("estimated again"))
    lines = memory_check.check([run], 8, tmp_path, 80 * GIB, 1000 * GIB, estimate=est, say=lambda s: None)
    assert len(lines) == 1 and "host memory" in lines[0]
    assert lines[0].endswith("the smallest stored configuration that fits: 32 GPUs (--ep 32 --offload none), "
                             "estimated 63.2 GiB per GPU"), lines[0]
    # 60 GiB GPUs: only the 64-GPU configuration and the offloaded 32-GPU one fit; with 1,000 GiB of
    # host memory the offloaded one, (50 + 6) x 8 = 448 GiB per node, fits and has fewer GPUs
    lines = memory_check.check([run], 8, tmp_path, 60 * GIB, 1000 * GIB, estimate=est, say=lambda s: None)
    assert lines[0].endswith("32 GPUs (--ep 32 --offload experts), estimated 20.0 GiB per GPU"), lines[0]
    # 16 GiB GPUs: nothing stored fits; the line says what does not fit and names nothing
    lines = memory_check.check([run], 8, tmp_path, 16 * GIB, 1000 * GIB, estimate=est, say=lambda s: None)
    assert "per GPU" in lines[0] and "smallest stored configuration" not in lines[0]
