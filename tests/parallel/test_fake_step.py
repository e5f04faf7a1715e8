"""The expert-parallel step runs under FakeTensorMode (what a memory estimate needs): with a fake process
group and fake tensors (shapes, no values), the runtime plans from a stated demand instead of reading
one, skips the value checks and the record, and the grouped GEMMs run their fake kernels. The step's
outputs and gradients have the real step's shapes and dtypes."""
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from lrmoe.kernels.grouped_gemm import grouped_mm
from lrmoe.parallel import fake

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["auto", "loop", "torch"])
def test_grouped_mm_on_fake_tensors_gives_the_real_shapes(dtype, backend):
    real_a, real_b = torch.randn(16, 16, dtype=dtype), torch.randn(3, 16, 32, dtype=dtype)  # (16-byte strides)
    real_at, real_bw = real_a.t().contiguous(), torch.randn(16, 32, dtype=dtype)
    offs = torch.tensor([4, 4, 13], dtype=torch.int32)
    want = grouped_mm(real_a, real_b, offs, backend=backend)
    want_w = grouped_mm(real_at, real_bw, offs, backend=backend)
    with FakeTensorMode() as mode:
        a, b, at, bw, o = (mode.from_tensor(t) for t in (real_a, real_b, real_at, real_bw, offs))
        out = grouped_mm(a, b, o, backend=backend)
        w = grouped_mm(at, bw, o, backend=backend)
    assert fake.is_fake(out) and (out.shape, out.dtype) == (want.shape, want.dtype)
    assert fake.is_fake(w) and (w.shape, w.dtype) == (want_w.shape, want_w.dtype)


def test_stated_demand_is_checked_and_balanced_by_default():
    d = fake.demand(2, 5, 12)
    assert d.tolist() == [[3, 3, 2, 2, 2], [3, 3, 2, 2, 2]]
    hot = lambda G, E, pairs: np.tile(np.r_[pairs, np.zeros(E - 1, np.int64)], (G, 1))  # noqa: E731
    with fake.stated_demand(hot):
        assert fake.demand(2, 4, 8).tolist() == [[8, 0, 0, 0], [8, 0, 0, 0]]
    with fake.stated_demand(lambda G, E, pairs: np.ones((G, E), np.int64)):
        with pytest.raises(ValueError, match="rows sum to the 8 pairs"):
            fake.demand(2, 4, 8)
    assert fake.demand(1, 4, 8).tolist() == [[2, 2, 2, 2]]  # the statement ended with its block


SCRIPT = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    import lrmoe.hf as hf
    from lrmoe import BackwardPolicy
    from lrmoe.hf import parallel as ep_hf
    from lrmoe.parallel.launch import init_distributed
    env = init_distributed(ep=4)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = hf.build_model("qwen3-moe-tiny", vocab_size=61, seed=0, num_hidden_layers=2,
                               policy=BackwardPolicy(0.2))
        eps = ep_hf.parallelize_experts(model, env.ep_group, sys.argv[1])
        ids = torch.randint(0, 61, (2, 16))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        gu = model.model.layers[0].mlp.experts.gate_up_proj
        print("RESULT", tuple(gu.shape), tuple(gu.grad.shape), gu.grad.dtype, type(eps[0].last_plan).__name__,
              int(eps[0].last_plan.send_GN.sum()))
    """)


@pytest.mark.parametrize("placement", ["fixed", "lrmoe", "symi"])
def test_ep_step_under_fake_tensors_and_a_fake_group(placement):
    p = subprocess.run([sys.executable, "-c", SCRIPT, placement], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT")), None)
    assert line is not None, p.stdout[-2000:] + p.stderr[-4000:]
    # 8 experts over 4 ranks: [2, 2I, H] per rank; the plan of a balanced demand of 2 x 16 tokens x top-2 per
    # source rank (4 ranks): 4 x 64 pairs routed in all
    assert line.split()[1:] == ["(2,", "64,", "64)", "(2,", "64,", "64)", "torch.float32", "Plan", "256"]
