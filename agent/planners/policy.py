"""The playbook's policies: named, versioned values, each a set of rules and sizes (STYLE.md habit 12).

A session records its policy in its `open` decision (name, protocol, version) and whole in its config snapshot;
resume and replay read it back (`PlaybookSettings.recorded`), so a session always replays with the rules it ran
with. A new rule is a new version in `_RULES`, never a flag kept forever.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from agent.errors import SessionError
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
#   4: arms train with the lab's [train] settings (a sweep as multiples of its lr, snapshots as shares of the run),
#      not the policy's own numbers, which were the toy world's.
#   5: the screen ranks a stage's candidates and no longer gates them: the best-screened `finalists` go on to the
#      judged holdout whether or not they screen above the incumbent. The cheap suites measure stopping, looping and
#      verified answers, not the win rate, and one screen look is noisier than the bars' replicate means: under the
#      gate (versions 1-4) the truly best arm was screened out before the judged holdout in 2 of 11 demo-size
#      sessions on the noisy-judge and harmful-arms worlds (seeds 301-306; bench/README.md), once an arm 21 points
#      truly better, by two verified items of 72.
#      A candidate that truly regresses on a cheap suite is still refused by the bars' guards at its comparison.
#   6: evidence bought, not assumed (issue 41): under bars that register sequential looks (evals/bars.py), a
#      comparison the p bar leaves unresolved buys one more served draw of the judged holdout (judged in both
#      positions, against the same reference answers) and looks again, up to the registered looks, while the budget
#      admits the draw; the comparison's p-value stays one member of the Holm family (min p/w over the looks). Under
#      version 5 the small-holdout world's ~46-battle holdout refused the truly best arm in 2 of 10 sessions.
#   7: more prompts, not only more draws (issue 41): where the split holds a reserve ([feedback] reserve_fraction) and
#      every p bar reads a suite of the dev holdout's prompts, the last registered look is the reserve look: a
#      comparison still unresolved after the draws bought on the dev prompts draws the reserve's prompts (the
#      incumbent's answers and first look at them, then the candidate's; each eval admitted by the budget) and is
#      decided on the dev draws with them (evals/compare.py). Without a reserve it is version 6 step for step.
VERSION = 7
_RULES: dict[int, dict[str, str]] = {
    1: {"calibration": "at_promotion", "stage": "first_cleared", "arms": "fixed", "finalists": "above_incumbent",
        "evidence": "one_look"},
    2: {"calibration": "when_read", "stage": "first_cleared", "arms": "fixed", "finalists": "above_incumbent",
        "evidence": "one_look"},
    3: {"calibration": "when_read", "stage": "best_of_stage", "arms": "fixed", "finalists": "above_incumbent",
        "evidence": "one_look"},
    4: {"calibration": "when_read", "stage": "best_of_stage", "arms": "train", "finalists": "above_incumbent",
        "evidence": "one_look"},
    5: {"calibration": "when_read", "stage": "best_of_stage", "arms": "train", "finalists": "best_screened",
        "evidence": "one_look"},
    6: {"calibration": "when_read", "stage": "best_of_stage", "arms": "train", "finalists": "best_screened",
        "evidence": "sequential"},
    7: {"calibration": "when_read", "stage": "best_of_stage", "arms": "train", "finalists": "best_screened",
        "evidence": "sequential_reserve"},
}

FinalistRule = Literal["above_incumbent", "best_screened"]
EvidenceRule = Literal["one_look", "sequential", "sequential_reserve"]


# The named policies: the combined playbook, and the five seeds' recipes (agent/planners/recipes.py).
RECIPES = ("combined", "aspen", "brook", "delta", "ember", "islet")


class PlaybookSettings(BaseModel):
    """A named, versioned playbook policy: its rules (how a stage judges its candidates, when an incumbent is
    calibrated) and its sizes. `named(protocol)` gives the current version of a protocol's sizes: `full` (the
    default), `test` (the few-arm setting of the test suite and `--protocol test`) and `short` (the
    decision-quality benchmark's short budget, `--protocol short`). A session records its policy whole in its
    `open` decision, and resume and replay read it back (`recorded`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: Literal["combined", "aspen", "brook", "delta", "ember", "islet"] = Field(
        "combined", description="The policy's name: the recipe it follows (the combined playbook, or a seed's).")
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
    arms: Literal["fixed", "train"] = Field(
        "train", description="Where an arm's lr, steps and batch come from: the lab's [train] (`train`; a protocol "
        "may still fix its steps), or the policy's own `lr`, `steps` and `batch_size` (`fixed`, versions 1-3).")
    families: tuple[Trainer, ...] = Field(("sft", "dpo", "klce", "rft"), description="First arms, in order.")
    steps: int | None = Field(None, ge=1, description="Optimizer steps per arm; None: [train]'s.")
    batch_size: int | None = Field(None, ge=1, description="Rows per optimizer step; None: [train]'s.")
    lr: dict[str, float] | None = Field(None, description="Learning rate per family (`fixed` arms only); None: "
                                        "[train]'s.")
    sweep: tuple[float, ...] = Field((0.5, 2.0), description="Learning-rate multipliers swept along the best family.")
    soup: bool = Field(True, description="Soup the promoted siblings when there are two or more.")
    dose_alphas: tuple[float, ...] = Field((0.5, 1.5), description="Dose positions from the parent to the best promoted arm.")
    serving: tuple[ServingAlternative, ...] = Field(
        (ServingAlternative(temperature=0.0), ServingAlternative(repetition_penalty=1.1)),
        description="Serving alternatives tried with the weights fixed.")
    k: int = Field(3, ge=3, description="Replicates of each incumbent calibration.")
    max_failed_arms: int = Field(3, ge=1, description="Stop after this many arms in a row failed or missed the bars.")
    min_step_gpuh: float = Field(0.0, ge=0, description="Stop when less than this is left above the reserve.")
    finalists: int = Field(2, ge=1, description="Screened candidates per stage that go on to the judged holdout and a "
                                                "comparison, best screen first (see `finalist_rule`).")
    finalist_rule: FinalistRule = Field(
        None, validate_default=True, description="Which screened candidates may be finalists: `best_screened` "
        "(version 5): the best-screened, whatever their score; `above_incumbent` (versions 1-4): only those whose "
        "screen score beats the incumbent's. Unset: the version's rule.")
    evidence: EvidenceRule = Field(
        None, validate_default=True, description="How a comparison's p bar is read: `sequential` (version 6): look "
        "by look under bars that register looks, buying one more served draw of the judged holdout while a look "
        "leaves it unresolved; `sequential_reserve` (version 7): the same, the last look reading the split's reserve "
        "prompts where it holds a reserve; `one_look` (versions 1-5): one look, decided. Unset: the version's rule.")
    fallbacks: int = Field(0, ge=0, description="Further screened candidates a stage judges, one for each of its "
                           "finalists the bars rejected (in screen order, under the same `finalist_rule`); "
                           "`comparisons()` counts them in the p-value family.")
    trajectory: tuple[int, ...] = Field(
        (), description="`fixed` arms: steps (increasing, below `steps`) at which every arm also saves its model; "
        "after the sweep the best run's snapshots are screened, and the best goes on to the holdout and a comparison "
        "only if it screens above that run's final checkpoint (trajectory selection; needs a screened stage).")
    method: Literal["full", "lora"] | None = Field(None, description="The arms' method; None: [train]'s.")
    replay_rows: int = Field(256, ge=1, description="aspen: prompts of the own-policy replay.")
    rounds: int = Field(2, ge=1, description="brook: DPO rounds, each from the last promoted round, merged back.")
    loop_fix_prompts: int | None = Field(
        None, ge=1, description="brook: train-battle prompts each round's model answers for its loop-fix pairs; None: "
        "every decisive train battle's.")
    margin_suite: str | None = Field(None, description="ember: the battle-margin suite every candidate is probed on.")
    verified_pool: str | None = Field(None, description="The lab's [[data]] verified pool the RFT arms' items come "
                                      "from (the combined playbook's and islet's); None: the lab has none, and an RFT "
                                      "arm is skipped.")
    trajectory_shares: tuple[float, ...] = Field(
        (1 / 3, 2 / 3), description="`train` arms: the same, at these shares of each run (settled to steps by the "
        "train tool once [train] gives the run's length). Empty: no trajectory selection.")

    @model_validator(mode="before")
    @classmethod
    def _version_rules(cls, data: Any) -> Any:
        """The version's finalist rule where none is given (a record made before the rule existed, or a policy
        built by version)."""
        if isinstance(data, dict):
            rules = _RULES.get(data.get("version", VERSION), _RULES[VERSION])
            if data.get("finalist_rule") is None:
                data = dict(data) | {"finalist_rule": rules["finalists"]}
            if data.get("evidence") is None:
                data = dict(data) | {"evidence": rules["evidence"]}
        return data

    @model_validator(mode="after")
    def _trajectory_inside_the_arms(self) -> PlaybookSettings:
        bound = self.steps if self.steps is not None else float("inf")
        if any(not 0 < t < bound for t in self.trajectory) or list(self.trajectory) != sorted(set(self.trajectory)):
            raise ValueError(f"trajectory {list(self.trajectory)} must increase and lie between 0 and steps "
                             f"({self.steps}), exclusive")
        shares = list(self.trajectory_shares)
        if any(not 0 < x < 1 for x in shares) or shares != sorted(set(shares)):
            raise ValueError(f"trajectory_shares {shares} must increase and lie between 0 and 1, exclusive")
        if self.selects_trajectory and not self.screened:
            raise ValueError("trajectory selection ranks snapshots by their screen score: it needs a screened stage")
        if self.arms == "fixed" and (self.lr is None or self.steps is None or self.batch_size is None):
            raise ValueError("fixed arms need the policy's lr, steps and batch_size")
        if self.arms == "train" and (self.lr is not None or self.trajectory):
            raise ValueError("arms from [train] take its lr (a sweep scales it) and snapshot at trajectory_shares")
        if self.arms == "fixed" and self.trajectory_shares:
            raise ValueError("fixed arms snapshot at trajectory steps, not shares")
        rules = _RULES[self.version]
        if self.arms != rules["arms"]:
            raise ValueError(f"version {self.version} of the playbook's rules is {rules}; other rules are another "
                             "version")
        if self.calibration != rules["calibration"] or self.evidence != rules["evidence"] or (self.screened and (
                self.stage != rules["stage"] or self.finalist_rule != rules["finalists"])):
            raise ValueError(f"version {self.version} of the playbook's rules is {_RULES[self.version]}; other rules "
                             "are another version")
        return self

    def ref(self) -> dict[str, Any]:
        """Name, protocol and version: what the session's `open` decision records of its policy."""
        return {"name": self.name, "protocol": self.protocol, "version": self.version}

    @property
    def selects_trajectory(self) -> bool:
        return bool(self.trajectory or self.trajectory_shares)

    @property
    def screened(self) -> bool:
        """Whether a stage screens its candidates on the cheap suites first (successive halving)."""
        return self.stage != "judge_every"

    @classmethod
    def test(cls) -> PlaybookSettings:
        return cls(protocol="test", families=("sft",), steps=4, sweep=(), dose_alphas=(0.5,),
                   serving=(ServingAlternative(temperature=0.0),), stage="judge_every",
                   trajectory_shares=())

    @classmethod
    def short(cls) -> PlaybookSettings:
        """Two first arms of different families (winner SFT, DPO on battle pairs), each with a holdout look (under
        versions 1-4 only when it screened above the parent), the better look judged under the bars first (the other
        if the bars reject it), one dose, no serving."""
        return cls(protocol="short", families=("sft", "dpo"), steps=16, sweep=(), soup=False, dose_alphas=(0.5,),
                   serving=(), finalists=2, fallbacks=0, trajectory_shares=())

    @classmethod
    def named(cls, protocol: str, verified_pool: str | None = None) -> PlaybookSettings:
        """The combined playbook at a protocol's sizes; `verified_pool`: the lab's own verified pool, its RFT
        arm's items (None: the lab has none, and the arm is skipped)."""
        sized = {"full": cls, "test": cls.test, "short": cls.short}[protocol]()
        return sized.model_copy(update={"verified_pool": verified_pool}) if verified_pool else sized

    @classmethod
    def recorded(cls, saved: dict[str, Any], session: str) -> PlaybookSettings:
        """The policy a session recorded at its start (resume and replay), or one clear refusal: a session
        recorded by another version of the playbook (e.g. before trajectory selection) cannot be read as is.
        A record made before policies were named (flags, no version) is read as the version its flags were."""
        # Retired keys: the toy world's generated tasks for RFT and loop-fix pairs, no longer any lab's data.
        saved = {k: v for k, v in saved.items() if k not in ("rft_counts", "loop_fix_counts")}
        if "version" not in saved:
            saved = _unnamed(saved)
        if saved.get("version", VERSION) < 4:  # before [train]: the policy's own numbers, recorded with it
            saved = {"arms": "fixed", "trajectory_shares": ()} | saved
        try:
            return cls.model_validate(saved)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "settings"
            raise SessionError(f"session {session}: its recorded playbook settings do not fit this version "
                               f"({where}: {first['msg']}); replay it with --protocol, or start a new session") from None

    def arm(self, family: str, scale: float = 1.0) -> dict[str, Any]:
        """An arm's lr, steps, batch and snapshots, as `train` arguments: the lab's [train] (`train` arms: a sweep
        as a multiple of its lr, the protocol's steps if it fixes them, snapshots at shares of the run; what is left
        out is [train]'s), or the policy's own numbers (`fixed` arms, versions 1-3)."""
        if self.arms == "fixed":
            return {"lr": self.lr[family] * scale, "steps": self.steps, "batch_size": self.batch_size,
                    "snapshots": list(self.trajectory)}
        extra = {"lr_scale": scale if scale != 1.0 else None, "steps": self.steps, "batch_size": self.batch_size,
                 "snapshot_fractions": list(self.trajectory_shares) or None}
        return {k: v for k, v in extra.items() if v is not None}

    def lr_text(self, family: str, scale: float = 1.0) -> str:
        """The learning rate of an arm (`arm`), as a rationale says it."""
        return f"lr {self.lr[family] * scale:g}" if self.arms == "fixed" else f"lr x{scale:g} of [train]'s"

    def comparisons(self) -> int:
        """The most comparisons (p-values) this protocol makes: the p_family its bars should register."""
        arms = len(self.families) + len(self.sweep)
        per_recipe = {"aspen": len(self.families) + int(self.selects_trajectory), "brook": self.rounds + int(self.soup),
                      "delta": 1 + len(self.serving), "ember": arms + int(self.soup),
                      "islet": arms + len(self.dose_alphas)}
        if self.name in per_recipe:
            return per_recipe[self.name]
        judged = self.finalists + self.fallbacks
        first = min(judged, len(self.families)) if self.screened else len(self.families)
        swept = min(judged, len(self.sweep)) if self.screened else len(self.sweep)
        soup = int(self.soup and first + swept >= 2)
        return first + swept + soup + int(self.selects_trajectory) + len(self.dose_alphas) + len(self.serving)


PROTOCOLS = ("full", "test", "short")


def _unnamed(saved: dict[str, Any]) -> dict[str, Any]:
    """A record of the flags era as a versioned policy: no `lazy_calibration` is version 1; lazy calibration
    without `best_of_stage` is version 2; both are version 3. `screen = false` was the unscreened stage."""
    lazy, best, screen = saved.pop("lazy_calibration", False), saved.pop("best_of_stage", False), saved.pop("screen", True)
    version = 3 if lazy and best else 2 if lazy else 1
    stage = "judge_every" if not screen else ("best_of_stage" if version == 3 else "first_cleared")
    return saved | {"version": version, "calibration": _RULES[version]["calibration"], "stage": stage}
