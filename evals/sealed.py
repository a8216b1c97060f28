"""Sealed confirmation suites: scored once per session, for the nominee only.

Before a sealed suite's eval job is launched, `open_sealed` checks the notebook: the artifact must
be the session's nominee (the latest `nominate` decision names it in `payload["artifact_id"]`) and
the suite must not have been opened in this session before. The attempt is recorded as a
`confirm` decision before the job runs, so a crash cannot buy a second look; a refused attempt is
recorded as a `refuse` decision and raises `SealedRefused`.
"""

from __future__ import annotations

from memory.notebook import Decision, Notebook


class SealedRefused(Exception):
    """A sealed suite may not be scored now; the refusal is already in the notebook."""


def nominee(nb: Notebook, session: str) -> int | None:
    """The artifact id named by the session's latest nominate decision, if any."""
    nominations = nb.decisions(session, kind="nominate")
    return nominations[-1].payload.get("artifact_id") if nominations else None


def open_sealed(nb: Notebook, session: str, suite: str, artifact_id: int) -> Decision:
    """Record the one permitted scoring of `suite` for the nominee, or record and raise a refusal."""
    reason = None
    opened = [d for d in nb.decisions(session, kind="confirm") if d.payload.get("suite") == suite]
    if opened:
        reason = f"sealed suite {suite} was already opened in session {session} (decision {opened[0].seq})"
    elif nominee(nb, session) != artifact_id:
        reason = f"sealed suite {suite} is scored for the nominee only; artifact {artifact_id} is not the nominee"
    if reason is not None:
        nb.record_decision(session, "refuse", reason, {"suite": suite, "artifact_id": artifact_id, "sealed": True})
        raise SealedRefused(reason)
    return nb.record_decision(session, "confirm", f"sealed suite {suite} opened for the nominee",
                              {"suite": suite, "artifact_id": artifact_id})
