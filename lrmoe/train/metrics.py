"""The per-step metrics of a run (``metrics.jsonl``) and the summary numbers drawn from them.

Rows are appended and flushed one per optimizer step. On resume the file is cut back to the
checkpoint's step so that it equals the uninterrupted run's file (except timings); rows of a
previous attempt are never dropped silently: rows past the checkpoint's step (or, on a restart
without a checkpoint, every row) are moved to ``metrics.jsonl.discarded`` and the count is
printed. The file is read strictly (:func:`lrmoe.run_folder.read_metrics`): only a torn last line
may be dropped; any other undecodable line is a :class:`lrmoe.files.CorruptFileError` naming it.

Definitions (see docs/reproduce.md):

* ``loss``: mean next-token cross-entropy over the response tokens (labels != -100) of the whole
  optimizer step (all micro-batches; each micro-batch's summed loss is divided by the step's token
  count, so at drop ratio 0 accumulation is exactly a bigger micro-batch; with drops, quotas and
  selection apply per layer call, i.e. per micro-batch). ``ppl = exp(loss)`` is the per-token
  perplexity of the training stream, the quantity the paper averages over its final steps. A step
  whose rows hold no response token logs ``loss`` and ``ppl`` as null and is left out of the PPL means.
* ``moe_fwd_s``/``moe_bwd_s``: seconds spent *inside the routed-experts functions* of all MoE layers
  during the step (forward: from entering to leaving each experts module, i.e. dispatch/sort,
  quotas, grouped GEMMs, combine; backward: from the moment autograd starts the experts node to
  the moment it has produced its input gradients, i.e. router gradient, scoring, selection,
  compaction, grouped GEMMs, scatter). Router, attention, shared experts and the optimizer are
  excluded: this is the paper's "execution inside MoE layers". CPU: ``time.perf_counter``; CUDA:
  CUDA events, summed after the step's synchronisation.
* ``moe_plan_s`` (expert-parallel rows only): host seconds the placement planners took during the
  step, summed over all MoE layers, micro-batches and split pieces (``ExpertParallel.plan``: the
  planner after the demand all-gather, before the dispatch); the slowest rank's, like the times
  above. It is a part of ``moe_fwd_s`` (planning runs inside the experts function's forward).
  Single-process and ``ep=1`` runs have no planner and leave the key out (not 0), like ``comm_bytes``;
  virtual-EP rows (``virtual_ep > 1``) have it (the planning of all G virtual ranks' layers, done once).
  ``summary.json``'s ``timings.moe_plan_s`` is the run's total (EP runs only).
* ``moe_layout_s`` (expert-parallel rows only): host seconds spent turning the step's plans into
  index layouts (:class:`~lrmoe.parallel.layout.Layout`: the plan's per-instance counts on the host,
  the per-pair index tensors built on the device), summed and taken like ``moe_plan_s``; also a part
  of ``moe_fwd_s``. ``timings.moe_layout_s`` in ``summary.json`` is the run's total.
* ``plans`` (expert-parallel and virtual-EP rows): per MoE layer, the step's placement plans summed
  (calls, routed, forward-dropped and backward-kept pairs, replicas, planned per-rank memory,
  splits; :mod:`lrmoe.train.plan_log`).
* ``kept_fraction``: kept / routed pairs in the expert backward, mean over MoE layers (1.0 at C0).
* ``tokens_per_s``: non-padding input tokens of the step / wall time of the step.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from ..files import write_text
from ..run_folder import read_metrics

METRIC_KEYS = ("step", "epoch", "loss", "ppl", "lr", "grad_norm", "tokens", "label_tokens", "tokens_per_s",
               "step_time_s", "moe_fwd_s", "moe_bwd_s", "kept_fraction", "nonfinite", "layers", "elapsed_s")
#: Keys that expert-parallel rows (``ep > 1``) add to :data:`METRIC_KEYS` (lrmoe.train.ep).
EP_METRIC_KEYS = ("comm_bytes", "comm_bytes_total", "moe_plan_s", "moe_layout_s", "plans")
#: Keys that virtual-EP rows (``virtual_ep > 1``, lrmoe.train.virtual_ep) add: no bytes cross a network.
VIRTUAL_EP_METRIC_KEYS = ("moe_plan_s", "plans")


def _lines(rows) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


class MetricsLog:
    """``metrics.jsonl`` of one run (rank 0 writes it)."""

    def __init__(self, path, say=None):
        self.path = Path(path)
        self.discarded = self.path.with_name(self.path.name + ".discarded")
        self.say = say or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self._f = None

    def _discard(self, rows: list[dict], why: str) -> None:
        if not rows:
            return
        with open(self.discarded, "a") as f:  # appended: every discarded attempt is kept
            f.write(_lines(rows))
        self.say(f"{self.path}: {len(rows)} row(s) {why} moved to {self.discarded.name}")

    def start(self) -> None:
        """A fresh run: an empty file (rows of an earlier attempt without a checkpoint are kept aside)."""
        rows = read_metrics(self.path)
        self._discard(rows, "of an earlier attempt that left no checkpoint (the run restarts at step 1)")
        write_text(self.path, "")

    def resume_at(self, step: int) -> None:
        """Cut the file back to the rows of steps 1..``step`` (the checkpoint's)."""
        rows = read_metrics(self.path)
        keep = [r for r in rows if r.get("step", 0) <= step]
        self._discard([r for r in rows if r.get("step", 0) > step], f"after the checkpoint's step {step}")
        write_text(self.path, _lines(keep))

    def open(self) -> None:
        self._f = open(self.path, "a")

    def append(self, row: dict) -> None:
        self._f.write(json.dumps(row) + "\n")
        self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None

    def rows(self) -> list[dict]:
        return read_metrics(self.path)


def summary_of_metrics(rows: list[dict], steps: int) -> dict:
    """The ``final`` entry of summary.json: last step, means of the PPL (final 10 % and all steps)."""
    if not rows:
        return {}
    last = rows[-1]
    n_tail = max(1, math.ceil(0.1 * steps))
    tail = [r["ppl"] for r in rows if r["step"] > steps - n_tail and r["ppl"] is not None]
    ppls = [r["ppl"] for r in rows if r["ppl"] is not None]  # steps without response tokens have none
    evals = [r for r in rows if "eval_loss" in r]
    out = {"step": last["step"], "loss": last["loss"], "ppl": last["ppl"],
           "mean_ppl_final_10pct": sum(tail) / len(tail) if tail else None,
           "mean_ppl_all_steps": sum(ppls) / len(ppls) if ppls else None,
           "steps_without_loss": len(rows) - len(ppls),
           "kept_fraction_mean": sum(r["kept_fraction"] for r in rows) / len(rows),
           "nonfinite_total": sum(r.get("nonfinite", 0) for r in rows)}
    if evals:
        out.update(eval_loss=evals[-1]["eval_loss"], eval_ppl=evals[-1]["eval_ppl"], eval_step=evals[-1]["step"])
    return out
