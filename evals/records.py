"""Eval results <-> notebook rows: the one place an EvalResult becomes `eval` records and back.

    verdict = judge_result(nb, session, artifact_id, result)     # Admitted | Refusal, writes nothing
    rows = record_result(nb, session, artifact_id, result)       # judges, then writes every row at once

The agent's evaluate tool calls `record_result` with the job's result; comparisons and the noise
floor read per-item values back with `EvalRecord.values(metric)`.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from evals.job import EvalResult
from evals.judgment import Refusal, close_tool_call
from evals.sealed import SealedRefused
from evals.types import Outcome
from memory.notebook import EvalRecord, Notebook, ToolCall
from memory.records import SealedRefusal
from memory.state import fold


class Admitted(BaseModel):
    """The verdict that an eval result may enter the notebook."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    artifact_id: int = Field(description="Artifact the result scores.")
    suites: list[str] = Field(description="Suites it adds rows for.")


class Recorded(BaseModel):
    """What a recorded eval result closes its tool call with."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    eval_ids: list[int] = Field(description="eval rows written, one per suite and replicate.")


def judge_result(nb: Notebook, session: str, artifact_id: int, result: EvalResult) -> Admitted | Refusal:
    """Whether `result` may be recorded for `artifact_id` (every reason if not); writes nothing.

    A sealed suite's scores enter the notebook once, for the artifact it was opened for. The job
    cannot see the notebook, so this is where invariant 1 is enforced on the way in: without a prior
    `open_sealed` for this artifact, or with the suite already scored, the result is refused.
    """
    reasons, refused = [], []
    confirmed = {c.suite for c in fold(nb, session).confirmed(artifact_id)}
    for suite in sorted({r.suite for r in result.suites if r.sealed}):
        opened = suite in confirmed
        before = len(reasons)
        if not opened:
            reasons.append(f"sealed suite {suite} was not opened for artifact {artifact_id} (open_sealed first)")
        if nb.evals(suite=suite, session=session):
            reasons.append(f"sealed suite {suite} already has scores in session {session}")
        if len(reasons) > before:
            refused.append(suite)
    if reasons:
        return Refusal(payload=SealedRefusal(suite=", ".join(refused), artifact_id=artifact_id, sealed=True,
                                             reasons=reasons))
    return Admitted(artifact_id=artifact_id, suites=sorted({r.suite for r in result.suites}))


def record_result(nb: Notebook, session: str, artifact_id: int, result: EvalResult,
                  job_key: str | None = None, *, tool_call: ToolCall | None = None) -> list[EvalRecord]:
    """One eval row per suite and replicate, with the decoding used and every per-item outcome, all
    in one transaction with `tool_call`; a refused result writes one refuse decision and raises
    SealedRefused."""
    with nb.transaction():
        judgment = judge_result(nb, session, artifact_id, result)
        if isinstance(judgment, Refusal):
            decision = nb.record_decision(session, "refuse", "; ".join(judgment.reasons), judgment.payload)
            close_tool_call(nb, tool_call, decision, "refused", judgment)
            rows = []
        else:
            rows = _write_rows(nb, session, artifact_id, result, job_key)
            close_tool_call(nb, tool_call, None, "done", Recorded(eval_ids=[r.id for r in rows]))
    if isinstance(judgment, Refusal):  # raised after the commit: the refusal stays recorded
        raise SealedRefused("; ".join(judgment.reasons))
    return rows


def _write_rows(nb: Notebook, session: str, artifact_id: int, result: EvalResult,
                job_key: str | None) -> list[EvalRecord]:
    decoding = result.decoding.model_dump(mode="json")
    return [
        nb.add_eval(session=session, artifact_id=artifact_id, suite=r.suite, replicate=r.replicate,
                    decoding=decoding, decoding_sha256=result.decoding_sha256, served=result.served,
                    metrics=r.metrics, items=[o.model_dump(mode="json") for o in r.outcomes], job_key=job_key)
        for r in result.suites
    ]


def outcomes(ev: EvalRecord) -> list[Outcome]:
    return [Outcome.model_validate(o) for o in ev.items]


def served_draws(nb: Notebook, session: str, artifact_id: int, suite: str,
                 decoding_sha256: str) -> dict[int, EvalRecord]:
    """replicate k -> the artifact's FIRST served eval of `suite` at that decoding with replicate index k (the look
    that counts for that draw; a later re-run of the same index is never read)."""
    out: dict[int, EvalRecord] = {}
    for e in nb.evals(artifact_id=artifact_id, suite=suite, session=session):
        if e.served and e.decoding_sha256 == decoding_sha256:
            out.setdefault(e.replicate, e)
    return out


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
