"""Tool `skip`: the planner records a planned step it does not take, and why.

A step whose data the lab does not have (an RFT arm in a lab with no verified pool) is skipped, never filled
from anywhere else (the toy world's generated tasks least of all), and a candidate whose evaluation failed is
not judged; either way the session says so. Skipping writes nothing but the tool call, linked to its `plan`
decision (which carries the reason); the status line, the report and the card count them
(memory/skips.py).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from memory.skips import SKIP_TOOL
from tools.context import ToolContext, ToolOutcome, invoke

NAME = SKIP_TOOL


class Args(BaseModel):
    """Skip a planned step, saying why (the lab lacks its data, or a step it needs failed)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    step: str = Field(min_length=1, max_length=200, description="The planned step not taken (e.g. 'rft arm').")
    reason: str = Field(min_length=1, max_length=500, description="Why it is skipped.")


def _body(ctx: ToolContext, args: Args) -> ToolOutcome:
    return ToolOutcome(tool=NAME, status="done", summary=f"skipped {args.step}: {args.reason}",
                       data={"step": args.step, "reason": args.reason})


def run(ctx: ToolContext, args: Args, decision_seq: int | None = None) -> ToolOutcome:
    return invoke(ctx, NAME, args, _body, decision_seq)
