"""Training (`lrmoe train`): one process (:mod:`lrmoe.train.loop`) or expert parallel under torchrun
(:mod:`lrmoe.train.ep`). See docs/reproduce.md."""
from .loop import METRIC_KEYS, TrainConfig, evaluate, lr_factor, read_metrics, train

__all__ = ["METRIC_KEYS", "TrainConfig", "evaluate", "lr_factor", "read_metrics", "train"]
