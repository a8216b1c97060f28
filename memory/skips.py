"""The planned steps a session skipped: one reader for the status line, the report and the model card.

A policy step whose data the lab lacks (no verified pool for an RFT arm), or that cannot go on because a step it
needs failed (a candidate whose evaluation failed is never judged), is not dropped in silence: the planner takes a
`skip` step (tools/skip.py) naming the step and why, recorded as its `plan` decision and a finished tool call.
This module reads them back; it is here, below the tools, so that the report can read them too.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from memory.notebook import Notebook

SKIP_TOOL = "skip"


class SkippedStep(BaseModel):
    """One planned step the session did not take."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    step: str = Field(description="The step, as the planner named it (e.g. 'rft arm').")
    reason: str = Field(description="Why it was skipped.")
    decision_seq: int | None = Field(description="The plan decision that recorded the skip.")


def skipped_steps(nb: Notebook, session: str) -> list[SkippedStep]:
    """Every step the session skipped, oldest first."""
    return [SkippedStep(step=c.args.get("step", ""), reason=c.args.get("reason", ""), decision_seq=c.decision_seq)
            for c in nb.tool_calls(session) if c.tool == SKIP_TOOL and c.status == "done"]
