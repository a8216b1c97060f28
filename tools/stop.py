"""Tool `stop`: the planner ends the research loop; the session goes on to its nomination.

Stopping writes nothing but the tool call: the graph routes to `nominate`, and the session's end
(`stop` decision with its status) is recorded when the nomination is done.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from tools.context import ToolContext, ToolOutcome, invoke

NAME = "stop"


class Args(BaseModel):
    """Stop researching and nominate the incumbent."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    reason: str = Field(description="Why the loop ends (budget, failed arms, protocol done).")


def _body(ctx: ToolContext, args: Args) -> ToolOutcome:
    return ToolOutcome(tool=NAME, status="done", summary=f"research loop stopped: {args.reason}")


def run(ctx: ToolContext, args: Args, decision_seq: int | None = None) -> ToolOutcome:
    return invoke(ctx, NAME, args, _body, decision_seq)
