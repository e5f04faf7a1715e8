"""The systems tables across the conditions that decide them (T4, T5 and F3 at 20x pressure).

One simulation of the paper's Qwen3-30B-A3B setting (EP8, 32,768 tokens per GPU, the four methods,
LRMoE at C20, the ``fixed-1x`` budget) per routing workload and grouped-GEMM rate, read two ways for
the memory table:

* workloads: every routing the simulator has (balanced; log-normal sigma 0.5, 1, 2; power law
  alpha 1.2, the cited Qwen3 fit; one hot rank) and a recorded model trace when given;
* T4's token buffers: ``all`` (every forward and backward buffer, the memory model's) or
  ``compacted`` (only those compaction sizes: the backward's execution buffers and its all-to-all,
  :func:`lrmoe.sim.simulate.compacted_token_bytes`); the paper does not say which it counts;
* GEMM rate: 242 TFLOP/s (torch grouped_mm at Qwen3's expert shape on one H100, VeOmni PR 460),
  400, and 483 (twice 242: about the rate the paper's 12.69 ms backward needs,
  docs/simulator.md); every other constant is ``h100-sxm``'s.

Each cell is marked when within 15 % of the paper's; :func:`reproducers` lists, per paper cell, the
configurations that reproduce it (or none). Every number is simulated.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from .hardware import get_hardware
from .scenarios import get_scenario, run_scenario

WORKLOADS = (("balanced", "balanced", {}), ("lognormal σ 0.5", "lognormal", {"sigma": 0.5}),
             ("lognormal σ 1", "lognormal", {"sigma": 1.0}), ("lognormal σ 2", "lognormal", {"sigma": 2.0}),
             ("power law α 1.2", "powerlaw", {"alpha": 1.2}), ("hot rank", "hot_rank", {}))
ACCOUNTING = ("all", "compacted")
GEMM_TFLOPS = (242.0, 400.0, 483.0)
WITHIN = 0.15
PRESSURE = 20
NAMES = {"fixed": "Megatron-LM", "ultraep": "UltraEP", "symi": "SYMI", "lrmoe": "LRMoE"}  # the paper's method names


def paper_cells(paper: dict) -> dict:
    """The paper's cells this sweep judges (Qwen3-30B-A3B), ``{(table, method): value}``, from the
    paper's numbers (``paper_figures.results.paper_numbers()``): T4 subtotal GiB per method, T5
    backward ms (fixed ownership = the paper's baseline) and their ratio, F3 at 20x in % of LRMoE."""
    t4, t5, f3 = paper["T4"]["subtotal"], paper["T5"]["values"], paper["F3"]["values"]
    cells = {("T4", m): float(t4[NAMES[m]]) for m in ("fixed", "ultraep", "symi", "lrmoe")}
    cells |= {("T5", "fixed"): float(t5["baseline"]), ("T5", "lrmoe"): float(t5["LRMoE"]),
              ("T5", "ratio"): float(t5["baseline"]) / float(t5["LRMoE"])}
    return cells | {("F3", m): float(f3[NAMES[m]]) for m in ("ultraep", "symi", "fixed")}


def within(kit: float, paper: float) -> bool:
    return abs(kit / paper - 1) <= WITHIN


def run_conditions(paper: dict, *, steps: int = 3, layers: int = 4, trace=None, trace_name: str = "model trace",
                   progress: Callable[[str], None] | None = None) -> dict:
    """``{"rows": [...], "reproducers": {...}, "settings": {...}}``; one row per (workload, accounting,
    GEMM rate) with the kit's value and whether it is within 15 % for every paper cell
    (``paper``: :func:`paper_cells`)."""
    say = progress or (lambda msg: None)
    paper_sc = dataclasses.replace(get_scenario("paper-qwen3"), steps=steps, layers=layers)
    pressure_sc = dataclasses.replace(get_scenario("pressure-qwen3"), steps=steps, layers=layers, pressures=(PRESSURE,))
    base = get_hardware("h100-sxm")
    workloads = [(name, w, p, None) for name, w, p in WORKLOADS]
    if trace is not None:
        workloads.append((trace_name, None, {}, trace))
    rows = []
    for name, workload, params, tr in workloads:
        for rate in GEMM_TFLOPS:
            hw = dataclasses.replace(base, name=f"h100-sxm@{rate:g}TFLOPs", gemm_tflops=rate,
                                     source=f"{base.source}; grouped-GEMM rate set to {rate:g} TFLOP/s")
            say(f"conditions: {name}, {rate:g} TFLOP/s")
            kw = {} if tr is not None else {"workload": workload, "workload_params": params}
            t = run_scenario(dataclasses.replace(paper_sc, **kw), tr, hardware=hw)["methods"]
            f = run_scenario(dataclasses.replace(pressure_sc, **kw), tr, hardware=hw)["methods"]
            t5 = {"fixed": t["fixed"]["backward_ms_per_layer"], "lrmoe": t["lrmoe"]["backward_ms_per_layer"]}
            t5["ratio"] = t5["fixed"] / t5["lrmoe"]
            f3 = {m: 100 * f[m]["throughput"][str(PRESSURE)]["relative"] for m in ("ultraep", "symi", "fixed")}
            kept = f["lrmoe"]["throughput"][str(PRESSURE)]["kept_backward_share"]
            for acc in ACCOUNTING:
                key = "subtotal" if acc == "all" else "subtotal_compacted"
                t4 = {m: t[m]["memory_gib"][key] for m in ("fixed", "ultraep", "symi", "lrmoe")}
                cells = {("T4", m): v for m, v in t4.items()} | {("T5", m): v for m, v in t5.items()} | \
                        {("F3", m): v for m, v in f3.items()}
                rows.append({"workload": name, "accounting": acc, "gemm_tflops": rate,
                             "cells": {f"{a}/{m}": v for (a, m), v in cells.items()},
                             "within": {f"{a}/{m}": within(v, paper[(a, m)]) for (a, m), v in cells.items()},
                             "lrmoe_vs_fixed_memory": t4["lrmoe"] / t4["fixed"] - 1,
                             "lrmoe_kept_backward_share_at_20x": kept})
    return {"rows": rows, "reproducers": reproducers(rows), "paper": {f"{a}/{m}": v for (a, m), v in paper.items()},
            "settings": {"steps": steps, "layers": layers, "pressure": PRESSURE, "within": WITHIN,
                         "scenario": "paper-qwen3 / pressure-qwen3", "hardware": "h100-sxm, gemm_tflops varied",
                         "trace": None if trace is None else dict(trace.meta)}, "simulated": True}


def reproducers(rows: list[dict]) -> dict[str, list[str]]:
    """Per paper cell, the configurations within 15 % of it (memory cells: workload and accounting;
    time cells: workload and rate; accounting does not change them)."""
    out: dict[str, list[str]] = {}
    for cell in rows[0]["cells"] if rows else ():
        hits = []
        for r in rows:
            if not r["within"][cell]:
                continue
            label = (f"{r['workload']}, {r['accounting']} buffers" if cell.startswith("T4") else
                     f"{r['workload']}, {r['gemm_tflops']:g} TFLOP/s")
            if label not in hits:
                hits.append(label)
        out[cell] = hits
    return out


def markdown(result: dict) -> str:
    """The table (✓ within 15 % of the paper) and, per paper cell, what reproduces it."""
    paper = result["paper"]
    cells = list(paper)
    head = ["workload", "T4 buffers", "GEMM TFLOP/s"] + [f"{c} ({paper[c]:.3g})" for c in cells]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in result["rows"]:
        vals = [f"{r['cells'][c]:.2f}{' ✓' if r['within'][c] else ''}" for c in cells]
        lines.append(f"| {r['workload']} | {r['accounting']} | {r['gemm_tflops']:g} | " + " | ".join(vals) + " |")
    lines += ["", "| paper cell | paper | configurations within 15 % |", "|---|---|---|"]
    for c in cells:
        hits = result["reproducers"][c]
        lines.append(f"| {c} | {paper[c]:.3g} | {'; '.join(hits) if hits else '**none**'} |")
    return "\n".join(lines) + "\n"
