"""The session state: one typed value folded from a session's decisions, in order (an event-sourced fold).

    state = fold(nb, "s1")
    state.ledger.admission(forecast_gpuh=0.4)      # may this job be admitted? (and why not)
    state.incumbent, state.chain                   # the parent, then each candidate an `incumbent` decision made
    state.bars                                     # the bars in force: typed rules (state.registrations: all)
    state.floor(rule, artifact, decoding)          # the noise floor a bar reads, and .unit(): in the bar's unit
    state.verdicts                                 # every comparison's verdict; `cleared`: every bar held
    state.promotion(candidate=7)                   # may it become the incumbent? if not, every reason
    state.p_family.left                            # how many p-values are left
    state.must_stop(max_failed_arms=3)             # must the research loop stop? (the reason, or None)
    state.confirmations, state.split, state.nominee

Each decision kind is one event with one meaning, applied in chain order by `_apply`: `register_bars` puts bars in
force, `calibrate` adds noise floors, `promote`/`reject` is a verdict (the candidate cleared every bar, or not; it
moves no incumbent), `incumbent` moves the incumbent (so did a `promote` carrying an incumbent payload, in notebooks
from before that kind existed), `confirm` opens a sealed suite, a sealed `evaluate` may leave it undecided,
`ingest` fixes the split, `nominate` names the nominee, `refuse` and `truth` are kept for the card, `look` is one
look of a p bar under sequential bars (one that left its comparison unresolved, or the one its verdict was read at),
`audit` flags a guard's suite the judge contradicted and `clear_suite` is a person clearing it. The rows an
event names (bars, floors, comparisons) are read as their typed records when it is applied. Two facts are no
decision: the ledger sums the session's job rows (a job is settled by updating its row), and the parent is the
session's checkpoint of role `parent`.

Everyone asks it: compare (evals/compare.py), replay, the planner's summary, the gates, the playbook, the promote
and compare tools, the model card and the report. None of them reads the notebook for a fact the state holds (a
test walks the code for it: tests/memory/test_state.py). It lives in memory/, the lowest layer that has the
notebook, so that every reader, the report included, may import it.
"""

from __future__ import annotations

import math

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from memory.notebook import Notebook
from memory.records import (
    AuditPayload,
    BarsSpec,
    BarVerdict,
    Comparison,
    Decision,
    EvalRecord,
    FloorRule,
    IncumbentPayload,
    Ledger,
    LookPayload,
    NoiseFloor,
    OpenPayload,
    RefuseDecision,
    Rule,
    ToolCall,
    TruthDecision,
    VerdictPayload,
)

# The tools whose results make a candidate (an "arm"): the failed-arms stop rule counts their outcomes.
ARM_TOOLS = ("train", "merge", "tune_serving")


class _Typed(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def resolution(values: list[float]) -> float:
    """The finest difference of means a suite of these per-item values can resolve: one item (1/n), or the standard
    error of the mean at the observed values (the binomial sqrt(p(1-p)/n) for 0/1 metrics), whichever is larger."""
    n = len(values)
    if n == 0:
        return 0.0
    se = float(np.std(values, ddof=1)) / math.sqrt(n) if n > 1 else 0.0
    return max(1.0 / n, se)


class Floor(_Typed):
    """One calibrated noise floor, with what it was measured on."""

    record: NoiseFloor = Field(description="The noise_floor row.")
    artifact_id: int | None = Field(description="The artifact every replicate scored (None when they span several).")
    decoding_sha256: str | None = Field(description="The decoding every replicate used (None when they differ).")
    resolution: float = Field(description="The finest difference its suite resolves on the first replicate.")

    def unit(self, rule: FloorRule) -> float:
        """One noise floor in a bar's threshold: the replicates' mean absolute delta (`replicates`), and under
        `resolvable` never finer than the suite resolves on the incumbent's first calibration replicate. The one
        rule: compare's thresholds and every floor the summary, the card and the report print come from here."""
        if rule == "replicates":
            return self.record.mean_abs_delta
        return max(self.record.mean_abs_delta, self.resolution)


class BarFloor(_Typed):
    """A noise-floor bar's floor, in the unit its threshold uses (threshold = value x unit)."""

    rule: Rule = Field(description="The bar.")
    floor_id: int = Field(description="The noise_floor row.")
    k: int = Field(description="Replicates it was calibrated from.")
    mean_abs_delta: float = Field(description="The replicates' mean absolute delta.")
    floor_unit: FloorRule = Field(description="The bars' floor rule (evals/bars.py).")
    unit: float = Field(description="The floor in the bar's unit: what one noise floor of its threshold is.")
    recorded: bool = Field(description="Whether the comparison recorded this unit (True), or it is derived from "
                           "the floors (a comparison recorded before units were kept, or a bar not judged yet).")


class RegisteredBars(_Typed):
    """Bars registered in the session, typed."""

    id: int = Field(description="bars row.")
    seq: int = Field(description="The register_bars decision.")
    sha256: str = Field(description="Hash of the canonical spec.")
    registered_at: str = Field(description="When they were registered.")
    spec: BarsSpec = Field(description="The rules and how they read.")

    @property
    def rules(self) -> tuple[Rule, ...]:
        """The bars, in the bars file's order."""
        return self.spec.bars

    @property
    def p_family(self) -> int | None:
        return self.spec.p_family

    @property
    def replicates(self) -> int:
        return self.spec.replicates

    @property
    def floor_unit(self) -> FloorRule:
        return self.spec.floor_unit

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
    """One comparison of a candidate with an incumbent under the bars: a verdict, never a change of incumbent."""

    comparison_id: int = Field(description="Notebook comparison row.")
    seq: int = Field(description="Its promote/reject decision.")
    candidate: int = Field(description="Artifact judged.")
    incumbent: int = Field(description="Artifact compared against.")
    bars_id: int = Field(description="bars row it was judged by.")
    cleared: bool = Field(description="Whether every bar held (the decision kind `promote`; else `reject`).")
    bars: list[BarVerdict] = Field(description="Per bar: statistic, threshold, verdict.")
    floors: list[BarFloor | None] = Field(description="Per bar: the floor in the unit its threshold used (None: "
                                          "not a noise-floor bar).")
    raw_p: list[float] = Field(description="The raw p-values it tested (its part of the p-value family).")

    @property
    def held(self) -> int:
        return sum(b.holds for b in self.bars)

    def lines(self) -> list[str]:
        """The verdicts rendered for a person or the LLM planner (never parsed back)."""
        out = []
        for b, f in zip(self.bars, self.floors, strict=True):
            value = f"{b.value:.4g}" if isinstance(b.value, float) else str(b.value)
            floor = f" (noise floor {f.unit:.4g})" if f is not None else ""
            out.append(f"{b.bar.target} {b.bar.statistic}={value} {b.bar.op} {b.threshold:.4g}{floor}: "
                       f"{'holds' if b.holds else 'fails'}")
        return out


class PFamily(_Typed):
    """The session's pre-registered family of p-values (Holm): its size, how many were tested, how many are left.
    The one count of p-values spent: compare refuses past it, and the planner reads it."""

    size: int | None = Field(description="p_family of the session's first bars declaring one; None: no p bars.")
    spent: int = Field(description="Raw p-values tested by the session's comparisons so far.")
    per_comparison: int = Field(description="p bars of the latest registered bars: what one comparison tests.")

    @property
    def left(self) -> int | None:
        return None if self.size is None else self.size - self.spent

    @property
    def fits_one_more(self) -> bool:
        """Whether one more comparison under the latest bars fits the family."""
        return self.size is None or self.size - self.spent >= self.per_comparison


class Eligibility(_Typed):
    """Whether a candidate may be made the incumbent now, with every reason it may not."""

    candidate: int = Field(description="The candidate asked about.")
    promotable: bool = Field(description="True only when no reason stands against it.")
    comparison_id: int | None = Field(None, description="The comparison whose verdict allows it.")
    reasons: list[str] = Field(default_factory=list, description="Every reason it may not be made the incumbent.")


class Confirmation(_Typed):
    """A sealed suite opened for the nominee (its `confirm` decision)."""

    seq: int = Field(description="The confirm decision.")
    suite: str = Field(description="Sealed suite.")
    artifact_id: int = Field(description="The nominee it was opened for.")
    undecided: bool = Field(False, description="Its sealed battles held no decisive vote: nothing was scored.")


class Split(_Typed):
    """The session's feedback split (its latest `ingest` decision)."""

    id: int = Field(description="feedback_split row.")
    sha256: str = Field(description="sha256 of the assignment.")
    counts: dict[str, int] = Field(description="Battles per split.")
    reserve_suites: tuple[str, ...] = Field((), description="With a reserve: the open suites reading the dev "
                                            "holdout's prompts, which a reserve look extends with the reserve's.")

    @property
    def reserve(self) -> int:
        """Battles held in reserve (0: the lab holds none)."""
        return self.counts.get("reserve", 0)


class IncumbentChange(_Typed):
    """A candidate made the incumbent (its `incumbent` decision)."""

    seq: int = Field(description="The decision.")
    artifact_id: int = Field(description="The new incumbent.")
    previous: int = Field(description="The incumbent it replaced.")
    comparison_id: int = Field(description="The comparison whose verdict allowed it.")


class Look(_Typed):
    """One look of a comparison's p bar under sequential bars (its `look` decision)."""

    seq: int = Field(description="The look decision.")
    payload: LookPayload = Field(description="The look's statistics and outcome.")


class Finding(_Typed):
    """A suite-audit finding (its `audit` decision), and whether a person has cleared the suite since."""

    seq: int = Field(description="The audit decision.")
    payload: AuditPayload = Field(description="The guard, the candidate and the statistics.")
    cleared_seq: int | None = Field(None, description="The clear_suite decision that cleared it; None: in force.")
    cleared_by: str | None = Field(None, description="Who cleared it.")


class Head(_Typed):
    """The session's latest decision: where its chain stood."""

    seq: int = Field(description="Chain position.")
    hash: str = Field(description="Its hash.")


class SessionState(_Typed):
    """A session as its decisions say, folded in order (`fold`)."""

    session: str = Field(description="Session name.")
    opened: OpenPayload | None = Field(description="What the open decision recorded (None before it).")
    ledger: Ledger = Field(description="The GPU-hour ledger.")
    parent: int | None = Field(description="The session's parent checkpoint (its first incumbent).")
    changes: list[IncumbentChange] = Field(description="Every change of incumbent, oldest first.")
    registrations: list[RegisteredBars] = Field(description="Every bars registration, oldest first.")
    floors: list[Floor] = Field(description="Every calibrated noise floor, oldest first.")
    verdicts: list[Verdict] = Field(description="Every comparison's verdict, oldest first.")
    p_family: PFamily = Field(description="The pre-registered p-value family: size, spent, per comparison.")
    confirmations: list[Confirmation] = Field(description="Sealed suites opened, oldest first.")
    split: Split | None = Field(description="The feedback split; None before ingestion.")
    nominee: int | None = Field(description="The latest nominated artifact.")
    refusals: list[RefuseDecision] = Field(description="Every refusal, oldest first.")
    truths: list[TruthDecision] = Field(description="Ground-truth measurements, oldest first.")
    failed_arms_in_row: int = Field(description="Arms in a row (latest last) that failed or missed the bars.")
    judged: list[int] = Field(default_factory=list, description="Candidates a comparison judged: a compare call of "
                              "theirs finished without leaving it unresolved (a verdict, a refusal or a failure).")
    head: Head | None = Field(description="The latest decision.")
    looks: list[Look] = Field(default_factory=list, description="Every look of a p bar under sequential bars, oldest "
                              "first.")
    findings: list[Finding] = Field(default_factory=list, description="Every suite-audit finding, oldest first.")

    def flagged(self, suite: str) -> Finding | None:
        """The suite-audit finding in force on `suite` (its first not cleared since), or None."""
        return next((f for f in self.findings if f.payload.suite == suite and f.cleared_seq is None), None)

    def open_look(self, candidate: int) -> Look | None:
        """The candidate's latest look against the current incumbent when it left the comparison unresolved and no
        verdict followed it: more evidence may be bought and the next look asked."""
        mine = [x for x in self.looks if (x.payload.candidate, x.payload.incumbent) == (candidate, self.incumbent)]
        if not mine or mine[-1].payload.outcome != "continue":
            return None
        later = [v for v in self.of(candidate) if v.incumbent == self.incumbent and v.seq > mine[-1].seq]
        return None if later else mine[-1]

    @property
    def chain(self) -> list[int]:
        """Incumbents in order: the parent, then each candidate made incumbent."""
        return ([self.parent] if self.parent is not None else []) + [c.artifact_id for c in self.changes]

    @property
    def incumbent(self) -> int | None:
        return self.chain[-1] if self.chain else None

    @property
    def bars(self) -> RegisteredBars | None:
        """The bars in force: the latest registered."""
        return self.registrations[-1] if self.registrations else None

    def registered(self, bars_id: int) -> RegisteredBars | None:
        return next((r for r in self.registrations if r.id == bars_id), None)

    def of(self, candidate: int) -> list[Verdict]:
        return [v for v in self.verdicts if v.candidate == candidate]

    @property
    def tested(self) -> list[tuple[int, float]]:
        """(comparison id, raw p) of every p-value the session's comparisons tested, oldest first."""
        return [(v.comparison_id, p) for v in self.verdicts for p in v.raw_p]

    def floor(self, suite: str, metric: str, artifact_id: int, decoding_sha256: str | None = None) -> Floor | None:
        """The FIRST floor of (suite, metric) calibrated on `artifact_id` (at that decoding, if given): the one a
        comparison against that incumbent reads. The first, so that recalibrating cannot shop for a wider one."""
        return next((f for f in self.floors if (f.record.suite, f.record.metric) == (suite, metric)
                     and f.artifact_id == artifact_id and decoding_sha256 in (None, f.decoding_sha256)), None)

    def first_floor(self, suite: str, metric: str) -> Floor | None:
        """The session's first floor of (suite, metric), on whatever artifact: the unit the playbook's screen ranks
        candidates in (every policy version; not a bar's unit)."""
        return next((f for f in self.floors if (f.record.suite, f.record.metric) == (suite, metric)), None)

    def bar_floors(self, incumbent: int | None = None) -> list[BarFloor]:
        """For each noise-floor bar in force, the floor a comparison against `incumbent` (default: the current one)
        would read, in the unit its threshold uses; bars whose floor is not calibrated yet are left out."""
        if self.bars is None:
            return []
        artifact = self.incumbent if incumbent is None else incumbent
        found = [(r, self.floor(r.suite, r.metric, artifact)) for r in self.bars.rules if r.in_noise_units]
        return [_bar_floor(r, f, self.bars.floor_unit, None) for r, f in found if f is not None]

    def calibrated(self) -> list[int]:
        """Artifacts with a noise floor of their own."""
        return sorted({f.artifact_id for f in self.floors if f.artifact_id is not None})

    def promotion(self, candidate: int) -> Eligibility:
        """May `candidate` become the incumbent: only on its latest verdict against the current incumbent, at its
        served decoding (compare refuses any other), with every bar holding. The one eligibility rule."""
        reasons = []
        if candidate == self.incumbent:
            reasons.append(f"artifact {candidate} is already the incumbent")
        elif candidate in self.chain:
            reasons.append(f"artifact {candidate} was an incumbent before: the chain only moves forward")
        mine = [v for v in self.of(candidate) if v.incumbent == self.incumbent]
        if not mine:
            reasons.append(f"artifact {candidate} has no comparison at its served decoding against incumbent "
                           f"{self.incumbent}")
        elif not mine[-1].cleared:
            failed = [line for b, line in zip(mine[-1].bars, mine[-1].lines(), strict=True) if not b.holds]
            reasons.append(f"its comparison {mine[-1].comparison_id} against incumbent {self.incumbent} failed "
                           f"{len(failed)} bar(s): " + "; ".join(failed))
        if reasons:
            return Eligibility(candidate=candidate, promotable=False, reasons=reasons)
        return Eligibility(candidate=candidate, promotable=True, comparison_id=mine[-1].comparison_id)

    def rejected(self, candidate: int) -> bool:
        """Whether the candidate's comparison ended without a promotion: judged (`judged`), and no verdict of its
        cleared the bars (it failed them, or the comparison was refused)."""
        return candidate in self.judged and not any(v.cleared for v in self.of(candidate))

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

    def confirmed(self, artifact_id: int) -> list[Confirmation]:
        """The sealed suites opened for `artifact_id`."""
        return [c for c in self.confirmations if c.artifact_id == artifact_id]

    def truth(self, artifact_id: int) -> TruthDecision | None:
        """The artifact's latest ground-truth measurement."""
        found = [t for t in self.truths if t.payload.artifact_id == artifact_id]
        return found[-1] if found else None


def _bar_floor(rule: Rule, floor: Floor, floor_unit: FloorRule, recorded: float | None) -> BarFloor:
    return BarFloor(rule=rule, floor_id=floor.record.id, k=floor.record.k, mean_abs_delta=floor.record.mean_abs_delta,
                    floor_unit=floor_unit, unit=floor.unit(floor_unit) if recorded is None else recorded,
                    recorded=recorded is not None)


# ---- the fold ------------------------------------------------------------------------------------


class _Fold:
    """The mutable accumulator of one fold; `SessionState` is its frozen result."""

    def __init__(self, nb: Notebook, session: str):
        self.nb, self.session = nb, session
        self.comparisons = {c.id: c for c in nb.comparisons(session)}
        self.opened: OpenPayload | None = None
        self.changes: list[IncumbentChange] = []
        self.registrations: list[RegisteredBars] = []
        self.floors: list[Floor] = []
        self.verdicts: list[Verdict] = []
        self.confirmations: list[Confirmation] = []
        self.split: Split | None = None
        self.nominee: int | None = None
        self.refusals: list[RefuseDecision] = []
        self.truths: list[TruthDecision] = []
        self.head: Head | None = None
        self.evals: dict[int, EvalRecord] = {}
        self.looks: list[Look] = []
        self.findings: list[Finding] = []

    def apply(self, d: Decision) -> None:
        self.head = Head(seq=d.seq, hash=d.hash)
        p = d.payload
        match d.kind:
            case "open":
                self.opened = p
            case "register_bars":
                record = self.nb.bars(p.bars_id)
                self.registrations.append(RegisteredBars(id=record.id, seq=d.seq, sha256=record.sha256,
                                                         registered_at=record.registered_at, spec=record.spec))
            case "calibrate":
                self.floors += [self._floor(self.nb.noise_floor(i)) for i in p.noise_floor_ids]
            case "promote" | "reject" if isinstance(p, VerdictPayload):
                self.verdicts.append(self._verdict(d.seq, self.comparisons[p.comparison_id]))
            case "incumbent" | "promote" if isinstance(p, IncumbentPayload):
                self.changes.append(IncumbentChange(seq=d.seq, artifact_id=p.artifact_id, previous=p.previous,
                                                    comparison_id=p.comparison_id))
            case "confirm":
                self.confirmations.append(Confirmation(seq=d.seq, suite=p.suite, artifact_id=p.artifact_id))
            case "evaluate" if p.sealed and p.undecided:
                self.confirmations = [c.model_copy(update={"undecided": True})
                                      if c.artifact_id == p.artifact_id and c.suite in p.undecided else c
                                      for c in self.confirmations]
            case "ingest":
                self.split = Split(id=p.split_id, sha256=p.sha256, counts=p.counts,
                                   reserve_suites=tuple(p.reserve_suites or ()))
            case "nominate":
                self.nominee = p.artifact_id
            case "refuse":
                self.refusals.append(d)
            case "truth":
                self.truths.append(d)
            case "look":
                self.looks.append(Look(seq=d.seq, payload=p))
            case "audit":
                self.findings.append(Finding(seq=d.seq, payload=p))
            case "clear_suite":
                self.findings = [f.model_copy(update={"cleared_seq": d.seq, "cleared_by": p.by})
                                 if f.payload.suite == p.suite and f.cleared_seq is None else f for f in self.findings]

    def _floor(self, record: NoiseFloor) -> Floor:
        for i in record.source_evals:  # a suite's metrics share their replicates: each eval is read once
            if i not in self.evals:
                self.evals[i] = self.nb.eval(i)
        sources = [self.evals[i] for i in record.source_evals]
        artifacts = {e.artifact_id for e in sources}
        decodings = {e.decoding_sha256 for e in sources}
        return Floor(record=record, artifact_id=artifacts.pop() if len(artifacts) == 1 else None,
                     decoding_sha256=decodings.pop() if len(decodings) == 1 else None,
                     resolution=resolution(list(sources[0].values(record.metric).values())))

    def _verdict(self, seq: int, c: Comparison) -> Verdict:
        registered = next(r for r in self.registrations if r.id == c.bars_id)
        floors = []
        for b in c.verdicts:
            if not b.bar.in_noise_units:
                floors.append(None)
                continue
            floor = (next(f for f in self.floors if f.record.id == b.floor_id) if b.floor_id is not None
                     else self._first_on(b.bar, c.incumbent))
            floors.append(None if floor is None else _bar_floor(b.bar, floor, registered.floor_unit, b.floor))
        return Verdict(comparison_id=c.id, seq=seq, candidate=c.candidate, incumbent=c.incumbent, bars_id=c.bars_id,
                       cleared=c.promoted, bars=c.verdicts, floors=floors, raw_p=c.adjustment.raw_p)

    def _first_on(self, rule: Rule, artifact_id: int) -> Floor | None:
        """A comparison recorded before verdicts kept their floor: the first floor of the bar's metric on its
        incumbent (the one compare read, whose decoding was the incumbent's served one)."""
        return next((f for f in self.floors if (f.record.suite, f.record.metric) == (rule.suite, rule.metric)
                     and f.artifact_id == artifact_id), None)

    def p_family(self) -> PFamily:
        """Fixed once: the p_family of the first bars declaring one (a later, larger family registered after some
        p-values were seen would re-spend error already spent under the smaller one)."""
        size = next((r.p_family for r in self.registrations if r.p_family is not None), None)
        per = len(self.registrations[-1].p_rules) if self.registrations else 0
        return PFamily(size=size, spent=sum(len(v.raw_p) for v in self.verdicts), per_comparison=per)


def parent_of(nb: Notebook, session: str) -> int | None:
    """The session's parent checkpoint (registered at its start: tools/promote.py start_incumbent)."""
    found = [a.id for a in nb.artifacts(kind="checkpoint", session=session) if a.recipe.get("role") == "parent"]
    return found[0] if found else None


def judged_candidates(calls: list[ToolCall]) -> list[int]:
    """Candidates a comparison judged: a compare call finished and did not leave it unresolved (an unresolved look
    judged nothing), in call order."""
    found = [c.args.get("candidate") for c in calls if c.tool == "compare" and c.status != "open"
             and not c.outcome.unresolved]
    return list(dict.fromkeys(found))


def failed_arms_in_row(nb: Notebook, session: str, calls: list[ToolCall], verdicts: list[Verdict],
                       compared: list[int]) -> int:
    """Finished arms in a row, latest last, whose candidate failed to be made or was compared (`compared`: judged)
    and never cleared the bars (an arm not compared yet counts neither way)."""
    checkpoints = {a.id for a in nb.artifacts(kind="checkpoint", session=session)}
    cleared = {v.candidate for v in verdicts if v.cleared}
    outcomes = []
    for c in calls:
        if c.tool not in ARM_TOOLS or c.status == "open":
            continue
        made = c.outcome.artifact_id
        if made not in checkpoints or c.status != "done":
            outcomes.append(False)
        elif made in compared:
            outcomes.append(made in cleared)
    n = 0
    for ok in reversed(outcomes):
        if ok:
            break
        n += 1
    return n


def fold(nb: Notebook, session: str) -> SessionState:
    """The session state: every decision of the session applied in chain order."""
    acc = _Fold(nb, session)
    for d in nb.decisions(session):
        acc.apply(d)
    parent = parent_of(nb, session)
    calls = nb.tool_calls(session)
    compared = judged_candidates(calls)
    return SessionState(
        session=session, opened=acc.opened, ledger=nb.ledger(session), parent=parent,
        changes=acc.changes, registrations=acc.registrations,
        floors=acc.floors, verdicts=acc.verdicts, p_family=acc.p_family(), confirmations=acc.confirmations,
        split=acc.split, nominee=acc.nominee, refusals=acc.refusals, truths=acc.truths,
        failed_arms_in_row=failed_arms_in_row(nb, session, calls, acc.verdicts, compared), judged=compared,
        head=acc.head, looks=acc.looks, findings=acc.findings)
