"""The learning-rate schedule and the row sampler (lrmoe.train.schedule)."""
import pytest

from lrmoe.train import TrainConfig, lr_factor


def test_lr_schedule():
    c = TrainConfig(steps=100, warmup_steps=10, lr=1.0, min_lr_ratio=0.1)
    f = [lr_factor(s, c) for s in range(100)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0) and f[10] == pytest.approx(1.0)
    assert f[-1] == pytest.approx(0.1, abs=1e-12) and all(a >= b for a, b in zip(f[10:], f[11:]))


def test_cosine_reaches_min_lr_on_the_last_step():
    """'cosine decay ends at min_lr_ratio * lr': the last optimizer step (0-based steps-1) should use
    min_lr_ratio * lr. With steps=10, warmup=2 it uses 0.134 * lr instead of 0.1 * lr."""
    c = TrainConfig(steps=10, warmup_steps=2, lr=1.0, min_lr_ratio=0.1)
    f = [lr_factor(s, c) for s in range(10)]
    assert f[-1] == pytest.approx(0.1, abs=1e-6), f


@pytest.mark.parametrize("steps,warmup", [(2, 1), (5, 4), (3, 0)])
def test_cosine_ends_at_min_lr_right_after_warmup(steps, warmup):
    c = TrainConfig(steps=steps, warmup_steps=warmup, lr=1.0, min_lr_ratio=0.1)
    assert lr_factor(steps - 1, c) == pytest.approx(0.1)
