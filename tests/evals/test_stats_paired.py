"""Paired statistics against values computed by hand or from textbook tables."""

from __future__ import annotations

import math

import pytest

from evals import stats


def test_mcnemar_exact_hand_values():
    # 5 candidate-only successes, 0 incumbent-only: p = 2 * (1/2)^5 = 0.0625.
    cand = [1, 1, 1, 1, 1, 1, 0, 0]
    inc = [0, 0, 0, 0, 0, 1, 0, 0]
    res = stats.mcnemar_exact(cand, inc)
    assert (res.statistic, res.p_value) == (5, pytest.approx(0.0625))
    # 2 vs 8 discordant: p = 2 * (C(10,0)+C(10,1)+C(10,2)) / 2^10 = 112/1024.
    cand = [1] * 2 + [0] * 8 + [1] * 5
    inc = [0] * 2 + [1] * 8 + [1] * 5
    res = stats.mcnemar_exact(cand, inc)
    assert res.p_value == pytest.approx(112 / 1024)
    assert res.delta == pytest.approx(-6 / 15)


def test_one_sided_greater_hand_values():
    # 5 candidate-only successes of 5 discordant: one-sided p = (1/2)^5; reversed it is 1.
    cand, inc = [1, 1, 1, 1, 1, 1, 0, 0], [0, 0, 0, 0, 0, 1, 0, 0]
    assert stats.mcnemar_exact(cand, inc, alternative="greater").p_value == pytest.approx(1 / 32)
    assert stats.mcnemar_exact(inc, cand, alternative="greater").p_value == pytest.approx(1.0)
    # t = 4.2426 on 4 df: the one-sided p is half the two-sided 0.0132.
    base = [10.0, 20.0, 30.0, 40.0, 50.0]
    better = [x + d for x, d in zip(base, [1, 2, 3, 4, 5], strict=True)]
    assert stats.paired_t(better, base, alternative="greater").p_value == pytest.approx(0.0066, abs=1e-4)
    assert stats.paired_t(base, better, alternative="greater").p_value > 0.99
    # Wilcoxon, all 5 differences positive: exact one-sided p = 1 / 2^5.
    assert stats.wilcoxon(better, base, alternative="greater").p_value == pytest.approx(1 / 32)
    assert stats.paired_t([1, 2], [2, 3], alternative="greater").p_value == 1.0


def test_mcnemar_rejects_non_binary_and_ties_give_one():
    with pytest.raises(ValueError, match="0/1"):
        stats.mcnemar_exact([0.5, 1], [1, 0])
    assert stats.mcnemar_exact([1, 0], [1, 0]).p_value == 1.0


def test_paired_t_hand_value():
    # d = 1..5: mean 3, sd sqrt(2.5), se sqrt(0.5), t = 3 / 0.70711 = 4.2426 on 4 df;
    # two-sided p = 0.0132 (t-table: t_{0.01,4} = 4.604, t_{0.025,4} = 3.495 bracket it: p in (0.01, 0.02)).
    inc = [10.0, 20.0, 30.0, 40.0, 50.0]
    cand = [x + d for x, d in zip(inc, [1, 2, 3, 4, 5], strict=True)]
    res = stats.paired_t(cand, inc)
    assert res.statistic == pytest.approx(3 / math.sqrt(0.5), rel=1e-9)
    assert 0.01 < res.p_value < 0.02 and res.p_value == pytest.approx(0.0132, abs=2e-4)


def test_paired_t_degenerate_cases():
    assert stats.paired_t([1, 2], [1, 2]).p_value == 1.0
    shifted = stats.paired_t([2, 3], [1, 2])
    assert shifted.statistic == math.inf and shifted.p_value == 0.0
    with pytest.raises(ValueError, match="length"):
        stats.paired_t([1, 2, 3], [1, 2])


def test_wilcoxon_exact_small_sample():
    # All 5 differences positive: W- = 0; exact two-sided p = 2 / 2^5 = 0.0625.
    res = stats.wilcoxon([2, 4, 6, 8, 10], [1, 2, 3, 4, 5])
    assert res.statistic == 0.0 and res.p_value == pytest.approx(0.0625)


def test_bootstrap_percentile_ci():
    cand = [1, 0] * 50  # 0/1 data where BCa would give NaN
    inc = [0, 0] * 50
    res = stats.paired_bootstrap(cand, inc, n_resamples=4000, seed=3)
    # delta = 0.5 with se = sqrt(0.25/100) = 0.05: a 95% CI of about 0.5 +- 0.098.
    assert res.delta == 0.5
    assert res.ci_low == pytest.approx(0.402, abs=0.02) and res.ci_high == pytest.approx(0.598, abs=0.02)
    assert stats.paired_bootstrap(cand, inc, n_resamples=4000, seed=3) == res
    constant = stats.paired_bootstrap([1, 1], [0, 0])
    assert (constant.ci_low, constant.ci_high) == (1.0, 1.0)


def test_holm_hand_values():
    # sorted: 0.005*4=0.02, 0.01*3=0.03, 0.03*2=0.06, 0.04*1=0.04 -> monotone 0.06.
    assert stats.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert stats.holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])
