"""Best of stage: a screened stage judges all its finalists against the stage's incumbent, then promotes the
cleared one with the best judged-holdout score (pure: hand-made summaries, no job, no notebook).

The setting: the parent (1) is the calibrated incumbent; two first arms from it, SFT (3) and DPO (4), made and
screened on the cheap suites. DPO screens higher (as it did in 7 of 10 toy worlds where SFT truly won more), so it
is the first finalist; the bars read one look a side, so no replicate draws come between the steps.
"""

from __future__ import annotations

import pytest

from agent.planners.playbook import PlaybookSettings, next_step
from agent.summary import Budget, Call, Checkpoint, Summary, Verdict
from agent.toolbox import canonical_args

RULES = ["holdout/win_score p <= 0.05", "synthetic/correct delta >= -1 * noise_floor",
         "loops/looping delta <= 1 * noise_floor"]
CHEAP = ["synthetic", "loops"]
CFG = PlaybookSettings(families=("sft", "dpo"), sweep=(), soup=False, dose_alphas=(0.5,), serving=(), finalists=2,
                       fallbacks=0, trajectory=())
SFT, DPO = 3, 4


def _call(id_: int, tool: str, args: dict, data: dict | None = None, status: str = "done") -> Call:
    return Call(id=id_, tool=tool, args=canonical_args(tool, args), status=status, summary="", data=data or {})


def _metrics(floors: float, win: float | None) -> dict:
    out = {"synthetic": {"correct": round(0.50 + 0.05 * floors, 6)}, "loops": {"looping": 0.20}}
    return out | ({"holdout": {"win_score": win}} if win is not None else {})


def _verdict(cid: int, promoted: bool, incumbent: int = 1) -> list[Verdict]:
    return [Verdict(comparison_id=cid, incumbent=incumbent, promoted=promoted,
                    bars=[f"holdout/win_score p=0.001 <= 0.05: {'holds' if promoted else 'fails'}"])]


def _session(extra: list[Call] = (), wins: tuple[float | None, float | None] = (None, None),
             verdicts: tuple[list, list] = ([], []), incumbent: int = 1) -> Summary:
    calls = [_call(1, "build_dataset", {"builder": "winner_sft"}, {"artifact_id": 2}),
             _call(2, "build_dataset", {"builder": "battle_pairs"}, {"artifact_id": 5}),
             _call(3, "train", {"trainer": "sft", "parent": 1, "dataset": 2, "lr": 1e-3, "steps": 30, "batch_size": 8,
                                "snapshots": []}, {"artifact_id": SFT}),
             _call(4, "train", {"trainer": "dpo", "parent": 1, "dataset": 5, "lr": 2e-4, "steps": 30, "batch_size": 8,
                                "snapshots": []}, {"artifact_id": DPO}),
             _call(5, "evaluate", {"artifact": SFT, "suites": CHEAP}),
             _call(6, "evaluate", {"artifact": DPO, "suites": CHEAP}), *extra]
    cps = [Checkpoint(id=1, name="parent", origin="parent", parent=None, served_decoding="",
                      metrics=_metrics(0, 0.5), verdicts=[]),
           Checkpoint(id=SFT, name="sft", origin="train:sft", parent=1, served_decoding="",
                      metrics=_metrics(2, wins[0]), verdicts=verdicts[0]),
           Checkpoint(id=DPO, name="dpo", origin="train:dpo", parent=1, served_decoding="",
                      metrics=_metrics(4, wins[1]), verdicts=verdicts[1])]
    budget = Budget(budget_gpuh=100, spent_gpuh=10, reserved_gpuh=0, reserve_gpuh=5, left_above_reserve_gpuh=85)
    return Summary(session="s", budget=budget, split={"id": 1, "sha256": "x", "counts": {}},
                   bars={"id": 1, "sha256": "y", "rules": RULES, "p_family": 3, "replicates": 1}, parent=1,
                   incumbent=incumbent, calibrated=[1], noise_floors={"synthetic/correct": 0.05, "loops/looping": 0.05},
                   checkpoints=cps, datasets=[], calls=calls, refusals=[], gate_refusals=[], failures=[],
                   consecutive_failed_arms=0, nominee=None, sealed_opened=False)


HOLDOUT = {"suites": ["holdout"]}
JUDGED = [_call(7, "evaluate", {"artifact": DPO} | HOLDOUT), _call(8, "compare", {"candidate": DPO}),
          _call(9, "evaluate", {"artifact": SFT} | HOLDOUT), _call(10, "compare", {"candidate": SFT})]


def test_the_first_finalist_that_clears_is_not_promoted_before_the_second_is_judged():
    step = next_step(_session(), CFG)
    assert (step.tool, step.args) == ("evaluate", {"artifact": DPO} | HOLDOUT)  # the better screen goes first
    s = _session(JUDGED[:2], wins=(None, 0.60), verdicts=([], _verdict(1, True)))
    step = next_step(s, CFG)
    assert (step.tool, step.args) == ("evaluate", {"artifact": SFT} | HOLDOUT)
    # Off, the old order: the cleared finalist is promoted at once, and the next one must beat it.
    step = next_step(s, CFG.model_copy(update={"best_of_stage": False}))
    assert (step.tool, step.args) == ("promote", {"candidate": DPO})


def test_the_cleared_finalist_with_the_best_judged_holdout_is_promoted():
    s = _session(JUDGED, wins=(0.66, 0.60), verdicts=(_verdict(2, True), _verdict(1, True)))
    step = next_step(s, CFG)
    assert (step.tool, step.args) == ("promote", {"candidate": SFT})
    assert "best judged-holdout score of the stage's 2 cleared finalist(s) (0.660; dpo 0.600)" in step.rationale
    # The same scores the other way round promote the better-screened DPO arm.
    s = _session(JUDGED, wins=(0.60, 0.66), verdicts=(_verdict(2, True), _verdict(1, True)))
    assert next_step(s, CFG).args == {"candidate": DPO}


@pytest.mark.parametrize("cleared", [(True, False), (False, True)])
def test_only_a_cleared_finalist_is_promoted_whatever_its_holdout_score(cleared):
    sft_ok, dpo_ok = cleared
    s = _session(JUDGED, wins=(0.58, 0.70) if sft_ok else (0.70, 0.58),
                 verdicts=(_verdict(2, sft_ok), _verdict(1, dpo_ok)))
    step = next_step(s, CFG)
    assert (step.tool, step.args) == ("promote", {"candidate": SFT if sft_ok else DPO})
    assert "of the stage's 1 cleared finalist(s)" in step.rationale


def test_a_stage_where_no_finalist_cleared_promotes_nothing_and_moves_on():
    s = _session(JUDGED, wins=(0.55, 0.56), verdicts=(_verdict(2, False), _verdict(1, False)))
    step = next_step(s, CFG)
    assert step.tool == "stop" and step.args == {"reason": "protocol complete"}  # no promoted arm: no dose


def test_after_the_stage_promotes_its_choice_the_next_stage_follows_the_promoted_arm():
    promoted = JUDGED + [_call(11, "promote", {"candidate": SFT})]
    s = _session(promoted, wins=(0.66, 0.60), verdicts=(_verdict(2, True), _verdict(1, True)), incumbent=SFT)
    step = next_step(s, CFG)
    assert (step.tool, step.args) == ("merge", {"method": "dose", "models": [1, SFT], "alpha": 0.5})
    # With a sweep, it follows the promoted arm's family (SFT), not the better-screened one (DPO).
    swept = CFG.model_copy(update={"sweep": (2.0,), "dose_alphas": ()})
    step = next_step(s, swept)
    assert (step.tool, step.args["trainer"], step.args["lr"]) == ("train", "sft", 2e-3)
    assert next_step(s, swept.model_copy(update={"best_of_stage": False})).args["trainer"] == "dpo"


def test_settings_the_short_protocol_and_sessions_recorded_before_the_setting():
    short = PlaybookSettings.short()
    assert short.best_of_stage and (short.finalists, short.fallbacks) == (2, 0)
    assert short.comparisons() == 3  # both arms and the dose: the family the fallback protocol registered too
    assert PlaybookSettings.recorded(PlaybookSettings.short().model_dump(exclude={"best_of_stage"}), "s").best_of_stage \
        is False
    assert PlaybookSettings.recorded(short.model_dump(mode="json"), "s").best_of_stage is True
