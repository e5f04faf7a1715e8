"""`lrmoe estimate-memory`: a run's peak memory per GPU, estimated on this machine (:mod:`lrmoe.train.estimate`).

    lrmoe estimate-memory --preset paper --run qwen3-C20-lrm-s0            # the preset's run, its world
    lrmoe estimate-memory --preset paper --run glm4-C20-lrm-s0 --offload experts --world 8
    lrmoe estimate-memory --preset paper --run qwen3-C20-lrm-s0 --save   # for lrmoe reproduce's check
    lrmoe estimate-memory --model qwen3-30b-a3b --ep 8 --fsdp --activation-checkpointing --micro-batch 32 \\
        --seq-len 8192 --world 8 --gpu-gib 80 --json est.json

The run's config is the preset run's (``--preset``/``--run``), with any ``lrmoe train`` flag
given here on top (a run with ``init_from`` is estimated with its model preset's dimensions).
Exit status 0 when the estimate fits ``--gpu-gib``, 3 when it does not, 2 for bad arguments."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..train.cli import add_config_arguments
from ..train.config import TrainConfig
from ..train.estimate import run_vocab


def register_cli(sub) -> None:
    p = sub.add_parser("estimate-memory", help="a run's peak memory per GPU, from its real step under fake tensors",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default=None, help="a preset of `lrmoe reproduce` (with --run)")
    p.add_argument("--run", default=None, help="a run name of the preset (`lrmoe reproduce --preset P --dry-run`)")
    p.add_argument("--world", type=int, default=None,
                   help="GPUs of the run (default: the preset's processes per run, else ep)")
    p.add_argument("--gpu-gib", type=float, default=80.0, help="memory of one GPU in GiB (default 80)")
    p.add_argument("--overhead-gib", type=float, default=3.0,
                   help="added for the CUDA context, NCCL and the allocator's rounding (default 3)")
    p.add_argument("--trace-steps", type=int, default=2, help="training steps traced (default 2: the second has the "
                                                        "optimizer state from the start)")
    p.add_argument("--doc-len", type=int, default=None, help="tokens per packed document (default 512)")
    p.add_argument("--demand", default="balanced",
                   help="the routing the planners size token buffers for, fake tensors having no values: balanced "
                        "(default) or one step of a simulator workload (lognormal, powerlaw, hot_experts, hot_rank: "
                        "rank 0's experts 4x as popular, ...; `lrmoe simulate --list`)")
    p.add_argument("--json", type=Path, default=None, help="also write the estimate here")
    p.add_argument("--save", type=Path, nargs="?", const=Path("results/memory/estimates.json"), default=None,
                   help="add the estimate to an estimates file that `lrmoe reproduce` reads before launching "
                        "(default with no value: results/memory/estimates.json, the committed one)")
    add_config_arguments(p)
    p.set_defaults(func=_cli)


def config_of(args) -> tuple[TrainConfig, int, int | None]:
    """The run's config, world size and model vocabulary (:func:`~lrmoe.train.estimate.run_vocab`) from
    the arguments (ValueError naming what is wrong)."""
    base: dict = {}
    world = None
    if (args.preset is None) != (args.run is None):
        raise ValueError("--preset and --run go together (or give the run's flags without either)")
    if args.preset is not None:
        from .presets import PRESETS

        if args.preset not in PRESETS:
            raise ValueError(f"unknown preset {args.preset!r}; accepted: {sorted(PRESETS)}")
        preset = PRESETS[args.preset]
        runs = {r.name: r for r in preset.runs()}
        if args.run not in runs:
            raise ValueError(f"preset {args.preset!r} has no run {args.run!r}; accepted: {', '.join(sorted(runs))}")
        base = dict(runs[args.run].config)
        world = preset.nproc if preset.launcher == "torchrun" else None
    names = {f for f in TrainConfig().to_dict()}
    given = {k: v for k, v in vars(args).items() if k in names and v is not None}
    if "model_overrides" in given:
        given["model_overrides"] = dict(given["model_overrides"])
    cfg = dict(base, **given)
    model_vocab = run_vocab(cfg)  # (read before the tokenizer is dropped below)
    for k in ("init_from", "tokenizer", "data"):  # the model preset's dimensions; no data is read
        cfg.pop(k, None)
    cfg = TrainConfig.from_dict(cfg)
    world = args.world or world or cfg.ep
    from ..train.estimate import demands

    if args.demand not in demands():
        raise ValueError(f"--demand {args.demand!r}: accepted {', '.join(demands())}")
    if args.trace_steps < 1 or args.gpu_gib <= 0 or args.overhead_gib < 0:
        raise ValueError(f"--trace-steps must be >= 1, --gpu-gib > 0 and --overhead-gib >= 0; got {args.trace_steps}, "
                         f"{args.gpu_gib}, {args.overhead_gib}")
    return cfg, world, model_vocab


def _cli(args) -> int:
    from ..train.estimate import estimate_memory, table

    try:
        cfg, world, model_vocab = config_of(args)
        res = estimate_memory(cfg, world, gpu_gib=args.gpu_gib, overhead_gib=args.overhead_gib, steps=args.trace_steps,
                              model_vocab=model_vocab, demand=args.demand,
                              doc_len=args.doc_len, progress=lambda line: print(line, file=sys.stderr, flush=True))
    except ValueError as e:
        print(f"lrmoe estimate-memory: {e}", file=sys.stderr)
        return 2
    print(table(res))
    if args.save is not None:
        from .memory_check import save

        save(args.save, cfg.to_dict(), world, res, args.run)
        print(f"saved in {args.save}", file=sys.stderr)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=1, default=str))
    return 0 if res["fits"] else 3
