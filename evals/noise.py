"""Noise floor: how much a suite's metrics move when nothing but evaluation noise changes.

The incumbent is evaluated K >= 3 times per suite (sampling seeds, or item resamples under greedy
decoding; see evals/job.py). Per metric the floor stores the spread of the K suite means (max - min),
the mean absolute delta between replicate pairs (the unit of noise-floor bars, `noise_floor`), and
the largest |t| between replicate pairs: a paired t on the per-item values when the replicates score
the same items, Welch's unequal-variance t (Welch 1947, Biometrika 34:28-35) for item resamples.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
from pydantic import BaseModel, ConfigDict, Field
from scipy import stats as sps

from evals import stats
from evals.records import outcomes
from memory.notebook import EvalRecord, NoiseFloor, Notebook


class FloorStats(BaseModel):
    """The noise floor of one metric."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    metric: str = Field(description="Metric name.")
    k: int = Field(description="Replicates used.")
    spread: float = Field(description="Max minus min of the replicate means.")
    mean_abs_delta: float = Field(description="Mean |difference| of means over replicate pairs (bar unit).")
    max_abs_t: float = Field(description="Largest |t| between any two replicates.")


def _t_between(a: list[tuple[str, float]], b: list[tuple[str, float]]) -> float:
    """|t| between two replicates' per-item values (paired if they score the same item sequence)."""
    xa, xb = np.array([v for _, v in a]), np.array([v for _, v in b])
    if [i for i, _ in a] == [i for i, _ in b]:
        return abs(stats.paired_t(xa, xb).statistic) if len(xa) > 1 else 0.0
    t = sps.ttest_ind(xa, xb, equal_var=False).statistic
    # Two constant samples make Welch's t 0/0; equal constants carry no difference at all.
    return 0.0 if math.isnan(t) else abs(float(t))


def floor_stats(replicates: list[list[tuple[str, float]]], metric: str) -> FloorStats:
    """Noise floor of one metric from K replicates of (item id, value) lists."""
    if len(replicates) < 3:
        raise ValueError(f"noise floor of {metric}: K={len(replicates)} replicates, at least 3 needed")
    means = [float(np.mean([v for _, v in rep])) for rep in replicates]
    pairs = list(itertools.combinations(range(len(replicates)), 2))
    return FloorStats(
        metric=metric, k=len(replicates), spread=max(means) - min(means),
        mean_abs_delta=float(np.mean([abs(means[i] - means[j]) for i, j in pairs])),
        max_abs_t=max(_t_between(replicates[i], replicates[j]) for i, j in pairs),
    )


def calibrate(nb: Notebook, session: str, evals: list[EvalRecord]) -> list[NoiseFloor]:
    """Store the noise floor of every metric of one suite from K evals of one artifact."""
    if len({(e.artifact_id, e.suite, e.decoding_sha256) for e in evals}) != 1:
        raise ValueError("a noise floor needs replicates of one artifact, one suite and one decoding")
    # The same eval twice, or two jobs' replicate 0 (a greedy re-run repeats itself; a re-run with
    # the same base seed draws the same samples), would measure zero noise and shrink every bar
    # written in noise-floor units: the K replicates must be distinct replicate indices.
    ids, reps = [e.id for e in evals], [e.replicate for e in evals]
    if len(set(ids)) != len(ids) or len(set(reps)) != len(reps):
        raise ValueError(f"a noise floor needs K distinct replicates; got evals {ids} with replicate indices {reps}")
    metrics = sorted(name for name in evals[0].metrics if not name.startswith("n_"))
    floors = []
    for metric in metrics:
        reps = [[(o.item_id, o.values[metric]) for o in outcomes(e) if metric in o.values] for e in evals]
        fs = floor_stats(reps, metric)
        floors.append(nb.add_noise_floor(session=session, suite=evals[0].suite, metric=metric, k=fs.k,
                                         spread=fs.spread, mean_abs_delta=fs.mean_abs_delta,
                                         max_abs_t=fs.max_abs_t, source_evals=[e.id for e in evals]))
    nb.record_decision(session, "calibrate", f"noise floor of suite {evals[0].suite} from K={len(evals)}",
                       {"suite": evals[0].suite, "artifact_id": evals[0].artifact_id,
                        "noise_floor_ids": [f.id for f in floors]})
    return floors
