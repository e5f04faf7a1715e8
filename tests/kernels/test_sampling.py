"""Fixed-size sampling within quotas (lrmoe.kernels.sampling) against its plain loops: inclusion
probabilities (capped, iterated, summing to the quota), the systematic draw (exact quota, exact
inclusion probabilities by integrating over the uniform point, empirical frequencies)."""
import math

import pytest
import torch

from lrmoe.kernels.sampling import (_UNIT, draw_points, inclusion_probabilities, inclusion_probabilities_loop,
                                    sample_quota, systematic_select, systematic_select_loop)

f64 = torch.float64


def _case(g, P, E, kind):
    expert = torch.randint(0, E, (P,), generator=g)
    if kind == "hot" and P:
        expert[torch.rand(P, generator=g) < 0.7] = 0
    if kind == "empty" and E > 2:
        expert = expert.clamp(max=E - 3)  # the last two experts get no pair
    d = torch.bincount(expert, minlength=E)
    q = (torch.rand(E, generator=g) * (d + 1)).floor().long().clamp(max=d)
    s = torch.rand(P, generator=g) ** 4 * 10  # a wide spread: some pairs capped
    if kind == "zeros" and P:
        s[torch.rand(P, generator=g) < 0.4] = 0
    if kind == "nonfinite" and P:
        s[torch.randint(0, P, (3,), generator=g)] = float("nan")
        s[torch.randint(0, P, (1,), generator=g)] = float("inf")
    if kind == "equal":
        s = torch.ones(P)
    return s, expert, q


KINDS = ["plain", "hot", "empty", "zeros", "nonfinite", "equal"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("P,E", [(1, 1), (1, 3), (7, 3), (40, 5), (97, 8)])
def test_fast_path_equals_the_loops(kind, P, E):
    g = torch.Generator().manual_seed(1000 * P + E + KINDS.index(kind))
    for _ in range(6):
        s, expert, q = _case(g, P, E, kind)
        pi = inclusion_probabilities(s, expert, q)
        # (the suffix sums are differences of float64 running sums: a tiny tail is exact to ~1e-16 x total/tail)
        torch.testing.assert_close(pi, torch.tensor(inclusion_probabilities_loop(s, expert, q), dtype=f64),
                                   rtol=1e-6, atol=1e-12)
        assert ((pi >= 0) & (pi <= 1)).all()
        for e in range(E):  # the quota in expectation ...
            assert math.isclose(float(pi[expert == e].sum()), int(q[e]), abs_tol=1e-9)
        finite = torch.isfinite(s)
        nf = ~finite
        if nf.any():  # non-finite scores are certain (up to the quota: the lowest pair indices, as top)
            for e in range(E):
                idx = torch.nonzero(nf & (expert == e)).squeeze(1)[: int(q[e])]
                assert (pi[idx] == 1).all()
        u = draw_points(E, "cpu", g)
        keep, used = systematic_select(pi, expert, q, u)
        k_ref, used_ref = systematic_select_loop(pi.tolist(), expert, q, u.tolist())
        assert keep.tolist() == k_ref
        torch.testing.assert_close(used, torch.tensor(used_ref, dtype=f64), rtol=0, atol=2.0**-30)
        # ... and exactly in every draw
        assert torch.equal(torch.bincount(expert[keep], minlength=E), q)
        torch.testing.assert_close(used, pi, rtol=1e-6, atol=1e-8)  # the draw's probabilities are pi (to 2^-32)
        assert not (keep & (used == 0)).any()


def test_capping_is_iterated():
    # sizes sqrt(s) = [10, 5, 1, 1, 1], quota 3: 10 capped, then 5 capped, the rest share 1
    s = torch.tensor([100.0, 25.0, 1.0, 1.0, 1.0])
    pi = inclusion_probabilities(s, torch.zeros(5, dtype=torch.long), torch.tensor([3]))
    torch.testing.assert_close(pi, torch.tensor([1, 1, 1 / 3, 1 / 3, 1 / 3], dtype=f64))
    # no capping: proportional to sqrt(score)
    pi = inclusion_probabilities(torch.tensor([4.0, 1.0, 1.0]), torch.zeros(3, dtype=torch.long), torch.tensor([1]))
    torch.testing.assert_close(pi, torch.tensor([0.5, 0.25, 0.25], dtype=f64))
    # positive weights cannot fill the quota: the rest evenly over the zero-weight pairs
    pi = inclusion_probabilities(torch.tensor([1.0, 0.0, 0.0, 0.0]), torch.zeros(4, dtype=torch.long),
                                 torch.tensor([3]))
    torch.testing.assert_close(pi, torch.tensor([1, 2 / 3, 2 / 3, 2 / 3], dtype=f64))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_systematic_inclusion_probabilities_are_exact(seed):
    """Integrating the draw over its uniform point (piecewise constant between the interval ends
    mod 1) gives each pair's inclusion probability exactly, and every point keeps the quota."""
    g = torch.Generator().manual_seed(seed)
    d, q = 9, 4
    s = torch.rand(d, generator=g) ** 3 * 5
    expert = torch.zeros(d, dtype=torch.long)
    quota = torch.tensor([q])
    pi = inclusion_probabilities(s, expert, quota)
    _, used = systematic_select(pi, expert, quota, torch.tensor([0]))
    ends = torch.round(torch.cumsum(used * (used < 1), 0) * _UNIT).long() % _UNIT
    cuts = sorted({0, *ends.tolist()}) + [_UNIT]
    freq = torch.zeros(d, dtype=f64)
    for a, b in zip(cuts[:-1], cuts[1:]):
        keep, _ = systematic_select(pi, expert, quota, torch.tensor([a]))
        assert int(keep.sum()) == q
        keep_b, _ = systematic_select(pi, expert, quota, torch.tensor([b - 1]))
        assert torch.equal(keep, keep_b)  # constant on the piece
        freq += keep.double() * (b - a) / _UNIT
    assert torch.equal(freq, used)  # exact (sums of multiples of 2^-32)
    torch.testing.assert_close(used, pi, rtol=0, atol=1e-8)


def test_empirical_inclusion_frequencies():
    g = torch.Generator().manual_seed(5)
    s, expert, q = _case(g, 30, 4, "plain")
    n = 20000  # n independent draws at once: n copies of the case on disjoint experts
    tiled = (expert[None, :] + 4 * torch.arange(n)[:, None]).reshape(-1)
    keep, pi = sample_quota(s.repeat(n), tiled, q.repeat(n), g)
    keep, pi = keep.view(n, 30), pi.view(n, 30)[0]
    assert all(torch.equal(torch.bincount(expert[k], minlength=4), q) for k in keep[:200])
    assert torch.equal(torch.bincount(tiled[keep.reshape(-1)], minlength=4 * n), q.repeat(n))
    freq = keep.double().mean(0)
    sd = (pi * (1 - pi) / n).sqrt()
    assert ((freq - pi).abs() <= 6 * sd + 1e-12).all(), (freq - pi).abs().max()


def test_generator_makes_the_draw_reproducible():
    s, expert, q = _case(torch.Generator().manual_seed(3), 50, 4, "plain")
    a = sample_quota(s, expert, q, torch.Generator().manual_seed(9))
    b = sample_quota(s, expert, q, torch.Generator().manual_seed(9))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_no_pairs():
    keep, pi = sample_quota(torch.zeros(0), torch.zeros(0, dtype=torch.long), torch.zeros(3, dtype=torch.long))
    assert keep.shape == (0,) and pi.shape == (0,)
