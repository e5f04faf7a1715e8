"""Kernel ops (torch and loop backends) against naive references."""
import pytest
import torch

from lrmoe.kernels import grouped_mm, grouped_mm_loop, kept_positions, select_top_quota, select_top_quota_loop
from lrmoe.kernels.routing import sort_pairs_by_expert, sum_rows_by_token, sum_rows_by_token_loop


def random_offsets(M, G, *, zeros=True):
    cuts = torch.sort(torch.randint(0, M + 1, (G - 1,))).values
    offs = torch.cat([cuts, torch.tensor([M])])
    if zeros and G > 2:
        offs[1] = offs[0]  # an empty group
    return offs.to(torch.int32)


def naive_rows(a, b, offs):
    out, start = torch.zeros(a.shape[0], b.shape[2], dtype=torch.float64), 0
    for g, end in enumerate(offs.tolist()):
        for i in range(start, end):
            out[i] = a[i].double() @ b[g].double()
        start = end
    return out


def naive_contraction(a, b, offs):
    out, start = torch.zeros(offs.numel(), a.shape[0], b.shape[1], dtype=torch.float64), 0
    for g, end in enumerate(offs.tolist()):
        for i in range(start, end):
            out[g] += torch.outer(a[:, i].double(), b[i].double())
        start = end
    return out


# torch.nn.functional.grouped_mm has no float64 kernel: float64 goes through loop (and auto).
CASES = [(b, d) for b in ("loop", "torch", "auto") for d in (torch.float32, torch.bfloat16, torch.float64)
         if not (b == "torch" and d == torch.float64)]


@pytest.mark.parametrize("backend,dtype", CASES)
@pytest.mark.parametrize("G", [1, 3, 8])
def test_row_split(backend, dtype, G):
    M, K, N = 37, 16, 24
    a = torch.randn(M, K, dtype=dtype)
    w = torch.randn(G, N, K, dtype=dtype)  # transposed view: never copied
    offs = random_offsets(M, G)
    out = grouped_mm(a, w.transpose(1, 2), offs, backend=backend)
    ref = naive_rows(a, w.transpose(1, 2), offs)
    n = int(offs[-1])
    tol = dict(rtol=2e-2, atol=2e-1) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out[:n].double(), ref[:n], **tol)
    assert out.dtype == dtype


@pytest.mark.parametrize("backend", ["loop", "torch"])
def test_contraction_split_with_empty_groups(backend):
    M, K, N, G = 41, 16, 8, 5
    x, dy = torch.randn(M, K), torch.randn(M, N)
    offs = random_offsets(M, G)
    out = grouped_mm(x.t(), dy, offs, backend=backend)
    torch.testing.assert_close(out.double(), naive_contraction(x.t(), dy, offs), rtol=1e-4, atol=1e-4)
    assert out[1].abs().sum() == 0  # the empty group


def test_rows_past_last_offset_are_zero_in_loop():
    a, b = torch.randn(10, 4), torch.randn(2, 4, 3)
    out = grouped_mm(a, b, torch.tensor([3, 6], dtype=torch.int32), backend="loop")
    assert out[6:].abs().sum() == 0


def test_grouped_mm_errors():
    a, b = torch.randn(6, 4), torch.randn(2, 4, 3)
    offs = torch.tensor([3, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="mat_b has 2 groups but offs has 3"):
        grouped_mm(a, b, torch.tensor([1, 2, 6], dtype=torch.int32))
    with pytest.raises(ValueError, match="inner dimensions differ"):
        grouped_mm(a, torch.randn(2, 5, 3), offs)
    with pytest.raises(ValueError, match="2D x 3D"):
        grouped_mm(a[None], b, offs)
    with pytest.raises(ValueError, match="int32"):
        grouped_mm(a, b, offs.float())
    with pytest.raises(ValueError, match="unknown grouped_mm backend 'cuda'"):
        grouped_mm(a, b, offs, backend="cuda")
    with pytest.raises(ValueError, match="16-byte aligned"):
        grouped_mm(torch.randn(6, 3), torch.randn(2, 3, 3), offs, backend="torch")


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
