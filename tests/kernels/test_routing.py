"""Pair bookkeeping ops (lrmoe.kernels.routing) against their plain-loop references: the stable sort
of pairs by expert, per-expert top-quota selection and the per-token row sum."""
import pytest
import torch

from lrmoe.kernels import kept_positions, select_top_quota, select_top_quota_loop
from lrmoe.kernels.routing import sort_pairs_by_expert, sum_rows_by_token, sum_rows_by_token_loop


def test_sort_pairs_by_expert():
    idx = torch.randint(0, 5, (11, 3))
    perm, demand, offs = sort_pairs_by_expert(idx, 6)
    flat = idx.reshape(-1)
    assert torch.equal(demand, torch.bincount(flat, minlength=6)) and demand[5] == 0
    assert torch.equal(flat[perm], torch.sort(flat).values)
    for e in range(6):  # stable: pair order inside each expert
        p = perm[flat[perm] == e]
        assert torch.equal(p, torch.sort(p).values)
    assert offs.dtype == torch.int32 and torch.equal(offs.long(), demand.cumsum(0))


def test_select_top_quota_matches_loop():
    for _ in range(100):
        P, E = int(torch.randint(1, 80, ())), int(torch.randint(1, 8, ()))
        expert = torch.randint(0, E, (P,))
        scores = torch.randn(P)
        scores[torch.rand(P) < 0.3] = 0.25  # ties
        scores[torch.rand(P) < 0.05] = float("nan")
        scores[torch.rand(P) < 0.05] = float("-inf")
        scores[torch.rand(P) < 0.1] = 0.0
        scores[torch.rand(P) < 0.1] = -0.0  # equal to 0.0: ties, not an order
        scores[torch.rand(P) < 0.1] *= 1e30  # extreme magnitudes
        scores[torch.rand(P) < 0.05] = torch.finfo(torch.float32).tiny / 4  # subnormals
        d = torch.bincount(expert, minlength=E)
        quota = (torch.rand(E) * (d + 1)).long().clamp(max=d)
        keep = select_top_quota(scores, expert, quota)
        assert torch.equal(keep, select_top_quota_loop(scores, expert, quota))
        assert torch.equal(torch.bincount(expert[keep], minlength=E), quota)
        perm, _, _ = sort_pairs_by_expert(expert[:, None], E)
        pos = kept_positions(keep, perm, int(quota.sum()))
        assert torch.equal(expert[perm[pos]], torch.sort(expert[keep]).values)  # expert-contiguous


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_sum_rows_by_token(dtype):
    for T, K in [(1, 1), (7, 3), (20, 2)]:
        P = T * K
        n = int(torch.randint(0, P + 1, ()))
        rows_pair = torch.randperm(P)[:n]  # any subset of pairs, any order; some tokens get nothing
        rows = torch.randn(n, 5, dtype=dtype)
        out = sum_rows_by_token(rows, rows_pair, T, K)
        torch.testing.assert_close(out, sum_rows_by_token_loop(rows, rows_pair, T, K))
        torch.testing.assert_close(sum_rows_by_token(rows, rows_pair, T, K, workspace=torch.randn_like(rows)), out)
        for method in ("index_add", "segment_reduce"):  # the CPU and the accelerator reduction
            torch.testing.assert_close(sum_rows_by_token(rows, rows_pair, T, K, method=method), out)
        assert out.shape == (T, 5)
