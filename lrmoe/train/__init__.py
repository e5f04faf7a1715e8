"""Training (`lrmoe train`): one process or expert parallel under torchrun. See docs/reproduce.md.

=================  ==========================================================================
``config``         :class:`TrainConfig`, its validation, :func:`config_differences`
``schedule``       the learning-rate schedule and the row sampler
``timer``          time inside the routed-experts functions (forward and backward)
``checkpoint``     checkpoint contents, atomic writes, sharded sets, RNG state, resume checks
``metrics``        metrics.jsonl (append, resume, discarded rows) and the summary numbers
``evaluate``       held-out evaluation and the token loss
``runner``         one process: :class:`LocalRunner`, :func:`load_data`
``ep``             torchrun: :class:`~lrmoe.train.ep.DistributedRunner`
``loop``           :func:`train` and its :class:`~lrmoe.train.loop.Trainer`
``retrain``        a finished run folder kept without its checkpoint gets it back (trained again)
``cli``            the `lrmoe train` command
=================  ==========================================================================
"""
from ..run_folder import read_metrics
from .cli import register_cli
from .config import TrainConfig, config_differences, resolve_device
from .evaluate import evaluate
from .loop import METRIC_KEYS, Interrupted, Trainer, train
from .runner import LocalRunner, load_data
from .schedule import lr_factor

__all__ = ["METRIC_KEYS", "Interrupted", "LocalRunner", "TrainConfig", "Trainer", "config_differences", "evaluate",
           "load_data", "lr_factor", "read_metrics", "register_cli", "resolve_device", "train"]
