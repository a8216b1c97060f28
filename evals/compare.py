"""Compare a candidate with the incumbent against registered bars; promote only if all hold.

    state = fold(nb, session)                                                      # memory/state.py
    verdict = judge(nb, state, candidate, incumbent, state.bars, served)          # writes nothing
    outcome = record(nb, session, verdict, tool_call=call)                         # the one writer
    outcome = compare(nb, session, candidate, incumbent, bars_id, served)          # both, atomically

`judge` returns a `ComparisonVerdict` or a `Refusal` listing every reason; `record` writes a
comparison row and its verdict decision (`promote`: every bar held, the candidate cleared the bars; `reject`
otherwise; neither moves the incumbent, the promote tool's `incumbent` decision does), or one `refuse` decision, in
one transaction with the tool call. The session's facts (bars, noise floors, earlier p-values) come from the
session state (memory/state.py); the bars are typed rules, never a rule string parsed again. Refusals when:
- the bars were registered after any eval of the candidate's weights (any artifact with its sha256)
  on the bars' suites began
  (invariant 2: bars before scores);
- a bar's suite was evaluated for the candidate only at a decoding other than its served one
  (invariant 4: such evals are diagnostics; only served-decoding evals are ever used);
- a bar is written in noise-floor units and the suite/metric has no noise floor calibrated on the
  incumbent at the decoding of the incumbent eval compared (the first such floor is used, so
  recalibrating cannot shop for a wider one), or that floor is zero while the bar demands a margin
  of k > 0 floors (the margin would vanish) (invariant 3);
- an eval the bars need is missing, or candidate and incumbent scored different items;
- candidate and incumbent were scored in different scoring modes (the `scoring_mode*` entries of
  the evals' metrics, e.g. the constraint scorer's plain-meaning vs IFEval-reference rules): their
  per-item values measure different things and cannot be paired.

Each side is read from its FIRST replicate-0 eval of the suite at the relevant decoding: the first
look is the one that counts, so re-running a sampled eval until a lucky draw buys nothing. Bars that
pre-register `replicates = n` read every bar other than a p bar on each side's per-item mean over its
first evals of replicates 0 .. n-1 at that decoding (a missing replicate refuses the comparison); the
number of draws is fixed before any score, so drawing until a lucky mean is not possible either. Items
are paired by item id, never by position.

p-value bars are Holm-adjusted (Holm 1979) over the pre-registered family of `p_family` p-values:
the session's earlier p-values, this comparison's, and the untested rest counted as p = 1 (see
evals/bars.py); a comparison that would exceed the family is refused. The raw and adjusted values
and the family are stored with the comparison.

Sequential looks (bars with `looks = L > 1`, issue 41; evals/bars.py says which test and why): look j of a p bar
reads the per-item mean of the candidate's served draws 0 .. j-1 of its suite against the incumbent's first look,
and the comparison's p-value is p* = min over the looks taken of p_i / w_i (w_i: look i's registered share of the
alpha; a union bound valid under any dependence between looks and any stopping rule). Only a policy that asks for
look j (`look=j`) may leave the comparison unresolved: when a p bar fails, j < L, every p bar's raw p at this look
is at most `continue_p` and every other bar could hold, nothing is spent: a `look` decision (`continue`) is recorded
and more evidence may be bought (the next draw, then look j+1). Otherwise the verdict is read at this look (a `look`
decision `decided`, then the comparison). Without `look` the p bar is read once, at look 1.

A reserve look (`reserve=True`, issue 41: a session whose split holds a reserve, rules version 7): the last
registered look L, and only it, reads more prompts instead of another draw of the same ones: each p bar pairs the
candidate's per-item means over its draws 0 .. L-2 of the dev holdout together with its first served look at the
reserve split's prompts (`<suite>@reserve`), against the incumbent's first looks at both. It is one of the L looks
the bars registered, at its registered share w_L: which items look L reads is fixed by the split (made at ingest,
before any score) and the policy's recorded version, never chosen after a look, so the union bound over the looks
holds as for the draws of the same prompts, and p* stays one member of the session's Holm family (no p-value more is
spent). So a reserve look anywhere but at L is refused, and so is a look L without the reserve once the candidate has
a reserve draw against this incumbent (its data would be read, then left out).

Suite audit (bars with `audit_margin = m`): a guard (a noise-floor bar allowing a loss) that fails on a candidate
whose every p bar holds is a guard contradicted by the judge beyond chance on the same candidate (the judge
significant at its family-wise level, the guard past its margin of noise floors): an `audit` decision flags its
suite, and from then on (this comparison included) the guard holds at m times its margin, until a person clears the
suite (`clear_suite`). A truly harmful arm does not pass: the audit needs the judge's p bar to hold, and the
widened guard still bounds the loss.
"""

from __future__ import annotations

import math
import operator

from pydantic import BaseModel, ConfigDict, Field

from evals import stats
from evals.decoding import Decoding
from evals.job import reserve_suite
from evals.judgment import Refusal, close_tool_call
from evals.records import served_draws, started_at
from memory.notebook import EvalRecord, Notebook, ToolCall
from memory.records import (
    Adjustment,
    AuditPayload,
    BarsSpec,
    BarVerdict,
    ClearSuitePayload,
    CompareRefusal,
    Decision,
    FloorRule,
    LookPayload,
    Rule,
)
from memory.state import Floor, RegisteredBars, SessionState, fold

# Metrics entries that name the rules a scorer applied (evals/constraints.py: plain vs ifeval).
SCORING_MODE_KEY = "scoring_mode"
_OPS = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt}
_TESTS = {"mcnemar_exact": stats.mcnemar_exact, "paired_t": stats.paired_t, "wilcoxon": stats.wilcoxon}


class CompareOutcome(BaseModel):
    """The result of compare: refused with reasons, or per-bar verdicts and the decision."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    refused: bool = Field(description="True when the comparison was refused.")
    reasons: list[str] = Field(description="Why it was refused (empty otherwise).")
    verdicts: list[BarVerdict] = Field(description="Per-bar verdicts (empty when refused).")
    cleared: bool = Field(description="True only if every bar holds (a verdict: the incumbent does not move).")
    comparison_id: int | None = Field(description="Notebook comparison row (None when refused or unresolved).")
    unresolved: bool = Field(False, description="The look left it unresolved: no verdict, nothing spent; more "
                             "evidence may be bought and a later look asked.")
    looks: list[LookPayload] = Field(default_factory=list, description="This look of each p bar (sequential bars).")


class ComparisonVerdict(BaseModel):
    """A comparison judged (not refused): the per-bar verdicts and what they decide."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    candidate: int = Field(description="Candidate artifact id.")
    incumbent: int = Field(description="Incumbent artifact id.")
    bars_id: int = Field(description="bars row judged by.")
    verdicts: list[BarVerdict] = Field(description="One verdict per bar, in the bars file's order.")
    cleared: bool = Field(description="True only if every bar holds.")
    adjustment: Adjustment = Field(description="Holm adjustment: family, tested count, raw and adjusted p-values, "
                                   "and the looks taken.")
    rationale: str = Field(description="One line: all bars hold, or which failed.")
    looks: list[LookPayload] = Field(default_factory=list, description="Each p bar's look (bars with looks > 1).")
    unresolved: bool = Field(False, description="The look left the comparison unresolved: no verdict is recorded.")
    audits: list[AuditPayload] = Field(default_factory=list, description="Suite-audit findings this comparison made.")


class _Refused(Exception):
    pass


def _first(nb: Notebook, session: str, artifact_id: int, suite: str, fingerprint: str | None) -> EvalRecord:
    """The first full (replicate 0) eval of a suite at served decoding (`fingerprint`, if given).

    The first, not the latest: with sampled decoding a re-run is a new draw, and picking the
    latest would let an agent re-evaluate a candidate until chance favours it.
    """
    evs = [e for e in nb.evals(artifact_id=artifact_id, suite=suite, session=session)
           if e.replicate == 0 and e.served and fingerprint in (None, e.decoding_sha256)]
    if not evs:
        raise _Refused(f"artifact {artifact_id} has no eval of suite {suite} at its served decoding in session {session}")
    return evs[0]


def _same_weights(nb: Notebook, artifact_id: int) -> list[int]:
    """Ids of every artifact with the same weights (sha256) as `artifact_id`, itself included."""
    return [a.id for a in nb.artifacts(sha256=nb.artifact(artifact_id).sha256)]


def _check_candidate(nb: Notebook, session: str, candidate: int, bars: RegisteredBars, served: Decoding) -> list[str]:
    """Reasons to refuse found in the candidate's evals on the bars' suites."""
    reasons = []
    twins = _same_weights(nb, candidate)
    for suite in sorted({r.suite for r in bars.rules}):
        evs = nb.evals(artifact_id=candidate, suite=suite, session=session)
        looks = [e for twin in twins for e in nb.evals(artifact_id=twin, suite=suite, session=session)]
        for ev in sorted(looks, key=lambda e: e.id):
            # Any look at the candidate's weights on a bar's suite before the bars existed taints
            # them, also under another artifact id (the same checkpoint registered twice).
            if started_at(nb, ev) < bars.registered_at:
                reasons.append(f"bars registered at {bars.registered_at}, after eval {ev.id} ({suite}, artifact "
                               f"{ev.artifact_id}) began")
        others = sorted({e.decoding_sha256[:12] for e in evs if e.decoding_sha256 != served.fingerprint()})
        if others and not any(e.decoding_sha256 == served.fingerprint() and e.served for e in evs):
            reasons.append(f"suite {suite} was evaluated only at decoding {', '.join(others)}, "
                           f"not the candidate's served decoding {served.fingerprint()[:12]}")
    return reasons


def _mean_values(nb: Notebook, session: str, first: EvalRecord, bar: Rule, draws: int) -> dict[str, float]:
    """item id -> the metric's value in `first` (a side's first look), or its mean over the side's replicates
    0 .. draws-1 at the same decoding (the first eval of each index); one look under greedy decoding."""
    if draws == 1 or Decoding.model_validate(first.decoding).greedy:
        return first.values(bar.metric)
    found = served_draws(nb, session, first.artifact_id, bar.suite, first.decoding_sha256)
    missing = [k for k in range(draws) if k not in found]
    if missing:
        raise _Refused(f"suite {bar.suite}: the bars read the mean of {draws} served draws a side, and artifact "
                       f"{first.artifact_id} lacks replicate(s) {missing} (evaluate it with replicates = {draws})")
    values = [found[k].values(bar.metric) for k in range(draws)]
    if any(set(v) != set(values[0]) for v in values):
        raise _Refused(f"suite {bar.suite}: the replicates of artifact {first.artifact_id} scored different items")
    return {i: sum(v[i] for v in values) / draws for i in values[0]}


def _pairs(nb: Notebook, session: str, candidate: int, incumbent: int, bar: Rule,
           served: Decoding, replicates: int = 1) -> tuple[list[float], list[float], EvalRecord, EvalRecord]:
    """Per-item values of both sides lined up by item id (each bar other than a p bar averaged over `replicates`
    served draws a side), and the incumbent's and the candidate's evals (their first looks) they came from."""
    sides, missing = [], []
    for artifact_id, fingerprint in ((candidate, served.fingerprint()), (incumbent, None)):
        try:
            sides.append(_first(nb, session, artifact_id, bar.suite, fingerprint))
        except _Refused as refusal:
            missing.extend(refusal.args)
    if missing:  # both sides named when both lack the eval
        raise _Refused(*missing)
    cand_eval, inc_eval = sides
    draws = 1 if bar.statistic == "p" else replicates
    cand = _mean_values(nb, session, cand_eval, bar, draws)
    inc = _mean_values(nb, session, inc_eval, bar, draws)
    modes = (_scoring_mode(cand_eval), _scoring_mode(inc_eval))
    if modes[0] != modes[1]:
        raise _Refused(f"suite {bar.suite}: candidate eval {cand_eval.id} was scored in mode {modes[0]}, incumbent "
                       f"eval {inc_eval.id} in mode {modes[1]}: values of different scoring modes cannot be paired")
    if not cand or set(cand) != set(inc):
        only_cand, only_inc = sorted(set(cand) - set(inc))[:5], sorted(set(inc) - set(cand))[:5]
        raise _Refused(f"suite {bar.suite}: candidate and incumbent have different items with metric {bar.metric} "
                       f"(only candidate: {only_cand}, only incumbent: {only_inc})")
    ids = sorted(cand)
    return [cand[i] for i in ids], [inc[i] for i in ids], inc_eval, cand_eval


def _looks(nb: Notebook, session: str, cand_eval: EvalRecord, inc: list[float], bar: Rule, look: int,
           weights: list[float], reserve: tuple[list[float], list[float]] | None = None) -> list[tuple[int, float, float]]:
    """(n, raw p, weight) of looks 1 .. `look` of a p bar: look i pairs the per-item mean of the candidate's served
    draws 0 .. i-1 (the items of its first look) with the incumbent's first look. With `reserve` (the candidate's and
    the incumbent's values on the reserve's items), the last look is the reserve look: the means of draws 0 .. look-2
    and the reserve's items, against the incumbent's first looks at both."""
    out = []
    for i in range(1, look + 1):
        at_reserve = reserve is not None and i == look
        means = _mean_values(nb, session, cand_eval, bar, i - 1 if at_reserve else i)
        cand = [means[k] for k in sorted(means)]
        if len(cand) != len(inc):
            raise _Refused(f"suite {bar.suite}: the draws of artifact {cand_eval.artifact_id} scored other items")
        base = inc
        if at_reserve:
            cand, base = cand + reserve[0], inc + reserve[1]
        out.append((len(cand), _TESTS[bar.test](cand, base, alternative="greater").p_value, weights[i - 1]))
    return out


def _reserve_problems(state: SessionState, nb: Notebook, candidate: int, incumbent: int, bars: RegisteredBars,
                      k: int, reserve: bool) -> list[str]:
    """Why the look's evidence is not the registered one: a reserve look must be the last registered look of a session
    whose split holds a reserve; a last look must read the reserve once the candidate has a reserve draw of a p bar's
    suite against this incumbent (else its data would be read, then left out)."""
    spec = bars.spec
    if reserve:
        if state.split is None or not state.split.reserve:
            return ["a reserve look reads the split's reserve, and this session's split holds none"]
        if k != spec.looks or spec.looks < 2:
            return [f"a reserve look is the last registered look (look {spec.looks} of {spec.looks}, after at least one "
                    f"look of the dev holdout alone); look {k} was asked"]
        return []
    if spec.looks < 2 or k != spec.looks or state.split is None or not state.split.reserve:
        return []
    drawn = [r.suite for r in bars.rules if r.statistic == "p" and any(
        e.served for e in nb.evals(artifact_id=candidate, suite=reserve_suite(r.suite), session=state.session))
        and nb.evals(artifact_id=incumbent, suite=reserve_suite(r.suite), session=state.session)]
    return [f"the candidate has a reserve draw of {', '.join(drawn)}: the last look reads it (ask it as the reserve "
            "look)"] if drawn else []


def sequential_p(looks: list[tuple[float, float]]) -> float:
    """The p-value of a p bar read at several looks: min over the looks taken of p_i / w_i, capped at 1, where w_i is
    look i's registered share of the alpha (sum <= 1). A weighted Bonferroni bound: P(p* <= u) <= sum_i u w_i <= u
    under H0 whatever the dependence between looks and whenever the looks stop (evals/bars.py)."""
    return min(1.0, min(p / w for p, w in looks))


def _loss_margin(bar: Rule) -> bool:
    """A guard the suite audit may widen: a noise-floor bar that allows a loss (`delta >= -k` floors, or `<= +k` for a
    lower-is-better metric)."""
    return bar.statistic != "p" and bar.in_noise_units and (bar.value < 0 if bar.op in (">=", ">") else bar.value > 0)


def _scoring_mode(ev: EvalRecord) -> str:
    """The scoring mode an eval's metrics declare: a `scoring_mode` label and/or `scoring_mode_<name>`
    flags (the constraint scorer's `scoring_mode_ifeval`, 1.0 under ifeval, 0.0 under plain);
    'none declared' for scorers with a single mode."""
    entries = {k: v for k, v in sorted(ev.metrics.items()) if k.startswith(SCORING_MODE_KEY)}
    return ", ".join(f"{k}={v}" for k, v in entries.items()) or "none declared"


def _statistic(bar: Rule, cand: list[float], inc: list[float]) -> float:
    match bar.statistic:
        case "delta":
            return sum(c - i for c, i in zip(cand, inc, strict=True)) / len(cand)
        case "t":
            return stats.paired_t(cand, inc).statistic
        case "p":
            # One-sided: a p bar asks "is the candidate better?"; a two-sided p would let a
            # significantly worse candidate clear it.
            return _TESTS[bar.test](cand, inc, alternative="greater").p_value
        case "ci_low" | "ci_high":
            res = stats.paired_bootstrap(cand, inc, confidence=bar.confidence)
            return res.ci_low if bar.statistic == "ci_low" else res.ci_high


def _incumbent_floor(state: SessionState, bar: Rule, inc_eval: EvalRecord) -> Floor:
    """The FIRST floor of the bar's suite/metric calibrated on the incumbent at its compared decoding.

    A floor measured on another model or decoding (say a noisier, high-temperature one) would widen
    the bar at will, and so would recalibrating until a wide floor comes up: the first one counts.
    """
    if state.first_floor(bar.suite, bar.metric) is None:
        raise _Refused(f"bar on {bar.suite}/{bar.metric} is in noise-floor units but no noise floor was calibrated")
    floor = state.floor(bar.suite, bar.metric, inc_eval.artifact_id, inc_eval.decoding_sha256)
    if floor is None:
        raise _Refused(f"no noise floor of {bar.suite}/{bar.metric} was calibrated on the incumbent "
                       f"(artifact {inc_eval.artifact_id}) at decoding {inc_eval.decoding_sha256[:12]}; calibrate it")
    return floor


def _threshold(state: SessionState, bar: Rule, inc_eval: EvalRecord, rule: FloorRule) -> tuple[float, Floor | None]:
    """The bar's threshold, and the floor it is written in; noise-floor units only from the incumbent's own
    calibration (invariant 3), in the unit `Floor.unit` gives under the bars' floor rule."""
    if not bar.in_noise_units:
        return bar.value, None
    floor = _incumbent_floor(state, bar, inc_eval)
    unit = floor.unit(rule)
    demands_margin = bar.value > 0 if bar.op in (">=", ">") else bar.value < 0
    if unit == 0 and demands_margin:
        # A zero floor turns "beat the incumbent by k noise floors" into "do not lose", so no
        # margin is demanded; bars that allow a loss of k floors only get stricter, and stand.
        raise _Refused(f"noise floor {floor.record.id} of {bar.suite}/{bar.metric} is 0 (identical replicates): "
                       f"the margin of {bar.value} noise floors would vanish")
    return bar.value * unit, floor


def _widened(state: SessionState, bars: RegisteredBars, bar: Rule, threshold: float) -> tuple[float, bool]:
    """The threshold a guard reads: its registered one, or `audit_margin` times it while its suite is flagged."""
    if bars.spec.audit_margin is None or not _loss_margin(bar) or state.flagged(bar.suite) is None:
        return threshold, False
    return threshold * bars.spec.audit_margin, True


def _holm(state: SessionState, raw: list[float], family_size: int | None) -> tuple[list[float], Adjustment]:
    """Adjust this comparison's p-values within the session's pre-registered family of p-values."""
    if raw and state.p_family.size != family_size:
        raise _Refused(f"p_family {family_size} differs from the session's pre-registered family "
                       f"of {state.p_family.size} p-values")
    prior = state.tested
    seen = [p for _, p in prior] + raw
    if raw and len(seen) > family_size:
        raise _Refused(f"the session's pre-registered family of {family_size} p-values is used up "
                       f"({len(prior)} tested before, {len(raw)} more asked)")
    untested = (family_size - len(seen)) if raw else 0
    adjusted = stats.holm(seen + [1.0] * untested)[len(prior):len(seen)] if raw else []
    return adjusted, Adjustment(family_size=family_size, tested=len(seen), raw_p=raw, adjusted_p=adjusted,
                                prior_comparisons=sorted({cid for cid, _ in prior}))


def _json_float(x: float) -> float | str:
    return x if math.isfinite(x) else ("inf" if x > 0 else "-inf")


def judge(nb: Notebook, state: SessionState, candidate: int, incumbent: int, bars: RegisteredBars,
          served: Decoding, look: int | None = None, reserve: bool = False) -> ComparisonVerdict | Refusal:
    """Judge `candidate` against `incumbent` by `bars` at the candidate's `served` decoding; writes nothing.

    Reads the session's evals, and from its state (`fold`) its noise floors, earlier p-values and flagged suites.
    `bars` are typed registered bars (usually `state.bars`), so replay can ask what other bars would have decided.
    `look`: the policy's look j at the p bars (sequential bars; may end unresolved); None: one look, decided.
    `reserve`: look j is the reserve look (the last registered one; see the module docstring).
    A refusal lists every reason found, candidate checks first, then each bar in order.
    """
    session, spec = state.session, bars.spec
    reasons = _check_candidate(nb, session, candidate, bars, served)
    if state.registered(bars.id) is None:
        reasons.append(f"bars {bars.id} were not registered in session {session}")
    k = look or 1
    if k > spec.looks:
        reasons.append(f"look {k} is past the {spec.looks} look(s) the bars registered")
    reasons += _reserve_problems(state, nb, candidate, incumbent, bars, k, reserve)
    rows, looks, drawn = [], {}, {}
    for bar in bars.rules:
        try:
            cand, inc, inc_eval, cand_eval = _pairs(nb, session, candidate, incumbent, bar, served, bars.replicates)
            threshold, floor = _threshold(state, bar, inc_eval, bars.floor_unit)
            value = _statistic(bar, cand, inc)
            if bar.statistic == "p" and k <= spec.looks and (spec.looks > 1 or k > 1):
                extra = None
                if reserve:  # the candidate's and the incumbent's first looks at the reserve's items
                    at = bar.model_copy(update={"suite": reserve_suite(bar.suite)})
                    extra = _pairs(nb, session, candidate, incumbent, at, served)[:2]
                    drawn[len(rows)] = len(extra[0])
                looks[len(rows)] = _looks(nb, session, cand_eval, inc, bar, k, spec.look_weights(), extra)
                value = sequential_p([(p, w) for _, p, w in looks[len(rows)]])
            rows.append((bar, looks[len(rows)][-1][0] if len(rows) in looks else len(cand), value, threshold, floor))
        except _Refused as refusal:
            reasons.extend(refusal.args)
    try:
        adjusted, adjustment = _holm(state, [row[2] for row in rows if row[0].statistic == "p"], bars.p_family)
    except _Refused as refusal:
        reasons.extend(refusal.args)
    if reasons:
        return Refusal(payload=CompareRefusal(candidate=candidate, incumbent=incumbent, bars_id=bars.id,
                                              reasons=list(dict.fromkeys(reasons))))
    verdicts, p_index, widened = [], 0, []
    for bar, n, value, threshold, floor in rows:
        raw_p = None
        if bar.statistic == "p":
            raw_p, value, p_index = value, adjusted[p_index], p_index + 1
        threshold, wide = _widened(state, bars, bar, threshold)
        widened.append(wide)
        verdicts.append(BarVerdict(bar=bar, n=n, value=_json_float(value), raw_p=raw_p, threshold=threshold,
                                   holds=_OPS[bar.op](value, threshold),
                                   floor=None if floor is None else floor.unit(bars.floor_unit),
                                   floor_id=None if floor is None else floor.record.id))
    verdicts, audits = _audit(state, bars, candidate, incumbent, verdicts, widened)
    cleared = all(v.holds for v in verdicts)
    unresolved = look is not None and not cleared and _may_continue(spec, k, verdicts, looks, widened)
    if looks:
        adjustment = adjustment.model_copy(update={"looks": {i: list(found) for i, found in looks.items()},
                                                   "look": k, "max_looks": spec.looks,
                                                   "reserve": sum(drawn.values()) if drawn else None})
    look_rows = [_look_payload(candidate, incumbent, bars, verdicts[i], found, unresolved, drawn.get(i))
                 for i, found in looks.items()]
    failed = [f"{v.bar.target} {v.bar.statistic}" for v in verdicts if not v.holds]
    rationale = "all bars hold" if cleared else "bars failed: " + ", ".join(failed)
    if unresolved:
        rationale = f"unresolved at look {k} of {spec.looks}: " + ", ".join(failed)
    return ComparisonVerdict(candidate=candidate, incumbent=incumbent, bars_id=bars.id, verdicts=verdicts,
                             cleared=cleared, adjustment=adjustment, rationale=rationale, looks=look_rows,
                             unresolved=unresolved, audits=audits)


def _audit(state: SessionState, bars: RegisteredBars, candidate: int, incumbent: int, verdicts: list[BarVerdict],
           widened: list[bool]) -> tuple[list[BarVerdict], list[AuditPayload]]:
    """The suite audit: a guard not flagged yet that fails while every p bar holds flags its suite, and is read at
    `audit_margin` times its margin (the verdicts with those guards re-read, and the findings)."""
    margin = bars.spec.audit_margin
    p_bars = [v for v in verdicts if v.bar.statistic == "p"]
    if margin is None or not p_bars or not all(v.holds for v in p_bars):
        return verdicts, []
    judge_bar = min(p_bars, key=lambda v: float(v.value))
    out, audits = [], []
    for v, wide in zip(verdicts, widened, strict=True):
        if v.holds or wide or not _loss_margin(v.bar) or isinstance(v.value, str):
            out.append(v)
            continue
        audits.append(AuditPayload(suite=v.bar.suite, metric=v.bar.metric, candidate=candidate, incumbent=incumbent,
                                   bars_id=bars.id, judge_target=judge_bar.bar.target,
                                   judge_adjusted_p=float(judge_bar.value), guard_value=v.value,
                                   guard_threshold=v.threshold, widened_threshold=v.threshold * margin))
        out.append(v.model_copy(update={"threshold": v.threshold * margin,
                                        "holds": _OPS[v.bar.op](v.value, v.threshold * margin)}))
    return out, audits


def _may_continue(spec: BarsSpec, k: int, verdicts: list[BarVerdict], looks: dict, widened: list[bool]) -> bool:
    """Whether look k may leave the comparison unresolved: a later look is registered, some p bar fails, every p
    bar's raw p at this look is at most `continue_p` (the candidate leads), and every other bar holds or, where the
    audit may widen it, holds at the widened margin (it would, once the p bars hold)."""
    if k >= spec.looks or not looks or not any(not v.holds for v in verdicts if v.bar.statistic == "p"):
        return False
    if any(found[-1][1] > spec.continue_p for found in looks.values()):
        return False
    for v, wide in zip(verdicts, widened, strict=True):
        if v.bar.statistic == "p" or v.holds:
            continue
        could = (spec.audit_margin is not None and not wide and _loss_margin(v.bar) and not isinstance(v.value, str)
                 and _OPS[v.bar.op](v.value, v.threshold * spec.audit_margin))
        if not could:
            return False
    return True


def _look_payload(candidate: int, incumbent: int, bars: RegisteredBars, verdict: BarVerdict,
                  found: list[tuple[int, float, float]], unresolved: bool, reserve: int | None = None) -> LookPayload:
    n, p, w = found[-1]
    outcome = "continue" if unresolved else "decided"
    where = (f"reserve look: {n - reserve} dev holdout item(s) on {len(found) - 1} draw(s) and {reserve} reserve "
             "prompt(s) drawn for it; " if reserve is not None else "")
    why = (f"{where}p*={verdict.raw_p:.4g} (min of p/w over {len(found)} look(s)), Holm-adjusted "
           f"{float(verdict.value):.4g} {'<=' if verdict.holds else '>'} {verdict.threshold:g}: "
           + ("unresolved, more evidence may be bought" if unresolved else ("holds" if verdict.holds else "fails")))
    return LookPayload(candidate=candidate, incumbent=incumbent, bars_id=bars.id, target=verdict.bar.target,
                       look=len(found), looks=bars.spec.looks, n=n, raw_p=p, weight=w, sequential_p=verdict.raw_p,
                       adjusted_p=float(verdict.value), threshold=verdict.threshold, outcome=outcome, reason=why,
                       reserve=reserve)


def record(nb: Notebook, session: str, judgment: ComparisonVerdict | Refusal, *,
           tool_call: ToolCall | None = None) -> CompareOutcome:
    """Write a judgment's outcome and close `tool_call` with it, all in one transaction: one refuse decision; or its
    audit findings, each p bar's look, and (unless the look left it unresolved) the comparison row with its
    promote/reject verdict."""
    with nb.transaction():
        if isinstance(judgment, Refusal):
            outcome = CompareOutcome(refused=True, reasons=judgment.reasons, verdicts=[], cleared=False,
                                     comparison_id=None)
            decision = nb.record_decision(session, "refuse", "comparison refused: " + "; ".join(judgment.reasons),
                                          judgment.payload)
            close_tool_call(nb, tool_call, decision, "refused", outcome)
            return outcome
        for finding in judgment.audits:
            nb.record_decision(session, "audit", f"suite audit: {finding.suite}/{finding.metric} fails its guard "
                               f"({finding.guard_value:.4g} vs {finding.guard_threshold:.4g}) on a candidate the judge "
                               f"prefers ({finding.judge_target} adjusted p {finding.judge_adjusted_p:.4g}): the guard "
                               f"holds at {finding.widened_threshold:.4g} until a person clears the suite", finding)
        decision = None
        for look in judgment.looks:
            decision = nb.record_decision(session, "look", f"{look.target} look {look.look} of {look.looks}: "
                                          f"{look.reason}", look)
        comparison_id = None
        if not judgment.unresolved:
            row, decision = nb.add_comparison(
                session=session, candidate=judgment.candidate, incumbent=judgment.incumbent,
                bars_id=judgment.bars_id, verdicts=judgment.verdicts, promoted=judgment.cleared,
                adjustment=judgment.adjustment, rationale=judgment.rationale)
            comparison_id = row.id
        outcome = CompareOutcome(refused=False, reasons=[], verdicts=judgment.verdicts, cleared=judgment.cleared,
                                 comparison_id=comparison_id, unresolved=judgment.unresolved, looks=judgment.looks)
        close_tool_call(nb, tool_call, decision, "done", outcome)
    return outcome


def compare(nb: Notebook, session: str, candidate: int, incumbent: int, bars_id: int, served: Decoding, *,
            tool_call: ToolCall | None = None, look: int | None = None, reserve: bool = False) -> CompareOutcome:
    """Judge and record in one transaction: no other writer can add a comparison (and shift the
    Holm family) between the judgment and its record. `bars_id` must be bars registered in the session; `look`: the
    policy's look at the p bars under sequential bars (None: one look, decided); `reserve`: it is the reserve look."""
    with nb.transaction():
        state = fold(nb, session)
        bars = state.registered(bars_id)
        if bars is None:
            judgment = Refusal(payload=CompareRefusal(candidate=candidate, incumbent=incumbent, bars_id=bars_id,
                                                      reasons=[f"bars {bars_id} were not registered in session "
                                                               f"{session}"]))
        else:
            judgment = judge(nb, state, candidate, incumbent, bars, served, look, reserve)
        return record(nb, session, judgment, tool_call=tool_call)


class SuiteNotFlagged(ValueError):
    """clear_suite was asked for a suite with no suite-audit finding in force: nothing was written."""


def clear_suite(nb: Notebook, session: str, suite: str, by: str, note: str) -> Decision:
    """A person clears a flagged suite: its guards read their registered margin again (the `clear_suite` decision,
    returned). Refused (SuiteNotFlagged) when the suite has no finding in force in the session.

        python run_agent.py clear-suite SESSION SUITE --lab LAB --by NAME --reason TEXT   (agent/clearing.py)
    """
    with nb.transaction():
        if fold(nb, session).flagged(suite) is None:
            raise SuiteNotFlagged(f"suite {suite!r} is not flagged by a suite audit in force in session {session}")
        return nb.record_decision(session, "clear_suite", f"{by} cleared suite {suite}: {note}",
                                  ClearSuitePayload(suite=suite, by=by, note=note))
