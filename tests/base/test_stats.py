"""lrmoe.stats, the kit's one statistics convention: t interval and p-value by hand, Holm's
correction against a hand-worked example, censored medians."""
import math

import pytest

from lrmoe.stats import censored_median, estimate, fmt_p, holm, paired, with_holm


def test_t_interval_and_p_by_hand():
    # xs = 1, 2, 3: mean 2, s = 1, se = 1/√3, t = 2√3, 2 degrees of freedom.
    e = estimate([1.0, 2.0, 3.0])
    half = 4.302652729911275 / math.sqrt(3)  # t(0.975, 2) = 4.3027
    assert (e.mean, e.lo, e.hi, e.n) == pytest.approx((2.0, 2.0 - half, 2.0 + half, 3))
    # with 2 degrees of freedom the t distribution's tail is closed-form: P(|T| > t) = 1 − t / √(t² + 2)
    assert e.p == pytest.approx(1 - math.sqrt(12 / 14))  # 0.0742: not below 0.05, yet the interval...
    assert e.resolved is False and e.lo < 0  # ...contains 0 too: interval and test agree
    assert estimate([0.3]).p is None and estimate([0.3]).lo is None
    assert estimate([0.2, 0.2]).p == 0.0 and estimate([0.0, 0.0]).p == 1.0


def test_interval_excludes_zero_exactly_when_p_below_alpha():
    for xs in ([0.1, 0.3, 0.2], [0.1, 0.5, -0.05], [1.0, 1.1, 0.9, 1.2, 1.05], [-2, 1, 0.5, 0.1]):
        e = estimate(xs)
        assert e.resolved == (e.p < 0.05), xs


def test_holm_hand_worked():
    # p = 0.01, 0.04, 0.03, 0.005 (m = 4). Ascending: 0.005·4 = 0.02; 0.01·3 = 0.03; 0.03·2 = 0.06;
    # 0.04·1 = 0.04 -> running maximum 0.06.
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([None, 0.02, None]) == [None, pytest.approx(0.02), None]  # one comparison: no correction
    assert holm([]) == []


def test_holm_running_maximum_and_cap():
    adj = holm([0.5, 0.9])
    assert adj[0] == 1.0 and adj[1] == 1.0  # 0.5·2 = 1.0; then max(1.0, 0.9·1) = 1.0


def test_with_holm_marks_corrected_resolution():
    a = estimate([0.10, 0.11, 0.12])   # p ≈ 0.003: survives ×2
    b = estimate([0.2, 0.3, 0.05, 0.25])  # p ≈ 0.034: resolved uncorrected, not after Holm
    assert a.resolved and b.resolved and b.p > 0.025
    c = estimate([0.3, -0.2, 0.1])       # p ≈ 0.7
    ha, hb, hc = with_holm([a, b, c])
    assert ha.resolved_holm and not hb.resolved_holm and not hc.resolved_holm
    assert ha.p_holm == pytest.approx(3 * a.p) and hb.p_holm == pytest.approx(2 * b.p)  # ×3, then ×2
    assert not a.resolved_holm  # unset before the table's correction


def test_paired_uses_common_seeds():
    e = paired({0: 1.0, 1: 2.0, 2: 5.0}, {0: 0.5, 1: 1.0, 3: 9.0})
    assert e.n == 2 and e.values == (0.5, 1.0)


def test_censored_median_counts_every_seed():
    assert censored_median([10, None, 30]) == (30.0, 2, 3)     # ranked 10, 30, ∞: the median is 30, not mean 20
    assert censored_median([10, None, None]) == (None, 1, 3)   # fewer than half reached
    assert censored_median([10, 20, 30, None]) == (25.0, 3, 4)
    assert censored_median([10, 20, None, None]) == (None, 2, 4)
    assert censored_median([]) == (None, 0, 0)


def test_fmt_p():
    assert fmt_p(None) == "—" and fmt_p(0.0004) == "<0.001" and fmt_p(0.0123) == "0.0123" and fmt_p(0.0499) == "0.0499" and fmt_p(0.5) == "0.50"
