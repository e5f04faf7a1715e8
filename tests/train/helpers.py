"""The small run config of the training tests, and helpers shared by their files."""
from lrmoe.data import shared_data_dir
from lrmoe.train import TrainConfig, read_metrics

TINY = shared_data_dir() / "alpaca" / "alpaca_tiny.json"


def cfg(data_path, **kw):
    base = dict(model="qwen3-moe-tiny", data=data_path, tokenizer="bpe:300", seq_len=64, micro_batch=2, steps=6,
                lr=3e-3, warmup_steps=2, threads=2, heldout_fraction=0.1, eval_batches=2)
    base.update(kw)
    return TrainConfig(**base)


def losses(out):
    return [r["loss"] for r in read_metrics(out / "metrics.jsonl")]
