"""The research loop as a LangGraph graph; all wiring is in this file.

    observe -> plan -> gate -> act -> record -> observe ...        (loop)
                 \\        \\             \\
                  observe   observe      nominate -> END          (bad reply / refused / stop)

- observe: read the notebook summary (the planner's only view of the world);
- plan: the planner proposes a tool call, recorded as a `plan` decision; an unusable LLM reply is
  recorded as a `refuse` and fed back; after 3 in a row the playbook's next step is taken;
- gate: the pure gates (agent/gates.py) with the job's forecast; a refusal is a recorded `refuse`;
- act: the tool runs (it records its tool call, job and decision in the notebook);
- record: decide whether the loop ends: the planner stopped, the budget above the reserve is spent,
  or N arms in a row failed their bars;
- nominate: nominate the first candidate (incumbent, earlier incumbents, parent) whose bundle passes
  check-bundle (each refused one is a recorded `refuse`), open the sealed confirmation once, for
  that nominee, measure its ground truth when the lab declares a scorer ([truth]), publish its bundle
  with the sealed result (and the ground truth) in the card, end the session.

State (agent/state.py) holds JSON and ids; it is checkpointed after every node with LangGraph's
SQLite checkpointer in its own file (`lab/graph.sqlite`), thread id = session name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from langgraph.graph import END, START, StateGraph
from pydantic import ValidationError

from agent import gates, toolbox
from agent.errors import SessionError
from agent.live import Reporter
from agent.planners import BadReply, Planner, ToolCall
from agent.planners.playbook import Playbook
from agent.state import AgentState, initial_state
from agent.summary import Summary, summarize
from core.display import shown
from memory.notebook import Notebook, tool_call_key
from memory.state import fold
from tools.context import ToolContext, ToolOutcome
from tools.jobs.launcher import Launcher
from tools.session import own_reservation
from tools.train import lab_recipe

MAX_BAD_REPLIES = 3
MAX_REFUSALS_IN_ROW = 3


@dataclass
class Runtime:
    """The live objects the nodes close over (never part of the checkpointed state)."""

    ctx: ToolContext
    planner: Planner
    playbook: Playbook
    forecaster: Launcher
    reporter: Reporter
    max_failed_arms: int = 3
    log: list[str] = field(default_factory=list)


# ---- nodes ---------------------------------------------------------------------------------------


def observe(rt: Runtime, state: AgentState) -> dict[str, Any]:
    summary = summarize(rt.ctx.nb, rt.ctx.session)
    rt.reporter.observe(summary)
    return {"summary": summary.model_dump(mode="json")}


def _usable(rt: Runtime, s: Summary, reply: ToolCall | BadReply) -> ToolCall | BadReply:
    """A proposal in canonical form, or why it cannot be acted on."""
    if isinstance(reply, BadReply):
        return reply
    if reply.tool not in toolbox.PLANNER_TOOLS:
        return BadReply(reason=f"unknown tool {reply.tool!r}; the tools are {', '.join(toolbox.PLANNER_TOOLS)}",
                        raw=reply.tool[:200])
    try:
        args = toolbox.canonical_args(reply.tool, reply.args)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'args'}: {e['msg']}" for e in exc.errors())
        return BadReply(reason=f"arguments of {reply.tool} are invalid: {problems}", raw=str(reply.args)[:200])
    done = s.call(reply.tool, args)
    if done is not None and done.status != "open" and reply.tool != "stop":
        return BadReply(reason=f"{reply.tool} with these arguments already ran: {done.status}: {done.summary}",
                        raw=str(args)[:200])
    return reply.model_copy(update={"args": args})


def _record_plan(rt: Runtime, call: ToolCall, planner: str) -> int:
    """The plan decision of this call. A step interrupted before its tool finished is planned again
    after a resume (from the checkpoint, or from the notebook alone): it reuses its plan decision."""
    nb, session = rt.ctx.nb, rt.ctx.session
    payload = {"tool": call.tool, "args": call.args, "planner": planner}
    plans = nb.decisions(session, kind="plan")
    if plans and plans[-1].payload.model_dump(mode="json") == payload:
        calls = [c for c in nb.tool_calls(session) if c.tool == call.tool and c.args == call.args]
        if not calls or calls[0].status == "open":
            return plans[-1].seq
    return nb.record_decision(session, "plan", call.rationale, payload).seq


def _fallback(rt: Runtime, s: Summary, planner: str, bad: int) -> ToolCall:
    step = rt.playbook.propose(s, [])
    return step.model_copy(update={
        "args": toolbox.canonical_args(step.tool, step.args),
        "rationale": f"{planner} planner: {bad} bad replies in a row; taking the playbook's next step: {step.rationale}"})


def plan(rt: Runtime, state: AgentState) -> dict[str, Any]:
    s = Summary.model_validate(state["summary"])
    planner, bad = rt.planner.name, state.get("bad_replies", 0)
    if bad >= MAX_BAD_REPLIES:
        reply, planner, bad = _fallback(rt, s, planner, bad), "playbook", 0
    else:
        reply = _usable(rt, s, rt.planner.propose(s, state.get("feedback", [])))
    if isinstance(reply, BadReply) and planner == "playbook":  # a protocol that repeats itself has ended
        reply = ToolCall(tool="stop", args={"reason": f"playbook stalled: {reply.reason}"}, rationale=reply.reason)
    if isinstance(reply, BadReply):
        bad += 1
        rt.ctx.nb.record_decision(rt.ctx.session, "refuse", f"planner reply refused: {reply.reason}",
                                  {"planner": planner, "reason": reply.reason, "raw": reply.raw, "in_row": bad})
        rt.reporter.event(f"planner reply refused ({bad} in a row): {reply.reason}")
        if bad < MAX_BAD_REPLIES:
            return {"proposal": None, "bad_replies": bad, "feedback": [*state.get("feedback", []), reply.reason]}
        reply, planner, bad = _fallback(rt, s, planner, bad), "playbook", 0
    seq = _record_plan(rt, reply, planner)
    rt.reporter.event(f"plan: {reply.tool} {reply.args} ({reply.rationale})")
    proposal = {"tool": reply.tool, "args": reply.args, "rationale": reply.rationale, "planner": planner, "plan_seq": seq}
    return {"proposal": proposal, "bad_replies": bad}


def gate(rt: Runtime, state: AgentState) -> dict[str, Any]:
    p = state["proposal"]
    # A step interrupted mid-job (a resumed session) is gated again on the ledger without its own jobs' reservation,
    # which would otherwise count against it twice: in the ledger and in its forecast's time limit, sized on what is
    # left (the first run's forecast, not the whole time limit's).
    own = own_reservation(rt.ctx.nb, rt.ctx.session, p["tool"], p["args"])
    s = Summary.model_validate(state["summary"])
    if own:
        s = s.model_copy(update={"view": s.view.model_copy(update={"ledger": s.view.ledger.without(own)})})
    args = toolbox.args_model(p["tool"]).model_validate(p["args"])
    forecast = toolbox.forecast_gpuh(rt.ctx, rt.forecaster, p["tool"], args, own)
    reason = gates.check(p["tool"], p["args"], s, forecast, rt.ctx.paths.root, lab_recipe(rt.ctx))
    if reason is None:
        return {"refusal": None}
    rt.ctx.nb.record_decision(rt.ctx.session, "refuse", f"gate: {reason}",
                              {"tool": p["tool"], "args": p["args"], "reason": reason, "plan_seq": p["plan_seq"],
                               "forecast_gpuh": forecast})
    rt.reporter.event(f"refused: {reason}")
    bad = state.get("bad_replies", 0) + (1 if p["planner"] != "playbook" else 0)
    return {"refusal": reason, "bad_replies": bad, "refusals_in_row": state.get("refusals_in_row", 0) + 1,
            "feedback": [*state.get("feedback", []), f"refused by the gates: {reason}"]}


def act(rt: Runtime, state: AgentState) -> dict[str, Any]:
    p = state["proposal"]
    args = toolbox.args_model(p["tool"]).model_validate(p["args"])
    rt.reporter.event(f"act: {p['tool']}")
    outcome = toolbox.run(rt.ctx, p["tool"], args, p["plan_seq"])
    rt.reporter.event(f"{outcome.status}: {outcome.summary}")
    call = rt.ctx.nb.tool_call(rt.ctx.session, tool_call_key(p["tool"], p["args"]))
    return {"outcome": outcome.model_dump(mode="json"), "acted": [call.id]}


def record(rt: Runtime, state: AgentState) -> dict[str, Any]:
    """The step is in the notebook already; decide whether the loop goes on."""
    p, s = state["proposal"], summarize(rt.ctx.nb, rt.ctx.session)
    reason = p["args"]["reason"] if p["tool"] == "stop" else s.view.must_stop(rt.max_failed_arms)
    return {"stop_reason": reason, "feedback": [], "refusals_in_row": 0,
            "bad_replies": 0 if p["planner"] == "playbook" else state.get("bad_replies", 0)}


def _gated_run(rt: Runtime, tool: str, args: dict[str, Any]) -> ToolOutcome | None:
    """A nomination-step tool through the same gates; None when refused (recorded). A call already in
    the notebook was gated when it was made: a resumed step re-enters it (its tool resumes or returns
    the recorded outcome) instead of being refused, e.g. a sealed suite opened before a crash."""
    s = summarize(rt.ctx.nb, rt.ctx.session)
    model = toolbox.args_model(tool).model_validate(args)
    if s.call(tool, model.model_dump(mode="json")) is None:
        forecast = toolbox.forecast_gpuh(rt.ctx, rt.forecaster, tool, model)
        reason = gates.check(tool, model.model_dump(mode="json"), s, forecast, rt.ctx.paths.root)
        if reason is not None:
            rt.ctx.nb.record_decision(rt.ctx.session, "refuse", f"gate: {reason}",
                                      {"tool": tool, "args": model.model_dump(mode="json"), "reason": reason})
            return None
    outcome = toolbox.run(rt.ctx, tool, model, None)
    rt.reporter.event(f"{tool}: {outcome.status}: {outcome.summary}")
    return outcome


def _nominees(s: Summary) -> list[int]:
    """Who to nominate, in order: the incumbent, earlier incumbents (latest first), then the parent."""
    cleared = [c.id for c in reversed(s.checkpoints) if any(v.cleared for v in c.verdicts)]
    order = [s.incumbent, *cleared, s.parent]
    return [i for n, i in enumerate(order) if i is not None and i not in order[:n]]


def _runner_up(s: Summary, nominee: int) -> int | None:
    """The best candidate not nominated: the next in the nomination order (an earlier incumbent, or
    one whose bundle was refused), else the compared candidate whose latest comparison held the most
    bars (the latest on a tie); never the parent, which has its own column."""
    others = [i for i in _nominees(s) if i not in (nominee, s.parent)]
    if others:
        return others[0]
    compared = [c for c in reversed(s.checkpoints) if c.verdicts and c.id not in (nominee, s.parent)]
    if not compared:
        return None
    return max(compared, key=lambda c: c.verdicts[-1].held).id


def _end(rt: Runtime, status: Literal["done", "failed"], why: str) -> dict[str, Any]:
    rt.ctx.nb.end_session(rt.ctx.session, status, why)
    rt.reporter.event(f"session {rt.ctx.session} {status}: {why}")
    return {"finished": True}


def nominate(rt: Runtime, state: AgentState) -> dict[str, Any]:
    """Nominate the first candidate whose bundle passes its checks; open the sealed confirmation once,
    for it; publish its bundle with the sealed result in the card."""
    nb, session = rt.ctx.nb, rt.ctx.session
    if nb.session(session).status != "open":
        return {"finished": True}
    s = summarize(nb, session)
    nominee = None
    for candidate in _nominees(s):
        outcome = _gated_run(rt, "nominate", {"artifact": candidate, "runner_up": _runner_up(s, candidate)})
        if outcome is not None and outcome.status == "done":
            nominee = candidate
            break
    if nominee is None:
        return _end(rt, "failed", "no candidate's bundle passed its checks: nothing nominated")
    name = nb.artifact(nominee).name
    if rt.ctx.lab.sealed_suites:
        _gated_run(rt, "sealed_open", {"artifact": nominee})
    if rt.ctx.lab.truth is not None:  # for the card and the report; the summary never shows it (agent/summary.py)
        _gated_run(rt, "ground_truth", {"artifact": nominee})
    published = _gated_run(rt, "publish", {"artifact": nominee, "runner_up": _runner_up(s, nominee)})
    if published is None or published.status != "done":
        why = published.summary if published is not None else "refused by the gates"
        return _end(rt, "failed", f"nominated {name}, but its bundle was not published: {why}")
    return _end(rt, "done", f"nominated {name} ({state.get('stop_reason') or 'loop ended'})")


# ---- routers -------------------------------------------------------------------------------------


def after_plan(state: AgentState) -> Literal["gate", "observe"]:
    return "gate" if state.get("proposal") else "observe"


def after_gate(state: AgentState) -> Literal["act", "observe", "nominate"]:
    if state.get("refusal") is None:
        return "act"
    return "nominate" if state.get("refusals_in_row", 0) >= MAX_REFUSALS_IN_ROW else "observe"


def after_record(state: AgentState) -> Literal["observe", "nominate"]:
    return "nominate" if state.get("stop_reason") else "observe"


# ---- wiring --------------------------------------------------------------------------------------


def build(rt: Runtime, checkpointer: Any):
    g = StateGraph(AgentState)
    for name, fn in (("observe", observe), ("plan", plan), ("gate", gate), ("act", act), ("record", record),
                     ("nominate", nominate)):
        g.add_node(name, lambda state, fn=fn: fn(rt, state))
    g.add_edge(START, "observe")
    g.add_edge("observe", "plan")
    g.add_conditional_edges("plan", after_plan)
    g.add_conditional_edges("gate", after_gate)
    g.add_edge("act", "record")
    g.add_conditional_edges("record", after_record)
    g.add_edge("nominate", END)
    return g.compile(checkpointer=checkpointer)


def _regate(rt: Runtime, graph: Any, config: dict[str, Any], values: dict[str, Any]) -> None:
    """A step checkpointed between its gate and its end (the agent died while it acted) is gated again on
    the notebook as it is now, never acted on as it was admitted: the checkpoint becomes "plan just
    proposed it", with a fresh summary, so the gate runs next (its own jobs, already in the notebook, are
    re-attached by `act` if it passes)."""
    p = values["proposal"]
    rt.reporter.event(f"resume: gating plan {p['plan_seq']} ({p['tool']}) again before acting on it")
    graph.update_state(config, observe(rt, values), as_node="plan")


# The node a checkpoint waiting on a node stands after, as far as its next node goes (nominate follows record when a
# stop reason is set, as it is whenever the checkpoint's stop reason is derived again).
_BEFORE = {"plan": "observe", "gate": "plan", "act": "gate", "record": "act", "nominate": "record"}


def check_checkpoint(nb: Notebook, session: str, path: Path, checkpointer: Any) -> None:
    """The session's checkpoint against the notebook's chained decisions, before resume writes anything: graph.sqlite
    lies outside the hash chain, so nothing read from it is trusted. The proposal must be its `plan` decision as
    recorded (tool, args, planner, rationale); each line fed back to the planner must be a recorded refusal's reason;
    the counters must be in range. A mismatch is refused, naming the file (the checkpoint holds nothing the notebook
    lacks: without it, resume plans the step again from the notebook). The summary and a stop reason are not checked
    but read afresh (`drive`). Needs no runtime, so that resume runs it before anything else it does."""
    graph = build(None, checkpointer)  # the wiring only: no node runs
    snapshot = graph.get_state({"configurable": {"thread_id": session}})
    if not snapshot.next:
        return
    values = snapshot.values
    where = f"{path}: the graph checkpoint of session {session}"
    fix = "; remove the file and resume plans the step again from the notebook"
    p = values.get("proposal")
    if p is not None:  # whichever node is next: every proposal a checkpoint holds was recorded as a plan decision
        plan_seq = p.get("plan_seq") if isinstance(p, dict) else None
        d = {d.seq: d for d in nb.decisions(session, kind="plan")}.get(plan_seq) if type(plan_seq) is int else None
        recorded = None
        if d is not None:
            payload = d.payload.model_dump(mode="json")
            recorded = {"tool": payload.get("tool"), "args": payload.get("args"), "rationale": d.rationale,
                        "planner": payload.get("planner"), "plan_seq": d.seq}
        if recorded is None or recorded != p:
            raise SessionError(f"{where} holds a proposal that is not the notebook's plan decision {plan_seq!r} as "
                               f"recorded (the hash chain covers the decision, not the checkpoint){fix}")
    reasons = set()
    for d in fold(nb, session).refusals:
        reason = getattr(d.payload, "reason", None)
        if isinstance(reason, str):
            reasons |= {reason, f"refused by the gates: {reason}"}
    feedback = values.get("feedback") or []
    if not isinstance(feedback, list) or any(f not in reasons for f in feedback):
        raise SessionError(f"{where} feeds the planner a line that is no refusal the notebook records{fix}")
    top = max(MAX_BAD_REPLIES, MAX_REFUSALS_IN_ROW)
    for key in ("bad_replies", "refusals_in_row"):
        n = values.get(key, 0)
        if type(n) is not int or not 0 <= n <= top:
            raise SessionError(f"{where} holds {key} = {shown(repr(n))[:40]}; expected an integer from 0 to "
                               f"{top}{fix}")


# The node a checkpoint waiting on a node stands after, as far as its next node goes (nominate follows record when a
# stop reason is set, as it is whenever `drive` derives one again).
_BEFORE = {"plan": "observe", "gate": "plan", "act": "gate", "record": "act", "nominate": "record"}


def _fresh(rt: Runtime, nxt: tuple[str, ...], values: dict[str, Any]) -> dict[str, Any]:
    """What a resumed checkpoint's state reads again from the notebook: the summary where the planner or the gates
    read it next, and a stop reason that is not the stop proposal's own (it is written into the session's end)."""
    fresh: dict[str, Any] = {}
    if set(nxt) & {"plan", "gate"}:
        fresh["summary"] = observe(rt, values)["summary"]
    stop, p = values.get("stop_reason"), values.get("proposal")
    if stop is not None and "nominate" in nxt:
        own = p["args"].get("reason") if p is not None and p.get("tool") == "stop" else None
        if stop != own:
            fresh["stop_reason"] = (summarize(rt.ctx.nb, rt.ctx.session).view.must_stop(rt.max_failed_arms)
                                    or "loop ended")
    return fresh


def _config(rt: Runtime) -> dict[str, Any]:
    return {"configurable": {"thread_id": rt.ctx.session}, "recursion_limit": 100_000}


def drive(rt: Runtime, checkpointer: Any) -> AgentState:
    """Run the session's thread to its end: continue from the last checkpoint if there is one (`check_checkpoint` has
    checked it against the notebook), else start from the notebook (a fresh state; everything else is re-read)."""
    graph, config = build(rt, checkpointer), _config(rt)
    snapshot = graph.get_state(config)
    if snapshot.next:
        fresh = _fresh(rt, snapshot.next, snapshot.values)
        if fresh:  # the values only: the node the checkpoint stands after is unchanged, so is what runs next
            graph.update_state(config, fresh, as_node=_BEFORE[snapshot.next[0]])
            snapshot = graph.get_state(config)
    if "act" in snapshot.next:
        _regate(rt, graph, config, snapshot.values)
    # "sync": each step's checkpoint is written before the next step starts, so an agent killed while it acts
    # has its gated proposal on disk, and resume gates that proposal again (an asynchronous write could still
    # be in flight when the job launches, and the step would be planned anew).
    if snapshot.next:
        return graph.invoke(None, config, durability="sync")
    if snapshot.values.get("finished"):
        return snapshot.values
    return graph.invoke(initial_state(rt.ctx.session), config, durability="sync")
