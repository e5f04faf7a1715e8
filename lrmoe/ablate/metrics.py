"""What an ablation grid reports per run, paired with its baseline: the metrics a grid's
``[grid] metrics`` may name (a registry: ``register_metric`` adds one).

Each metric is a function ``fn(run, baseline) -> float | None`` of two finished runs
(:class:`paper_figures.results.Run`), read from their run files only; None when the files do not
hold it (e.g. no held-out evaluation). Every built-in is a paired difference run − baseline of the
same seed and family, except ``kept_fraction`` (the run's own value, a check of the drop ratio)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from lrmoe.registry import Registry
from paper_figures.tables import loss_gap_all_steps


@dataclass(frozen=True)
class Metric:
    label: str  # table and figure label
    unit: str
    fn: Callable  # (run, baseline) -> float | None
    digits: int = 6
    help: str = ""
    paired: bool = True  # a difference run − baseline (False: the run's own value; no orderings)

    def __call__(self, run, base) -> float | None:
        return self.fn(run, base)


def _final(key):
    def get(run):
        v = (run.summary.get("final") or {}).get(key)
        return float(v) if isinstance(v, (int, float)) else None
    return get


def _diff(get):
    def fn(run, base):
        a, b = get(run), get(base)
        return None if a is None or b is None else a - b
    return fn


def _ppl_final(run):
    return run.ppl_window_mean()


def _per_step_ms(key):
    def get(run):
        t, steps = (run.summary.get("timings") or {}).get(key), run.summary.get("steps_done")
        return 1000.0 * t / steps if isinstance(t, (int, float)) and steps else None
    return get


def _max_abs_loss_gap(run, base):
    a, b = ({r["step"]: r["loss"] for r in x.rows if r.get("loss") is not None} for x in (run, base))
    common = set(a) & set(b)
    return max(abs(a[s] - b[s]) for s in common) if common else None


_METRICS = Registry("ablation metric", builtins={
    "dppl_final": Metric("ΔPPL (final 10 %)", "PPL", _diff(_ppl_final), 6,
                         "mean training PPL over the final 10 % of steps, run − baseline (T2's ΔPPL)"),
    "dloss_all": Metric("Δloss (all steps)", "nats", loss_gap_all_steps, 6,
                        "mean over all steps of the training-loss difference run − baseline (area between the curves / steps)"),
    "max_abs_dloss": Metric("max |Δloss| (any step)", "nats", _max_abs_loss_gap, 8,
                            "largest per-step training-loss difference to the baseline (0 for identical gradients)"),
    "deval_loss": Metric("Δeval loss", "nats", _diff(_final("eval_loss")), 4,
                         "held-out loss after the last step, run − baseline"),
    "dmoe_bwd_ms": Metric("ΔMoE backward ms/step", "ms", _diff(_per_step_ms("moe_bwd_s")), 2,
                          "MoE-layer backward time per step (the kit's step timer), run − baseline; measured on the "
                          "machine of the run, so runs trained in parallel share its cores"),
    "dstep_ms": Metric("Δstep ms", "ms", _diff(_per_step_ms("train_s")), 2,
                       "training time per step, run − baseline (same caveat)"),
    "kept_fraction": Metric("kept fraction", "", lambda run, base: _final("kept_fraction_mean")(run), 4,
                            "mean share of routed pairs kept in the expert backward (the run's own value)",
                            paired=False),
})

#: ``register_metric(name, Metric(...))``: a metric grids may name.
register_metric = _METRICS.register
unregister_metric = _METRICS.unregister


def metric_names() -> list[str]:
    return _METRICS.names()


def get_metric(name: str) -> Metric:
    return _METRICS.get(name)
