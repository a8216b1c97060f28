"""Planners: who proposes the next step. A planner is a small protocol: `propose(summary, feedback)`
returns a `ToolCall`, or a `BadReply` (the LLM planner's reply could not be used; why is fed back).

- `playbook.Playbook`: the default, a deterministic research protocol distilled from the seeds.
- `llm.LLMPlanner`: any OpenAI-compatible endpoint through Chat Completions tool calling.
"""

from __future__ import annotations

from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field

from agent.summary import Summary


class ToolCall(BaseModel):
    """One proposed action: a tool, its JSON arguments and the planner's one-line reason."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    tool: str = Field(description="Tool name (agent/toolbox.py).")
    args: dict[str, Any] = Field(description="Arguments as JSON (validated against the tool's Args model).")
    rationale: str = Field(description="Why this step, citing the numbers it rests on.")


class BadReply(BaseModel):
    """A planner reply that cannot be acted on (bad JSON, unknown tool, invalid arguments)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    reason: str = Field(description="What was wrong, as fed back to the planner.")
    raw: str = Field(description="The reply's tool call as received (name and arguments text), truncated.")


class Planner(Protocol):
    name: str

    def propose(self, summary: Summary, feedback: list[str]) -> ToolCall | BadReply: ...
