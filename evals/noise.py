"""Noise floor: how much a suite's metrics move when nothing but evaluation noise changes.

The incumbent is evaluated K >= 3 times per suite (sampling seeds, or item resamples under greedy
decoding; see evals/job.py). Per metric the floor stores the spread of the K suite means (max - min),
the mean absolute delta between replicate pairs (the unit of noise-floor bars, `noise_floor`), and
the largest |t| between replicate pairs: a paired t on the per-item values when the replicates score
the same items, Welch's unequal-variance t (Welch 1947, Biometrika 34:28-35) for item resamples.

    verdict = judge_calibration(evals)                     # Calibration | Refusal, pure over the records
    floors = record_calibration(nb, session, verdict)      # the one writer (floors + calibrate decision)
    floors = calibrate(nb, session, evals)                 # both; raises ValueError on a refusal
"""

from __future__ import annotations

import itertools
import math

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from evals import stats
from evals.judgment import Refusal, close_tool_call
from evals.records import outcomes
from memory.notebook import EvalRecord, NoiseFloor, Notebook, ToolCall
from memory.records import CalibratePayload, CalibrationRefusal


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
    from scipy import stats as sps

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


class Calibration(BaseModel):
    """The verdict that K evals measure noise: the floor of every numeric metric of their suite."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    suite: str = Field(description="Suite calibrated.")
    artifact_id: int = Field(description="Artifact evaluated K times.")
    source_evals: list[int] = Field(description="Eval ids of the K replicates.")
    floors: list[FloorStats] = Field(description="One floor per numeric metric, by metric name.")


def _numeric_metrics(ev: EvalRecord) -> list[str]:
    # Counts (n_*) are sizes, not scores; a scoring mode (a label, or a scoring_mode_* flag) does not vary.
    return sorted(name for name, value in ev.metrics.items()
                  if not name.startswith(("n_", "scoring_mode")) and isinstance(value, int | float)
                  and not isinstance(value, bool))


def judge_calibration(evals: list[EvalRecord]) -> Calibration | Refusal:
    """Whether `evals` are K >= 3 distinct replicates of one artifact, suite and decoding, and their
    floors if so; every reason if not. Pure: reads only the records given."""
    ids, reps = [e.id for e in evals], [e.replicate for e in evals]
    reasons = []
    if len({(e.artifact_id, e.suite, e.decoding_sha256) for e in evals}) > 1:
        reasons.append("a noise floor needs replicates of one artifact, one suite and one decoding")
    # The same eval twice, or two jobs' replicate 0 (a greedy re-run repeats itself; a re-run with
    # the same base seed draws the same samples), would measure zero noise and shrink every bar
    # written in noise-floor units: the K replicates must be distinct replicate indices.
    if len(set(ids)) != len(ids) or len(set(reps)) != len(reps):
        reasons.append(f"a noise floor needs K distinct replicates; got evals {ids} with replicate indices {reps}")
    if len(set(ids)) < 3:
        reasons.append(f"a noise floor needs K >= 3 replicates; got {len(set(ids))}")
    suites = {e.suite for e in evals}
    if reasons:
        return Refusal(payload=CalibrationRefusal(suite=suites.pop() if len(suites) == 1 else None, eval_ids=ids,
                                                  reasons=reasons))
    floors = []
    for metric in _numeric_metrics(evals[0]):
        values = [[(o.item_id, o.values[metric]) for o in outcomes(e) if metric in o.values] for e in evals]
        floors.append(floor_stats(values, metric))
    return Calibration(suite=evals[0].suite, artifact_id=evals[0].artifact_id, source_evals=ids, floors=floors)


def record_calibration(nb: Notebook, session: str, judgment: Calibration | Refusal, *,
                       tool_call: ToolCall | None = None) -> list[NoiseFloor]:
    """Write the K floors and their calibrate decision (or one refuse decision) and close `tool_call`,
    all in one transaction; returns the floors written (none for a refusal)."""
    with nb.transaction():
        if isinstance(judgment, Refusal):
            decision = nb.record_decision(session, "refuse", "calibration refused: " + "; ".join(judgment.reasons),
                                          judgment.payload)
            close_tool_call(nb, tool_call, decision, "refused", judgment)
            return []
        floors = [nb.add_noise_floor(session=session, suite=judgment.suite, metric=f.metric, k=f.k, spread=f.spread,
                                     mean_abs_delta=f.mean_abs_delta, max_abs_t=f.max_abs_t,
                                     source_evals=judgment.source_evals) for f in judgment.floors]
        decision = nb.record_decision(
            session, "calibrate", f"noise floor of suite {judgment.suite} from K={len(judgment.source_evals)}",
            CalibratePayload(suite=judgment.suite, artifact_id=judgment.artifact_id,
                             noise_floor_ids=[f.id for f in floors]))
        close_tool_call(nb, tool_call, decision, "done", judgment)
        return floors


def calibrate(nb: Notebook, session: str, evals: list[EvalRecord], *,
              tool_call: ToolCall | None = None) -> list[NoiseFloor]:
    """Judge and record the noise floor of every metric of one suite from K evals of one artifact;
    a refusal is recorded, then raised as ValueError."""
    judgment = judge_calibration(evals)
    floors = record_calibration(nb, session, judgment, tool_call=tool_call)
    if isinstance(judgment, Refusal):
        raise ValueError("; ".join(judgment.reasons))
    return floors
