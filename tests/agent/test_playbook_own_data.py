"""The playbook on a team's lab: its arms use the lab's own data only, a step whose data the lab lacks is skipped
and the skip recorded, and every bar shape works after a promotion (pure: hand-made summaries, no job, no notebook).

The lab of these summaries is no toy world: a `digits` suite of its own and a judge-scored `holdout`, the parent
(1) calibrated, its calibration holding the parent's reference answers to the judge suite (as tools/calibrate.py
records them).
"""

from __future__ import annotations

import pytest

from agent.planners.playbook import PlaybookSettings, next_step
from agent.summary import Call, Checkpoint, Summary
from agent.toolbox import canonical_args
from tests.agent.views import bars, ledger, rule, summary, verdict

DIGITS_GUARD = rule("digits", "correct", "delta", ">=", -1, floors=True)
HOLDOUT_DELTA = rule("holdout", "win_score", "delta", ">=", -0.05)  # the judged holdout barred by a delta, no p-value
CALIBRATE_PARENT = {"artifact": 1, "k": 3}


def _call(id_: int, tool: str, args: dict, data: dict | None = None, status: str = "done") -> Call:
    return Call(id=id_, tool=tool, args=canonical_args(tool, args), status=status, summary="", data=data or {})


def _parent(metrics: dict | None = None) -> Checkpoint:
    return Checkpoint(id=1, name="parent", origin="parent", parent=None, served_decoding="", metrics=metrics or {},
                      verdicts=[])


def _lab(calls: list[Call], checkpoints: list[Checkpoint], rules=(DIGITS_GUARD,), incumbent: int = 1,
         calibrated: list[int] | None = None) -> Summary:
    first = [_call(1, "calibrate", CALIBRATE_PARENT, {"reference": {"holdout": "evals/ref/holdout.jsonl"}})]
    return summary(budget=ledger(100, 1, 0, 5), bars=bars(*rules), parent=1, incumbent=incumbent,
                   calibrated=calibrated or [1], screen_floors={"digits/correct": 0.05}, checkpoints=checkpoints,
                   calls=first + calls)


# ---- item 1: the lab's own data, or a recorded skip ------------------------------------------------------


BUILT = [_call(2, "build_dataset", {"builder": "winner_sft"}, {"artifact_id": 2}),
         _call(3, "build_dataset", {"builder": "battle_pairs"}, {"artifact_id": 3})]


def test_the_rft_arm_samples_the_labs_own_verified_pool():
    step = next_step(_lab(BUILT, [_parent()]), PlaybookSettings.named("full", "math-pool"))
    assert (step.tool, step.args) == ("build_dataset", {"builder": "verified_pool", "source": "math-pool"})


def test_a_lab_without_a_verified_pool_skips_the_rft_arm_and_says_why():
    cfg = PlaybookSettings.named("full")
    step = next_step(_lab(BUILT, [_parent()]), cfg)
    assert step.tool == "skip" and step.args["step"] == "the first rft arm"
    assert "no [[data]] pool of kind \"verified\"" in step.args["reason"]
    # once the skip is on record the protocol goes on with the arms it has data for: nothing is generated instead
    skipped = _call(4, "skip", step.args)
    step = next_step(_lab([*BUILT, skipped], [_parent()]), cfg)
    assert (step.tool, step.args["trainer"]) == ("train", "sft")


def test_an_arm_whose_build_failed_is_skipped_on_record_once():
    failed = _call(4, "build_dataset", {"builder": "verified_pool", "source": "math-pool"}, status="failed")
    cfg = PlaybookSettings.named("full", "math-pool")
    step = next_step(_lab([*BUILT, failed], [_parent()]), cfg)
    assert step.tool == "skip" and step.args["step"] == "the first rft arm" and "was not built" in step.args["reason"]
    step = next_step(_lab([*BUILT, failed, _call(5, "skip", step.args)], [_parent()]), cfg)
    assert (step.tool, step.args["trainer"]) == ("train", "sft")


# ---- item 2: a delta bar on the judged holdout, after the first promotion --------------------------------


def _metrics(digits: float, win: float) -> dict:
    return {"digits": {"correct": digits}, "holdout": {"win_score": win}}


def _promoted_then_swept(sweep_status: str | None = None, holdout_bar=HOLDOUT_DELTA) -> Summary:
    """The SFT arm (3) screened on both suites (the holdout is a screen suite under a delta bar), compared and
    promoted; the sweep's arm (5) trained from the parent; the new incumbent 3 not calibrated yet (when_read)."""
    screen = ["digits", "holdout"]
    calls = [_call(2, "build_dataset", {"builder": "winner_sft"}, {"artifact_id": 2}),
             _call(3, "train", {"trainer": "sft", "parent": 1, "dataset": 2}, {"artifact_id": 3}),
             _call(4, "evaluate", {"artifact": 3, "suites": screen}),
             _call(5, "compare", {"candidate": 3}), _call(6, "promote", {"candidate": 3}),
             _call(7, "train", {"trainer": "sft", "parent": 1, "dataset": 2, "lr_scale": 2.0}, {"artifact_id": 5})]
    cps = [_parent(_metrics(0.5, 0.5)),
           Checkpoint(id=3, name="sft", origin="train:sft", parent=1, served_decoding="", metrics=_metrics(0.6, 0.55),
                      verdicts=[verdict(1, 1, True)]),
           Checkpoint(id=5, name="sft-x2", origin="train:sft", parent=1, served_decoding="", metrics={}, verdicts=[])]
    if sweep_status is not None:
        calls.append(_call(8, "evaluate", {"artifact": 5, "suites": screen}, status=sweep_status))
    return _lab(calls, cps, rules=(DIGITS_GUARD, holdout_bar), incumbent=3)


SWEEP = PlaybookSettings(families=("sft",), sweep=(2.0,), soup=False, dose_alphas=(), serving=(), trajectory_shares=())


@pytest.mark.parametrize("holdout_bar", [
    HOLDOUT_DELTA, rule("holdout", "win_score", "delta", ">=", -1, floors=True),
    rule("holdout", "win_score", "t", ">=", -2), rule("holdout", "win_score", "ci_low", ">=", -0.1)],
    ids=["delta", "delta-floors", "t", "ci_low"])
def test_a_bar_without_a_p_value_on_the_judged_holdout_calibrates_the_new_incumbent_before_its_screen(holdout_bar):
    # The screen's holdout eval scores the sweep arm against the incumbent's own answers: the incumbent's
    # calibration makes them, so it comes first (the eval failed with "calibrate the incumbent first" before).
    step = next_step(_promoted_then_swept(holdout_bar=holdout_bar), SWEEP)
    assert (step.tool, step.args) == ("calibrate", {"artifact": 3, "k": 3})
    assert "now that the next step (evaluate:" in step.rationale
    step = next_step(_promoted_then_swept(holdout_bar=holdout_bar).model_copy(update={"calibrated": [1, 3]}), SWEEP)
    assert (step.tool, step.args) == ("evaluate", {"artifact": 5, "suites": ["digits", "holdout"]})


def test_a_candidate_whose_evaluation_failed_is_skipped_on_record():
    s = _promoted_then_swept("failed").model_copy(update={"calibrated": [1, 3]})
    step = next_step(s, SWEEP)
    assert step.tool == "skip" and "sft-x2" in step.args["step"] and "evaluation failed" in step.args["reason"]
    s = s.model_copy(update={"calls": [*s.calls, _call(9, "skip", step.args)]})
    assert next_step(s, SWEEP).tool == "stop"


def test_brook_builds_its_loop_fix_pairs_from_the_labs_battles_and_records_a_failed_build_as_a_skip():
    from agent.planners import recipes

    cfg = recipes.settings("brook", "test", {})
    pairs = [_call(2, "build_dataset", {"builder": "battle_pairs"}, {"artifact_id": 2})]
    step = next_step(_lab(pairs, [_parent()]), cfg)
    fix = {"builder": "loop_fix_pairs", "model": 1, "n": 8, "seed": 1}  # the lab's train battles, no task counts
    assert (step.tool, step.args) == ("build_dataset", fix)
    failed = [*pairs, _call(3, "build_dataset", fix, status="failed")]
    step = next_step(_lab(failed, [_parent()]), cfg)
    assert step.tool == "skip" and step.args["step"] == "brook round 1's loop-fix pairs"
    assert "battle pairs alone" in step.args["reason"]
    step = next_step(_lab([*failed, _call(4, "skip", step.args)], [_parent()]), cfg)
    assert (step.tool, step.args["trainer"], step.args["dataset"]) == ("train", "dpo", 2)


def test_aspens_arm_records_that_its_rank_replaces_the_labs_lora_r():
    from agent.planners import recipes

    cfg = recipes.settings("aspen", "test", {"chat_data": True})
    own = {"builder": "own_replay", "model": 1, "n": 8}
    mix = {"builder": "mix", "parts": [{"dataset": 2}, {"dataset": 3, "kl_only": True}]}
    built = [_call(2, "build_dataset", {"builder": "winner_sft"}, {"artifact_id": 2}),
             _call(3, "build_dataset", own, {"artifact_id": 3}), _call(4, "build_dataset", mix, {"artifact_id": 4})]
    step = next_step(_lab(built, [_parent()]), cfg)
    assert (step.tool, step.args["lora_r"], step.args["method"]) == ("train", recipes.ASPEN_RANK, "lora")
    # the plan decision's rationale is the record: the lab's [train.lora] r is replaced, its alpha / r kept
    assert "in place of the lab's [train.lora] r" in step.rationale and "alpha / r" in step.rationale
