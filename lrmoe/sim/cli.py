"""``lrmoe simulate``: replay routing through the real planners and the hardware model.

    lrmoe simulate --list
    lrmoe simulate calibrate                             # measure this machine: results/sim/cpu-local.json
    lrmoe simulate record-trace --run RUN_DIR --out t.npz  # a trained model's routing on its data
    lrmoe simulate trace-stats t.npz lognormal hot_rank  # skew and drift of traces / workloads, side by side
    lrmoe simulate --scenario paper-qwen3 --out results/sim/paper-qwen3
    lrmoe simulate --scenario paper                      # the four paper scenarios, results/sim/<name>/
    lrmoe simulate --scenario pressure-glm --trace my_trace.npz --hardware h200-sxm
    lrmoe simulate --scenario paper-qwen3 --trace RUN/routing_trace.npz --at-trace  # at the run's own model
    lrmoe simulate conditions --out results/sim/conditions   # T4/T5/F3 across skew, buffers, GEMM rate

Each scenario writes ``simulation.json``, its tables (``tables/*.md`` + ``.tex``) and figures
(``figures/*.png`` + ``.pdf``). Every number is simulated: the hardware preset and the trace are
written beside it (docs/simulator.md).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

PAPER_SET = ("paper-qwen3", "paper-glm", "pressure-qwen3", "pressure-glm")


def register_cli(sub) -> None:
    ap = sub.add_parser("simulate", help="simulate the paper's system results (T4, T5, F3, F5) on a hardware model",
                        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", nargs="?", choices=["calibrate", "record-trace", "trace-stats", "replot", "conditions"],
                    default=None,
                    help="calibrate: measure this machine (2 gloo processes) into the cpu-local preset "
                         "(OUT/cpu-local.json, OUT default results/sim); record-trace: the routing of the model "
                         "of --run on its data into the trace file --out; trace-stats: skew and drift of the "
                         "traces and workloads named after it (OUT/trace_stats.json + .md); replot: the tables "
                         "and figures again from the simulation.json files under the folders named after it "
                         "(simulating nothing)")
    ap.add_argument("items", nargs="*", metavar="TRACE",
                    help="trace-stats: trace files (.npz) or synthetic workload names; replot: result folders")
    ap.add_argument("--run", type=Path, default=None, help="record-trace: an lrmoe train run folder")
    ap.add_argument("--ranks", type=int, default=8, help="record-trace: source ranks (8)")
    ap.add_argument("--rows-per-rank", type=int, default=1, help="record-trace: packed rows per rank per step (1)")
    ap.add_argument("--split", choices=["train", "heldout"], default="train", help="record-trace: data split")
    ap.add_argument("--tokens-per-rank", type=int, default=32768,
                    help="trace-stats: tokens per rank of the named workloads (32768, the paper's)")
    ap.add_argument("--list", action="store_true", help="name the scenarios and hardware presets, then exit")
    ap.add_argument("--scenario", default=None, metavar="NAME",
                    help="a scenario of --list, 'paper' (the four paper scenarios) or 'all'")
    ap.add_argument("--trace", type=Path, default=None, metavar="PATH",
                    help="a routing trace file (docs/simulator.md) to replay instead of the scenario's workload")
    ap.add_argument("--at-trace", action="store_true",
                    help="with --trace: simulate at the trace's own configuration (its model's experts, MoE layers, "
                         "ranks and tokens per rank) instead of the scenario's paper model")
    ap.add_argument("--hardware", default=None, metavar="NAME", help="hardware preset (default: the scenario's)")
    ap.add_argument("--steps", type=int, default=None, help="trace steps to simulate (default: the scenario's)")
    ap.add_argument("--layers", type=int, default=None, help="MoE layers to simulate (default: the scenario's)")
    ap.add_argument("--no-planning", dest="planning", action="store_false",
                    help="leave the planners' host time out of the forward")
    ap.add_argument("--out", type=Path, default=Path("results/sim"),
                    help="output folder (one scenario: DIR/simulation.json; several: DIR/<scenario>/)")
    ap.set_defaults(func=run)


def _fail(msg: str) -> int:
    print(f"lrmoe simulate: error: {msg}", file=sys.stderr)
    return 2


def run(args) -> int:
    from ..environment import git_revision
    from ..files import write_json
    from .hardware import get_hardware, hardware_names
    from .scenarios import get_scenario, run_scenario, scenario_names

    if args.action == "calibrate":
        if args.out.exists() and not args.out.is_dir():
            return _fail(f"--out {args.out} is a file; give a folder")
        from ..bench.simulator import main as bench_main
        bench_main(["--calibrate-only", "--calibration", str(args.out / "cpu-local.json")])
        return 0
    if args.action == "record-trace":
        return _record_trace(args)
    if args.action == "trace-stats":
        return _trace_stats(args)
    if args.action == "conditions":
        return _conditions(args)
    if args.action == "replot":
        return _replot(args.items)
    if args.items:
        return _fail(f"unexpected arguments {args.items}; only trace-stats takes traces")
    if args.list:
        from .scenarios import SCENARIOS
        for name, sc in SCENARIOS.items():
            print(f"{name:16s} {sc.description}")
        print("hardware presets: " + ", ".join(hardware_names()))
        return 0
    if args.scenario is None:
        return _fail("give --scenario NAME (or --list); scenarios: " + ", ".join(scenario_names()) + ", paper, all")
    names = {"paper": list(PAPER_SET), "all": scenario_names()}.get(args.scenario, [args.scenario])
    try:
        scenarios = [get_scenario(n) for n in names]
        if args.hardware is not None:
            get_hardware(args.hardware)
    except ValueError as e:
        return _fail(str(e))
    for flag, v in (("--steps", args.steps), ("--layers", args.layers)):
        if v is not None and v < 1:
            return _fail(f"{flag} must be >= 1, got {v}")
    if args.out.exists() and not args.out.is_dir():
        return _fail(f"--out {args.out} is a file; give a folder")
    trace = None
    if args.at_trace and args.trace is None:
        return _fail("--at-trace needs --trace PATH (the trace whose configuration to simulate at)")
    if args.trace is not None:
        from ..files import CorruptFileError
        from .scenarios import at_trace, check_trace_fits
        from .trace import load_trace
        try:
            trace = load_trace(args.trace)
            if args.at_trace:
                dims = trace_dims(trace, args.trace)
                scenarios = [at_trace(sc, trace, dims) for sc in scenarios]
            else:
                for sc in scenarios:
                    check_trace_fits(sc, trace)
        except (OSError, CorruptFileError, ValueError) as e:
            return _fail(f"--trace {args.trace}: {e}")
    from paper_figures.results import paper_numbers
    from paper_figures.simulation import make_figures, make_tables

    paper = paper_numbers()
    rev = git_revision()
    t_all = time.perf_counter()
    for sc in scenarios:
        changes = {k: v for k, v in (("steps", args.steps), ("layers", args.layers)) if v is not None}
        sc = dataclasses.replace(sc, **changes)
        if trace is not None:
            tr = trace
            if args.steps is not None or args.layers is not None:
                from .trace import Trace
                tr = Trace(trace.counts[: args.steps or None, : args.layers or None], dict(trace.meta))
        else:
            tr = None
        out = args.out if len(scenarios) == 1 else args.out / sc.name
        t0 = time.perf_counter()
        print(f"[simulate] {sc.name}: {sc.description}", file=sys.stderr, flush=True)
        try:
            result = run_scenario(sc, tr, hardware=args.hardware, include_planning=args.planning,
                                  progress=lambda msg: print(f"[simulate] {msg}", file=sys.stderr, flush=True))
        except ValueError as e:
            return _fail(f"{sc.name}: {e}")
        result["git_rev"] = rev
        result["wall_s"] = time.perf_counter() - t0
        path = write_json(Path(out) / "simulation.json", result)
        made = make_tables(result, paper, Path(out)) + make_figures(result, paper, Path(out))
        for p in made:
            if p.suffix == ".md":
                print(p.read_text())
        print(f"[simulate] {sc.name}: {result['wall_s']:.1f} s; wrote {path} and {len(made)} tables/figures",
              file=sys.stderr)
    if len(scenarios) > 1:
        print(f"[simulate] {len(scenarios)} scenarios in {time.perf_counter() - t_all:.1f} s", file=sys.stderr)
    return 0


def trace_dims(trace, path: Path) -> dict:
    """The routed experts' dimensions of the model a trace was recorded from: the meta's ``"dims"``
    (traces recorded since they are stored), else the meta's model preset with its overrides, or
    with those of the run folder the trace sits in (``summary.json``'s config). ValueError when
    neither says."""
    if isinstance(trace.meta.get("dims"), dict):
        return trace.meta["dims"]
    model = trace.meta.get("model")
    overrides = trace.meta.get("model_overrides")
    summary = Path(path).parent / "summary.json"
    if overrides is None and summary.exists():
        from ..files import read_json
        cfg = read_json(summary).get("config", {})
        if cfg.get("model") == model:
            overrides = cfg.get("model_overrides") or {}
    if not model or overrides is None:
        raise ValueError("the trace's meta has no 'dims' and its model cannot be resolved (no 'model' and "
                         "'model_overrides', and no run folder summary.json beside it); record it again with "
                         "this version (lrmoe train --record-trace, lrmoe simulate record-trace)")
    from ..hf.integration import model_config, moe_dims
    return moe_dims(model_config(model, **overrides))


def _replot(folders) -> int:
    """The tables and figures of every ``simulation.json`` under ``folders`` again, beside it."""
    from paper_figures.results import paper_numbers
    from paper_figures.simulation import make_figures, make_tables

    from ..files import CorruptFileError, read_json

    if not folders:
        return _fail("replot: name result folders, e.g. lrmoe simulate replot results/sim results/cpu/sim")
    found = sorted({p for f in folders for p in Path(f).rglob("simulation.json")})
    if not found:
        return _fail(f"replot: no simulation.json under {', '.join(map(str, folders))}")
    paper = paper_numbers()
    for path in found:
        try:
            result = read_json(path)
        except CorruptFileError as e:
            return _fail(str(e))
        made = make_tables(result, paper, path.parent) + make_figures(result, paper, path.parent)
        print(f"[simulate] replot {path.parent}: {len(made)} tables/figures", file=sys.stderr)
    return 0


def _conditions(args) -> int:
    """T4, T5 and F3 (20x) across workloads x token-buffer accounting x GEMM rate (lrmoe.sim.conditions)."""
    from ..environment import git_revision
    from ..files import write_json, write_text
    from paper_figures.results import paper_numbers

    from .conditions import markdown, paper_cells, run_conditions

    if args.out.exists() and not args.out.is_dir():
        return _fail(f"--out {args.out} is a file; give a folder")
    for flag, v in (("--steps", args.steps), ("--layers", args.layers)):
        if v is not None and v < 1:
            return _fail(f"{flag} must be >= 1, got {v}")
    trace = None
    if args.trace is not None:
        from ..files import CorruptFileError
        from .scenarios import check_trace_fits, get_scenario
        from .trace import load_trace
        try:
            trace = load_trace(args.trace)
            check_trace_fits(get_scenario("paper-qwen3"), trace)
        except (OSError, CorruptFileError, ValueError) as e:
            return _fail(f"--trace {args.trace}: {e}")
    t0 = time.perf_counter()
    result = run_conditions(paper_cells(paper_numbers()), steps=args.steps or 3, layers=args.layers or 4, trace=trace,
                            progress=lambda msg: print(f"[simulate] {msg}", file=sys.stderr, flush=True))
    result["git_rev"] = git_revision()
    result["wall_s"] = time.perf_counter() - t0
    path = write_json(args.out / "conditions.json", result)
    md = markdown(result)
    write_text(args.out / "conditions.md", "# T4, T5 and F3 (20x) across conditions (simulated)\n\n"
               "Qwen3-30B-A3B, EP8, 32,768 tokens per GPU, LRMoE at C20, budget fixed-1x; cells: T4 subtotal GiB per "
               "MoE layer, T5 backward ms per MoE layer (and fixed / LRMoE), F3 effective throughput at 20x in % of "
               "LRMoE's (planning included); ✓ within 15 % of the paper's cell (in the header). lrmoe.sim.conditions "
               f"explains every condition. Revision {result['git_rev']}.\n\n" + md)
    print(md)
    print(f"[simulate] conditions: {result['wall_s']:.1f} s; wrote {path}", file=sys.stderr)
    return 0


def _record_trace(args) -> int:
    if args.run is None:
        return _fail("record-trace needs --run RUN_DIR (an lrmoe train run with a checkpoint)")
    if args.out.suffix != ".npz":
        return _fail(f"record-trace --out must be a .npz trace file, got {args.out}")
    steps = 32 if args.steps is None else args.steps
    from ..train.model_trace import record_model_trace
    from .trace import save_trace, trace_stats
    try:
        tr = record_model_trace(args.run, num_ranks=args.ranks, steps=steps, rows_per_rank=args.rows_per_rank,
                                split=args.split,
                                progress=lambda s, n: print(f"[record-trace] step {s}/{n}", file=sys.stderr, flush=True))
    except ValueError as e:
        return _fail(str(e))
    save_trace(args.out, tr)
    st = trace_stats(tr)
    print(f"[record-trace] {args.out}: [steps, layers, ranks, experts] {list(tr.counts.shape)}; fixed-ownership "
          f"rank max/mean median {st['rank_max_mean']['median']:.2f}, expert max/mean median "
          f"{st['expert_max_mean']['median']:.2f}", file=sys.stderr)
    return 0


def _trace_stats(args) -> int:
    if args.out.exists() and not args.out.is_dir():
        return _fail(f"--out {args.out} is a file; give a folder")
    if not args.items:
        return _fail("trace-stats needs trace files (.npz) or workload names; workloads: " + ", ".join(_workloads()))
    from ..files import write_json, write_text
    from .trace import load_trace, trace_stats
    rows, out = [], {}
    for item in args.items:
        try:
            if item.endswith(".npz"):
                tr = load_trace(Path(item))
            else:
                tr = _paper_workload(item, args)
        except (OSError, ValueError) as e:
            return _fail(f"{item}: {e}")
        st = trace_stats(tr)
        st.pop("per_step_layer", None)
        out[item] = {"meta": dict(tr.meta), "shape": list(tr.counts.shape), "stats": st}
        rows.append([item, tr.meta.get("source", ""), "x".join(map(str, tr.counts.shape)),
                     f"{tr.meta['tokens_per_rank']:g}"] +
                    [f"{st[k]['median']:.2f} ({st[k]['max']:.2f})" for k in ("rank_max_mean", "expert_max_mean")] +
                    [f"{st['gini']['median']:.2f}", f"{st['drift_tv']['median']:.3f}" if st["drift_tv"]["median"]
                     is not None else "—"])
    head = ["trace", "source", "steps x layers x ranks x experts", "tokens per rank", "rank max/mean, median (max)",
            "expert max/mean, median (max)", "expert Gini", "step-to-step TV"]
    table = "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] +
                       ["| " + " | ".join(r) + " |" for r in rows])
    print(table)
    if args.out.exists() and not args.out.is_dir():
        return _fail(f"--out {args.out} is a file; give a folder")
    write_json(args.out / "trace_stats.json", out)
    write_text(args.out / "trace_stats.md", table + "\n")
    print(f"[trace-stats] wrote {args.out / 'trace_stats.json'} and trace_stats.md", file=sys.stderr)
    return 0


def _workloads() -> list[str]:
    from .workloads import WORKLOADS
    return list(WORKLOADS.names())


def _paper_workload(name: str, args):
    """A synthetic workload at the paper's setting (EP8, 128 experts, top-8, 32,768 tokens per rank)."""
    from .workloads import synthetic_trace
    if name not in _workloads():
        raise ValueError(f"not a trace file (.npz) nor a workload; workloads: {', '.join(_workloads())}")
    return synthetic_trace(name, steps=args.steps or 32, layers=args.layers or 48, num_ranks=args.ranks,
                           num_experts=128, tokens_per_rank=args.tokens_per_rank, top_k=8, seed=0)
