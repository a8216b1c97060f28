"""The planner's view of a session, read from the notebook alone: aggregates and ids, never battle text.

`summarize(nb, session)` is what both planners observe at every step (the LLM planner gets its rendering,
`Summary.render()`, as JSON). Its facts and rules come from the session state (memory/state.py): the budget, the
split's counts, the registered bars with their noise floors (in the unit each bar's threshold uses), the incumbent,
every verdict; around them it adds every candidate with its served metrics, datasets, every tool call with its
outcome line, recent refusals and failures. Nothing in it comes from anywhere but the notebook, so a resumed or
replayed session sees exactly what the original saw.

The ground truth (tools/ground_truth.py) is never in it: not its `truth` decision, its tool call, its
job's failures or a refusal of it. It measures the agent and must not steer it (its GPU-hours are in the
budget's spent total, like every settled job's; no number of its result is).
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from agent.toolbox import HIDDEN_TOOLS, canonical_args
from evals.decoding import Decoding
from memory.notebook import Notebook
from memory.place import LAB_MARK, rewrite, root_pattern
from memory.records import BudgetRefusal, GateRefusal, Ledger, MemoryRefusal, PartitionRefusal
from memory.state import BarFloor, RegisteredBars, SessionState, Split, Verdict, fold
from tools.data.datasets import audit_clean
from tools.ground_truth import JOB_KIND as TRUTH_JOB_KIND
from tools.session import render


class _View(BaseModel):
    model_config = ConfigDict(frozen=True)


class Checkpoint(_View):
    id: int = Field(description="Artifact id.")
    name: str = Field(description="Artifact name.")
    origin: str = Field(description="parent, train:<trainer>, merge:<method> or serving.")
    parent: int | None = Field(description="Artifact it was derived from.")
    served_decoding: str = Field(description="Fingerprint (12 hex) of its served decoding.")
    metrics: dict[str, dict[str, float]] = Field(description="Suite -> metric -> value of its first served look.")
    verdicts: list[Verdict] = Field(description="Its comparisons, oldest first.")


class Dataset(_View):
    id: int = Field(description="Artifact id.")
    name: str = Field(description="Artifact name.")
    builder: str = Field(description="Builder that made it.")
    row_kind: str = Field(description="sft, pairs, items or klce.")
    rows: int = Field(description="Rows.")
    audit_passed: bool = Field(description="Leak audit against holdouts and eval prompts: ran, and every overlapping "
                               "row was dropped.")


class Call(_View):
    id: int = Field(description="Tool call id.")
    tool: str = Field(description="Tool name.")
    args: dict[str, Any] = Field(description="Canonical arguments.")
    status: str = Field(description="open, done, failed or refused.")
    summary: str = Field(description="The outcome line.")
    data: dict[str, Any] = Field(description="Ids the outcome produced.")


class Refused(_View):
    tool: str = Field(description="Tool a gate refused.")
    args: dict[str, Any] = Field(description="Its canonical arguments.")
    reason: str = Field(description="The gate's reason.")


class Summary(_View):
    session: str = Field(description="Session name.")
    view: SessionState = Field(description="The session state: ledger, incumbent chain, typed bars and verdicts, "
                               "noise floors, p-value family, failed arms in a row (memory/state.py); its ground "
                               "truth, the refusals of it and the chain head (which a truth decision moves) left "
                               "out.")
    split: Split | None = Field(description="The feedback split: id, sha256 and per-split counts.")
    calibrated: list[int] = Field(description="Checkpoints with noise floors.")
    noise_floors: list[BarFloor] = Field(description="Per noise-floor bar in force, the floor a comparison against "
                                         "the incumbent reads, in the unit the bar's threshold uses.")
    screen_floors: dict[str, float] = Field(description="'suite/metric' -> the session's first floor's mean absolute "
                                            "delta: the unit the playbook's screen ranks candidates in (every "
                                            "policy version), not a bar's unit.")
    checkpoints: list[Checkpoint] = Field(description="Every checkpoint of the session.")
    datasets: list[Dataset] = Field(description="Every dataset built in the session.")
    calls: list[Call] = Field(description="Every tool call, in order.")
    refusals: list[str] = Field(description="The latest refusals (gates, planner replies, admission).")
    gate_refusals: list[Refused] = Field(default_factory=list, description="Every step a gate refused, oldest first.")
    failures: list[str] = Field(description="Failed job attempts: kind and failure class.")
    nominee: int | None = Field(description="The nominated checkpoint, once nominated.")
    sealed_opened: bool = Field(description="Whether the sealed confirmation was opened.")
    lab_roots: tuple[str, ...] = Field(default=(), description="Every spelling of the lab's root in the notebook's "
                                       "records: what render() rewrites to '<lab>'. Never rendered.")

    @property
    def budget(self) -> Ledger:
        return self.view.ledger

    @property
    def bars(self) -> RegisteredBars | None:
        return self.view.bars

    @property
    def parent(self) -> int | None:
        return self.view.parent

    @property
    def incumbent(self) -> int | None:
        return self.view.incumbent

    @property
    def consecutive_failed_arms(self) -> int:
        return self.view.failed_arms_in_row

    def render(self) -> dict[str, Any]:
        """The summary as plain JSON for the LLM planner: the view's bars and verdicts rendered as lines (text
        exists only at this boundary and is never parsed back)."""
        out = self.model_dump(mode="json", exclude={"view", "checkpoints", "lab_roots", "noise_floors"})
        out["session_view"] = render(self.view)
        out["checkpoints"] = [c.model_dump(mode="json", exclude={"verdicts"})
                              | {"verdicts": [{"comparison_id": v.comparison_id, "incumbent": v.incumbent,
                                               "cleared": v.cleared, "bars": v.lines()} for v in c.verdicts]}
                              for c in self.checkpoints]
        return without_paths(out, self.lab_roots)

    def call(self, tool: str, args: dict[str, Any]) -> Call | None:
        """The recorded call of `tool` with these arguments (compared in canonical form, defaults filled)."""
        wanted = canonical_args(tool, args)
        for c in self.calls:
            if c.tool == tool and c.args == wanted:
                return c
        return None

    def refused(self, tool: str, args: dict[str, Any]) -> Refused | None:
        """The gate refusal of `tool` with these arguments, if a gate refused it."""
        wanted = canonical_args(tool, args)
        return next((r for r in self.gate_refusals if r.tool == tool and r.args == wanted), None)

    def checkpoint(self, artifact_id: int) -> Checkpoint | None:
        return next((c for c in self.checkpoints if c.id == artifact_id), None)


# An absolute path left once the lab's own are lab-relative: a place outside the lab (a base model the team keeps
# elsewhere), named by a user.
_OUTSIDE_PATH = re.compile(r"(?<![\w.~/<>-])/[^\s\"'`,;()\[\]{}]+")
OUTSIDE = "<path outside the lab>"


def without_paths(value: Any, lab_roots: tuple[str, ...]) -> Any:
    """The planner's view of `value` (JSON): every path into the lab lab-relative ('<lab>/runs/...'), every other
    absolute path replaced by a placeholder. A lab directory's name is a user's choice, and any text in it (an
    instruction) would otherwise reach the LLM verbatim through the paths in outcome lines and refusals."""
    relative = rewrite(value, root_pattern(lab_roots), LAB_MARK)
    return rewrite(relative, _OUTSIDE_PATH, OUTSIDE, ("/",))


def _recorded(tool: str, args: dict[str, Any]) -> dict[str, Any]:
    """Recorded arguments in today's canonical form: a call recorded before an argument existed gets its default
    (an evaluate recorded without `replicates` is the one-look evaluate it was)."""
    try:
        return canonical_args(tool, args)
    except ValueError:  # no longer valid arguments: compared as recorded, so they match nothing asked today
        return args


def _origin(recipe: dict[str, Any]) -> str:
    if recipe.get("role") == "parent":
        return "parent"
    if "trainer" in recipe:
        return f"train:{recipe['trainer']}"
    if "merge" in recipe:
        return f"merge:{recipe['merge']}"
    return "serving" if "serving_of" in recipe else "other"


def _checkpoints(nb: Notebook, session: str, verdicts: list[Verdict]) -> list[Checkpoint]:
    out = []
    for a in nb.artifacts(kind="checkpoint", session=session):
        fp = a.recipe.get("served_decoding")
        served = [e for e in nb.evals(artifact_id=a.id, session=session) if e.served and e.replicate == 0]
        metrics: dict[str, dict[str, float]] = {}
        for e in served:
            metrics.setdefault(e.suite, {k: round(v, 6) for k, v in e.metrics.items()})
        out.append(Checkpoint(id=a.id, name=a.name, origin=_origin(a.recipe), parent=a.recipe.get("parent"),
                              served_decoding=_fingerprint(fp), metrics=metrics,
                              verdicts=[v for v in verdicts if v.candidate == a.id]))
    return out


def _fingerprint(decoding: dict[str, Any] | None) -> str:
    return Decoding.model_validate(decoding).fingerprint()[:12] if decoding else ""


def summarize(nb: Notebook, session: str) -> Summary:
    """Everything the planner may know, read from the notebook."""
    state = fold(nb, session)
    calls = [Call(id=c.id, tool=c.tool, args=_recorded(c.tool, c.args), status=c.status,
                  summary=c.outcome.summary if c.outcome else "", data=c.outcome.data if c.outcome else {})
             for c in nb.tool_calls(session) if c.tool not in HIDDEN_TOOLS]
    checkpoints = _checkpoints(nb, session, state.verdicts)
    screen = {f"{suite}/{metric}": round(found.record.mean_abs_delta, 6)
              for cp in checkpoints for suite, metrics in cp.metrics.items() for metric in metrics
              if (found := state.first_floor(suite, metric)) is not None}
    datasets = [Dataset(id=a.id, name=a.name, builder=a.recipe.get("builder", ""), row_kind=a.recipe.get("row_kind", ""),
                        rows=a.recipe.get("rows", 0), audit_passed=audit_clean(a.recipe))
                for a in nb.artifacts(kind="dataset", session=session)]
    refused = [d for d in state.refusals if not _hidden(d.payload)]
    refusals = [d.rationale for d in refused][-5:]
    gate_refusals = [Refused(tool=d.payload.tool, args=_recorded(d.payload.tool, d.payload.args),
                             reason=d.payload.reason) for d in refused if isinstance(d.payload, GateRefusal)]
    failures = [f"{j.kind} {j.key[:12]} attempt {j.attempt}: {j.failure_class}" for j in nb.jobs(session=session)
                if j.state == "failed" and j.kind != TRUTH_JOB_KIND]
    return Summary(
        session=session, view=state.model_copy(update={"truths": [], "refusals": refused, "head": None}), split=state.split,
        calibrated=[a for a in state.calibrated() if any(cp.id == a for cp in checkpoints)],
        noise_floors=state.bar_floors(), screen_floors=screen, checkpoints=checkpoints, datasets=datasets, calls=calls,
        refusals=refusals, gate_refusals=gate_refusals, failures=failures, nominee=state.nominee,
        sealed_opened=bool(state.confirmations), lab_roots=tuple(sorted({nb.place.root, *nb.place.spellings})),
    )


def _hidden(refusal: BaseModel) -> bool:
    """A refusal the planner never sees: of a hidden tool (the ground truth's), or of the ground truth's job."""
    if isinstance(refusal, GateRefusal):
        return refusal.tool in HIDDEN_TOOLS
    return isinstance(refusal, BudgetRefusal | MemoryRefusal | PartitionRefusal) and refusal.kind == TRUTH_JOB_KIND
