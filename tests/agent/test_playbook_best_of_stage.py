"""Best of stage: a screened stage gives every finalist a judged-holdout look first, then takes them under the bars
in order of that look until one is promoted (pure: hand-made summaries, no job, no notebook).

The setting: the parent (1) is the calibrated incumbent; two first arms from it, SFT (3) and DPO (4), made and
screened on the cheap suites. DPO screens higher (as it did in 7 of 10 toy worlds where SFT truly won more), so it
is the first finalist; the bars read one look a side, so no replicate draws come between the steps.
"""

from __future__ import annotations

import pytest

from agent.planners.playbook import PlaybookSettings, next_step
from agent.summary import Call, Checkpoint, Summary
from agent.toolbox import canonical_args
from tests.agent.views import (
    FIXED_ARMS,
    HOLDOUT_P,
    TOY_RULES,
    bar_verdict,
    bars,
    flags_era,
    ledger,
    summary,
    v3,
    verdict,
)

CHEAP = ["synthetic", "loops"]
CFG = v3(families=("sft", "dpo"), sweep=(), soup=False, dose_alphas=(0.5,), serving=(), finalists=2,
                       fallbacks=0, trajectory=())
SFT, DPO = 3, 4


def _call(id_: int, tool: str, args: dict, data: dict | None = None, status: str = "done") -> Call:
    return Call(id=id_, tool=tool, args=canonical_args(tool, args), status=status, summary="", data=data or {})


def _metrics(floors: float, win: float | None) -> dict:
    out = {"synthetic": {"correct": round(0.50 + 0.05 * floors, 6)}, "loops": {"looping": 0.20}}
    return out | ({"holdout": {"win_score": win}} if win is not None else {})


def _verdict(cid: int, promoted: bool, incumbent: int = 1) -> list:
    return [verdict(cid, incumbent, promoted, [bar_verdict(HOLDOUT_P, 0.001 if promoted else 0.4, 0.05, promoted)])]


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
    return summary(budget=ledger(100, 10, 0, 5), bars=bars(*TOY_RULES, p_family=3), parent=1, incumbent=incumbent,
                   calibrated=[1], screen_floors={"synthetic/correct": 0.05, "loops/looping": 0.05}, checkpoints=cps,
                   calls=calls)


HOLDOUT = {"suites": ["holdout"]}
LOOKS = [_call(7, "evaluate", {"artifact": DPO} | HOLDOUT), _call(8, "evaluate", {"artifact": SFT} | HOLDOUT)]


def _compared(*order: int) -> list[Call]:
    return [_call(9 + n, "compare", {"candidate": c}) for n, c in enumerate(order)]


def test_every_finalist_gets_its_holdout_look_before_any_comparison():
    step = next_step(_session(), CFG)
    assert (step.tool, step.args) == ("evaluate", {"artifact": DPO} | HOLDOUT)  # the better screen goes first
    s = _session(LOOKS[:1], wins=(None, 0.60))
    step = next_step(s, CFG)
    assert (step.tool, step.args) == ("evaluate", {"artifact": SFT} | HOLDOUT)
    assert "every finalist's look before any comparison" in step.rationale
    # Off, the old order: the best-screened finalist is compared (and promoted) before the second is looked at.
    step = next_step(s, CFG.model_copy(update={"stage": "first_cleared", "version": 2}))
    assert (step.tool, step.args) == ("compare", {"candidate": DPO})


def test_the_better_holdout_look_goes_under_the_bars_first_and_is_promoted_when_it_clears():
    step = next_step(_session(LOOKS, wins=(0.66, 0.60)), CFG)
    assert (step.tool, step.args) == ("compare", {"candidate": SFT})
    assert "leads the stage's judged holdout (0.660; dpo 0.600)" in step.rationale
    s = _session(LOOKS + _compared(SFT), wins=(0.66, 0.60), verdicts=(_verdict(1, True), []))
    assert (next_step(s, CFG).tool, next_step(s, CFG).args) == ("promote", {"candidate": SFT})
    # The same looks the other way round take the better-screened DPO arm first.
    assert next_step(_session(LOOKS, wins=(0.60, 0.66)), CFG).args == {"candidate": DPO}


def test_a_rejected_leader_hands_its_place_to_the_next_look_and_that_one_is_promoted_if_it_clears():
    s = _session(LOOKS + _compared(SFT), wins=(0.66, 0.60), verdicts=(_verdict(1, False), []))
    step = next_step(s, CFG)
    assert (step.tool, step.args) == ("compare", {"candidate": DPO})
    assert "next on the stage's judged holdout (0.600; sft 0.660), the finalists above it rejected" in step.rationale
    s = _session(LOOKS + _compared(SFT, DPO), wins=(0.66, 0.60), verdicts=(_verdict(1, False), _verdict(2, True)))
    assert (next_step(s, CFG).tool, next_step(s, CFG).args) == ("promote", {"candidate": DPO})


def test_a_stage_where_no_finalist_cleared_promotes_nothing_and_moves_on():
    s = _session(LOOKS + _compared(SFT, DPO), wins=(0.66, 0.60), verdicts=(_verdict(1, False), _verdict(2, False)))
    step = next_step(s, CFG)
    assert step.tool == "stop" and step.args == {"reason": "protocol complete"}  # no promoted arm: no dose


def test_a_promoted_leader_ends_the_stage_and_the_next_stage_follows_it():
    promoted = LOOKS + _compared(SFT) + [_call(11, "promote", {"candidate": SFT})]
    # DPO is never compared, not even against the new incumbent, though it screens above it here.
    s = _session(promoted, wins=(0.66, 0.60), verdicts=(_verdict(1, True), []), incumbent=SFT)
    step = next_step(s, CFG)
    assert (step.tool, step.args) == ("merge", {"method": "dose", "models": [1, SFT], "alpha": 0.5})
    # With a sweep, it follows the promoted arm's family (SFT), not the better-screened one (DPO).
    swept = CFG.model_copy(update={"sweep": (2.0,), "dose_alphas": ()})
    step = next_step(s, swept)
    assert (step.tool, step.args["trainer"], step.args["lr"]) == ("train", "sft", 2e-3)


def test_no_holdout_look_for_a_finalist_no_p_value_is_left_for():
    s = _session([_call(7, "compare", {"candidate": 99}), _call(8, "compare", {"candidate": 98}),
                  _call(12, "compare", {"candidate": 97})])
    assert next_step(s, CFG).tool == "stop"  # p_family 3, all spent elsewhere


def test_settings_the_short_protocol_and_sessions_recorded_before_the_setting():
    short = PlaybookSettings.short()
    assert short.stage == "best_of_stage" and (short.finalists, short.fallbacks) == (2, 0)
    assert short.comparisons() == 3  # both arms and the dose: the family the fallback protocol registered too
    # A record of the flags era: lazy calibration without best_of_stage was version 2, promoting the first cleared.
    old = PlaybookSettings.recorded(flags_era(short, lazy_calibration=True), "s")
    assert (old.version, old.stage, old.calibration, old.arms) == (2, "first_cleared", "when_read", "fixed")
    both = PlaybookSettings.recorded(flags_era(short, lazy_calibration=True, best_of_stage=True), "s")
    assert (both.version, both.stage, both.protocol) == (3, "best_of_stage", "full")  # the flags era named none
    assert both.lr == FIXED_ARMS["lr"] and both.steps == short.steps  # its arms replay with the numbers it used
    assert PlaybookSettings.recorded(short.model_dump(mode="json"), "s") == short


def _below(floors: float, extra: list[Call] = (), arms_from_train: bool = False) -> Summary:
    """The stage with the SFT arm screening `floors` noise floors below the parent (DPO still above it); with
    `arms_from_train` the arms' calls are those of version 4 and later (the lab's [train], the steps fixed)."""
    s = _session(list(extra), wins=(None, 0.60) if extra else (None, None))
    cps = [cp.model_copy(update={"metrics": _metrics(floors, None)}) if cp.id == SFT else cp for cp in s.checkpoints]
    calls = s.calls
    if arms_from_train:
        calls = [_call(c.id, "train", {"trainer": c.args["trainer"], "parent": 1, "dataset": c.args["dataset"],
                                        "steps": 30, "batch_size": 8}, c.data) if c.tool == "train" else c for c in calls]
    return s.model_copy(update={"checkpoints": cps, "calls": calls})


def test_version_5_the_screen_ranks_the_finalists_and_no_longer_gates_them():
    # SFT screens two floors below the parent (two verified items, say): under versions 1-4 it never reaches the
    # holdout; under version 5 it is the second finalist and gets its look, and the bars decide.
    v5 = PlaybookSettings(**(CFG.model_dump() | {"version": 5, "arms": "train", "lr": None, "steps": 30,
                                                 "batch_size": 8, "trajectory_shares": (), "finalist_rule": None}))
    assert (v5.finalist_rule, CFG.finalist_rule) == ("best_screened", "above_incumbent")
    assert next_step(_below(-2, arms_from_train=True), v5).args == {"artifact": DPO} | HOLDOUT  # better screen first
    step = next_step(_below(-2, LOOKS[:1], arms_from_train=True), v5)
    assert (step.tool, step.args) == ("evaluate", {"artifact": SFT} | HOLDOUT)
    assert "screened -2.00 noise floors against the incumbent" in step.rationale
    # version 3's gate (and 1-4's): the one finalist above the parent is compared at once
    assert next_step(_below(-2, LOOKS[:1]), CFG).args == {"candidate": DPO}
    # The rule is the version's: another one is refused, and a record of version 4 reads back with its gate.
    with pytest.raises(ValueError, match="version 5"):
        PlaybookSettings(**(v5.model_dump() | {"finalist_rule": "above_incumbent"}))
    old = PlaybookSettings.short().model_dump(mode="json") | {"version": 4}
    old.pop("finalist_rule")
    old.pop("evidence")  # recorded before version 6's key: read back as the version's rule
    assert PlaybookSettings.recorded(old, "s").finalist_rule == "above_incumbent"
    assert PlaybookSettings.recorded(old, "s").evidence == "one_look"
    assert PlaybookSettings.short().finalist_rule == "best_screened" and PlaybookSettings().version == 7
