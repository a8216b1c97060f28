"""Sealed confirmation suites: scored once per session, for the nominee only.

    verdict = judge_open(nb, session, suite, artifact_id)          # SealedOpen | Refusal, writes nothing
    decision = open_sealed(nb, session, suite, artifact_id)        # records it; raises SealedRefused

Before a sealed suite's eval job is launched, the notebook must show that the artifact is the
session's nominee (the latest `nominate` decision names it) and that the suite was not opened in
this session before. The opening is recorded as a `confirm` decision before the job runs, so a
crash cannot buy a second look; a refused attempt is recorded as a `refuse` decision listing every
reason, and `open_sealed` raises `SealedRefused`.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from evals.judgment import Refusal, close_tool_call
from memory.notebook import Decision, Notebook, ToolCall
from memory.records import ConfirmPayload, SealedRefusal
from memory.state import fold


class SealedRefused(Exception):
    """A sealed suite may not be scored now; the refusal is already in the notebook."""


class SealedOpen(BaseModel):
    """The verdict that a sealed suite may be opened, once, for this artifact."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    suite: str = Field(description="Sealed suite to open.")
    artifact_id: int = Field(description="The nominee it opens for.")


def nominee(nb: Notebook, session: str) -> int | None:
    """The artifact id named by the session's latest nominate decision, if any."""
    return fold(nb, session).nominee


def judge_open(nb: Notebook, session: str, suite: str, artifact_id: int) -> SealedOpen | Refusal:
    """Whether `suite` may be opened for `artifact_id` now (every reason if not); writes nothing."""
    reasons, state = [], fold(nb, session)
    opened = [c for c in state.confirmations if c.suite == suite]
    if opened:
        reasons.append(f"sealed suite {suite} was already opened in session {session} (decision {opened[0].seq})")
    if state.nominee != artifact_id:
        reasons.append(f"sealed suite {suite} is scored for the nominee only; artifact {artifact_id} is not the nominee")
    if reasons:
        return Refusal(payload=SealedRefusal(suite=suite, artifact_id=artifact_id, sealed=True, reasons=reasons))
    return SealedOpen(suite=suite, artifact_id=artifact_id)


def record_open(nb: Notebook, session: str, judgment: SealedOpen | Refusal, *,
                tool_call: ToolCall | None = None) -> Decision:
    """Write the `confirm` (or `refuse`) decision and close `tool_call` with it, in one transaction."""
    with nb.transaction():
        if isinstance(judgment, Refusal):
            decision = nb.record_decision(session, "refuse", "; ".join(judgment.reasons), judgment.payload)
        else:
            decision = nb.record_decision(session, "confirm", f"sealed suite {judgment.suite} opened for the nominee",
                                          ConfirmPayload(suite=judgment.suite, artifact_id=judgment.artifact_id))
        close_tool_call(nb, tool_call, decision, "refused" if isinstance(judgment, Refusal) else "done", judgment)
    return decision


def open_sealed(nb: Notebook, session: str, suite: str, artifact_id: int, *,
                tool_call: ToolCall | None = None) -> Decision:
    """Record the one permitted scoring of `suite` for the nominee, or record and raise a refusal."""
    with nb.transaction():
        judgment = judge_open(nb, session, suite, artifact_id)
        decision = record_open(nb, session, judgment, tool_call=tool_call)
    if isinstance(judgment, Refusal):  # raised after the commit: the refusal stays recorded
        raise SealedRefused("; ".join(judgment.reasons))
    return decision
