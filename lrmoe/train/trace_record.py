"""``--record-trace``: the routing an expert-parallel training run all-gathers, written as a
simulator trace (:mod:`lrmoe.sim.trace`), so a user can replay their own routing
(``lrmoe simulate --trace PATH``).

One trace step per micro-batch: for every MoE layer the [ranks, experts] pair counts of its latest
call (:func:`lrmoe.train.plan_log.routing_counts` of the runner's ``last_plans``). Rank 0 writes
the file at every checkpoint and at the end (atomically). A resumed run keeps the micro-batches its
checkpoint covers and extends them; a trace shorter than that (written by another run) is refused,
and a fresh run refuses to overwrite an existing file, unless it is the run folder's own trace
(``routing_trace.npz`` in the run folder: a virtual-EP run's default, or where a preset's E3 run
records; rewritten by a restart from step 0).
A virtual-EP run's meta says ``"virtual": true`` and its ``ep`` is the virtual G."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..environment import git_revision
from ..run_folder import TRACE
from ..sim.trace import Trace, load_trace, save_trace


class TraceRecorder:
    def __init__(self, path, cfg, *, run_dir, main: bool, steps_done: int, tokens_per_rank: int,
                 dims: dict | None = None):
        """``path``: where to write (None: the run folder's own trace); ``dims``: the model's routed
        experts (:func:`lrmoe.hf.integration.moe_dims`), stored in the meta so that the trace replays
        at the run's own configuration (``lrmoe simulate --trace T --at-trace``)."""
        own = Path(run_dir) / TRACE
        self.path, self.main = Path(path) if path else own, main
        own_file = self.path.resolve() == own.resolve()
        virtual = getattr(cfg, "virtual_ep", 1) > 1
        self.meta = {"source": "runtime", "top_k": None, "tokens_per_rank": tokens_per_rank, "model": cfg.model,
                     "placement": cfg.placement, "ep": cfg.virtual_ep if virtual else cfg.ep,
                     "drop_ratio": cfg.drop_ratio, "seed": cfg.seed, "grad_accum": cfg.grad_accum,
                     "git_rev": git_revision(), "unit": "micro-batch", **({"virtual": True} if virtual else {}),
                     "model_overrides": dict(getattr(cfg, "model_overrides", None) or {}),
                     **({"dims": dict(dims)} if dims else {})}
        self.counts: list[np.ndarray] = []
        done = steps_done * cfg.grad_accum
        if self.path.exists() and not (own_file and steps_done == 0):
            if steps_done == 0:
                raise ValueError(f"record_trace {self.path} exists and this run starts at step 0: remove it or give "
                                 f"another path (a resumed run extends its own trace)")
            old = load_trace(self.path)
            if old.steps < done:
                raise ValueError(f"record_trace {self.path} holds {old.steps} micro-batches but the run resumes "
                                 f"after {done}: it was not written by this run; give another path")
            self.counts = list(old.counts[:done])  # micro-batches past the checkpoint are recorded again
            self.meta["top_k"] = old.meta.get("top_k")
        elif steps_done:
            raise ValueError(f"record_trace {self.path} does not exist but the run resumes at step {steps_done}: "
                             f"the trace of the steps before would be missing; give the path it was recorded to")

    def add(self, counts_LGE: np.ndarray, top_k: int) -> None:
        self.meta["top_k"] = int(top_k)
        self.counts.append(np.asarray(counts_LGE, dtype=np.int64))

    def save(self) -> Path | None:
        if not self.main or not self.counts:
            return None
        return save_trace(self.path, Trace(np.stack(self.counts), dict(self.meta)))
