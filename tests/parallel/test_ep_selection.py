"""The expert-parallel selection options in one process (lrmoe.parallel.virtual, which runs the
runtime's select_pairs per (source, instance) bucket): with ``selection="sample"`` every source
keeps exactly its planned backward quota per expert, the recorded inclusion probabilities are the
capped sqrt(score) ones of each bucket, and the gradients equal the per-pair loop with the kept
pairs scaled by 1/pi; ``phi`` reaches the scores. float64."""
import numpy as np
import pytest
import torch

from lrmoe import BackwardPolicy, BackwardRecord
from lrmoe.kernels.sampling import inclusion_probabilities_loop
from lrmoe.parallel.virtual import VirtualExpertParallel, VirtualGroup, virtual_ep_experts
from oracle import assert_close_all, make_case, run_loop

G = 2


def _run(case, policy, placement):
    x, idx, w, gu, dn, dy = case
    vep = VirtualExpertParallel(gu.shape[0], VirtualGroup(G), placement)
    leaves = [t.clone().requires_grad_() for t in (x, w, gu, dn)]
    rec = BackwardRecord()
    y = virtual_ep_experts(leaves[0], idx, leaves[1], leaves[2], leaves[3], vep, policy, rec)
    y.backward(dy)
    return y.detach(), [t.grad for t in leaves], rec, vep.plans()[0]


@pytest.mark.parametrize("placement", ["fixed", "lrmoe"])
@pytest.mark.parametrize("kind", ["odd", "hot", "empty"])
@pytest.mark.parametrize("phi", ["h", "both"])
def test_virtual_ep_sampled_selection(placement, kind, phi):
    kw = {"odd": {}, "hot": dict(hot=3), "empty": dict(empty=(0, 5))}[kind]
    case = make_case(15, 6, 4, 8, 2, seed=40 + len(kind), **kw)
    x, idx, w, gu, dn, dy = case
    y, grads, rec, plan = _run(case, BackwardPolicy(0.5, selection="sample", phi=phi, seed=2), placement)
    assert rec.selection == "sample" and rec.inclusion is not None
    assert int(plan.dropped_GE.sum()) == 0  # no forward drops here: the loop reference applies
    bounds = [15 * r // G for r in range(G + 1)]
    E = gu.shape[0]
    inst_expert = np.array([i.expert for i in plan.instances])
    for r in range(G):  # exactly the planned quota of every (source, expert), summed over its instances
        sl = slice(bounds[r], bounds[r + 1])
        kept = torch.bincount(idx[sl][rec.kept_mask[sl]], minlength=E).numpy()
        want = np.bincount(inst_expert, weights=plan.backward_quota_GN[r], minlength=E).astype(np.int64)
        np.testing.assert_array_equal(kept, want)
        if len(plan.instances) == E:  # one instance per expert: the bucket is the expert
            pi = inclusion_probabilities_loop(rec.scores[sl].reshape(-1), idx[sl].reshape(-1),
                                              torch.as_tensor(want))
            torch.testing.assert_close(rec.inclusion[sl].reshape(-1), torch.tensor(pi, dtype=torch.float64),
                                       rtol=1e-6, atol=1e-8)
    g2 = (dy**2).sum(-1, keepdim=True) * G**2  # a rank's gradient is G x dL/dy
    h2 = run_loop(case)[2]
    x2 = (x**2).sum(-1, keepdim=True)
    want_scores = w**2 * g2 * (h2 + x2 if phi == "both" else h2)
    torch.testing.assert_close(rec.scores, want_scores.float(), rtol=1e-5, atol=1e-6)
    scale = torch.where(rec.kept_mask, 1 / rec.inclusion, torch.zeros_like(rec.inclusion))
    _, grads_ref, _ = run_loop(case, kept=rec.kept_mask, scale=scale)
    assert_close_all(grads, grads_ref, f"virtual EP sample {placement} {kind}")
