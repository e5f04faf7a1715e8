"""The learning-rate schedule and the order in which training rows are visited."""
from __future__ import annotations

import math

import torch

from .config import TrainConfig


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier of ``cfg.lr`` for optimizer step ``step`` (0-based): linear warm-up, cosine decay."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    decay_steps = cfg.steps - cfg.warmup_steps - 1  # the last step (steps - 1) gets min_lr_ratio
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps) if decay_steps > 0 else 1.0
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class BatchStream:
    """Deterministic infinite stream of training rows: epoch e visits the rows in the order of
    ``randperm(N, seed=(seed, e))``; the state is the number of rows consumed so far."""

    def __init__(self, n_rows: int, seed: int, position: int = 0):
        if n_rows < 1:
            raise ValueError("the training split has no rows")
        self.n, self.seed, self.position = n_rows, seed, position
        self._perm_epoch, self._perm = -1, None

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm, self._perm_epoch = torch.randperm(self.n, generator=g), epoch
        return self._perm

    def next(self, k: int) -> torch.Tensor:
        rows = []
        for _ in range(k):
            epoch, i = divmod(self.position, self.n)
            rows.append(int(self._order(epoch)[i]))
            self.position += 1
        return torch.tensor(rows)

    @property
    def epoch(self) -> float:
        return self.position / self.n
