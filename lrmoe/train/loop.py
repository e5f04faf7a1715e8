"""Training loop for the paper's convergence experiments (`lrmoe train`).

    from lrmoe.train import TrainConfig, train
    cfg = TrainConfig(model="qwen3-moe-small", data="alpaca_en_demo.json", drop_ratio=0.2, steps=400)
    summary = train(cfg, "results/my_run")

One process, one device; or, launched by torchrun, expert parallel (``ep`` ranks share the routed
experts, placed by ``placement``) and data parallel over the ranks, computing the same step on the
same global batch (lrmoe.train.ep; docs/expert_parallel.md, "Training with torchrun")::

    torchrun --nproc-per-node 8 -m lrmoe.cli train --out runs/x --ep 8 --placement lrmoe --micro-batch 32 ...

or, with ``virtual_ep = G``, in one process exactly as G such ranks would (lrmoe.train.virtual_ep)::

    lrmoe train --out runs/x --virtual-ep 8 --placement symi --micro-batch 32 ...

AdamW with linear warm-up and cosine decay to ``min_lr_ratio * lr``,
global-norm gradient clipping, gradient accumulation (``global_batch = micro_batch * grad_accum``
rows per optimizer step; under torchrun every micro-batch is split evenly over the ranks), bf16
autocast on GPU and fp32 on CPU (``dtype="auto"``).

Files written to ``out_dir`` (all atomically, so a killed run never leaves a torn file):

* ``metrics.jsonl``: one JSON object per optimizer step (schema in :data:`METRIC_KEYS`; eval
  steps add ``eval_loss``/``eval_ppl``; every step carries per-expert ``demand``/``quota``/``kept``
  of the sampled MoE layers). Each line is appended and flushed; on resume the file is cut back
  to the checkpoint's step, so it always equals the uninterrupted run's file (except timings);
  rows that are cut are kept in ``metrics.jsonl.discarded`` and counted on stderr
  (:mod:`lrmoe.train.metrics`).
* ``summary.json``: config, environment (versions, hardware, git revision), seed, data stats,
  model description, ``status`` ("running" or "done"), final metrics and timings.
* ``checkpoint.pt``: model, optimizer, LR scheduler, RNG states (torch, CUDA, python, numpy, the
  backward policy's generator) and the data-loader position. Written every
  ``checkpoint_interval`` steps, on ``stop_after``, on Ctrl-C or SIGTERM (one process only: the
  step in flight finishes first, a second signal stops at once without one) and at the end.
  Under torchrun it holds the full unsharded weights, and ``checkpoint.step{N}.rank{r}.pt`` each
  rank's optimizer state, RNG states and placement-planner state (:mod:`lrmoe.train.checkpoint`).

Under torchrun, rank 0 writes these files; metrics are sums over all ranks (times: the slowest
rank) and EP rows add ``comm_bytes`` (bytes sent to other ranks per all-to-all kind, summed over
MoE layers, micro-batches and ranks) and ``comm_bytes_total``.

Exact resume: calling :func:`train` again on the same ``out_dir`` with the same config continues
from the checkpoint; the losses it logs are bit-identical to those of an uninterrupted run (same
device, same thread count: a resume on the CPU with another thread count is refused).

Definitions of the metrics: :mod:`lrmoe.train.metrics`.
"""
from __future__ import annotations

import math
import random
import signal
import sys
import threading
import time
from pathlib import Path

import torch

from .. import hf
from ..environment import environment
from ..files import write_json
from ..hf.attention import attention_for
from ..run_folder import METRICS, SUMMARY, read_summary, run_folder_lock
from . import checkpoint
from .config import TrainConfig, config_differences
from .evaluate import evaluate
from .loss import causal_lm_loss, label_tokens
from .metrics import METRIC_KEYS, MetricsLog, summary_of_metrics
from .plan_log import PlanLog, routing_counts
from .runner import LocalRunner
from .schedule import BatchStream, lr_factor
from .timer import MoETimer

__all__ = ["METRIC_KEYS", "Interrupted", "Trainer", "make_runner", "request_stop", "train"]


class Interrupted(KeyboardInterrupt):
    """Raised by :func:`train` at a step boundary after SIGINT (Ctrl-C) or SIGTERM, once the
    checkpoint of that step is written; ``exit_code`` is the shell's 128 + signal number."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.exit_code = 128 + signum

    def __reduce__(self):  # pickles across a process pool (the default would pass the name as signum)
        return type(self), (self.signum,)


def make_runner(cfg: TrainConfig):
    """:class:`LocalRunner`, or the distributed one when ``cfg.ep > 1`` or under torchrun."""
    from . import ep as train_ep

    if cfg.virtual_ep > 1:
        from .virtual_ep import VirtualRunner

        return VirtualRunner(cfg)
    return train_ep.DistributedRunner(cfg) if train_ep.wanted(cfg) else LocalRunner(cfg)


def train(cfg: TrainConfig, out_dir, progress: bool = True, stop_after: int | None = None) -> dict:
    """Train (or resume) the run ``cfg`` in ``out_dir``; returns the summary dict.

    ``stop_after``: stop (checkpoint, status "running") once this many optimizer steps are done,
    to be resumed by a later call. A finished run (status "done") is returned as is. A folder
    whose summary.json cannot be read is refused (:class:`lrmoe.files.CorruptFileError`): it may
    hold another run.

    Under torchrun (or with ``cfg.ep > 1``) every rank calls this with the same arguments: the
    experts are sharded over the EP group, each rank trains on its share of every batch and rank
    0 writes the files (lrmoe.train.ep, docs/expert_parallel.md).
    """
    cfg.validate()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    previous = read_summary(out)
    diff = config_differences(previous.get("config", {}), cfg.to_dict()) if previous is not None else []
    if diff:
        raise ValueError(f"{out} holds a different run (its summary.json has another config: {'; '.join(diff)}); "
                         "use a fresh output directory or delete that one")
    if previous is not None and previous.get("status") == "done":
        return previous
    runner = make_runner(cfg)
    try:
        with run_folder_lock(out, runner.is_main):
            return Trainer(cfg, out, runner, progress).run(stop_after)
    finally:
        runner.close()


def param_groups(model, weight_decay: float):
    """AdamW's groups: weight decay on matrices only; with FSDP also one group per device mesh (the
    experts' expert-data-parallel mesh, the dense parameters' mesh of all ranks), since one fused or
    foreach AdamW call over DTensors of two meshes makes full-size temporaries."""
    groups: dict = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        mesh = getattr(p, "device_mesh", None)
        groups.setdefault((id(mesh) if mesh is not None else None, p.dim() < 2), []).append(p)
    if all(mesh is None for mesh, _ in groups):  # no FSDP: the two groups of every earlier run (resume)
        return [{"params": groups.get((None, False), []), "weight_decay": weight_decay},
                {"params": groups.get((None, True), []), "weight_decay": 0.0}]
    return [{"params": ps, "weight_decay": 0.0 if no_decay else weight_decay} for (_, no_decay), ps in groups.items()]


class _StopSignals:
    """SIGINT and SIGTERM (one process, main thread) ask the loop to stop at the next step boundary:
    the step in flight finishes (its metrics row included), then a checkpoint is written at that
    boundary, so a resumed run equals an uninterrupted one. A second signal of the same kind acts at
    once (the handler that was there before is back), without a checkpoint. A process that ignores
    SIGINT (started in the background, under nohup) keeps ignoring it; a SIGTERM handler installed by
    the caller (e.g. a worker pool) is left in place, and passes the stop on with
    :func:`request_stop`."""

    active: "_StopSignals | None" = None  # the one of the run training in this process's main thread

    def __init__(self, enabled: bool, say):
        self.requested: list[int] = []
        self.say = say
        self._prev = {}
        self._outer = None
        self._on = False
        if not (enabled and threading.current_thread() is threading.main_thread()):
            return
        self._outer, _StopSignals.active, self._on = _StopSignals.active, self, True
        if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
            self._prev[signal.SIGINT] = signal.signal(signal.SIGINT, self._on_signal)
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            self._prev[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame):
        signal.signal(signum, self._prev[signum])
        self.request(signum)

    def request(self, signum: int) -> bool:
        """Stop at the next step boundary, as on signal ``signum``; False (nothing done) when that
        signal asked already."""
        if signum in self.requested:
            return False
        self.requested.append(signum)
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        self.say(f"{name}: finishing this step, then writing a checkpoint ({name} again to stop at once)")
        return True

    def restore(self):
        for signum, prev in self._prev.items():
            signal.signal(signum, prev)
        self._prev = {}
        if self._on and _StopSignals.active is self:
            _StopSignals.active = self._outer
        self._on = False


def request_stop(signum: int) -> bool:
    """For a signal handler the caller installed (main thread): ask the run training in this process
    to finish its step, checkpoint and raise :class:`Interrupted` (``signum``), as the signal
    itself would without that handler, whatever SIGINT's disposition. Returns False, doing
    nothing, when no run trains here (between runs, under torchrun) or ``signum`` asked already:
    the caller then stops at once (e.g. ``raise Interrupted(signum)``)."""
    stops = _StopSignals.active
    return stops is not None and stops.request(signum)


class _Routing:
    """The backward records of one step's micro-batches, summed: kept and routed pairs per MoE layer,
    per-expert demand/quota/kept of the sampled layers, non-finite scores, EP communication bytes."""

    def __init__(self, n_moe: int, sampled: list[int]):
        self.kept = [[0, 0] for _ in range(n_moe)]
        self.layer_stats = {i: None for i in sampled}
        self.nonfinite = 0
        self.comm = {}

    def add(self, records) -> None:
        for li, rec in enumerate(records):
            if rec is None or not rec.filled:
                continue
            self.kept[li][0] += int(rec.kept.sum())
            self.kept[li][1] += int(rec.demand.sum())
            self.nonfinite += rec.nonfinite
            for k, v in (getattr(rec, "comm_bytes", None) or {}).items():  # EP records only
                self.comm[k] = self.comm.get(k, 0) + v
            if li in self.layer_stats:
                cur = {"demand": rec.demand.cpu(), "quota": rec.quota.cpu(), "kept": rec.kept.cpu()}
                prev = self.layer_stats[li]
                self.layer_stats[li] = cur if prev is None else {k: prev[k] + cur[k] for k in cur}


class Trainer:
    """One run in one folder: built from its config, resumed from its checkpoint if there is one.

    :meth:`run` loops over :meth:`step` (one optimizer step, its metrics row) and, around it,
    :meth:`log` (metrics.jsonl, progress bar), :meth:`checkpoint` and :meth:`write_summary`."""

    def __init__(self, cfg: TrainConfig, out: Path, runner, progress: bool = True):
        self.cfg, self.out, self.runner = cfg, out, runner
        self.summary_path, self.ckpt_path = out / SUMMARY, out / checkpoint.MAIN
        self.main = runner.is_main
        self.device = device = runner.device
        self.use_bf16 = cfg.dtype == "bf16" or (cfg.dtype == "auto" and device.type == "cuda")
        self.progress, self.bar = progress, None
        self.metrics = MetricsLog(out / METRICS, say=self.say) if self.main else None
        self.wall0 = time.perf_counter()

        self.train_set, self.heldout, self.data_stats = runner.load_data(cfg, progress)
        if "source_fingerprint" not in self.data_stats:  # a file prepared before fingerprints were stored
            from ..data import source_fingerprint

            src = self.data_stats.get("config", {}).get("source")
            self.data_stats["source_fingerprint"] = source_fingerprint(src) if src else None
        self.vocab = int(self.data_stats["vocab_size"])
        self.policy = runner.policy_for_rank(cfg.policy())
        self.built = {}
        # EP: experts sharded over the ranks (which build in turns of cfg.load_concurrency per node).
        self.model = runner.build_model(self._make_model, self.policy)
        self.moe_modules = hf.experts_modules(self.model)
        self.model.train()
        n_moe = self.n_moe = len(self.moe_modules)
        bad = [i for i in cfg.sample_layers if not -n_moe <= i < n_moe]
        if bad:
            raise ValueError(f"sample_layers {bad} out of range: the model has {n_moe} MoE layers "
                             f"(accepted: {-n_moe}..{n_moe - 1})")
        self.sampled = sorted({i % n_moe for i in cfg.sample_layers})

        # fused AdamW on CUDA (one kernel per step instead of a copy per parameter); the CPU keeps the
        # plain (foreach) AdamW, whose numbers the committed CPU results were trained with
        self.opt = torch.optim.AdamW(param_groups(self.model, cfg.weight_decay), lr=cfg.lr,
                                     betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                     fused=True if device.type == "cuda" else None)
        self.params = [p for g in self.opt.param_groups for p in g["params"]]  # what the clip sees, every step
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: lr_factor(s, cfg))
        self.stream = BatchStream(len(self.train_set), cfg.seed)
        self.step_done = 0
        self.timings = {"train_s": 0.0, "eval_s": 0.0, "moe_fwd_s": 0.0, "moe_bwd_s": 0.0, "checkpoint_s": 0.0}
        self.resumed_from = []
        self._resume_or_start()
        self.trace = None
        if cfg.record_trace or cfg.virtual_ep > 1:  # every virtual-EP run records its routing
            from .trace_record import TraceRecorder

            G = max(cfg.ep, cfg.virtual_ep)
            self.trace = TraceRecorder(cfg.record_trace, cfg, run_dir=out, main=self.main, steps_done=self.step_done,
                                       tokens_per_rank=cfg.micro_batch // G * cfg.seq_len,
                                       dims=hf.integration.moe_dims(self.model.config))
        self.base = self._describe()

    # ------------------------------------------------------------------ set-up
    def autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.use_bf16)

    def say(self, msg: str) -> None:
        if self.bar is not None:
            self.bar.write(msg)
        else:
            print(msg, file=sys.stderr, flush=True)

    def _make_model(self):
        cfg, built, vocab, policy = self.cfg, self.built, self.vocab, self.policy
        if cfg.init_from:
            from ..hf import loading

            # on the meta device: the runner shards the experts, then each rank reads only what it keeps
            # (lrmoe.hf.loading.load_weights), in fp32 master weights
            built["overrides"] = dict(cfg.model_overrides)
            torch.manual_seed(cfg.seed)
            model = loading.meta_model(loading.checkpoint_dir(cfg.init_from), torch.float32, **built["overrides"])
            hf.set_policy(model, policy)
            if model.config.vocab_size < vocab:
                raise ValueError(f"{cfg.init_from} has {model.config.vocab_size} token embeddings but the tokenizer "
                                 f"{cfg.tokenizer!r} has {vocab} tokens; use the checkpoint's tokenizer")
        else:
            built["overrides"] = {"vocab_size": vocab, **cfg.model_overrides}
            if built["overrides"]["vocab_size"] < vocab:
                raise ValueError(f"model_overrides vocab_size={built['overrides']['vocab_size']} is smaller than the "
                                 f"tokenizer {cfg.tokenizer!r} ({vocab} tokens); leave it out (it follows the tokenizer)")
            model = hf.build_model(cfg.model, policy=policy, seed=cfg.seed, **built["overrides"])
        attention = attention_for(self.device)  # flex attention on CUDA, sdpa on the CPU (lrmoe.hf.attention)
        if model.config._attn_implementation != attention:
            model.set_attn_implementation(attention)
        built["attention"] = attention
        mods = hf.experts_modules(model)  # counted before the experts are sharded
        # the family of what was built or loaded (an init_from checkpoint may not be the preset's)
        built["family"] = getattr(model.config, "model_type", None) or hf.MODEL_PRESETS[cfg.model].family
        built.update(parameters=sum(p.numel() for p in model.parameters()),
                     experts=int(mods[0].gate_up_proj.shape[0]) if mods else 0)
        return model

    def _resume_or_start(self) -> None:
        cfg, runner = self.cfg, self.runner
        if self.ckpt_path.exists():
            ck = runner.load_checkpoint(self.ckpt_path)
            checkpoint.check_resume(ck, self.ckpt_path, cfg.to_dict(), self.data_stats.get("source_fingerprint"),
                                    self.data_stats.get("config", {}).get("source"), torch.get_num_threads(),
                                    self.device)
            runner.load_state(self.ckpt_path, ck, self.model, self.opt,
                              lambda state: checkpoint.set_rng_state(state, self.policy, self.device))
            self.sched.load_state_dict(ck["scheduler"])
            self.stream.position = ck["data_position"]
            self.step_done = ck["step"]
            self.timings.update(ck.get("timings", {}))
            self.resumed_from = ck.get("resumed_from", []) + [self.step_done]
            del ck
            if self.main:
                self.metrics.resume_at(self.step_done)
                self.say(f"{self.out.name}: resuming from step {self.step_done} of {cfg.steps} ({self.ckpt_path.name})")
        else:
            torch.manual_seed(cfg.seed)
            random.seed(cfg.seed)
            if self.main:
                self.metrics.start()

    def _describe(self) -> dict:
        cfg, built, data_stats = self.cfg, self.built, self.data_stats
        return {"config": cfg.to_dict(), "seed": cfg.seed, "environment": environment(self.device),
                "data": {**{k: v for k, v in data_stats.items() if k != "config"},
                         "source": data_stats.get("config", {}).get("source")},  # resolved ($LRMOE_ALPACA too)
                "model": {"preset": cfg.model, "family": built["family"],
                          "parameters": built["parameters"], "moe_layers": self.n_moe, "experts": built["experts"],
                          "sampled_layers": self.sampled, "vocab_size": self.vocab, "overrides": built["overrides"],
                          "autocast_bf16": self.use_bf16, "attention": built["attention"]},
                "metrics_file": METRICS, "resumed_from": self.resumed_from, **self.runner.describe()}

    # ------------------------------------------------------------------ files
    def write_summary(self, status: str) -> dict | None:
        if not self.main:
            return None
        s = dict(self.base, status=status, steps_done=self.step_done,
                 final=summary_of_metrics(self.metrics.rows(), self.cfg.steps),
                 timings=dict(self.timings, wall_s_this_process=time.perf_counter() - self.wall0))
        write_json(self.summary_path, s)
        return s

    def checkpoint(self) -> None:
        t0 = time.perf_counter()
        common = {"config": self.cfg.to_dict(), "step": self.step_done, "scheduler": self.sched.state_dict(),
                  "data_position": self.stream.position, "timings": self.timings,
                  "resumed_from": self.resumed_from, "threads": torch.get_num_threads(),
                  "data_fingerprint": self.data_stats.get("source_fingerprint"),
                  "model_config": self.model.config.to_dict()}  # for lrmoe export-hf
        if self.trace is not None:  # before the checkpoint: a resume drops micro-batches past it
            self.trace.save()
        self.runner.save_checkpoint(self.ckpt_path, common, self.model, self.opt,
                                    checkpoint.rng_state(self.policy, self.device))
        self.timings["checkpoint_s"] += time.perf_counter() - t0

    # ------------------------------------------------------------------ one step
    def step(self, timer: MoETimer) -> dict:
        """One optimizer step (all micro-batches); returns its metrics row (without evaluation)."""
        cfg, runner, device, model, opt = self.cfg, self.runner, self.device, self.model, self.opt
        t0 = time.perf_counter()
        micro = [self.stream.next(cfg.micro_batch) for _ in range(cfg.grad_accum)]
        tensors = self.train_set.tensors
        batches = [{k: tensors[k][idx] for k in ("input_ids", "labels", "position_ids")} for idx in micro]
        n_label = sum(label_tokens(b["labels"]) for b in batches)
        n_tokens = sum(int((tensors["doc_ids"][idx] >= 0).sum()) for idx in micro)
        opt.zero_grad(set_to_none=True)
        timer.enabled = True
        loss_total = 0.0
        routing = _Routing(self.n_moe, self.sampled)
        plan_log = PlanLog()
        for b in runner.local_batches(batches):  # EP: this rank's rows of every micro-batch
            b = {k: v.to(device, non_blocking=True) for k, v in b.items()}
            with self.autocast():  # document-causal attention over packed rows; the loss chunked at scale
                loss_sum, _ = causal_lm_loss(model, b["input_ids"], b["position_ids"], b["labels"])
            loss = loss_sum / max(1, n_label)
            runner.backward(loss)
            loss_total += float(loss.detach())
            routing.add(hf.backward_records(model))
            plans = runner.last_plans()  # EP and virtual EP: every layer's plans of this micro-batch
            if plans:
                plan_log.add(plans)
                if self.trace is not None:
                    self.trace.add(routing_counts(plans), self.model.config.num_experts_per_tok)
            del loss, loss_sum
        timer.enabled = False
        # EP: sums over the ranks (the per-rank records hold this rank's pairs only)
        loss_total, kept, layer_stats, nonfinite, extra = runner.reduce_step(
            loss_total, routing.kept, routing.layer_stats, routing.nonfinite, routing.comm)
        grad_norm = runner.clip_(model, self.params, cfg.clip)  # EP: gradient sync, then the global norm
        lr = opt.param_groups[0]["lr"]
        opt.step()
        self.sched.step()
        fwd_s, bwd_s = timer.collect()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        dt, fwd_s, bwd_s = runner.max_times(dt, fwd_s, bwd_s)  # EP: the slowest rank
        self.step_done += 1
        self.timings["train_s"] += dt
        self.timings["moe_fwd_s"] += fwd_s
        self.timings["moe_bwd_s"] += bwd_s
        if plan_log.layers:
            extra["plans"] = plan_log.row()
        for key in ("moe_plan_s", "moe_layout_s"):  # EP runs: the step's planning and layouts (parts of moe_fwd_s)
            if key in extra:
                self.timings[key] = self.timings.get(key, 0.0) + extra[key]
        fracs = [k / d for k, d in kept if d]
        # A step whose rows hold no response token has no loss: None, not 0 (PPL 1), and the
        # PPL averages leave it out (the optimizer still steps, on a zero gradient).
        return {"step": self.step_done, "epoch": self.stream.epoch, "loss": loss_total if n_label else None,
                "ppl": math.exp(min(loss_total, 700.0)) if n_label else None, "lr": lr, "grad_norm": grad_norm,
                "tokens": n_tokens, "label_tokens": n_label, "tokens_per_s": n_tokens / dt,
                "step_time_s": dt, "moe_fwd_s": fwd_s, "moe_bwd_s": bwd_s,
                "kept_fraction": sum(fracs) / len(fracs) if fracs else 1.0, "nonfinite": nonfinite,
                "layers": {str(i): {k: v.tolist() for k, v in s.items()}
                           for i, s in layer_stats.items() if s is not None}, **extra}

    def evaluate_into(self, row: dict) -> None:
        """Held-out evaluation at the eval interval and after the last step."""
        cfg, step = self.cfg, self.step_done
        if (cfg.eval_interval and step % cfg.eval_interval == 0) or step == cfg.steps:
            te = time.perf_counter()
            row.update(evaluate(self.model, self.heldout, cfg, self.device, self.autocast, self.runner))
            self.timings["eval_s"] += time.perf_counter() - te

    def log(self, row: dict) -> None:
        """Append the row to metrics.jsonl; refresh the progress bar."""
        row["elapsed_s"] = self.timings["train_s"] + self.timings["eval_s"]
        if self.metrics is not None:
            self.metrics.append(row)
        if self.bar is not None:
            if self.step_done % self.cfg.log_interval == 0 or self.step_done == self.cfg.steps:
                loss = row["loss"]
                post = {"loss": f"{loss:.4f}" if loss is not None else "-", "kept": f"{row['kept_fraction']:.2f}",
                        "tok/s": f"{row['tokens_per_s']:.0f}"}
                if "eval_loss" in row:
                    post["eval"] = f"{row['eval_loss']:.4f}"
                self.bar.set_postfix(post, refresh=False)  # before the update, which draws (or prints) it
            self.bar.update(1)

    # ------------------------------------------------------------------ the loop
    def run(self, stop_after: int | None = None) -> dict:
        """Train to ``cfg.steps`` (or ``stop_after``); returns the summary."""
        cfg, runner = self.cfg, self.runner
        self.write_summary("running")
        timer = MoETimer(self.moe_modules, self.device)
        if self.progress and self.main:
            from lrmoe.console import progress_bar

            self.bar = progress_bar(total=cfg.steps, initial=self.step_done, desc=self.out.name, unit="step",
                                    dynamic_ncols=True)
        if self.metrics is not None:
            self.metrics.open()
        stops = _StopSignals(not runner.distributed, self.say)
        at_boundary = False
        try:
            while self.step_done < cfg.steps:
                if stops.requested:
                    at_boundary = True
                    raise Interrupted(stops.requested[0])
                if stop_after is not None and self.step_done >= stop_after:
                    break
                row = self.step(timer)
                self.evaluate_into(row)
                self.log(row)
                if cfg.checkpoint_interval and self.step_done % cfg.checkpoint_interval == 0 \
                        and self.step_done < cfg.steps:
                    self.checkpoint()
                    self.write_summary("running")
        except KeyboardInterrupt:
            # Only at a step boundary is the state consistent (mid-step, the data stream and the RNGs
            # have advanced but the step is not done); ranks interrupted at different points could not
            # run the checkpoint's collectives anyway.
            if at_boundary and not runner.distributed:
                self.checkpoint()
                self.write_summary("running")
            raise
        finally:
            stops.restore()
            if self.metrics is not None:
                self.metrics.close()
            timer.remove()
            if self.bar is not None:
                self.bar.close()
                self.bar = None
        return self.finish()

    def finish(self) -> dict:
        """The last checkpoint and summary; every rank gets the summary."""
        done = self.step_done >= self.cfg.steps
        self.checkpoint()
        s = self.write_summary("done" if done else "running")
        self.runner.barrier()
        if self.main:
            return s
        # other ranks: rank 0's summary (a folder on a shared file system), else the essentials
        return read_summary(self.out) or {"status": "done" if done else "running", "steps_done": self.step_done}
