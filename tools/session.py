"""The tools' door to the session state (memory/state.py), and the planner's rendering of it.

    v = view(nb, "s1")                          # the session state, folded from the session's decisions
    v.ledger.admission(forecast_gpuh=0.4)       # may this job be admitted? (and why not)
    v.ledger.time_limit_min(240, minute_gpuh=0.13)   # under which time limit
    v.promotion(candidate=7)                    # may it be made the incumbent? if not, every reason
    v.p_family.left                             # how many p-values are left
    v.must_stop(max_failed_arms=3)              # must the research loop stop? (the reason, or None)

The rules live on the state's types (`Ledger`, `SessionState.promotion`, `PFamily`); this module only names the
questions tools ask (launcher admission, the tools' time limits, the incumbent a tool acts on) and renders the
state for a person or the LLM planner: text is rendered from the typed bars and verdicts and never parsed back.
"""

from __future__ import annotations

from typing import Any

from memory.notebook import Notebook, NotebookError, tool_call_key
from memory.records import Ledger
from memory.state import RegisteredBars, SessionState, Verdict, fold, parent_of

__all__ = ["incumbent_of", "ledger", "own_reservation", "parent_of", "registered_bars", "render", "verdicts_of",
           "view"]


def view(nb: Notebook, session: str) -> SessionState:
    """The session state (memory/state.py fold)."""
    return fold(nb, session)


def ledger(nb: Notebook, session: str) -> Ledger:
    """The session's GPU-hour ledger (the budget arithmetic's one home: memory/records.py Ledger)."""
    return nb.ledger(session)


def incumbent_of(nb: Notebook, session: str) -> int | None:
    """The session's incumbent: the latest candidate made incumbent, else its parent."""
    return fold(nb, session).incumbent


def registered_bars(nb: Notebook, session: str) -> RegisteredBars | None:
    """The bars in force."""
    return fold(nb, session).bars


def verdicts_of(nb: Notebook, session: str) -> list[Verdict]:
    """Every comparison's verdict, oldest first."""
    return fold(nb, session).verdicts


def own_reservation(nb: Notebook, session: str, tool: str, args: dict[str, Any]) -> float:
    """GPU-hours still reserved by the jobs of an interrupted call of `tool` with these (canonical) arguments: the
    unsettled jobs launched since the call opened (a session runs one tool at a time). A resumed step is gated
    again, on the ledger without them: its own reservation is not counted against it a second time."""
    try:
        call = nb.tool_call(session, tool_call_key(tool, args))
    except NotebookError:
        return 0.0
    if call.status != "open":
        return 0.0
    return sum(j.forecast_gpuh for j in nb.jobs(session=session)
               if j.gpu_hours is None and j.submitted_at >= call.started_at)


def render(v: SessionState) -> dict[str, Any]:
    """The state as plain JSON for a person or the LLM planner: the bars, their noise floors (in the unit each bar's
    threshold uses) and the verdicts as readable lines."""
    out = v.model_dump(mode="json", include={"session", "ledger", "parent", "p_family", "failed_arms_in_row"})
    out["incumbent"], out["chain"] = v.incumbent, v.chain
    out["ledger"]["left_above_reserve_gpuh"] = round(v.ledger.left_above_reserve_gpuh, 6)
    if v.bars is not None:
        out["bars"] = {"id": v.bars.id, "p_family": v.bars.p_family, "replicates": v.bars.replicates,
                       "floor_unit": v.bars.floor_unit, "rules": [f"{r.target} {r.text()}" for r in v.bars.rules],
                       "noise_floors": {f.rule.target: round(f.unit, 6) for f in v.bar_floors()}}
    out["p_family"]["left"] = v.p_family.left
    return out
