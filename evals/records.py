"""Eval results <-> notebook rows: the one place an EvalResult becomes `eval` records and back.

The agent's evaluate tool calls `record_result` with the job's result; comparisons and the noise
floor read per-item values back with `item_values`.
"""

from __future__ import annotations

from evals.job import EvalResult
from evals.sealed import SealedRefused
from evals.types import Outcome
from memory.notebook import EvalRecord, Notebook


def _check_sealed(nb: Notebook, session: str, artifact_id: int, result: EvalResult) -> None:
    """A sealed suite's scores enter the notebook once, for the artifact it was opened for.

    The job cannot see the notebook, so this is where invariant 1 is enforced on the way in:
    without a prior `open_sealed` for this artifact, or with the suite already scored, the result
    is refused (and the refusal recorded) before anything is written.
    """
    for suite in sorted({r.suite for r in result.suites if r.sealed}):
        opened = [d for d in nb.decisions(session, kind="confirm")
                  if d.payload.get("suite") == suite and d.payload.get("artifact_id") == artifact_id]
        reason = None
        if not opened:
            reason = f"sealed suite {suite} was not opened for artifact {artifact_id} (open_sealed first)"
        elif nb.evals(suite=suite, session=session):
            reason = f"sealed suite {suite} already has scores in session {session}"
        if reason is not None:
            nb.record_decision(session, "refuse", reason, {"suite": suite, "artifact_id": artifact_id, "sealed": True})
            raise SealedRefused(reason)


def record_result(nb: Notebook, session: str, artifact_id: int, result: EvalResult,
                  job_key: str | None = None) -> list[EvalRecord]:
    """One eval row per suite and replicate, with the decoding used and every per-item outcome."""
    _check_sealed(nb, session, artifact_id, result)
    decoding = result.decoding.model_dump(mode="json")
    return [
        nb.add_eval(session=session, artifact_id=artifact_id, suite=r.suite, replicate=r.replicate,
                    decoding=decoding, decoding_sha256=result.decoding_sha256, served=result.served,
                    metrics=r.metrics, items=[o.model_dump(mode="json") for o in r.outcomes], job_key=job_key)
        for r in result.suites
    ]


def outcomes(ev: EvalRecord) -> list[Outcome]:
    return [Outcome.model_validate(o) for o in ev.items]


def item_values(ev: EvalRecord, metric: str) -> dict[str, float]:
    """item id -> value of `metric` for the items that have it (resampled duplicates collapse)."""
    return {o.item_id: o.values[metric] for o in outcomes(ev) if metric in o.values}


def started_at(nb: Notebook, ev: EvalRecord) -> str:
    """When the eval began: its job's submission time when known, else when it was recorded.

    Bars must predate the start of an eval, not only its recording: bars registered while a job
    was generating would otherwise pass as registered before it.
    """
    if ev.job_key is not None:
        job = nb.get_job(ev.job_key, 1)
        if job is not None:
            return job.submitted_at
    return ev.created_at
