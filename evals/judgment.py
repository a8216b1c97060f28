"""What every judgment returns when it says no, and how a judgment's outcome closes its tool call.

The judgments (evals/compare.py `judge`, evals/sealed.py `judge_open`, evals/noise.py
`judge_calibration`, evals/records.py `judge_result`) read notebook records and write nothing: the
agent's gates ask them "would this be refused?" and replay re-derives a verdict with them. Each
module's `record_*` function is the one place its outcome is written, inside one
`nb.transaction()` together with the tool call that asked for it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from memory.notebook import Decision, Notebook, ToolCall
from memory.records import CalibrationRefusal, CompareRefusal, SealedRefusal


class Refusal(BaseModel):
    """A judgment that refuses, with every reason found; recording it writes one `refuse` decision."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    payload: CompareRefusal | SealedRefusal | CalibrationRefusal = Field(
        description="The refuse decision's payload in its gate's shape; its `reasons` lists every reason.")

    @property
    def reasons(self) -> list[str]:
        return self.payload.reasons


def close_tool_call(nb: Notebook, tool_call: ToolCall | None, decision: Decision | None,
                    status: Literal["done", "refused"], result: BaseModel) -> None:
    """Finish the tool call that asked for a judgment (if any) with its outcome; call inside the
    transaction that records the outcome, so the call and the outcome land together."""
    if tool_call is not None:
        nb.finish_tool_call(tool_call.id, status, result.model_dump(mode="json"),
                            decision_seq=None if decision is None else decision.seq)
