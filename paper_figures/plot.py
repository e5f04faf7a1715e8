"""`lrmoe plot RUN [RUN ...]`: one's own runs side by side (any run folders of `lrmoe train`).

Two figures, PNG + PDF, in ``--out`` (default ``plots/``):

* ``<name>_curves``: training loss (and held-out loss where evaluated) and PPL per step, the
  kept fraction of routed pairs in the backward, MoE-layer forward / backward time per step, and
  the training loss against cumulative MoE-layer time (the paper's F4 axis);
* ``<name>_experts``: per run, the per-expert routed demand, backward quota and kept pairs of one
  sampled MoE layer at one step (default: the first sampled layer at the last step that has them).

Each run is labelled by the config fields in which the runs differ (``drop_ratio=0.2,
scorer=random``); the fields they share are listed once. Unfinished runs (running or
interrupted) are drawn up to their last step; a damaged run folder, a folder that is not a run,
an unknown ``--layer`` or ``--step`` is one line on stderr with exit status 2, before anything is
written."""
from __future__ import annotations

import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

from lrmoe.files import CorruptFileError
from lrmoe.run_folder import DAMAGED, NEW, read_metrics, run_state

from .figures import pyplot, save_figure
from .results import RUNTIME_FIELDS

# fields that never change what a run computes (the data path does: it stays)
_IGNORED = tuple(k for k in RUNTIME_FIELDS if k != "data")


class PlotError(ValueError):
    """Bad input to `lrmoe plot`: the message says what was wrong and what is accepted."""


@dataclass
class PlotRun:
    path: Path
    state: str
    config: dict
    rows: list
    label: str = ""


def load_runs(paths) -> list[PlotRun]:
    """The run folders ``paths`` with their metrics; :class:`PlotError` for one that is missing,
    not a run folder, damaged or given twice, or that has no step yet."""
    if not paths:
        raise PlotError("give one or more run folders (each written by `lrmoe train` or `lrmoe reproduce`)")
    runs, seen = [], set()
    for p in map(Path, paths):
        if not p.is_dir():
            raise PlotError(f"{str(p)!r} {'is not a folder' if p.exists() else 'does not exist'}; give run folders "
                            f"(each with summary.json and metrics.jsonl)")
        if p.resolve() in seen:
            raise PlotError(f"run folder {str(p)!r} is given twice; give each run once")
        seen.add(p.resolve())
        st = run_state(p)
        if st.state == NEW or st.summary is None:
            raise PlotError(f"{str(p)!r} holds no run (no summary.json); give folders written by `lrmoe train`")
        if st.state == DAMAGED:
            raise PlotError(f"run folder {str(p)!r} is damaged: {st.why}")
        try:
            rows = st.rows if st.rows is not None else read_metrics(p)
        except (CorruptFileError, OSError) as e:
            raise PlotError(f"run folder {str(p)!r}: its metrics cannot be read: {e}") from None
        if not rows:
            raise PlotError(f"run folder {str(p)!r} ({st.label}) has no step in metrics.jsonl yet; plot it after "
                            f"its first step")
        runs.append(PlotRun(p, st.label, st.summary.get("config", {}), rows))
    _label(runs)
    return runs


def _value(v) -> str:
    return Path(v).name if isinstance(v, str) and "/" in v else repr(v) if isinstance(v, str) else str(v)


def differing_fields(runs: list[PlotRun]) -> list[str]:
    keys = sorted({k for r in runs for k in r.config} - set(_IGNORED))
    return [k for k in keys if any(r.config.get(k) != runs[0].config.get(k) for r in runs)]


def shared_fields(runs: list[PlotRun], keys=("model", "steps", "seq_len", "micro_batch", "grad_accum", "lr",
                                             "drop_ratio", "scorer", "quota", "mode", "seed")) -> str:
    diff = set(differing_fields(runs))
    return ", ".join(f"{k}={_value(runs[0].config[k])}" for k in keys if k in runs[0].config and k not in diff)


def _label(runs: list[PlotRun]) -> None:
    """Each run's legend label: the fields in which the runs differ, else (or when two labels are
    the same) the folder name."""
    diff = differing_fields(runs)
    for r in runs:
        r.label = ", ".join(f"{k}={_value(r.config.get(k))}" for k in diff) or r.path.name
    labels = [r.label for r in runs]
    for r in runs:
        if labels.count(r.label) > 1 or not diff:
            r.label = f"{r.path.parent.name}/{r.path.name}" if [x.path.name for x in runs].count(r.path.name) > 1 \
                else r.path.name + (f" ({r.label})" if diff else "")
        if r.state != "done":
            r.label += f" [{r.state}]"


def _series(rows, key):
    pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    return [s for s, _ in pts], [v for _, v in pts]


def expert_step(run: PlotRun, layer: str | None, step: int | None) -> tuple[dict, str, int] | None:
    """(the layer's demand/quota/kept, layer key, step) of ``run``, or None when it logged none;
    a ``layer`` or ``step`` it did not log is a :class:`PlotError` listing what it has."""
    with_layers = [r for r in run.rows if r.get("layers")]
    if not with_layers:
        return None
    if step is None:
        row = with_layers[-1]
    else:
        row = next((r for r in with_layers if r["step"] == step), None)
        if row is None:
            steps = [r["step"] for r in with_layers]
            raise PlotError(f"--step {step}: run {run.path.name} has per-expert statistics at {len(steps)} steps "
                            f"({steps[0]}-{steps[-1]}), not at {step}")
    keys = sorted(row["layers"], key=int)
    key = keys[0] if layer is None else str(layer)
    if key not in row["layers"]:
        raise PlotError(f"--layer {layer}: run {run.path.name} sampled MoE layers {', '.join(keys)} (sample_layers), "
                        f"not {layer}")
    return row["layers"][key], key, row["step"]


def plot_runs(paths, out="plots", name: str = "runs", layer=None, step=None) -> list[Path]:
    """Write ``<out>/<name>_curves`` and ``<out>/<name>_experts`` (PNG + PDF) for the run folders
    ``paths``; returns the files. Bad input is a :class:`PlotError` before anything is written."""
    runs = load_runs(paths)
    out = Path(out)
    for q in (out, *out.parents):
        if q.exists():
            if not q.is_dir():
                raise PlotError(f"--out {str(out)!r}: {q} is a file; give a folder (created if missing)")
            break
    if not name or "/" in name or name.startswith("."):
        raise PlotError(f"--name {name!r}: give a file-name stem without '/' (e.g. 'runs')")
    experts = [expert_step(r, layer, step) for r in runs]  # checked before anything is written
    plt, sns = pyplot()
    colors = sns.color_palette("tab10", max(len(runs), 1))
    return _curves(plt, runs, colors, out, name) + _experts(plt, runs, experts, out, name)


def _curves(plt, runs, colors, out: Path, name: str) -> list[Path]:
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    (a_loss, a_ppl, a_kept), (a_time, a_cum, a_leg) = axes
    for r, c in zip(runs, colors):
        a_loss.plot(*_series(r.rows, "loss"), color=c, lw=0.9, label=r.label)
        es, ev = _series(r.rows, "eval_loss")
        if es:
            a_loss.plot(es, ev, color=c, ls=":", marker="o", ms=3)
        a_ppl.plot(*_series(r.rows, "ppl"), color=c, lw=0.9)
        a_kept.plot(*_series(r.rows, "kept_fraction"), color=c, lw=0.9)
        for key, ls in (("moe_fwd_s", "-"), ("moe_bwd_s", "--")):
            s, v = _series(r.rows, key)
            a_time.plot(s, [1e3 * x for x in v], color=c, ls=ls, lw=0.8)
        cum, t, loss = [], 0.0, []
        for row in r.rows:
            t += (row.get("moe_fwd_s") or 0.0) + (row.get("moe_bwd_s") or 0.0)
            if row.get("loss") is not None:
                cum.append(t)
                loss.append(row["loss"])
        a_cum.plot(cum, loss, color=c, lw=0.9)
    for ax, title, ylabel in ((a_loss, "training loss (dotted: held-out loss)", "loss (nats, log scale)"),
                              (a_ppl, "training perplexity per step", "PPL (log scale)"),
                              (a_kept, "kept fraction of routed pairs in the backward", "kept / routed"),
                              (a_time, "MoE-layer time per step (solid: forward, dashed: backward)", "ms"),
                              (a_cum, "training loss vs cumulative MoE-layer time", "loss (nats, log scale)")):
        ax.set_title(title, fontsize=9)
        ax.set_ylabel(ylabel)
        ax.set_xlabel("cumulative MoE-layer time (s, forward + backward)" if ax is a_cum else "step")
    for ax in (a_loss, a_ppl, a_cum):
        ax.set_yscale("log")
    a_leg.axis("off")
    handles, labels = a_loss.get_legend_handles_labels()
    a_leg.legend(handles, labels, loc="upper left", fontsize=8, title="runs (the fields they differ in)",
                 title_fontsize=8, frameon=False)
    shared = shared_fields(runs)
    if shared:  # wrapped to the legend panel's width (a third of the figure)
        a_leg.text(0.0, 0.0, textwrap.fill(f"shared: {shared}", width=70), fontsize=7, va="bottom",
                   transform=a_leg.transAxes)
    fig.suptitle(f"{len(runs)} run(s): measured, from their metrics.jsonl", fontsize=10)
    fig.tight_layout()
    files = save_figure(fig, out, f"{name}_curves", sub="")
    plt.close(fig)
    return files


def _experts(plt, runs, experts, out: Path, name: str) -> list[Path]:
    import numpy as np

    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 2.6 * len(runs)), squeeze=False)
    for (ax,), r, ex in zip(axes, runs, experts):
        if ex is None:
            ax.axis("off")
            ax.text(0.5, 0.5, f"{r.label}: no per-expert statistics logged (sample_layers empty)", ha="center",
                    va="center", fontsize=9)
            continue
        st, key, step = ex
        x = np.arange(len(st["demand"]))
        for i, (what, c) in enumerate((("demand", "#9ecae1"), ("quota", "#fdae6b"), ("kept", "#31a354"))):
            ax.bar(x + (i - 1) * 0.27, st[what], width=0.27, color=c,
                   label={"demand": "routed demand (forward)", "quota": "backward quota",
                          "kept": "kept in backward"}[what])
        ax.set_xticks(x)
        ax.set_ylabel("routed pairs")
        ax.set_title(f"{r.label}: MoE layer {key}, step {step}", fontsize=9)
    axes[-1][0].set_xlabel("expert")
    handles, labels = next((ax.get_legend_handles_labels() for (ax,) in axes if ax.get_legend_handles_labels()[0]),
                           ([], []))
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8, frameon=False, bbox_to_anchor=(0.5, -0.02))
    fig.suptitle("per-expert demand, backward quota and kept pairs (measured)", fontsize=10)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    files = save_figure(fig, out, f"{name}_experts", sub="")
    plt.close(fig)
    return files


def register_cli(sub) -> None:
    p = sub.add_parser("plot", help="plot one's own runs side by side (curves, kept fraction, experts, MoE time)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", metavar="RUN", help="run folders (written by `lrmoe train` / `lrmoe reproduce`)")
    p.add_argument("--out", default="plots", help="output folder (default: plots/)")
    p.add_argument("--name", default="runs", help="file-name stem: <name>_curves.png|pdf, <name>_experts.png|pdf "
                                                  "(default: runs)")
    p.add_argument("--layer", default=None, help="sampled MoE layer of the per-expert figure (default: the first)")
    p.add_argument("--step", type=int, default=None, help="step of the per-expert figure (default: the last one "
                                                          "with per-expert statistics)")
    p.set_defaults(func=_cli)


def _cli(args) -> int:
    try:
        files = plot_runs(args.runs, args.out, args.name, args.layer, args.step)
    except PlotError as e:
        print(f"lrmoe plot: {e}", file=sys.stderr)
        return 2
    for f in files:
        print(f)
    return 0
