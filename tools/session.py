"""The session view: one typed picture of a session, read from the notebook, and the one place its rules live.

    v = view(nb, "s1")
    v.ledger.admission(forecast_gpuh=0.4)       # may this job be admitted? (and why not)
    v.ledger.time_limit_min(240, minute_gpuh=0.13)   # under which time limit
    v.promotion(candidate=7)                    # may it be promoted? if not, every reason
    v.p_family.left                             # how many p-values are left
    v.must_stop(max_failed_arms=3)              # must the research loop stop? (the reason, or None)

Everyone asks it: launcher admission (tools/jobs/launcher.py), the tools' time limits (tools/context.py), the
gates (agent/gates.py), the promote tool, the graph's stop check, the playbook and replay. No other module does
budget arithmetic or re-derives eligibility. Bars and verdicts are typed (`evals.bars.Rule`, `BarVerdict`);
text is rendered from them for a person or the LLM planner and never parsed back.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from evals.bars import Bars, Rule
from evals.compare import BarVerdict, PFamily, p_family
from memory.notebook import Notebook, NotebookError, tool_call_key

# The tools whose results make a candidate (an "arm"): the failed-arms stop rule counts their outcomes.
ARM_TOOLS = ("train", "merge", "tune_serving")
_EPS = 1e-12  # float slack of sums of settled costs


class _Typed(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Admission(_Typed):
    """Whether a job of this forecast is admitted, and the arithmetic when it is not."""

    admitted: bool = Field(description="Whether the forecast fits what is left.")
    forecast_gpuh: float = Field(description="The job's forecast.")
    left_gpuh: float = Field(description="What is left for it: above the reserve, or including it (nomination).")
    reason: str | None = Field(None, description="Why it was refused; None when admitted.")


class Ledger(_Typed):
    """The session's GPU-hours: budget, settled spend, reservations of unsettled jobs, the nomination reserve."""

    budget_gpuh: float = Field(description="Session budget.")
    spent_gpuh: float = Field(description="Settled GPU-hours.")
    reserved_gpuh: float = Field(description="Forecasts of jobs not yet settled.")
    reserve_gpuh: float = Field(description="Kept back for the nomination checks.")

    @property
    def left_above_reserve_gpuh(self) -> float:
        """What new research jobs may still use."""
        return self.left_gpuh(nomination=False)

    def left_gpuh(self, nomination: bool = False) -> float:
        """What is left for a job: above the reserve, or including it for the nomination's own checks (bundle,
        sealed confirmation), which the reserve is kept for."""
        reserve = 0.0 if nomination else self.reserve_gpuh
        return self.budget_gpuh - self.spent_gpuh - self.reserved_gpuh - reserve

    def without(self, reservation_gpuh: float) -> Ledger:
        """The ledger without one pending reservation (a job's own, when its attempt is admitted again)."""
        return self.model_copy(update={"reserved_gpuh": max(0.0, self.reserved_gpuh - reservation_gpuh)})

    def admission(self, forecast_gpuh: float, nomination: bool = False) -> Admission:
        left = self.left_gpuh(nomination)
        if forecast_gpuh <= left + _EPS:
            return Admission(admitted=True, forecast_gpuh=forecast_gpuh, left_gpuh=left)
        reserve = 0.0 if nomination else self.reserve_gpuh
        return Admission(admitted=False, forecast_gpuh=forecast_gpuh, left_gpuh=left, reason=(
            f"forecast {forecast_gpuh:.3f} GPU-h + spent {self.spent_gpuh:.3f} + reserved {self.reserved_gpuh:.3f} "
            f"+ reserve {reserve:.3f} > budget {self.budget_gpuh:.3f}"))

    def time_limit_min(self, limit_min: float, minute_gpuh: float, nomination: bool = False) -> float:
        """A job's time limit: the lab's, or shorter (in tenths of a minute) when only that much of what is left
        pays for it. A run never costs more than its limit, so a job admitted under this bound cannot overrun the
        budget; with less than one minute left the limit stays the lab's and admission refuses the job. A job that
        costs nothing per minute (a Slurm CPU job: no GPU charged) keeps the lab's limit."""
        if minute_gpuh <= 0:
            return limit_min
        fit = math.floor(self.left_gpuh(nomination) / minute_gpuh * 10) / 10
        return fit if 1.0 <= fit < limit_min else limit_min

    @property
    def exhausted(self) -> bool:
        return self.left_above_reserve_gpuh <= 0


class RegisteredBars(_Typed):
    """The session's latest registered bars, typed."""

    id: int = Field(description="bars row.")
    sha256: str = Field(description="Hash of the canonical spec.")
    rules: tuple[Rule, ...] = Field(description="The bars, in the bars file's order; the first is the primary.")
    p_family: int | None = Field(description="Pre-registered p-value family size.")
    replicates: int = Field(description="Served draws a side that every bar without a p-value averages.")

    @property
    def primary(self) -> Rule:
        """The bar listed first in the bars file: the metric a stage ranks by when it is not screened."""
        return self.rules[0]

    @property
    def p_rules(self) -> tuple[Rule, ...]:
        return tuple(r for r in self.rules if r.statistic == "p")

    @property
    def guards(self) -> tuple[Rule, ...]:
        """The bars without a p-value (noise-floor and absolute guards)."""
        return tuple(r for r in self.rules if r.statistic != "p")

    def suites(self) -> tuple[list[str], list[str]]:
        """(cheap, judged): the suites of the guards not judged, and the suites of the p bars (the holdout)."""
        judged = list(dict.fromkeys(r.suite for r in self.p_rules))
        cheap = list(dict.fromkeys(r.suite for r in self.guards if r.suite not in judged))
        return cheap, judged


class Verdict(_Typed):
    """One comparison of a candidate with an incumbent under the bars."""

    comparison_id: int = Field(description="Notebook comparison row.")
    candidate: int = Field(description="Artifact judged.")
    incumbent: int = Field(description="Artifact compared against.")
    promoted: bool = Field(description="Whether every bar held.")
    bars: list[BarVerdict] = Field(description="Per bar: statistic, threshold, verdict.")

    @property
    def held(self) -> int:
        return sum(b.holds for b in self.bars)

    def lines(self) -> list[str]:
        """The verdicts rendered for a person or the LLM planner (never parsed back)."""
        out = []
        for b in self.bars:
            value = f"{b.value:.4g}" if isinstance(b.value, float) else str(b.value)
            out.append(f"{b.bar.target} {b.bar.statistic}={value} {b.bar.op} {b.threshold:.4g}: "
                       f"{'holds' if b.holds else 'fails'}")
        return out


class Eligibility(_Typed):
    """Whether a candidate may be promoted now, with every reason it may not."""

    candidate: int = Field(description="The candidate asked about.")
    promotable: bool = Field(description="True only when no reason stands against it.")
    comparison_id: int | None = Field(None, description="The comparison that promotes it.")
    reasons: list[str] = Field(default_factory=list, description="Every reason it may not be promoted.")


class SessionView(_Typed):
    """A session as its rules read it, built from the notebook alone (`view`)."""

    session: str = Field(description="Session name.")
    ledger: Ledger = Field(description="The GPU-hour ledger.")
    parent: int | None = Field(description="The session's parent checkpoint (its first incumbent).")
    incumbent: int | None = Field(description="The current incumbent.")
    chain: list[int] = Field(description="Incumbents in order: the parent, then each promoted candidate.")
    bars: RegisteredBars | None = Field(description="The latest registered bars; None before registration.")
    verdicts: list[Verdict] = Field(description="Every comparison of the session, oldest first.")
    p_family: PFamily = Field(description="The pre-registered p-value family: size, spent, per comparison.")
    failed_arms_in_row: int = Field(description="Arms in a row (latest last) that failed or missed the bars.")

    def of(self, candidate: int) -> list[Verdict]:
        return [v for v in self.verdicts if v.candidate == candidate]

    def promotion(self, candidate: int) -> Eligibility:
        """May `candidate` become the incumbent: only on its latest comparison against the current incumbent, at
        its served decoding (compare refuses any other), with every bar holding."""
        reasons = []
        if candidate == self.incumbent:
            reasons.append(f"artifact {candidate} is already the incumbent")
        elif candidate in self.chain:
            reasons.append(f"artifact {candidate} was an incumbent before: the chain only moves forward")
        mine = [v for v in self.of(candidate) if v.incumbent == self.incumbent]
        if not mine:
            reasons.append(f"artifact {candidate} has no comparison at its served decoding against incumbent "
                           f"{self.incumbent}")
        elif not mine[-1].promoted:
            failed = [line for b, line in zip(mine[-1].bars, mine[-1].lines(), strict=True) if not b.holds]
            reasons.append(f"its comparison {mine[-1].comparison_id} against incumbent {self.incumbent} failed "
                           f"{len(failed)} bar(s): " + "; ".join(failed))
        if reasons:
            return Eligibility(candidate=candidate, promotable=False, reasons=reasons)
        return Eligibility(candidate=candidate, promotable=True, comparison_id=mine[-1].comparison_id)

    def must_stop(self, max_failed_arms: int, min_step_gpuh: float = 0.0) -> str | None:
        """Why the research loop must stop now, or None: N arms in a row failed or missed the bars, or no more than
        `min_step_gpuh` is left above the reserve."""
        if self.failed_arms_in_row >= max_failed_arms:
            return f"{self.failed_arms_in_row} arms in a row failed or missed the bars (limit {max_failed_arms})"
        left = self.ledger.left_above_reserve_gpuh
        if left <= min_step_gpuh:
            return (f"budget spent: {self.ledger.spent_gpuh:.3f} of {self.ledger.budget_gpuh:.3f} GPU-h, "
                    f"{left:.3f} left above the reserve of {self.ledger.reserve_gpuh:.3f}")
        return None


# ---- reading the notebook --------------------------------------------------------------------------


def ledger(nb: Notebook, session: str) -> Ledger:
    raw = nb.ledger(session)
    return Ledger(budget_gpuh=raw.budget_gpuh, spent_gpuh=raw.spent_gpuh, reserved_gpuh=raw.reserved_gpuh,
                  reserve_gpuh=raw.reserve_gpuh)


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


def parent_of(nb: Notebook, session: str) -> int | None:
    found = [a.id for a in nb.artifacts(kind="checkpoint", session=session) if a.recipe.get("role") == "parent"]
    return found[0] if found else None


def chain_of(nb: Notebook, session: str) -> list[int]:
    """The session's incumbents in order: its parent, then every candidate a `promote` decision made incumbent."""
    parent = parent_of(nb, session)
    promoted = [d.payload.get("artifact_id") for d in nb.decisions(session, kind="promote")
                if d.payload.get("action") == "incumbent"]
    return ([parent] if parent is not None else []) + promoted


def incumbent_of(nb: Notebook, session: str) -> int | None:
    """The session's incumbent: the latest promoted artifact, else its parent."""
    chain = chain_of(nb, session)
    return chain[-1] if chain else None


def registered_bars(nb: Notebook, session: str) -> RegisteredBars | None:
    registered = nb.decisions(session, kind="register_bars")
    if not registered:
        return None
    record = nb.bars(registered[-1].payload.get("bars_id"))
    return RegisteredBars(id=record.id, sha256=record.sha256, rules=Bars.rules(record.spec),
                          p_family=record.spec.get("p_family"), replicates=record.spec.get("replicates", 1))


def verdicts_of(nb: Notebook, session: str) -> list[Verdict]:
    return [Verdict(comparison_id=c.id, candidate=c.candidate, incumbent=c.incumbent, promoted=c.promoted,
                    bars=[BarVerdict.model_validate(v) for v in c.verdicts]) for c in nb.comparisons(session)]


def failed_arms_in_row(nb: Notebook, session: str, verdicts: list[Verdict]) -> int:
    """Finished arms in a row, latest last, whose candidate failed to be made or was compared and never promoted
    (an arm not compared yet counts neither way)."""
    calls = nb.tool_calls(session)
    checkpoints = {a.id for a in nb.artifacts(kind="checkpoint", session=session)}
    promoted = {v.candidate for v in verdicts if v.promoted}
    compared = {c.args.get("candidate") for c in calls if c.tool == "compare" and c.status != "open"}
    outcomes = []
    for c in calls:
        if c.tool not in ARM_TOOLS or c.status == "open":
            continue
        made = (c.result or {}).get("data", {}).get("artifact_id")
        if made not in checkpoints or c.status != "done":
            outcomes.append(False)
        elif made in compared:
            outcomes.append(made in promoted)
    n = 0
    for ok in reversed(outcomes):
        if ok:
            break
        n += 1
    return n


def view(nb: Notebook, session: str) -> SessionView:
    """The session view, read from the notebook."""
    verdicts = verdicts_of(nb, session)
    chain = chain_of(nb, session)
    return SessionView(session=session, ledger=ledger(nb, session), parent=parent_of(nb, session),
                       incumbent=chain[-1] if chain else None, chain=chain, bars=registered_bars(nb, session),
                       verdicts=verdicts, p_family=p_family(nb, session),
                       failed_arms_in_row=failed_arms_in_row(nb, session, verdicts))


def render(v: SessionView) -> dict[str, Any]:
    """The view as plain JSON for a person or the LLM planner: the bars and verdicts as readable lines."""
    out = v.model_dump(mode="json", exclude={"verdicts", "bars"})
    out["ledger"]["left_above_reserve_gpuh"] = round(v.ledger.left_above_reserve_gpuh, 6)
    if v.bars is not None:
        unit = {"noise_floor": " * noise_floor", "absolute": ""}
        out["bars"] = {"id": v.bars.id, "p_family": v.bars.p_family, "replicates": v.bars.replicates,
                       "rules": [f"{r.target} {r.statistic} {r.op} {r.value:g}{unit[r.unit]}" for r in v.bars.rules]}
    out["p_family"]["left"] = v.p_family.left
    return out
