"""The Triton kernels compile for Hopper (sm_90) exactly as the kit launches them, without a GPU.

The interpreter tests check the kernels' numbers; they cannot catch what only the compiler sees
(layouts, TMA descriptor types, shared memory, PTX and ptxas errors). This runs
``scripts/check_triton_compile.py --quick --dtype bf16`` in a fresh process (the real kernels,
not the interpreter's): every bf16 specialisation the experts' forward/backward and the public op
launch, with and without TMA descriptors, compiled to a cubin through Triton's own binder; every
autotune config for the layer's launches with TMA at the first size (what training runs on
Hopper), the smallest-tile config for every other launch (other sizes, pointer loads, the op's
other paths). ``results/bench/triton_compile_sm90.json`` has every config of every launch.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from background import KEY, triton_check_argv, triton_check_env

ROOT = Path(__file__).resolve().parents[2]


def _nvidia_toolchain() -> str | None:
    """Why the NVIDIA compile path is unavailable here, or None when it is."""
    try:
        import triton  # noqa: F401
        from triton.backends import backends
    except Exception as e:  # noqa: BLE001
        return f"triton does not import: {e}"
    if "nvidia" not in backends:
        return f"this Triton build has no NVIDIA backend (has {sorted(backends)})"
    try:
        from triton import knobs

        ptxas = knobs.nvidia.ptxas.path
    except Exception as e:  # noqa: BLE001
        return f"Triton cannot locate ptxas: {e}"
    if not ptxas or not (os.path.exists(ptxas) or shutil.which(ptxas)):
        return f"ptxas not found ({ptxas!r})"
    return None


@pytest.fixture(scope="module")
def compiled(request, tmp_path_factory):
    why = _nvidia_toolchain()
    if why:
        pytest.skip(f"cannot compile for sm_90 here: {why}")
    # run beside the earlier tests by the session's background (tests/background.py), else here
    bg = request.config.stash.get(KEY, None)
    done = bg.result("triton_sm90") if bg is not None else None
    if done is not None:
        r, out = done
    else:
        out = tmp_path_factory.mktemp("aot")
        r = subprocess.run(triton_check_argv(out, jobs=2), cwd=ROOT, env=triton_check_env(out), capture_output=True,
                           text=True, timeout=600)
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return json.loads((out / "triton_compile_sm90.json").read_text())


def test_the_check_binds_exactly_as_a_real_launch(compiled):
    """Every compiled (launch, config) was also run through JITFunction.run in warmup mode (the
    path of a real launch, with a stand-in driver for sm_90): same options, signature, constexprs
    and attributes. Guards the check against drifting from Triton's own launch path."""
    assert compiled["binder_checks"] == len(compiled["rows"]) > 0
    assert compiled["binder_matches"] == compiled["binder_checks"]


def test_every_bf16_launch_compiles_to_a_cubin(compiled):
    rows = compiled["rows"]
    assert compiled["failed"] == []
    assert len(rows) >= 20
    for r in rows:
        assert r["error"] is None and r["cubin_bytes"] > 0 and r["shared"] > 0, r


def test_the_launches_cover_tma_fused_gather_scatter_and_both_kernels(compiled):
    variants = {r["variant"] for r in compiled["rows"]}
    kernels = {r["kernel"] for r in compiled["rows"]}
    assert kernels == {"row_split_kernel", "contraction_split_kernel"}
    for flag in ("A_TMA=True", "B_TMA=True", "B_KMAJOR=True", "B_KMAJOR=False", "HAS_A_IDX=True", "HAS_OUT_IDX=True",
                 "HAS_B_IDX=True", "ACCUMULATE=True", "tensordesc<bf16[1, "):
        assert any(flag in v for v in variants), f"no compiled launch with {flag}"
    # pointer loads only (the fallback after a TMA failure, and GPUs before Hopper) are compiled too
    assert any("A_TMA=False" in v and "B_TMA=False" in v and "HAS_A_IDX=False" in v for v in variants)


def test_every_autotune_config_compiles_and_some_config_fits_each_launch(compiled):
    from collections import defaultdict

    by_kernel = defaultdict(set)
    for r in compiled["rows"]:
        by_kernel[r["kernel"]].add(r["config"])
    assert {k: sorted(v) for k, v in by_kernel.items()} == {k: sorted(v) for k, v in compiled["autotune_configs"].items()}
    assert all(r["fits"] for r in compiled["rows"])  # bf16: every config within sm_90's 227 KiB


def test_hopper_code_uses_warpgroup_mma_and_tma(compiled):
    """16-bit tiles must run on Hopper's wgmma (not the Ampere mma.sync path, about half the
    peak), descriptors must become TMA bulk copies, gathered rows pipelined cp.async loads."""
    rows = compiled["rows"]
    assert all(r["mma"] == "wgmma" for r in rows), {(r["variant"], r["config"], r["mma"]) for r in rows
                                                     if r["mma"] != "wgmma"}
    for r in rows:
        uses_desc = "A_TMA=True" in r["variant"] or "B_TMA=True" in r["variant"]
        assert r["tma_loads"] == uses_desc, r
        if "HAS_A_IDX=True" in r["variant"] or "HAS_B_IDX=True" in r["variant"]:
            assert r["async_copies"], r


def test_ptxas_facts_are_read_for_every_compile(compiled):
    """Registers, stack frame and spills come from the ptxas -v log of each compile (a fresh Triton
    cache: every kernel is compiled here, none comes from an earlier run)."""
    for r in compiled["rows"]:
        assert r["registers"] is not None and 0 < r["registers"] <= 255, r
        assert r["stack_bytes"] is not None and r["spill_store_bytes"] is not None, r


def test_no_bf16_layer_config_spills_registers(compiled):
    """The launches training makes (the experts' forward and backward in bf16): no register spills
    in any config compiled here. (Other launches of the op are reported by the script, not asserted.)"""
    layer = [r for r in compiled["rows"] if r["source"].startswith("layer")]
    assert len(layer) >= 40 and len({(r["kernel"], r["config"]) for r in layer}) == 10
    spilled = [(r["source"], r["variant"], r["config"], r["registers"], r["spill_store_bytes"]) for r in layer
               if r["spill_store_bytes"]]
    assert not spilled, spilled
