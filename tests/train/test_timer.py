"""The MoE timer (lrmoe.train.timer): it times the experts' backward node found by its autograd
Function class, not by a class name, and only inside an enabled step."""
import time

import torch
from torch import nn

from lrmoe import BackwardPolicy, lrmoe_experts
from lrmoe.train.timer import MoETimer

E, H, I, T, K = 4, 16, 8, 6, 2


class _FakeSelectiveExpertsFunction(torch.autograd.Function):
    """Another autograd function whose class name contains "SelectiveExperts"."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


class _Experts(nn.Module):
    def __init__(self, fake: bool):
        super().__init__()
        self.fake = fake
        self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * I, H) * 0.1)
        self.down_proj = nn.Parameter(torch.randn(E, H, I) * 0.1)

    def forward(self, x, idx, w):
        if self.fake:
            return _FakeSelectiveExpertsFunction.apply(x)
        return lrmoe_experts(x, idx, w, self.gate_up_proj, self.down_proj, BackwardPolicy(0.0))


def _timed_step(fake: bool, monkeypatch) -> tuple[float, float]:
    """One forward and backward through the experts module under the timer, with a clock that
    advances by one per reading: a timed interval is at least 1, an untimed phase exactly 0."""
    clock = iter(range(1, 10 ** 6))
    monkeypatch.setattr(time, "perf_counter", lambda: float(next(clock)))
    mod = _Experts(fake)
    x = torch.randn(T, H, requires_grad=True)
    idx = torch.randint(0, E, (T, K))
    w = torch.rand(T, K)
    timer = MoETimer([mod], torch.device("cpu"))
    try:
        timer.enabled = True
        y = mod(x, idx, w)
        timer.enabled = False
        y.sum().backward()
        return timer.collect()
    finally:
        timer.remove()


def test_the_experts_function_is_timed(monkeypatch):
    fwd, bwd = _timed_step(False, monkeypatch)
    assert fwd >= 1 and bwd >= 1


def test_a_node_named_like_the_experts_function_is_not_timed(monkeypatch):
    fwd, bwd = _timed_step(True, monkeypatch)
    assert fwd >= 1  # the module's forward is timed (hooks), ...
    assert bwd == 0  # ... but the backward of an autograd function that is not the kit's is not


def test_nothing_is_timed_while_disabled(monkeypatch):
    clock = iter(range(1, 10 ** 6))
    monkeypatch.setattr(time, "perf_counter", lambda: float(next(clock)))
    mod = _Experts(False)
    timer = MoETimer([mod], torch.device("cpu"))
    x = torch.randn(T, H, requires_grad=True)
    mod(x, torch.randint(0, E, (T, K)), torch.rand(T, K)).sum().backward()
    assert timer.collect() == (0.0, 0.0)
    timer.remove()
