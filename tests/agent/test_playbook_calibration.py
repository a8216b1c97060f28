"""Lazy calibration of a promoted incumbent, on hand-made summaries (pure: no job, no notebook).

The setting: one SFT arm (artifact 3) was promoted over the parent (1) and is the incumbent, not yet calibrated;
the protocol's one step left is a dose of 0.5 from the parent along it (artifact 5 once made). Screens on the
cheap suites read the parent's floors and the incumbent's first eval; the judged holdout eval (against the
incumbent's reference answers) and the comparison (its floors) read its calibration, so that is when it runs.
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from agent.planners.playbook import PlaybookSettings, next_step
from agent.summary import Call, Checkpoint, Summary
from agent.toolbox import canonical_args
from tests.agent.views import TOY_RULES, bars, flags_era, ledger, summary, v3, verdict

RULES = TOY_RULES
CHEAP = ["synthetic", "loops"]
CFG = v3(families=("sft",), sweep=(), soup=False, dose_alphas=(0.5,), serving=(), finalists=1,
                       trajectory=())
DOSE = {"method": "dose", "models": [1, 3], "alpha": 0.5}


def _metrics(floors: float, holdout: bool = False) -> dict:
    out = {"synthetic": {"correct": round(0.50 + 0.05 * floors, 6)}, "loops": {"looping": 0.20}}
    return out | ({"holdout": {"win_score": 0.55}} if holdout else {})


def _call(id_: int, tool: str, args: dict, data: dict | None = None) -> Call:
    return Call(id=id_, tool=tool, args=canonical_args(tool, args), status="done", summary="", data=data or {})


def _session(dose: dict | None = None, extra: list[Call] | None = None, calibrated: list[int] | None = None,
             parent_only: bool = False) -> Summary:
    """After the arm's promotion; `dose` the dose's metrics once it is made (None: not made yet)."""
    won = [verdict(1, 1, True)]
    calls = [_call(1, "build_dataset", {"builder": "winner_sft"}, {"artifact_id": 2}),
             _call(2, "train", {"trainer": "sft", "parent": 1, "dataset": 2, "lr": 1e-3, "steps": 30, "batch_size": 8,
                                "snapshots": []}, {"artifact_id": 3}),
             _call(3, "evaluate", {"artifact": 3, "suites": CHEAP}), _call(4, "evaluate", {"artifact": 3, "suites": ["holdout"]}),
             _call(5, "compare", {"candidate": 3}), _call(6, "promote", {"candidate": 3})]
    cps = [Checkpoint(id=1, name="parent", origin="parent", parent=None, served_decoding="",
                      metrics=_metrics(0, holdout=True), verdicts=[]),
           Checkpoint(id=3, name="arm", origin="train:sft", parent=1, served_decoding="",
                      metrics=_metrics(4, holdout=True), verdicts=won)]
    if dose is not None:
        calls.append(_call(7, "merge", DOSE, {"artifact_id": 5}))
        cps.append(Checkpoint(id=5, name="dose", origin="merge:dose", parent=1, served_decoding="", metrics=dose,
                              verdicts=[]))
    budget = ledger(100, 10, 0, 5)
    return summary(budget=budget, split={"id": 1, "sha256": "x", "counts": {}},
                   bars=bars(*RULES, p_family=3), parent=1,
                   incumbent=1 if parent_only else 3, calibrated=[1] if calibrated is None else calibrated,
                   screen_floors={"synthetic/correct": 0.05, "loops/looping": 0.05}, checkpoints=cps, datasets=[],
                   calls=calls + (extra or []), refusals=[], gate_refusals=[], failures=[], consecutive_failed_arms=0,
                   nominee=None, sealed_opened=False)


def test_the_parent_is_calibrated_before_anything_else():
    step = next_step(_session(parent_only=True, calibrated=[]), CFG)
    assert (step.tool, step.args) == ("calibrate", {"artifact": 1, "k": 3})


def test_a_promoted_incumbent_is_not_calibrated_before_a_step_reads_it():
    step = next_step(_session(), CFG)
    assert (step.tool, step.args["method"]) == ("merge", "dose")
    step = next_step(_session(dose={}), CFG)
    assert (step.tool, step.args) == ("evaluate", {"artifact": 5, "suites": CHEAP})


def test_the_judged_eval_of_a_screened_finalist_calibrates_the_incumbent_first():
    step = next_step(_session(dose=_metrics(5)), CFG)  # one floor above the incumbent: a finalist
    assert (step.tool, step.args) == ("calibrate", {"artifact": 3, "k": 3})
    assert "now that the next step (evaluate: judged holdout of finalist dose (screened +1.00" in step.rationale
    # calibrated: the holdout eval itself
    step = next_step(_session(dose=_metrics(5), calibrated=[1, 3]), CFG)
    assert (step.tool, step.args) == ("evaluate", {"artifact": 5, "suites": ["holdout"]})


def test_a_dose_that_screens_out_ends_the_protocol_without_a_calibration():
    step = next_step(_session(dose=_metrics(3)), CFG)  # a floor below the incumbent
    assert (step.tool, step.args) == ("stop", {"reason": "protocol complete"})


def test_an_interrupted_calibration_is_run_again_and_a_failed_one_stops():
    open_ = Call(id=8, tool="calibrate", args=canonical_args("calibrate", {"artifact": 3, "k": 3}), status="open",
                 summary="", data={})
    assert next_step(_session(extra=[open_]), CFG).tool == "calibrate"
    failed = open_.model_copy(update={"status": "failed", "summary": "job died"})
    step = next_step(_session(extra=[failed]), CFG)
    assert step.tool == "stop" and "calibration of incumbent arm failed: job died" in step.args["reason"]


def test_eager_calibration_and_sessions_recorded_before_lazy_calibration():
    eager = PlaybookSettings(**(CFG.model_dump() | {"version": 1, "calibration": "at_promotion", "stage": "first_cleared"}))
    assert next_step(_session(), eager).tool == "calibrate"
    # A record of the flags era without `lazy_calibration` is version 1: every new incumbent calibrated at once.
    assert PlaybookSettings.recorded(flags_era(PlaybookSettings.short()), "s").calibration == "at_promotion"
    assert PlaybookSettings.recorded(PlaybookSettings.short().model_dump(), "s").calibration == "when_read"
    # Rules that are not those of the version are another version, refused as such.
    with pytest.raises(ValidationError, match="version 3 of the playbook's rules"):
        PlaybookSettings(**(CFG.model_dump() | {"calibration": "at_promotion"}))
