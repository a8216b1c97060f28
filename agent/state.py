"""The research loop's graph state: plain JSON and ids only, never live objects.

Every field is documented with its merge rule (how a node's partial update combines with the
state). LangGraph checkpoints this state in its own SQLite file after every node; the notebook
remains the single source of truth: the summary is re-read from it at every observe, a proposal is
also a `plan` decision, an outcome is also the tool call's stored result. A checkpoint therefore
never holds a fact the notebook lacks, and a session whose checkpoint file is gone is rebuilt from
the notebook by starting the graph again (`initial_state`).
"""

from __future__ import annotations

import operator
from typing import Annotated, Any, TypedDict


class AgentState(TypedDict, total=False):
    session: str
    """Session name; also the checkpointer's thread id. Merge: replace (set once, at start)."""

    summary: dict[str, Any]
    """The notebook summary (agent.summary.Summary as JSON) read by the latest observe. Merge: replace."""

    proposal: dict[str, Any] | None
    """The planned call: tool, canonical args, rationale, planner, plan_seq (its `plan` decision);
    None after a bad planner reply. Merge: replace."""

    refusal: str | None
    """Why the gates refused the proposal, or None when it passed. Merge: replace."""

    outcome: dict[str, Any] | None
    """The acted call's ToolOutcome as JSON (also stored in the notebook's tool_call row). Merge: replace."""

    feedback: list[str]
    """Reasons fed back to the planner since its last usable call (bad replies, gate refusals).
    Merge: replace (reset to [] after a step is acted on)."""

    bad_replies: int
    """Consecutive unusable planner replies, gate refusals included; at 3 the playbook's next step is
    taken instead. Merge: replace."""

    refusals_in_row: int
    """Consecutive gate refusals (any planner); at 3 the loop stops and nominates. Merge: replace."""

    stop_reason: str | None
    """Set when the loop must end (planner stop, budget spent, N failed arms). Merge: replace."""

    acted: Annotated[list[int], operator.add]
    """Tool call ids acted on, in order. Merge: append (operator.add)."""

    finished: bool
    """True once the nomination step ended the session. Merge: replace."""


def initial_state(session: str) -> AgentState:
    """A fresh state: everything else is read from the notebook at the first observe."""
    return AgentState(session=session, summary={}, proposal=None, refusal=None, outcome=None, feedback=[],
                      bad_replies=0, refusals_in_row=0, stop_reason=None, acted=[], finished=False)
