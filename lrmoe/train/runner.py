"""How one training step runs on one process: :class:`LocalRunner`.

:func:`lrmoe.train.train` delegates what a distributed run does differently (data loading,
model building, the backward, reductions, checkpoints) to a *runner*; the expert-parallel one is
:class:`lrmoe.train.ep.DistributedRunner`, with the same methods."""
from __future__ import annotations

from pathlib import Path

import torch

from . import checkpoint
from .config import TrainConfig, resolve_device


def load_data(cfg: TrainConfig, progress: bool = True):
    """(train, heldout, stats) for ``cfg``, tokenised and packed once and cached under data/cache
    (``progress``: progress bars when it is tokenised now)."""
    from ..data import load_prepared, prepare

    path = prepare(cfg.data, cfg.tokenizer, cfg.seq_len, cfg.heldout_fraction, cfg.data_seed, cfg.max_records,
                   progress=progress)
    return load_prepared(path)


class LocalRunner:
    """One process, one device: the steps of :func:`train` that a distributed run does differently
    (:class:`lrmoe.train.ep.DistributedRunner` has the same methods)."""

    distributed = False
    is_main = True
    rank, world = 0, 1

    def __init__(self, cfg: TrainConfig):
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.device = resolve_device(cfg.device)
        self.cfg = cfg

    @staticmethod
    def load_data(cfg, progress: bool = True):
        return load_data(cfg, progress)

    @staticmethod
    def policy_for_rank(policy):
        return policy

    def build_model(self, make, policy):
        from .parallelize import apply_scale

        from ..hf import loading

        model = make()
        if loading.is_meta(model):  # init_from: read from the checkpoint straight onto the device
            loading.load_weights(model, self.device)
        return apply_scale(model.to(self.device), None, self.cfg, self.device)

    def describe(self) -> dict:
        return {}

    def local_batches(self, batches):
        return batches

    def backward(self, loss):
        loss.backward()

    @staticmethod
    def last_plans() -> list[list]:
        """Per MoE layer, the placement plans of its latest call (none: no planner here)."""
        return []

    def reduce_step(self, loss_total, kept, layer_stats, nonfinite, comm):
        return loss_total, kept, layer_stats, nonfinite, {}

    def clip_(self, model, params, clip: float) -> float:
        if clip > 0:
            return float(torch.nn.utils.clip_grad_norm_(params, clip))
        return float(torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None]))

    def max_times(self, *times):
        return times

    @staticmethod
    def eval_rows(batch):
        return batch, True

    @staticmethod
    def sum_eval(total, count):
        return total, count

    def save_checkpoint(self, path: Path, common: dict, model, opt, rng_state: dict) -> None:
        checkpoint.save({**common, "model": model.state_dict(), "optimizer": opt.state_dict(), "rng": rng_state},
                        path)

    def load_checkpoint(self, path: Path) -> dict:
        return checkpoint.load(path)

    def load_state(self, path: Path, ck: dict, model, opt, set_rng) -> None:
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        set_rng(ck["rng"])

    def barrier(self):
        pass

    def close(self):
        pass
