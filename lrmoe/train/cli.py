"""The `lrmoe train` command: one flag per :class:`TrainConfig` field, exit codes, the resume hint.

Exit status: 0 done (or stopped by ``--stop-after``); 2 a bad config, data, output folder or
run file (the message says which and why); 130 after Ctrl-C and 143 after SIGTERM (the
checkpoint of the step in flight is written first; rerun the same command to resume)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

from .config import TrainConfig
from .loop import train


def _parse_override(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    k, v = text.split("=", 1)
    try:
        return k, json.loads(v)
    except json.JSONDecodeError:
        return k, v


def _optional(kind):
    def parse(text: str):
        return None if text.lower() in ("none", "null", "") else kind(text)

    parse.__name__ = kind.__name__
    return parse


_KINDS = {"int": int, "float": float, "str": str, "int | None": _optional(int), "str | None": _optional(str),
          "float | None": _optional(float)}


def add_config_arguments(p: argparse.ArgumentParser) -> None:
    """One flag per TrainConfig field (``--micro-batch``, ``--drop-ratio``, ...); unset flags are None."""
    defaults = TrainConfig()
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        help_ = TrainConfig.FIELD_HELP.get(f.name, "")
        if "default" not in help_:  # a help text that states its default says it once
            help_ += f" (default: {getattr(defaults, f.name)})"
        if f.name == "model_overrides":
            p.add_argument("--model-override", dest="model_overrides", action="append", type=_parse_override,
                           metavar="KEY=VALUE", help=TrainConfig.FIELD_HELP[f.name])
        elif f.name == "ep_options":
            p.add_argument("--ep-option", dest="ep_options", action="append", type=_parse_override,
                           metavar="KEY=VALUE", help=TrainConfig.FIELD_HELP[f.name])
        elif f.name == "sample_layers":
            p.add_argument(flag, type=int, nargs="+", default=None, help=help_)
        elif str(f.type) == "bool":  # --fsdp / --no-fsdp
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_)
        else:
            p.add_argument(flag, type=_KINDS[str(f.type)], default=None, help=help_)


def read_config_file(path) -> dict:
    """The TrainConfig fields of a ``--config`` JSON file; a ValueError naming the file if it cannot
    be read, is not JSON or is not a JSON object."""
    from ..files import CorruptFileError, read_json

    if not Path(path).is_file():
        raise ValueError(f"--config {path}: {'not a file' if Path(path).exists() else 'no such file'}; give a "
                         "JSON file of TrainConfig fields")
    try:
        d = read_json(path)
    except CorruptFileError as e:
        raise ValueError(f"--config {e}; expected a JSON object of TrainConfig fields, e.g. "
                         '{"steps": 200, "drop_ratio": 0.2}') from None
    if not isinstance(d, dict):
        raise ValueError(f"--config {path}: expected a JSON object of TrainConfig fields, got a JSON "
                         f"{type(d).__name__}")
    return d


def config_from_args(args, base: dict | None = None) -> TrainConfig:
    """A TrainConfig from dataclass defaults, then ``base``/``--config`` JSON, then the flags given."""
    d = {}
    if base:
        d.update(base)
    if getattr(args, "config", None):
        d.update(read_config_file(args.config))
    given = {}
    for f in dataclasses.fields(TrainConfig):
        v = getattr(args, f.name, None)
        if v is not None:
            given[f.name] = dict(v) if f.name in ("model_overrides", "ep_options") else v
    # The batch flags given decide; what they leave open is re-derived (a global batch from the
    # config is kept when only --micro-batch is given: accumulation adapts).
    if "grad_accum" in given and "global_batch" not in given:
        d.pop("global_batch", None)
    elif {"micro_batch", "global_batch"} & set(given) and "grad_accum" not in given:
        d.pop("grad_accum", None)
    d.update(given)
    return TrainConfig.from_dict(d)


def register_cli(sub) -> None:
    p = sub.add_parser("train", help="train one run (AdamW, cosine, accumulation, exact resume)",
                       description="Train one run (see docs/reproduce.md); an existing run in --out is resumed.")
    p.add_argument("--out", required=True, help="run directory (metrics.jsonl, summary.json, checkpoint.pt); "
                                                "an existing run there is resumed")
    p.add_argument("--config", default=None, help="JSON file of TrainConfig fields (flags override it)")
    p.add_argument("--stop-after", type=int, default=None, help="stop after this many steps (resumable)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_config_arguments(p)
    p.set_defaults(func=_cli)


def _cli(args) -> int:
    try:
        cfg = config_from_args(args)
        cfg.validate()
        from .ep import check_launch

        check_launch(cfg)
        if cfg.init_from:  # before any rank waits on another: a checkpoint not downloaded is refused here
            from ..hf.loading import checkpoint_dir

            checkpoint_dir(cfg.init_from)
    except (ValueError, OSError) as e:  # a bad flag or --config file (named)
        print(f"lrmoe train: {e}", file=sys.stderr)
        return 2
    main = int(os.environ.get("RANK", "0")) == 0  # under torchrun, rank 0 reports
    if main:
        print(json.dumps(cfg.to_dict()), file=sys.stderr)
    try:
        s = train(cfg, args.out, progress=not args.no_progress, stop_after=args.stop_after)
    except (ValueError, OSError) as e:  # bad data, tokenizer or output folder: say what, no traceback
        print(f"lrmoe train: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # at a step boundary the loop wrote a checkpoint before re-raising
        print(f"lrmoe train: interrupted; rerun the same command to resume from {args.out}", file=sys.stderr)
        return getattr(e, "exit_code", 130)
    if not main:
        return 0
    fin = s.get("final", {})
    def r(v):  # rounded for reading; summary.json keeps every digit
        return "—" if v is None else f"{v:.4f}"

    print(f"{args.out}: status {s['status']}, step {s.get('steps_done')}, loss {r(fin.get('loss'))}, "
          f"ppl {r(fin.get('ppl'))}, eval_ppl {r(fin.get('eval_ppl'))} (every digit: summary.json)")
    return 0

