"""Pair scorers (lrmoe.scorers): what each built-in scores, the seeded random scorer, the registry
(explicit built-ins, registering an existing name raises unless override=True) and how the experts
treat a custom scorer's output."""
import pytest
import torch

from lrmoe import BackwardPolicy
from lrmoe.scorers import register_scorer, scorers, unregister_scorer
from oracle import make_case, run_loop, run_lrmoe


def test_random_scorer_is_seeded():
    case = make_case(30, 6, 4, 4, 2)
    kept = [run_lrmoe(case, BackwardPolicy(0.5, scorer="random", seed=s))[2].kept_mask for s in (1, 1, 2)]
    assert torch.equal(kept[0], kept[1])
    assert not torch.equal(kept[0], kept[2])


def test_lrm_uses_all_three_factors():
    """Same ||g_t||, different alpha or phi: only LRM tells the pairs apart."""
    x, idx, w, gu, dn, dy = make_case(8, 6, 4, 1, 1)
    dy = dy / dy.norm(dim=-1, keepdim=True)  # every token has the same gradient norm
    case = (x, idx, w, gu, dn, dy)
    _, _, rec = run_lrmoe(case, BackwardPolicy(0.5, scorer="lrm"))
    h2 = run_loop(case)[2]
    r = (w**2 * h2).squeeze(1)
    assert torch.equal(rec.kept_mask.squeeze(1), r >= r.sort(descending=True).values[3])
    _, _, rec_g = run_lrmoe(case, BackwardPolicy(0.5, scorer="grad_norm"))
    # All grad-norm scores tie (up to rounding), so its choice ignores alpha and phi.
    assert torch.allclose(rec_g.scores, rec_g.scores[0, 0].expand_as(rec_g.scores), rtol=1e-5)


def test_custom_scorer_registration(temporary_scorer):
    def last_slot_first(inp):  # prefers each token's k-th choice for larger k
        return torch.arange(inp.alpha_TK.shape[1], dtype=torch.float32).expand(inp.alpha_TK.shape).contiguous()

    temporary_scorer("test_last_slot_first", last_slot_first)

    assert "test_last_slot_first" in scorers()
    x, idx, w, gu, dn, dy = make_case(16, 5, 4, 2, 2)
    idx = torch.zeros_like(idx)  # both slots of every token on expert 0: 32 pairs, quota 16
    _, _, rec = run_lrmoe((x, idx, w, gu, dn, dy), BackwardPolicy(0.5, scorer="test_last_slot_first"))
    assert rec.kept_mask[:, 1].all() and not rec.kept_mask[:, 0].any()


def test_custom_scorer_with_transposed_output_fails_clearly(temporary_scorer):
    """A scorer must return [T, K]; a [K, T] result (T != K) is silently reshaped into [T, K] and
    selects the wrong pairs instead of failing with a clear ValueError."""
    temporary_scorer("test_transposed", lambda inp: inp.alpha_TK.t().float().contiguous())
    case = make_case(6, 5, 4, 3, 2)
    with pytest.raises(ValueError, match=r"\[6, 2\]"):
        run_lrmoe(case, BackwardPolicy(0.5, scorer="test_transposed"))


def test_custom_scorer_with_broadcastable_output_fails_with_value_error(temporary_scorer):
    """A [T, 1] result (the natural mistake: grad_norm without expand) dies with a bare
    RuntimeError from reshape deep inside backward, not a ValueError naming the scorer."""
    temporary_scorer("test_column", lambda inp: inp.grad_norm2_T[:, None])
    case = make_case(6, 5, 4, 3, 2)
    with pytest.raises(ValueError, match="test_column"):
        run_lrmoe(case, BackwardPolicy(0.5, scorer="test_column"))


def test_builtin_scorers_are_listed_explicitly():
    """The built-ins are in the registry whatever was imported, each the function of lrmoe.scorers."""
    import lrmoe.scorers as S

    assert {"lrm", "lrm_input", "grad_norm", "abs_grad", "random"} <= set(scorers())
    for name, fn in (("lrm", S.lrm_score), ("lrm_input", S.lrm_input_score), ("grad_norm", S.grad_norm_score),
                     ("abs_grad", S.abs_grad_score), ("random", S.random_score)):
        assert S.get_scorer(name) is fn


def test_registering_an_existing_name_raises_unless_override():
    from lrmoe.scorers import get_scorer, lrm_score

    def other(inp):
        return -lrm_score(inp)

    with pytest.raises(ValueError, match="scorer 'lrm' is already registered .*pass override=True"):
        register_scorer("lrm", other)
    assert get_scorer("lrm") is lrm_score
    try:
        register_scorer("lrm", other, override=True)
        assert get_scorer("lrm") is other
    finally:
        register_scorer("lrm", lrm_score, override=True)
    assert get_scorer("lrm") is lrm_score


def test_register_as_a_decorator_and_unregister():
    @register_scorer("test_decorated")
    def decorated(inp):
        return inp.alpha_TK.float()

    try:
        assert "test_decorated" in scorers() and BackwardPolicy(0.5, scorer="test_decorated").scorer == "test_decorated"
    finally:
        unregister_scorer("test_decorated")


def test_unregister_removes_a_user_scorer():
    register_scorer("test_temporary", lambda inp: inp.alpha_TK.float())
    assert "test_temporary" in scorers()
    unregister_scorer("test_temporary")
    assert "test_temporary" not in scorers()
    with pytest.raises(ValueError, match="unknown scorer 'test_temporary'"):
        BackwardPolicy(0.5, scorer="test_temporary")
    with pytest.raises(ValueError, match="unknown scorer 'test_temporary'"):
        unregister_scorer("test_temporary")


def test_builtin_scores_are_their_formulas():
    """lrm = alpha^2 ||g||^2 ||h||^2, lrm_input = alpha^2 ||g||^2 ||x||^2, grad_norm = ||g||^2,
    abs_grad = ||g||_1 (per pair, float32)."""
    from lrmoe.scorers import ScoreInputs, get_scorer

    T, K, H = 7, 3, 5
    alpha, g, x = torch.rand(T, K), torch.randn(T, H), torch.randn(T, H)
    phi2 = torch.rand(T, K) * 4
    inp = ScoreInputs(alpha, g, phi2, x, torch.zeros(T, K, dtype=torch.long))
    g2 = (g.double() ** 2).sum(-1, keepdim=True)
    want = {"lrm": alpha.double() ** 2 * g2 * phi2.double(),
            "lrm_input": alpha.double() ** 2 * g2 * (x.double() ** 2).sum(-1, keepdim=True),
            "grad_norm": g2.expand(T, K), "abs_grad": g.double().abs().sum(-1, keepdim=True).expand(T, K)}
    for name, ref in want.items():
        got = get_scorer(name)(inp)
        assert got.shape == (T, K) and got.dtype == torch.float32, name
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
