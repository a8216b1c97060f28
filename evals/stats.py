"""Paired statistics for two models scored on the same items.

Every test takes two equal-length sequences of per-item values (candidate, incumbent) in item
order. Conventions: deltas are candidate minus incumbent; p-values are two-sided unless
`alternative="greater"` asks for the one-sided test of "the candidate is better" (what promotion
bars use, so that a significantly worse candidate can never clear a p bar).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field


class TestResult(BaseModel):
    """One paired test's outcome."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    test: str = Field(description="mcnemar_exact | paired_t | wilcoxon | bootstrap.")
    n: int = Field(description="Number of paired items.")
    delta: float = Field(description="Mean per-item difference, candidate minus incumbent.")
    statistic: float = Field(description="The test statistic (t, W, discordant count, or delta).")
    p_value: float | None = Field(None, description="p-value (two-sided or one-sided 'greater'); None for the bootstrap.")
    ci_low: float | None = Field(None, description="Lower confidence bound of delta (bootstrap).")
    ci_high: float | None = Field(None, description="Upper confidence bound of delta (bootstrap).")


def _scipy_stats():
    """scipy.stats, imported at the first test: a CLI command that runs none need not load it (0.5 CPU-s)."""
    from scipy import stats

    return stats


def _diffs(candidate: Sequence[float], incumbent: Sequence[float]) -> np.ndarray:
    if len(candidate) != len(incumbent):
        raise ValueError(f"paired samples differ in length: {len(candidate)} vs {len(incumbent)}")
    if len(candidate) == 0:
        raise ValueError("paired samples are empty")
    return np.asarray(candidate, dtype=float) - np.asarray(incumbent, dtype=float)


Alternative = Literal["two-sided", "greater"]


def mcnemar_exact(candidate: Sequence[float], incumbent: Sequence[float],
                  alternative: Alternative = "two-sided") -> TestResult:
    """Exact McNemar test on 0/1 outcomes.

    Under H0 the discordant pairs split 50/50, so the count of candidate-only successes among the
    discordant pairs is Binomial(n_discordant, 1/2) (McNemar 1947; exact form as recommended by
    Fagerland, Lydersen & Laake 2013, BMC Med Res Methodol 13:91). Statistic: candidate-only wins.
    """
    d = _diffs(candidate, incumbent)
    if not np.isin(np.asarray(candidate), (0, 1)).all() or not np.isin(np.asarray(incumbent), (0, 1)).all():
        raise ValueError("McNemar's test needs 0/1 outcomes")
    wins, losses = int((d > 0).sum()), int((d < 0).sum())
    p = 1.0 if wins + losses == 0 else _scipy_stats().binomtest(wins, wins + losses, 0.5, alternative=alternative).pvalue
    return TestResult(test="mcnemar_exact", n=len(d), delta=float(d.mean()), statistic=wins, p_value=float(p))


def paired_t(candidate: Sequence[float], incumbent: Sequence[float],
             alternative: Alternative = "two-sided") -> TestResult:
    """Paired t-test: t = mean(d) / (sd(d) / sqrt(n)) on n-1 df (Student 1908; any stats text)."""
    d = _diffs(candidate, incumbent)
    if len(d) < 2:
        raise ValueError("a paired t-test needs at least 2 items")
    if np.all(d == d[0]):
        # Zero variance: scipy returns NaN. Identical pairs carry no evidence (t=0, p=1); a constant
        # non-zero shift is an infinitely sharp difference (t=+-inf, p=0).
        t = 0.0 if d[0] == 0 else float(np.sign(d[0]) * np.inf)
        p = float(t == 0.0) if alternative == "two-sided" else float(t <= 0.0)
        return TestResult(test="paired_t", n=len(d), delta=float(d[0]), statistic=t, p_value=p)
    res = _scipy_stats().ttest_rel(candidate, incumbent, alternative=alternative)
    return TestResult(test="paired_t", n=len(d), delta=float(d.mean()), statistic=float(res.statistic),
                      p_value=float(res.pvalue))


def wilcoxon(candidate: Sequence[float], incumbent: Sequence[float],
             alternative: Alternative = "two-sided") -> TestResult:
    """Wilcoxon signed-rank test (Wilcoxon 1945), zero differences dropped (the original method)."""
    d = _diffs(candidate, incumbent)
    if not np.any(d != 0):
        return TestResult(test="wilcoxon", n=len(d), delta=0.0, statistic=0.0, p_value=1.0)
    res = _scipy_stats().wilcoxon(d, zero_method="wilcox", alternative=alternative)
    return TestResult(test="wilcoxon", n=len(d), delta=float(d.mean()), statistic=float(res.statistic),
                      p_value=float(res.pvalue))


def paired_bootstrap(candidate: Sequence[float], incumbent: Sequence[float], confidence: float = 0.95,
                     n_resamples: int = 10_000, seed: int = 0) -> TestResult:
    """Percentile CI of the mean difference from resampling items (Efron & Tibshirani 1993, ch. 13).

    Percentile, not BCa: on mostly 0/1 outcomes BCa's acceleration estimate degenerates to NaN.
    """
    d = _diffs(candidate, incumbent)
    if np.all(d == d[0]):
        return TestResult(test="bootstrap", n=len(d), delta=float(d[0]), statistic=float(d[0]),
                          ci_low=float(d[0]), ci_high=float(d[0]))
    res = _scipy_stats().bootstrap((d,), np.mean, confidence_level=confidence, n_resamples=n_resamples,
                          method="percentile", rng=np.random.default_rng(seed))
    ci = res.confidence_interval
    return TestResult(test="bootstrap", n=len(d), delta=float(d.mean()), statistic=float(d.mean()),
                      ci_low=float(ci.low), ci_high=float(ci.high))


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm step-down adjusted p-values (Holm 1979, Scand J Statist 6:65-70), in input order.

    Sorted ascending, p_(i) is multiplied by (m - i + 1), then made monotone non-decreasing and
    capped at 1; reject H_(i) at level alpha iff its adjusted p <= alpha.
    """
    m = len(p_values)
    order = np.argsort(p_values, kind="stable")
    adjusted = np.empty(m)
    running = 0.0
    for rank, idx in enumerate(order):
        running = max(running, min(1.0, (m - rank) * float(p_values[idx])))
        adjusted[idx] = running
    return adjusted.tolist()
