"""The playbook planner: a deterministic research protocol distilled from the seeds' model cards.

The next step is a pure function of the notebook summary, so the same notebook always gets the same
step (what resume and replay rely on). The protocol, in order:

1. ingest and split the feedback; register the bars (bars before scores);
2. calibrate the incumbent: K >= 3 replicates on every open suite (noise before deltas; replicate 0
   is the baseline); again after a promotion, since compare reads the incumbent's own floor, but only
   when a step first reads that calibration (`calibration = when_read`): screens on the cheap suites read the
   parent's floors and the incumbent's first eval, so a promotion whose later candidates all screen out
   spends nothing on a calibration no comparison reads;
3. stop early when N arms in a row failed or missed the bars, or the budget above the reserve is
   too small for another step;
4. first arms, one per family at conservative settings, each from the session's parent: winner
   SFT on every human-preferred answer, DPO + NLL on battle pairs, KL-leashed CE (with replay when
   the lab has replay data), RFT on the lab's own verified pool (in a lab without one the arm is skipped, and
   the skip recorded: nothing is generated in its place);
5. a learning-rate sweep along the family whose first arm screened best;
6. trajectory selection: every arm saves its model at the `trajectory` steps; the best run of the first
   arms and the sweep (by screen score) has those snapshots screened, and the best snapshot goes on to the
   judged holdout and a comparison only if it screens above that run's final checkpoint (and above the
   incumbent): an arm that overshot its best point is caught without a p-value spent on every step;
7. a soup of the promoted siblings (two or more), and dose interpolation from the parent along the
   best promoted trained checkpoint (alpha < 1 backs off, alpha > 1 extrapolates); the bars pick
   the knee, since only a dose that clears them against the incumbent is promoted;
8. serving tuning with the weights fixed (decoding alternatives of the incumbent's weights);
9. stop; the graph then nominates the incumbent and opens the sealed confirmation once.

Each stage (the first arms, the sweep, each merge, each serving alternative) runs as successive
halving (Jamieson & Talwalkar 2016; Li et al. 2018, Hyperband): every candidate of the stage is made,
then screened on the cheap suites (those of the noise-floor bars: verified tasks, loops, stops) at
served decoding; the best `finalists` of them go on to the expensive judged holdout and a comparison under
the bars (rules version 5; versions 1-4 let only those whose screen score beats the incumbent go on, and
the truly best arm of 2 of 11 demo-size hard-world sessions never reached the holdout). The screen
score is the sum, over the noise-floor bars, of the candidate's delta from the incumbent in units of that
bar's noise floor, signed so that better is positive; it orders the finalists, and the bars' guards, read
on replicate means at the comparison, refuse a candidate that truly regresses on a cheap suite. A p-value
is the scarcest thing a session has: the bars pre-register a family of `p_family` p-values, Holm-adjusted
with the untested rest counted as p = 1. The playbook never compares more often than `p_family` allows,
and `PlaybookSettings.comparisons()` is the family a protocol needs, every finalist a stage may judge
counted (the toy world's bars register the full protocol's).

Under the stage rule `best_of_stage` (versions 3-5, current), every finalist of a stage gets one judged-holdout look against the stage's incumbent
before any comparison; then they go under the bars in order of that look (replicate draws, comparison,
promotion) until one is promoted, and the stage promotes no other (the sweep follows the promoted arm's family).
The cheap suites measure stopping, looping and verified answers, not the win rate: on ten toy worlds they ranked
the DPO arm first in 7 where the SFT arm truly won more, and a finalist promoted first made the truly better
second one beat it, not the parent, a difference the holdout could not resolve.

When the bars pre-register `replicates = n` (the toy world's: 3), their guards without a p-value read each
side's mean over n served draws, so a finalist draws its replicates 1 .. n-1 on those suites before its comparison
(the incumbent's come from its K >= n calibration): one sampled draw against one rejects a truly equal candidate
at a one-floor guard about one time in five (a normal approximation). With `fallbacks`, a stage whose finalist the bars rejected judges its
next screened candidate (under versions 1-4 only one above the incumbent), while the p-value family allows;
`comparisons()` counts them.

A step a gate refused (the budget, most often) is never proposed again: the protocol moves on to
the next step, or stops when none is left.

Trajectory selection (step 6) is in the full protocol only: 2 snapshots of the best run cost two screen evals
and, when one is picked, a holdout eval and one p-value (`comparisons()` counts it). When it keeps the final
checkpoint no step of its own is taken, so the next step's rationale leads with that choice and its numbers.
"""

from __future__ import annotations

from collections.abc import Iterator

from agent.planners import ToolCall, recipes
from agent.planners.policy import PROTOCOLS, PlaybookSettings, ServingAlternative
from agent.planners.stages import (
    dataset_step,
    merges,
    noted,
    proposal,
    reference_suites,
    run_stage,
    train_args,
    trajectory_selection,
    weights_incumbent,
)
from agent.summary import Summary

__all__ = ["PROTOCOLS", "Playbook", "PlaybookSettings", "ServingAlternative", "next_step"]


class Playbook:
    """The default planner (deterministic, no network)."""

    name = "playbook"

    def __init__(self, settings: PlaybookSettings | None = None):
        self.settings = settings or PlaybookSettings()

    def propose(self, summary: Summary, feedback: list[str]) -> ToolCall:
        return next_step(summary, self.settings)


def next_step(s: Summary, cfg: PlaybookSettings) -> ToolCall:
    if s.split is None:
        return proposal("ingest", {}, "ingest and split the feedback first: train, dev holdout, sealed confirmation")
    if s.bars is None:
        return proposal("register_bars", {}, "bars before scores: register the lab's promotion bars before any eval")
    inc = s.incumbent
    calibrate = proposal("calibrate", {"artifact": inc, "k": cfg.k},
                      f"noise before deltas: K={cfg.k} replicates of incumbent {inc} on every open suite (its baseline)")
    if inc not in s.calibrated:
        calibration = s.call("calibrate", {"artifact": inc, "k": cfg.k})
        if calibration is not None and calibration.status != "open":
            name = s.checkpoint(inc).name if s.checkpoint(inc) else inc
            return proposal("stop", {"reason": f"calibration of incumbent {name} failed: {calibration.summary}"},
                         "no noise floor, no comparison")
        if cfg.calibration == "at_promotion" or inc == s.parent or calibration is not None:
            return calibrate
    stop = _stop_reason(s, cfg)
    if stop:
        return proposal("stop", {"reason": stop}, stop)
    step = next(_protocol(s, cfg) if cfg.name == "combined" else recipes.steps(s, cfg), None)
    if step is not None and inc not in s.calibrated and _reads_calibration(s, step):
        return calibrate.model_copy(update={"rationale": f"{calibrate.rationale}, now that the next step "
                                                          f"({step.tool}: {step.rationale}) reads it"})
    return step or proposal("stop", {"reason": "protocol complete"}, "every step of the protocol has run or was refused")


def _reads_calibration(s: Summary, step: ToolCall) -> bool:
    """Whether `step` reads the incumbent's calibration: a comparison (its floors and baseline), a serving
    alternative (evaluated on every suite against its reference answers), or an eval on a judged suite: one a p
    bar holds, or a judge suite whatever bar holds it (a delta bar on the judged holdout makes it a screen suite,
    and its eval still scores against the incumbent's own answers, which its calibration generates)."""
    if step.tool in ("compare", "tune_serving"):
        return True
    if step.tool != "evaluate":
        return False
    suites = step.args.get("suites")
    _, judged = s.bars.suites()
    return suites is None or any(x in judged or x in reference_suites(s) for x in suites)


def _stop_reason(s: Summary, cfg: PlaybookSettings) -> str | None:
    return s.view.must_stop(cfg.max_failed_arms, cfg.min_step_gpuh)


# ---- the protocol: each generator yields the steps still to take, in order; the first one is taken -------


def _protocol(s: Summary, cfg: PlaybookSettings) -> Iterator[ToolCall]:
    first = yield from _first_arms(s, cfg)
    if not first:
        return
    best_score, best = _lead(s, cfg, first)
    family, dataset = best.args["trainer"], best.args["dataset"]
    sweep = [proposal("train", train_args(s, family, dataset, cfg, f),
                      f"lr sweep along the best family {family} (first arm screened {best_score:+.2f}): "
                      f"{cfg.lr_text(family, f)}") for f in cfg.sweep]
    swept = yield from run_stage(s, cfg, sweep)
    note = yield from trajectory_selection(s, cfg, first + swept)
    yield from noted(_later(s, cfg), note)
    if note:  # nothing after it: the stop carries the choice
        yield proposal("stop", {"reason": "protocol complete"}, f"{note}; every step of the protocol has run or was refused")


def _lead(s: Summary, cfg: PlaybookSettings, ranked: list[tuple[float, ToolCall]]) -> tuple[float, ToolCall]:
    """The first arm the sweep follows: the best screened one, or with `best_of_stage` the one the stage promoted
    (chosen on the judged holdout) when it promoted one."""
    if cfg.stage == "best_of_stage":
        for score, producer in ranked:
            call = s.call(producer.tool, producer.args)
            made = call.data.get("artifact_id") if call is not None else None
            promoted = s.call("promote", {"candidate": made}) if made is not None else None
            if promoted is not None and promoted.status == "done":
                return score, producer
    return ranked[0]


def _later(s: Summary, cfg: PlaybookSettings) -> Iterator[ToolCall]:
    """The merges, then the serving alternatives."""
    for merge in merges(s, cfg):
        yield from run_stage(s, cfg, [merge])
    base = weights_incumbent(s)
    for alt in cfg.serving:
        args = {"artifact": base, **alt.model_dump(exclude_none=True)}
        yield from run_stage(s, cfg, [proposal("tune_serving", args, "serving alternative for the incumbent's weights: "
                                                              f"{alt.model_dump(exclude_none=True)}")])


def _first_arms(s: Summary, cfg: PlaybookSettings) -> Iterator[ToolCall]:
    """Build each family's data and train its arm; returns the arms ranked, best first."""
    producers = []
    for family in cfg.families:
        dataset, step = dataset_step(s, family, cfg)
        if step is not None:  # its build, or the skip of an arm whose data the lab lacks
            yield step
            return []
        if dataset is None:
            continue
        why = (f"first {family} arm at a conservative {cfg.lr_text(family)}, {cfg.steps} steps, from the parent"
               if cfg.arms == "fixed" else f"first {family} arm at the lab's [train] settings, from the parent")
        producers.append(proposal("train", train_args(s, family, dataset, cfg), why))
    return (yield from run_stage(s, cfg, producers))
