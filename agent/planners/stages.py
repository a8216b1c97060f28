"""The steps the playbook's policies are made of: a stage (make candidates, screen them, judge the finalists under
the bars), evaluations, replicate draws, comparisons and promotions, trajectory selection and merges. Each is a
generator over the summary that yields the steps still to take, in order; the policy takes the first one.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from agent.planners import ToolCall
from agent.planners.policy import PlaybookSettings
from agent.summary import Summary

# Each first arm's data, from the lab's own: its feedback, or (RFT) its own verified pool. A family whose data the
# lab lacks is skipped, and the skip recorded; nothing is generated in its place.
BUILDERS = {"sft": "winner_sft", "dpo": "battle_pairs", "klce": "winner_sft", "rft": "verified_pool"}
NO_POOL = ("the lab has no [[data]] pool of kind \"verified\": RFT samples answers to the lab's own verified items, "
           "and nothing else is used in their place")


def proposal(tool: str, args: dict[str, Any], why: str) -> ToolCall:
    return ToolCall(tool=tool, args=args, rationale=why)


def skipped(s: Summary, step: str, reason: str) -> Iterator[ToolCall]:
    """The `skip` step that records a planned step not taken and why (tools/skip.py), unless it is recorded
    already; returns nothing either way, so the caller goes on without the step."""
    args = {"step": step[:200], "reason": reason if len(reason) <= 500 else reason[:497] + "..."}
    if s.call("skip", args) is None and s.refused("skip", args) is None:
        yield proposal("skip", args, f"skip {args['step']}: {args['reason']}")


def reference_suites(s: Summary) -> set[str]:
    """The suites whose eval scores a candidate against the incumbent's own answers (the judge suites), read off
    the calibrations, which generate those answers. An eval on one reads the incumbent's calibration whatever bar
    holds that suite: a p bar, or a delta bar on the judged holdout."""
    return {name for c in s.calls if c.tool == "calibrate" and c.status == "done"
            for name in c.data.get("reference", {})}


def noted(steps: Iterator[ToolCall], note: str | None) -> Iterator[ToolCall]:
    """The steps, the first one's rationale led by `note` (a choice the protocol made without a step of its own)."""
    for step in steps:
        yield step.model_copy(update={"rationale": f"{note}; next: {step.rationale}"}) if note else step
        note = None


def trajectory_selection(s: Summary, cfg: PlaybookSettings, runs: list[tuple[float, ToolCall]]) -> Iterator[ToolCall]:
    """Trajectory selection over the best run's snapshots (see the module docstring). Returns the one-line note of a
    selection that kept the run's final checkpoint, while no step was taken after it; else None."""
    cheap, judged = s.bars.suites()
    found = best_run(s, runs) if cfg.selects_trajectory and cheap else None
    if found is None:
        return None
    final, snaps = found
    for step, snap in snaps:
        yield from evaluate_step(s, snap, cheap, f"trajectory selection: screen {snap.name}, step {step} of the best run "
                             f"{final.name} (screened {screen_score(s, final):+.2f}), on the cheap suites {', '.join(cheap)}")
    screened = [(step, snap) for step, snap in snaps if has_metrics(snap, cheap)]
    if not screened:
        return None  # every snapshot's screen failed or was refused: nothing to select from
    step, best = max(screened, key=lambda t: (screen_score(s, t[1]), -t[0]))  # a tie goes to the earlier snapshot
    mine, theirs = screen_score(s, best), screen_score(s, final)
    line = (f"trajectory selection: {best.name} (step {step} of {final.name}) screened {mine:+.2f} noise floors, "
            f"the run's final checkpoint {theirs:+.2f}")
    if compare_call(s, best.id) is not None or (mine > max(theirs, 0.0) and best.id != s.incumbent):
        yield from evaluate_step(s, best, judged, f"{line}: the snapshot goes on to the judged holdout")
        yield from judge(s, cfg, best, judged, line)
        return None
    screens = [c.id for c in s.calls if c.tool == "evaluate" and c.args.get("artifact") in {x.id for _, x in snaps}]
    if any(c.id > max(screens, default=0) for c in s.calls):
        return None  # a step was taken since: the choice is on record in that step's rationale
    return f"{line}: kept the final checkpoint (a snapshot must screen above it and above the incumbent)"


def best_run(s: Summary, runs: list[tuple[float, ToolCall]]) -> tuple[Any, list[tuple[int, Any]]] | None:
    """The best-screened run (first arms and sweep; a tie goes to the earlier) that saved snapshots: its final
    checkpoint and [(step, snapshot)]."""
    for _, producer in sorted(runs, key=lambda t: -t[0]):
        call = s.call(producer.tool, producer.args)
        final = s.checkpoint(call.data.get("artifact_id", -1)) if call is not None else None
        snaps = [(e["step"], s.checkpoint(e["artifact_id"])) for e in (call.data.get("snapshots", []) if call else [])]
        if final is not None:
            return (final, [(k, c) for k, c in snaps if c is not None]) if snaps else None
    return None


def run_stage(s: Summary, cfg: PlaybookSettings, producers: list[ToolCall]) -> Iterator[ToolCall]:
    """One stage: make every candidate, then judge them by the policy's stage rule. Returns the (score, producer)
    of every candidate made, best first."""
    made = []
    for producer in producers:
        if s.refused(producer.tool, producer.args) is not None:
            continue  # a gate said no (the budget, most often): never proposed again
        call = s.call(producer.tool, producer.args)
        if call is None or call.status == "open":  # not run yet, or interrupted: (re)run it
            yield producer
            return []
        cand = s.checkpoint(call.data.get("artifact_id", -1)) if call.status == "done" else None
        if cand is not None:
            made.append((cand, producer))
    cheap, judged = s.bars.suites()
    if cfg.stage == "judge_every" or not cheap:
        return (yield from _judge_every(s, cfg, made))
    for cand, _ in made:
        yield from evaluate_step(s, cand, cheap, f"screen {cand.name} on the cheap suites {', '.join(cheap)}")
    ranked = sorted(((screen_score(s, c), n, c, p) for n, (c, p) in enumerate(made) if has_metrics(c, cheap)),
                    key=lambda t: (-t[0], t[1]))
    result = [(score, p) for score, _, _, p in ranked]
    if cfg.stage == "best_of_stage":
        yield from _best_of_stage(s, cfg, [(c, p) for _, _, c, p in ranked], judged)
    else:
        yield from _first_cleared(s, cfg, [c for _, _, c, _ in ranked], judged)
    return result


def _judge_every(s: Summary, cfg: PlaybookSettings, made: list) -> Iterator[ToolCall]:
    """No screen: every candidate on every suite, compared and promoted in order; ranked by the primary bar."""
    for cand, _ in made:
        yield from judge(s, cfg, cand, None, primary_line(s, cand))
    scored = [(primary_score(s, c.id), p) for c, p in made]
    return sorted(((x, p) for x, p in scored if x is not None), key=lambda t: -t[0])


def finalists_of(s: Summary, cfg: PlaybookSettings, ranked: list) -> tuple[list, int]:
    """The stage's finalists (those compared already, then the best-screened, `finalists` of them plus one fallback
    per rejected finalist; under the `above_incumbent` rule only those that screen above the incumbent), and how
    many were rejected."""
    compared = [c for c in ranked if compare_call(s, c.id) is not None]
    gated = cfg.finalist_rule == "above_incumbent"
    hopeful = [c for c in ranked if (screen_score(s, c) > 0 or not gated) and c.id != s.incumbent and c not in compared]
    rejected = sum(was_rejected(s, c) for c in compared)
    return (compared + hopeful)[:max(cfg.finalists + min(cfg.fallbacks, rejected), len(compared))], rejected


def _first_cleared(s: Summary, cfg: PlaybookSettings, ranked: list, judged: list[str]) -> Iterator[ToolCall]:
    """Finalists in screen order, each promoted as soon as it clears, the next one then judged against it."""
    finalists, rejected = finalists_of(s, cfg, ranked)
    compared = [c for c in ranked if compare_call(s, c.id) is not None]
    for cand in finalists:
        yield from judge(s, cfg, cand, judged, f"screened {screen_score(s, cand):+.2f} noise floors against the incumbent"
                          + (f" (a fallback: {rejected} finalist(s) of this stage rejected)"
                             if cand not in compared[:cfg.finalists] and rejected else ""))


def _best_of_stage(s: Summary, cfg: PlaybookSettings, ranked: list, judged: list[str]) -> Iterator[ToolCall]:
    """Every finalist's judged holdout first (one served look each, against the stage's incumbent), then the
    finalists in order of their judged score go under the bars (replicate draws, comparison, promotion) until one
    is promoted: the leader, or the next when the bars reject it. The cheap suites that chose the finalists measure
    stopping, looping and verified answers, not the win rate; the holdout is the suite nearest it. Replicates and
    p-values go to the leader first. Testing the leader of k looks on those same looks stays inside the bars' error
    rate because `comparisons()` counts every finalist in the family: its rejection is one of the k finalists' own
    tests rejecting, which the family already pays for."""
    if any(s.call("promote", {"candidate": c.id}) is not None for c, _ in ranked):
        return  # the stage made its choice
    finalists, _ = finalists_of(s, cfg, [c for c, _ in ranked])
    if not s.view.p_family.fits_one_more:  # no comparison can follow: no holdout look for a finalist not compared yet
        finalists = [c for c in finalists if compare_call(s, c.id) is not None]
    for cand in finalists:
        yield from evaluate_step(s, cand, judged, f"judged holdout of finalist {cand.name} (screened {screen_score(s, cand):+.2f} "
                             "noise floors against the incumbent)" + (": every finalist's look before any comparison"
                                                                   if len(finalists) > 1 else ""))
    looked = sorted((c for c in finalists if has_metrics(c, judged)), key=lambda c: (-judged_score(s, c), -screen_score(s, c), c.id))
    for n, cand in enumerate(looked):
        others = "".join(f"; {c.name} {judged_score(s, c):.3f}" for c in looked if c is not cand)
        yield from judge(s, cfg, cand, judged, f"{'leads' if n == 0 else 'next on'} the stage's judged holdout "
                          f"({judged_score(s, cand):.3f}{others})" + (", the finalists above it rejected" if n else ""))


def judge(s: Summary, cfg: PlaybookSettings, cand, suites: list[str] | None, why: str) -> Iterator[ToolCall]:
    """Evaluate the candidate on `suites` (None: every open suite), compare it with the incumbent, promote it. Under
    the `sequential` evidence rules (versions 6 and 7) the comparison goes look by look (`looked`)."""
    ok = yield from evaluate_step(s, cand, suites, f"evaluate {cand.name} at its served decoding")
    if not ok:
        return
    ok = yield from replicated(s, cand)
    if not ok:
        return
    if cfg.evidence in ("sequential", "sequential_reserve") and s.bars.spec.looks > 1:
        decided = yield from looked(s, cand, why, reserve_look(s, cfg))
        if not decided:
            return
    else:
        compared = s.call("compare", {"candidate": cand.id})
        if compared is None or compared.status == "open":
            if s.refused("compare", {"candidate": cand.id}) is not None or not s.view.p_family.fits_one_more:
                return  # no p-value left in the pre-registered family: the candidate is not judged
            yield proposal("compare", {"candidate": cand.id},
                        f"compare {cand.name} ({why}) with incumbent {s.incumbent} under the bars")
            return
    eligibility = s.view.promotion(cand.id)  # the one eligibility rule (memory/state.py)
    if eligibility.promotable and s.call("promote", {"candidate": cand.id}) is None \
            and s.refused("promote", {"candidate": cand.id}) is None:
        verdict = next(v for v in cand.verdicts if v.comparison_id == eligibility.comparison_id)
        yield proposal("promote", {"candidate": cand.id}, f"{cand.name} cleared every bar: " + "; ".join(verdict.lines()))


def reserve_look(s: Summary, cfg: PlaybookSettings) -> bool:
    """Whether a comparison's last registered look is the reserve look (version 7): the split holds a reserve and
    every p bar reads a suite of the dev holdout's prompts, which the reserve's extend. Fixed by the split (made at
    ingest, before any score) and the policy's version: never chosen after a look."""
    split = s.split
    return (cfg.evidence == "sequential_reserve" and split is not None and split.reserve > 0
            and set(s.bars.suites()[1]) <= set(split.reserve_suites))


def looked(s: Summary, cand, why: str, reserve: bool = False) -> Iterator[ToolCall]:
    """The candidate's comparison look by look (bars registering `looks` > 1): look 1 on its first draw; while a look
    leaves it unresolved, one more served draw of the judged holdout is bought (an eval replicate, admitted by the
    budget like any job) and the next look asked. With `reserve` the last look is the reserve look: instead of another
    draw of the same prompts, the reserve's prompts are drawn (`_reserve_draw`). Returns whether a look decided (a
    verdict, or a refusal)."""
    judged, last = s.bars.suites()[1], s.bars.spec.looks
    for j in range(1, last + 1):
        at_reserve = reserve and j == last
        args = {"candidate": cand.id, "look": j} | ({"reserve": True} if at_reserve else {})
        call = s.call("compare", args)
        if call is not None and call.status != "open":
            if call.data.get("unresolved"):
                continue
            return True
        if s.refused("compare", args) is not None or not s.view.p_family.fits_one_more:
            return False  # no p-value left in the pre-registered family (or refused): the candidate is not judged
        if j > 1:
            ok = yield from (_reserve_draw(s, cand, judged) if at_reserve else _draw(s, cand, judged, j))
            if not ok:
                return False
        before = f"look {j - 1} left it unresolved, one more served draw bought; " if j > 1 else ""
        if at_reserve:
            before = (f"look {j - 1} left it unresolved after {j - 1} draw(s) of the dev holdout, so the reserve's "
                      f"{s.split.reserve} battles were drawn; ")
        yield proposal("compare", args, f"compare {cand.name} ({why}) with incumbent {s.incumbent} under the bars: "
                       f"{before}look {j} of {last} of the registered sequential rule"
                       + (", the reserve look" if at_reserve else ""))
        return False
    return True


def _reserve_draw(s: Summary, cand, suites: list[str]) -> Iterator[ToolCall]:
    """The reserve look's evidence: the incumbent's first look at the reserve split's prompts (its answers there are
    the judged suites' reference), then the candidate's; returns whether both are there. A draw the budget refuses or
    whose eval failed ends the looks, as a draw of the dev holdout does: the candidate stays unjudged."""
    for artifact, name in ((s.incumbent, f"incumbent {s.incumbent}"), (cand.id, cand.name)):
        args = {"artifact": artifact, "suites": suites, "reserve": True}
        done = s.call("evaluate", args)
        if done is not None and done.status == "done":
            continue
        if (done is None or done.status == "open") and s.refused("evaluate", args) is None:
            yield proposal("evaluate", args, f"buy evidence: {cand.name}'s comparison is unresolved after the draws "
                           f"of the dev holdout, so draw more prompts: {name}'s served answers on {', '.join(suites)} "
                           f"for the reserve split's {s.split.reserve} battles (held out at ingest, never read "
                           "before)" + (", the incumbent's first: they are the reference" if artifact != cand.id else ""))
        return False
    return True


def _draw(s: Summary, cand, suites: list[str], draws: int) -> Iterator[ToolCall]:
    """The candidate's served draws 0 .. draws-1 of the judged suites (the evidence a look reads); returns whether
    they are there. A draw the budget refuses or whose eval failed ends the looks: the candidate stays unjudged."""
    args = {"artifact": cand.id, "suites": suites, "replicates": draws}
    done = s.call("evaluate", args)
    if done is not None and done.status == "done":
        return True
    if (done is None or done.status == "open") and s.refused("evaluate", args) is None:
        yield proposal("evaluate", args, f"buy evidence: {cand.name}'s comparison is unresolved, so draw its served "
                                         f"answers on {', '.join(suites)} again (replicate {draws - 1}), judged in "
                                         "both positions against the same reference answers")
    return False


def compare_call(s: Summary, candidate: int):
    """The candidate's latest compare call, at any look (None: never compared)."""
    found = [c for c in s.calls if c.tool == "compare" and c.args.get("candidate") == candidate]
    return found[-1] if found else None


def judged_score(s: Summary, cand) -> float:
    """The candidate's mean, over the p bars, of their metric on its first served look (the judged holdout's win
    score in the toy world): higher is better, as a p bar tests that the candidate beats the incumbent."""
    values = [cand.metrics.get(r.suite, {}).get(r.metric) for r in s.bars.p_rules]
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else float("-inf")


def was_rejected(s: Summary, cand) -> bool:
    """Whether the candidate's comparison ended without a promotion (failed the bars, or was refused): the
    session state's one definition (memory/state.py `SessionState.rejected`)."""
    return s.view.rejected(cand.id)


def replicated(s: Summary, cand) -> Iterator[ToolCall]:
    """The served draws the bars average (`replicates` a side on the suites of the bars without a p-value), drawn
    before the comparison; returns whether they are there (or not needed)."""
    draws = s.bars.replicates
    suites = list(dict.fromkeys(r.suite for r in s.bars.guards))
    if draws == 1 or not suites:
        return True
    args = {"artifact": cand.id, "suites": suites, "replicates": draws}
    done = s.call("evaluate", args)
    if done is not None and done.status == "done":
        return True
    if (done is None or done.status == "open") and s.refused("evaluate", args) is None:
        yield proposal("evaluate", args, f"the bars read the mean of {draws} served draws a side on {', '.join(suites)}: "
                                      f"draw {cand.name}'s replicates up to {draws - 1} before its comparison")
    return False


def evaluate_step(s: Summary, cand, suites: list[str] | None, why: str) -> Iterator[ToolCall]:
    """The eval step the candidate still needs on `suites`; returns whether its metrics are there."""
    if has_metrics(cand, suites):
        return True
    args: dict[str, Any] = {"artifact": cand.id} | ({"suites": suites} if suites else {})
    done = s.call("evaluate", args)
    if (done is None or done.status == "open") and s.refused("evaluate", args) is None:
        yield proposal("evaluate", args, why)
    elif done is not None and done.status == "failed":  # the steps that read this eval are skipped: say so
        yield from skipped(s, f"the steps after evaluating {cand.name} on {', '.join(suites or ['every open suite'])}",
                           f"its evaluation failed ({done.summary})")
    return False  # not evaluated yet, or its evaluation failed or was refused


def has_metrics(cand, suites: list[str] | None) -> bool:
    return all(x in cand.metrics for x in suites) if suites else bool(cand.metrics)


def screen_score(s: Summary, cand) -> float:
    """Sum over the noise-floor bars of the candidate's delta from the incumbent, in noise floors, better > 0."""
    inc = s.checkpoint(s.incumbent)
    total = 0.0
    for r in s.bars.guards:
        mine, theirs = cand.metrics.get(r.suite, {}).get(r.metric), inc.metrics.get(r.suite, {}).get(r.metric)
        if mine is None or theirs is None:
            continue
        floor = s.screen_floors.get(r.target) or 1.0
        total += (mine - theirs) / floor * (1 if r.higher_is_better else -1)
    return round(total, 6)


def primary_score(s: Summary, artifact_id: int) -> float | None:
    cp, primary = s.checkpoint(artifact_id), s.bars.primary
    return cp.metrics.get(primary.suite, {}).get(primary.metric) if cp else None


def primary_line(s: Summary, cand) -> str:
    primary = s.bars.primary
    value = cand.metrics.get(primary.suite, {}).get(primary.metric)
    return f"{primary.target}={value:.3f}" if value is not None else "no primary metric"


def dataset_step(s: Summary, family: str, cfg: PlaybookSettings) -> tuple[int | None, ToolCall | None]:
    """The family's dataset id, or the step still to take: the build that makes it, or the skip of an arm whose
    data the lab lacks or whose build failed (None, None once that is recorded, or when a gate refused the build)."""
    builder = BUILDERS[family]
    args: dict[str, Any] = {"builder": builder}
    if builder == "verified_pool":
        if cfg.verified_pool is None:
            return None, next(skipped(s, f"the first {family} arm", NO_POOL), None)
        args |= {"source": cfg.verified_pool}
    if s.refused("build_dataset", args) is not None:
        return None, None
    call = s.call("build_dataset", args)
    if call is None or call.status == "open":
        return None, proposal("build_dataset", args, f"{family} arm needs {builder} data (leak-audited)")
    if call.status != "done":
        return None, next(skipped(s, f"the first {family} arm", f"its {builder} data was not built ({call.summary})"),
                          None)
    return call.data["artifact_id"], None


def train_args(s: Summary, family: str, dataset: int, cfg: PlaybookSettings, scale: float = 1.0) -> dict[str, Any]:
    """An arm's train arguments: the family from the session's parent on `dataset`, at the policy's `arm`."""
    return {"trainer": family, "parent": s.parent, "dataset": dataset} | cfg.arm(family, scale)


def cleared_trained(s: Summary) -> list[int]:
    """The parent's trained children whose verdict cleared every bar (whether or not one became the incumbent)."""
    return [c.id for c in s.checkpoints if c.origin.startswith("train:") and c.parent == s.parent
            and any(v.cleared for v in c.verdicts)]


def merges(s: Summary, cfg: PlaybookSettings) -> Iterator[ToolCall]:
    promoted = cleared_trained(s)
    if cfg.soup and len(promoted) >= 2:
        yield proposal("merge", {"method": "soup", "models": promoted}, f"soup of the promoted siblings {promoted}")
    if not promoted:
        return
    best = max(promoted, key=lambda i: (primary_score(s, i) or 0.0, -i))
    for alpha in cfg.dose_alphas:
        yield proposal("merge", {"method": "dose", "models": [s.parent, best], "alpha": alpha},
                    f"dose {alpha:g} from the parent along the best promoted arm {best}: the bars pick the knee")


def weights_incumbent(s: Summary) -> int:
    """The incumbent, or the artifact whose weights it serves when it is a serving alternative."""
    cp = s.checkpoint(s.incumbent)
    return cp.parent if cp is not None and cp.origin == "serving" and cp.parent is not None else s.incumbent
