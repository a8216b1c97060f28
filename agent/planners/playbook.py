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
   the lab has replay data), RFT on verified synthetic tasks;
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
served decoding; only the best `finalists` of them whose screen score beats the incumbent go on to the
expensive judged holdout and a comparison under the bars. The screen score is the sum, over the
noise-floor bars, of the candidate's delta from the incumbent in units of that bar's noise floor, signed
so that better is positive. A p-value is the scarcest thing a session has: the bars pre-register a
family of `p_family` p-values, Holm-adjusted with the untested rest counted as p = 1, so every
comparison spent on a candidate that already looks no better on the verified suites raises the bar of
the ones that matter. The playbook never compares more often than `p_family` allows, and
`PlaybookSettings.comparisons()` is the family a protocol needs (the toy world's bars register the
full protocol's).

Under the stage rule `best_of_stage` (version 3, current), every finalist of a stage gets one judged-holdout look against the stage's incumbent
before any comparison; then they go under the bars in order of that look (replicate draws, comparison,
promotion) until one is promoted, and the stage promotes no other (the sweep follows the promoted arm's family).
The cheap suites measure stopping, looping and verified answers, not the win rate: on ten toy worlds they ranked
the DPO arm first in 7 where the SFT arm truly won more, and a finalist promoted first made the truly better
second one beat it, not the parent, a difference the holdout could not resolve.

When the bars pre-register `replicates = n` (the toy world's: 3), their guards without a p-value read each
side's mean over n served draws, so a finalist draws its replicates 1 .. n-1 on those suites before its comparison
(the incumbent's come from its K >= n calibration): one sampled draw against one rejects a truly equal candidate
at a one-floor guard about one time in five (a normal approximation). With `fallbacks`, a stage whose finalist the bars rejected judges its
next screened candidate (one above the incumbent), while the p-value family allows; `comparisons()` counts them.

A step a gate refused (the budget, most often) is never proposed again: the protocol moves on to
the next step, or stops when none is left.

Trajectory selection (step 6) is in the full protocol only: 2 snapshots of the best run cost two screen evals
and, when one is picked, a holdout eval and one p-value (`comparisons()` counts it). When it keeps the final
checkpoint no step of its own is taken, so the next step's rationale leads with that choice and its numbers.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from agent.errors import SessionError
from agent.planners import ToolCall
from agent.summary import Summary
from evals.synthetic import Family
from tools.train import Trainer


class ServingAlternative(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="Served temperature.")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="Served nucleus mass.")
    repetition_penalty: float | None = Field(None, ge=1.0, le=2.0, description="Served repetition penalty.")
    system_prompt: str = Field("served", pattern="^(served|none)$", description="Keep the served system prompt or serve none.")


Calibration = Literal["at_promotion", "when_read"]
StageRule = Literal["judge_every", "first_cleared", "best_of_stage"]

# The playbook's rules by policy version. A new rule is a new version: sessions recorded under an older version
# replay with that version's rules (`PlaybookSettings.recorded`), so no rule is a flag kept forever.
#   1: every new incumbent calibrated at once; a screened stage promotes its first finalist that clears the bars.
#   2: a promoted incumbent is calibrated when a step first reads its calibration (lazy calibration).
#   3: a screened stage looks at every finalist's judged holdout first, then promotes the best look that clears.
VERSION = 3
_RULES: dict[int, dict[str, str]] = {
    1: {"calibration": "at_promotion", "stage": "first_cleared"},
    2: {"calibration": "when_read", "stage": "first_cleared"},
    3: {"calibration": "when_read", "stage": "best_of_stage"},
}
RECIPES = ("combined",)


class PlaybookSettings(BaseModel):
    """A named, versioned playbook policy: its rules (how a stage judges its candidates, when an incumbent is
    calibrated) and its sizes. `named(protocol)` gives the current version of a protocol's sizes: `full` (the
    default), `test` (the few-arm setting of the test suite and `--protocol test`) and `short` (the
    decision-quality benchmark's short budget, `--protocol short`). A session records its policy whole in its
    `open` decision, and resume and replay read it back (`recorded`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = Field("combined", description="The policy's name: the recipe it follows (the combined playbook).")
    protocol: Literal["full", "test", "short"] = Field("full", description="The sizes it runs at.")
    version: int = Field(VERSION, ge=1, le=VERSION, description="Rules version (see _RULES).")
    calibration: Calibration = Field(
        "when_read", description="When a promoted incumbent is calibrated: at once (`at_promotion`), or only when a "
        "step first reads its calibration (`when_read`: a judged eval against its reference answers, a serving "
        "alternative, a comparison against its floors), so a promotion whose later candidates all screen out costs "
        "no calibration. The parent is calibrated first always.")
    stage: StageRule = Field(
        "best_of_stage", description="How a stage judges its candidates. `judge_every`: no screen; every candidate "
        "is evaluated on every suite and compared. `first_cleared`: successive halving; the best-screened finalists "
        "in screen order, each promoted as soon as it clears, the next then judged against it. `best_of_stage`: "
        "successive halving; every finalist gets one judged-holdout look against the stage's incumbent first, then "
        "they go under the bars (replicate draws, comparison, promotion) in order of that look until one is "
        "promoted, and the stage promotes no other.")
    families: tuple[Trainer, ...] = Field(("sft", "dpo", "klce", "rft"), description="First arms, in order.")
    steps: int = Field(30, ge=1, description="Optimizer steps per arm.")
    batch_size: int = Field(8, ge=1, description="Rows per optimizer step.")
    lr: dict[str, float] = Field({"sft": 1e-3, "dpo": 2e-4, "klce": 1e-3, "rft": 1e-3},
                                 description="Conservative learning rate per family.")
    sweep: tuple[float, ...] = Field((0.5, 2.0), description="Learning-rate multipliers swept along the best family.")
    soup: bool = Field(True, description="Soup the promoted siblings when there are two or more.")
    dose_alphas: tuple[float, ...] = Field((0.5, 1.5), description="Dose positions from the parent to the best promoted arm.")
    serving: tuple[ServingAlternative, ...] = Field(
        (ServingAlternative(temperature=0.0), ServingAlternative(repetition_penalty=1.1)),
        description="Serving alternatives tried with the weights fixed.")
    k: int = Field(3, ge=3, description="Replicates of each incumbent calibration.")
    max_failed_arms: int = Field(3, ge=1, description="Stop after this many arms in a row failed or missed the bars.")
    rft_counts: dict[Family, int] = Field({"digit_sum": 24, "arithmetic_chain": 24, "letter_count": 24},
                                          description="Verified tasks per family for RFT prompts.")
    min_step_gpuh: float = Field(0.0, ge=0, description="Stop when less than this is left above the reserve.")
    finalists: int = Field(2, ge=1, description="Screened candidates per stage that go on to the judged holdout and a "
                                                "comparison (only those whose screen score beats the incumbent).")
    fallbacks: int = Field(0, ge=0, description="Further screened candidates a stage judges, one for each of its "
                           "finalists the bars rejected (in screen order, only those that screen above the incumbent); "
                           "`comparisons()` counts them in the p-value family.")
    trajectory: tuple[int, ...] = Field(
        (10, 20), description="Steps (increasing, below `steps`) at which every arm also saves its model; after the "
        "sweep the best run's snapshots are screened, and the best goes on to the holdout and a comparison only if it "
        "screens above that run's final checkpoint (trajectory selection; needs a screened stage). Empty: no step.")

    @model_validator(mode="after")
    def _trajectory_inside_the_arms(self) -> PlaybookSettings:
        if any(not 0 < t < self.steps for t in self.trajectory) or list(self.trajectory) != sorted(set(self.trajectory)):
            raise ValueError(f"trajectory {list(self.trajectory)} must increase and lie between 0 and steps "
                             f"({self.steps}), exclusive")
        if self.trajectory and not self.screened:
            raise ValueError("trajectory selection ranks snapshots by their screen score: it needs a screened stage")
        rules = _RULES[self.version]
        if self.calibration != rules["calibration"] or (self.screened and self.stage != rules["stage"]):
            raise ValueError(f"version {self.version} of the playbook's rules is {_RULES[self.version]}; other rules "
                             "are another version")
        return self

    def ref(self) -> dict[str, Any]:
        """Name, protocol and version: what the session's `open` decision records of its policy."""
        return {"name": self.name, "protocol": self.protocol, "version": self.version}

    @property
    def screened(self) -> bool:
        """Whether a stage screens its candidates on the cheap suites first (successive halving)."""
        return self.stage != "judge_every"

    @classmethod
    def test(cls) -> PlaybookSettings:
        return cls(protocol="test", families=("sft",), steps=4, sweep=(), dose_alphas=(0.5,),
                   serving=(ServingAlternative(temperature=0.0),), rft_counts={"digit_sum": 8}, stage="judge_every",
                   trajectory=())

    @classmethod
    def short(cls) -> PlaybookSettings:
        """Two first arms of different families (winner SFT, DPO on battle pairs), each with a holdout look when it
        screens above the parent, the better look judged under the bars first (the other if the bars reject it), one
        dose, no serving."""
        return cls(protocol="short", families=("sft", "dpo"), steps=16, sweep=(), soup=False, dose_alphas=(0.5,),
                   serving=(), finalists=2, fallbacks=0, trajectory=())

    @classmethod
    def named(cls, protocol: str) -> PlaybookSettings:
        return {"full": cls, "test": cls.test, "short": cls.short}[protocol]()

    @classmethod
    def recorded(cls, saved: dict[str, Any], session: str) -> PlaybookSettings:
        """The policy a session recorded at its start (resume and replay), or one clear refusal: a session
        recorded by another version of the playbook (e.g. before trajectory selection) cannot be read as is.
        A record made before policies were named (flags, no version) is read as the version its flags were."""
        saved = dict(saved)
        if "version" not in saved:
            saved = _unnamed(saved)
        try:
            return cls.model_validate(saved)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "settings"
            raise SessionError(f"session {session}: its recorded playbook settings do not fit this version "
                               f"({where}: {first['msg']}); replay it with --protocol, or start a new session") from None

    def comparisons(self) -> int:
        """The most comparisons (p-values) this protocol makes: the p_family its bars should register."""
        judged = self.finalists + self.fallbacks
        first = min(judged, len(self.families)) if self.screened else len(self.families)
        swept = min(judged, len(self.sweep)) if self.screened else len(self.sweep)
        soup = int(self.soup and first + swept >= 2)
        return first + swept + soup + int(bool(self.trajectory)) + len(self.dose_alphas) + len(self.serving)


PROTOCOLS = ("full", "test", "short")


def _unnamed(saved: dict[str, Any]) -> dict[str, Any]:
    """A record of the flags era as a versioned policy: no `lazy_calibration` is version 1; lazy calibration
    without `best_of_stage` is version 2; both are version 3. `screen = false` was the unscreened stage."""
    lazy, best, screen = saved.pop("lazy_calibration", False), saved.pop("best_of_stage", False), saved.pop("screen", True)
    version = 3 if lazy and best else 2 if lazy else 1
    stage = "judge_every" if not screen else ("best_of_stage" if version == 3 else "first_cleared")
    return saved | {"version": version, "calibration": _RULES[version]["calibration"], "stage": stage}
_BUILDERS = {"sft": "winner_sft", "dpo": "battle_pairs", "klce": "winner_sft", "rft": "synthetic_verified"}


def _call(tool: str, args: dict[str, Any], why: str) -> ToolCall:
    return ToolCall(tool=tool, args=args, rationale=why)


class Playbook:
    """The default planner (deterministic, no network)."""

    name = "playbook"

    def __init__(self, settings: PlaybookSettings | None = None):
        self.settings = settings or PlaybookSettings()

    def propose(self, summary: Summary, feedback: list[str]) -> ToolCall:
        return next_step(summary, self.settings)


def next_step(s: Summary, cfg: PlaybookSettings) -> ToolCall:
    if s.split is None:
        return _call("ingest", {}, "ingest and split the feedback first: train, dev holdout, sealed confirmation")
    if s.bars is None:
        return _call("register_bars", {}, "bars before scores: register the lab's promotion bars before any eval")
    inc = s.incumbent
    calibrate = _call("calibrate", {"artifact": inc, "k": cfg.k},
                      f"noise before deltas: K={cfg.k} replicates of incumbent {inc} on every open suite (its baseline)")
    if inc not in s.calibrated:
        calibration = s.call("calibrate", {"artifact": inc, "k": cfg.k})
        if calibration is not None and calibration.status != "open":
            name = s.checkpoint(inc).name if s.checkpoint(inc) else inc
            return _call("stop", {"reason": f"calibration of incumbent {name} failed: {calibration.summary}"},
                         "no noise floor, no comparison")
        if cfg.calibration == "at_promotion" or inc == s.parent or calibration is not None:
            return calibrate
    stop = _stop_reason(s, cfg)
    if stop:
        return _call("stop", {"reason": stop}, stop)
    step = next(_protocol(s, cfg), None)
    if step is not None and inc not in s.calibrated and _reads_calibration(s, step):
        return calibrate.model_copy(update={"rationale": f"{calibrate.rationale}, now that the next step "
                                                          f"({step.tool}: {step.rationale}) reads it"})
    return step or _call("stop", {"reason": "protocol complete"}, "every step of the protocol has run or was refused")


def _reads_calibration(s: Summary, step: ToolCall) -> bool:
    """Whether `step` reads the incumbent's calibration: a comparison (its floors and baseline), a serving
    alternative (evaluated on every suite against its reference answers), or an eval on a judged suite."""
    if step.tool in ("compare", "tune_serving"):
        return True
    if step.tool != "evaluate":
        return False
    suites = step.args.get("suites")
    _, judged = s.bars.suites()
    return suites is None or any(x in judged for x in suites)


def _stop_reason(s: Summary, cfg: PlaybookSettings) -> str | None:
    return s.view.must_stop(cfg.max_failed_arms, cfg.min_step_gpuh)


# ---- the protocol: each generator yields the steps still to take, in order; the first one is taken -------


def _protocol(s: Summary, cfg: PlaybookSettings) -> Iterator[ToolCall]:
    first = yield from _first_arms(s, cfg)
    if not first:
        return
    best_score, best = _lead(s, cfg, first)
    family, dataset = best.args["trainer"], best.args["dataset"]
    sweep = [_call("train", _train_args(s, family, dataset, cfg, cfg.lr[family] * f),
                   f"lr sweep along the best family {family} (first arm screened {best_score:+.2f}): "
                   f"lr {cfg.lr[family] * f:g}") for f in cfg.sweep]
    swept = yield from _stage(s, cfg, sweep)
    note = yield from _trajectory(s, cfg, first + swept)
    yield from _noted(_later(s, cfg), note)
    if note:  # nothing after it: the stop carries the choice
        yield _call("stop", {"reason": "protocol complete"}, f"{note}; every step of the protocol has run or was refused")


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
    for merge in _merges(s, cfg):
        yield from _stage(s, cfg, [merge])
    base = _weights_incumbent(s)
    for alt in cfg.serving:
        args = {"artifact": base, **alt.model_dump(exclude_none=True)}
        yield from _stage(s, cfg, [_call("tune_serving", args, "serving alternative for the incumbent's weights: "
                                                              f"{alt.model_dump(exclude_none=True)}")])


def _noted(steps: Iterator[ToolCall], note: str | None) -> Iterator[ToolCall]:
    """The steps, the first one's rationale led by `note` (a choice the protocol made without a step of its own)."""
    for step in steps:
        yield step.model_copy(update={"rationale": f"{note}; next: {step.rationale}"}) if note else step
        note = None


def _trajectory(s: Summary, cfg: PlaybookSettings, runs: list[tuple[float, ToolCall]]) -> Iterator[ToolCall]:
    """Trajectory selection over the best run's snapshots (see the module docstring). Returns the one-line note of a
    selection that kept the run's final checkpoint, while no step was taken after it; else None."""
    cheap, judged = s.bars.suites()
    found = _best_run(s, runs) if cfg.trajectory and cheap else None
    if found is None:
        return None
    final, snaps = found
    for step, snap in snaps:
        yield from _evaluate(s, snap, cheap, f"trajectory selection: screen {snap.name}, step {step} of the best run "
                             f"{final.name} (screened {_screen(s, final):+.2f}), on the cheap suites {', '.join(cheap)}")
    screened = [(step, snap) for step, snap in snaps if _has(snap, cheap)]
    if not screened:
        return None  # every snapshot's screen failed or was refused: nothing to select from
    step, best = max(screened, key=lambda t: (_screen(s, t[1]), -t[0]))  # a tie goes to the earlier snapshot
    mine, theirs = _screen(s, best), _screen(s, final)
    line = (f"trajectory selection: {best.name} (step {step} of {final.name}) screened {mine:+.2f} noise floors, "
            f"the run's final checkpoint {theirs:+.2f}")
    if s.call("compare", {"candidate": best.id}) is not None or (mine > max(theirs, 0.0) and best.id != s.incumbent):
        yield from _evaluate(s, best, judged, f"{line}: the snapshot goes on to the judged holdout")
        yield from _judge(s, best, judged, line)
        return None
    screens = [c.id for c in s.calls if c.tool == "evaluate" and c.args.get("artifact") in {x.id for _, x in snaps}]
    if any(c.id > max(screens, default=0) for c in s.calls):
        return None  # a step was taken since: the choice is on record in that step's rationale
    return f"{line}: kept the final checkpoint (a snapshot must screen above it and above the incumbent)"


def _best_run(s: Summary, runs: list[tuple[float, ToolCall]]) -> tuple[Any, list[tuple[int, Any]]] | None:
    """The best-screened run (first arms and sweep; a tie goes to the earlier) that saved snapshots: its final
    checkpoint and [(step, snapshot)]."""
    for _, producer in sorted(runs, key=lambda t: -t[0]):
        call = s.call(producer.tool, producer.args)
        final = s.checkpoint(call.data.get("artifact_id", -1)) if call is not None else None
        snaps = [(e["step"], s.checkpoint(e["artifact_id"])) for e in (call.data.get("snapshots", []) if call else [])]
        if final is not None:
            return (final, [(k, c) for k, c in snaps if c is not None]) if snaps else None
    return None


def _first_arms(s: Summary, cfg: PlaybookSettings) -> Iterator[ToolCall]:
    """Build each family's data and train its arm; returns the arms ranked, best first."""
    producers = []
    for family in cfg.families:
        dataset, build = _dataset_step(s, family, cfg)
        if build is not None:
            yield build
            return []
        if dataset is None:
            continue
        producers.append(_call("train", _train_args(s, family, dataset, cfg, cfg.lr[family]),
                               f"first {family} arm at a conservative lr {cfg.lr[family]:g}, {cfg.steps} steps, "
                               "from the parent"))
    return (yield from _stage(s, cfg, producers))


def _stage(s: Summary, cfg: PlaybookSettings, producers: list[ToolCall]) -> Iterator[ToolCall]:
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
        return (yield from _judge_every(s, made))
    for cand, _ in made:
        yield from _evaluate(s, cand, cheap, f"screen {cand.name} on the cheap suites {', '.join(cheap)}")
    ranked = sorted(((_screen(s, c), n, c, p) for n, (c, p) in enumerate(made) if _has(c, cheap)),
                    key=lambda t: (-t[0], t[1]))
    result = [(score, p) for score, _, _, p in ranked]
    if cfg.stage == "best_of_stage":
        yield from _best_of_stage(s, cfg, [(c, p) for _, _, c, p in ranked], judged)
    else:
        yield from _first_cleared(s, cfg, [c for _, _, c, _ in ranked], judged)
    return result


def _judge_every(s: Summary, made: list) -> Iterator[ToolCall]:
    """No screen: every candidate on every suite, compared and promoted in order; ranked by the primary bar."""
    for cand, _ in made:
        yield from _judge(s, cand, None, _primary_line(s, cand))
    scored = [(_score(s, c.id), p) for c, p in made]
    return sorted(((x, p) for x, p in scored if x is not None), key=lambda t: -t[0])


def _finalists(s: Summary, cfg: PlaybookSettings, ranked: list) -> tuple[list, int]:
    """The stage's finalists (those compared already, then the best-screened above the incumbent, `finalists` of
    them plus one fallback per rejected finalist), and how many were rejected."""
    compared = [c for c in ranked if s.call("compare", {"candidate": c.id}) is not None]
    hopeful = [c for c in ranked if _screen(s, c) > 0 and c.id != s.incumbent and c not in compared]
    rejected = sum(_rejected(s, c) for c in compared)
    return (compared + hopeful)[:max(cfg.finalists + min(cfg.fallbacks, rejected), len(compared))], rejected


def _first_cleared(s: Summary, cfg: PlaybookSettings, ranked: list, judged: list[str]) -> Iterator[ToolCall]:
    """Finalists in screen order, each promoted as soon as it clears, the next one then judged against it."""
    finalists, rejected = _finalists(s, cfg, ranked)
    compared = [c for c in ranked if s.call("compare", {"candidate": c.id}) is not None]
    for cand in finalists:
        yield from _judge(s, cand, judged, f"screened {_screen(s, cand):+.2f} noise floors above the incumbent"
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
    finalists, _ = _finalists(s, cfg, [c for c, _ in ranked])
    if not s.view.p_family.fits_one_more:  # no comparison can follow: no holdout look for a finalist not compared yet
        finalists = [c for c in finalists if s.call("compare", {"candidate": c.id}) is not None]
    for cand in finalists:
        yield from _evaluate(s, cand, judged, f"judged holdout of finalist {cand.name} (screened {_screen(s, cand):+.2f} "
                             "noise floors above the incumbent)" + (": every finalist's look before any comparison"
                                                                   if len(finalists) > 1 else ""))
    looked = sorted((c for c in finalists if _has(c, judged)), key=lambda c: (-_judged_score(s, c), -_screen(s, c), c.id))
    for n, cand in enumerate(looked):
        others = "".join(f"; {c.name} {_judged_score(s, c):.3f}" for c in looked if c is not cand)
        yield from _judge(s, cand, judged, f"{'leads' if n == 0 else 'next on'} the stage's judged holdout "
                          f"({_judged_score(s, cand):.3f}{others})" + (", the finalists above it rejected" if n else ""))


def _judge(s: Summary, cand, suites: list[str] | None, why: str) -> Iterator[ToolCall]:
    """Evaluate the candidate on `suites` (None: every open suite), compare it with the incumbent, promote it."""
    ok = yield from _evaluate(s, cand, suites, f"evaluate {cand.name} at its served decoding")
    if not ok:
        return
    ok = yield from _replicated(s, cand)
    if not ok:
        return
    compared = s.call("compare", {"candidate": cand.id})
    if compared is None or compared.status == "open":
        if s.refused("compare", {"candidate": cand.id}) is not None or not s.view.p_family.fits_one_more:
            return  # no p-value left in the pre-registered family: the candidate is not judged
        yield _call("compare", {"candidate": cand.id},
                    f"compare {cand.name} ({why}) with incumbent {s.incumbent} under the bars")
        return
    mine = [v for v in cand.verdicts if v.incumbent == s.incumbent]
    if mine and mine[-1].promoted and cand.id != s.incumbent and s.call("promote", {"candidate": cand.id}) is None \
            and s.refused("promote", {"candidate": cand.id}) is None:
        yield _call("promote", {"candidate": cand.id}, f"{cand.name} cleared every bar: " + "; ".join(mine[-1].lines()))


def _judged_score(s: Summary, cand) -> float:
    """The candidate's mean, over the p bars, of their metric on its first served look (the judged holdout's win
    score in the toy world): higher is better, as a p bar tests that the candidate beats the incumbent."""
    values = [cand.metrics.get(r.suite, {}).get(r.metric) for r in s.bars.p_rules]
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else float("-inf")


def _rejected(s: Summary, cand) -> bool:
    """Whether the candidate's comparison ended without a promotion (failed the bars, or was refused)."""
    compared = s.call("compare", {"candidate": cand.id})
    return compared is not None and compared.status != "open" and not any(v.promoted for v in cand.verdicts)


def _replicated(s: Summary, cand) -> Iterator[ToolCall]:
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
        yield _call("evaluate", args, f"the bars read the mean of {draws} served draws a side on {', '.join(suites)}: "
                                      f"draw {cand.name}'s replicates up to {draws - 1} before its comparison")
    return False


def _evaluate(s: Summary, cand, suites: list[str] | None, why: str) -> Iterator[ToolCall]:
    """The eval step the candidate still needs on `suites`; returns whether its metrics are there."""
    if _has(cand, suites):
        return True
    args: dict[str, Any] = {"artifact": cand.id} | ({"suites": suites} if suites else {})
    done = s.call("evaluate", args)
    if (done is None or done.status == "open") and s.refused("evaluate", args) is None:
        yield _call("evaluate", args, why)
    return False  # not evaluated yet, or its evaluation failed or was refused


def _has(cand, suites: list[str] | None) -> bool:
    return all(x in cand.metrics for x in suites) if suites else bool(cand.metrics)


def _screen(s: Summary, cand) -> float:
    """Sum over the noise-floor bars of the candidate's delta from the incumbent, in noise floors, better > 0."""
    inc = s.checkpoint(s.incumbent)
    total = 0.0
    for r in s.bars.guards:
        mine, theirs = cand.metrics.get(r.suite, {}).get(r.metric), inc.metrics.get(r.suite, {}).get(r.metric)
        if mine is None or theirs is None:
            continue
        floor = s.noise_floors.get(r.target) or 1.0
        total += (mine - theirs) / floor * (1 if r.higher_is_better else -1)
    return round(total, 6)


def _score(s: Summary, artifact_id: int) -> float | None:
    cp, primary = s.checkpoint(artifact_id), s.bars.primary
    return cp.metrics.get(primary.suite, {}).get(primary.metric) if cp else None


def _primary_line(s: Summary, cand) -> str:
    primary = s.bars.primary
    value = cand.metrics.get(primary.suite, {}).get(primary.metric)
    return f"{primary.target}={value:.3f}" if value is not None else "no primary metric"


def _dataset_step(s: Summary, family: str, cfg: PlaybookSettings) -> tuple[int | None, ToolCall | None]:
    """The family's dataset id, or the build step that makes it (None, None when the build failed or was refused)."""
    builder = _BUILDERS[family]
    args: dict[str, Any] = {"builder": builder}
    if builder == "synthetic_verified":
        args |= {"rows": "items", "counts": dict(cfg.rft_counts), "seed": 1000}
    if s.refused("build_dataset", args) is not None:
        return None, None
    call = s.call("build_dataset", args)
    if call is None or call.status == "open":
        return None, _call("build_dataset", args, f"{family} arm needs {builder} data (leak-audited)")
    if call.status != "done":
        return None, None
    return call.data["artifact_id"], None


def _train_args(s: Summary, family: str, dataset: int, cfg: PlaybookSettings, lr: float) -> dict[str, Any]:
    return {"trainer": family, "parent": s.parent, "dataset": dataset, "lr": lr, "steps": cfg.steps,
            "batch_size": cfg.batch_size, "snapshots": list(cfg.trajectory)}


def _promoted_trained(s: Summary) -> list[int]:
    return [c.id for c in s.checkpoints if c.origin.startswith("train:") and c.parent == s.parent
            and any(v.promoted for v in c.verdicts)]


def _merges(s: Summary, cfg: PlaybookSettings) -> Iterator[ToolCall]:
    promoted = _promoted_trained(s)
    if cfg.soup and len(promoted) >= 2:
        yield _call("merge", {"method": "soup", "models": promoted}, f"soup of the promoted siblings {promoted}")
    if not promoted:
        return
    best = max(promoted, key=lambda i: (_score(s, i) or 0.0, -i))
    for alpha in cfg.dose_alphas:
        yield _call("merge", {"method": "dose", "models": [s.parent, best], "alpha": alpha},
                    f"dose {alpha:g} from the parent along the best promoted arm {best}: the bars pick the knee")


def _weights_incumbent(s: Summary) -> int:
    """The incumbent, or the artifact whose weights it serves when it is a serving alternative."""
    cp = s.checkpoint(s.incumbent)
    return cp.parent if cp is not None and cp.origin == "serving" and cp.parent is not None else s.incumbent
