"""The playbook's trajectory selection, on hand-made summaries (pure: no job, no notebook).

The setting: one family, one sweep setting, every arm saving snapshots at steps 10 and 20 of 30. Artifacts: the
parent 1, the dataset 2, the first SFT arm 3 (snapshots 31, 32) and the sweep's arm 4 (snapshots 41, 42). The
bars are a p bar on the holdout and two noise-floor bars (synthetic, loops at a floor of 0.05), so a screen score
is the synthetic delta from the parent in units of 0.05 when looping is unchanged.
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from agent.planners.playbook import PlaybookSettings, next_step
from agent.summary import Call, Checkpoint, Summary
from agent.toolbox import canonical_args
from tests.agent.views import TOY_RULES, bars, flags_era, ledger, summary, v3, verdict

RULES = TOY_RULES
FLOORS = {"synthetic/correct": 0.05, "loops/looping": 0.05}
CHEAP = ["synthetic", "loops"]
CFG = v3(families=("sft",), sweep=(2.0,), soup=False, dose_alphas=(), serving=(), finalists=1, trajectory=(10, 20))
PARENT = {"synthetic": {"correct": 0.50}, "loops": {"looping": 0.20}, "holdout": {"win_score": 0.5}}


def _screened(floors: float, holdout: bool = False) -> dict:
    """Metrics `floors` noise floors above the parent on synthetic (looping unchanged)."""
    out = {"synthetic": {"correct": round(0.50 + 0.05 * floors, 6)}, "loops": {"looping": 0.20}}
    return out | ({"holdout": {"win_score": 0.55}} if holdout else {})


def _cp(id_: int, metrics: dict, verdicts: list | None = None) -> Checkpoint:
    return Checkpoint(id=id_, name=f"c{id_}", origin="train:sft", parent=1, served_decoding="", metrics=metrics,
                      verdicts=verdicts or [])


def _call(id_: int, tool: str, args: dict, data: dict | None = None) -> Call:
    return Call(id=id_, tool=tool, args=canonical_args(tool, args), status="done", summary="", data=data or {})


def _arm_args(lr: float) -> dict:
    return {"trainer": "sft", "parent": 1, "dataset": 2, "lr": lr, "steps": 30, "batch_size": 8, "snapshots": [10, 20]}


def _session(arm: float, swept: float, snaps: dict[int, dict], extra_calls: list[Call] | None = None,
             verdicts: dict[int, list] | None = None, p_family: int = 3) -> Summary:
    """After the sweep: arm 3 screened `arm` floors (judged, not promoted), arm 4 `swept` (below the parent: not
    judged); `snaps` the snapshots' metrics so far (artifact id -> metrics)."""
    rejected = [verdict(1, 1, False)]
    calls = [_call(1, "build_dataset", {"builder": "winner_sft"}, {"artifact_id": 2}),
             _call(2, "train", _arm_args(1e-3), {"artifact_id": 3, "snapshots": [{"step": 10, "artifact_id": 31},
                                                                                 {"step": 20, "artifact_id": 32}]}),
             _call(3, "compare", {"candidate": 3}),
             _call(4, "train", _arm_args(2e-3), {"artifact_id": 4, "snapshots": [{"step": 10, "artifact_id": 41},
                                                                                 {"step": 20, "artifact_id": 42}]})]
    cps = [Checkpoint(id=1, name="parent", origin="parent", parent=None, served_decoding="", metrics=PARENT,
                      verdicts=[]),
           _cp(3, _screened(arm, holdout=True), rejected), _cp(4, _screened(swept)),
           *(_cp(i, m, (verdicts or {}).get(i)) for i, m in snaps.items()), _cp(41, {}), _cp(42, {})]
    budget = ledger(100, 10, 0, 5)
    return summary(budget=budget, split={"id": 1, "sha256": "x", "counts": {}},
                   bars=bars(*RULES, p_family=p_family), parent=1, incumbent=1,
                   calibrated=[1], screen_floors=FLOORS, checkpoints=cps, datasets=[], calls=calls + (extra_calls or []),
                   refusals=[], gate_refusals=[], failures=[], consecutive_failed_arms=0, nominee=None,
                   sealed_opened=False)


def test_the_best_runs_snapshots_are_screened_on_the_cheap_suites():
    step = next_step(_session(2, -1, {31: {}, 32: {}}), CFG)
    assert (step.tool, step.args) == ("evaluate", {"artifact": 31, "suites": CHEAP})
    assert "trajectory selection" in step.rationale and "step 10 of the best run c3 (screened +2.00)" in step.rationale
    step = next_step(_session(2, -1, {31: _screened(1), 32: {}}), CFG)
    assert (step.tool, step.args) == ("evaluate", {"artifact": 32, "suites": CHEAP})


def test_the_best_run_is_the_best_screened_one_sweep_included():
    # the sweep's arm screened +3, above the first arm's +2 (and was judged: holdout metrics are there)
    s = _session(2, 3, {31: {}, 32: {}})
    s = s.model_copy(update={"checkpoints": [c if c.id != 4 else _cp(4, _screened(3, holdout=True)) for c in s.checkpoints],
                             "calls": [*s.calls, _call(5, "compare", {"candidate": 4})]})
    step = next_step(s, CFG)
    assert (step.tool, step.args) == ("evaluate", {"artifact": 41, "suites": CHEAP})


def test_a_snapshot_that_screens_above_the_final_goes_to_the_holdout_and_the_bars():
    snaps = {31: _screened(1), 32: _screened(4)}
    step = next_step(_session(2, -1, snaps), CFG)
    assert (step.tool, step.args) == ("evaluate", {"artifact": 32, "suites": ["holdout"]})
    assert "c32 (step 20 of c3) screened +4.00 noise floors, the run's final checkpoint +2.00" in step.rationale
    snaps[32] = _screened(4, holdout=True)
    step = next_step(_session(2, -1, snaps), CFG)
    assert (step.tool, step.args) == ("compare", {"candidate": 32}) and "+4.00" in step.rationale
    promoted = {32: [verdict(2, 1, True)]}
    step = next_step(_session(2, -1, snaps, [_call(5, "compare", {"candidate": 32})], promoted), CFG)
    assert (step.tool, step.args) == ("promote", {"candidate": 32})


def test_the_final_is_kept_when_no_snapshot_screens_above_it_and_the_next_step_says_why():
    # snapshot 32 ties the final (+2): not above it; nothing else is left, so the stop carries the numbers
    screens = [_call(5, "evaluate", {"artifact": 31, "suites": CHEAP}), _call(6, "evaluate", {"artifact": 32, "suites": CHEAP})]
    step = next_step(_session(2, -1, {31: _screened(1), 32: _screened(2)}, screens), CFG)
    assert (step.tool, step.args) == ("stop", {"reason": "protocol complete"})
    assert step.rationale.startswith("trajectory selection: c32 (step 20 of c3) screened +2.00 noise floors, the "
                                     "run's final checkpoint +2.00: kept the final checkpoint")
    # once a later step is on record, the choice is not repeated
    later = _call(7, "stop", {"reason": "elsewhere"})
    step = next_step(_session(2, -1, {31: _screened(1), 32: _screened(2)}, [*screens, later]), CFG)
    assert step.rationale == "every step of the protocol has run or was refused"


def test_a_snapshot_above_the_final_but_not_above_the_incumbent_is_not_judged():
    # the final screened -2 (not judged), snapshot 31 -1: better than its run, still below the parent
    screens = [_call(5, "evaluate", {"artifact": 31, "suites": CHEAP}), _call(6, "evaluate", {"artifact": 32, "suites": CHEAP})]
    s = _session(-2, -3, {31: _screened(-1), 32: _screened(-2.5)}, screens)
    step = next_step(s, CFG)
    assert step.tool == "stop" and "c31 (step 10 of c3) screened -1.00" in step.rationale
    assert "kept the final checkpoint" in step.rationale


def test_no_snapshot_is_compared_beyond_the_p_family():
    snaps = {31: _screened(1), 32: _screened(4, holdout=True)}
    assert next_step(_session(2, -1, snaps, p_family=2), CFG).tool == "compare"
    spent = [_call(5, "compare", {"candidate": 99})]
    assert next_step(_session(2, -1, snaps, spent, p_family=2), CFG).tool == "stop"


def test_the_full_protocol_saves_snapshots_and_counts_their_comparison_the_others_do_not():
    full, test, short = PlaybookSettings(), PlaybookSettings.test(), PlaybookSettings.short()
    assert full.trajectory_shares == (1 / 3, 2 / 3) and not test.selects_trajectory and not short.selects_trajectory
    assert full.comparisons() == full.model_copy(update={"trajectory_shares": ()}).comparisons() + 1 == 10
    assert test.comparisons() == 3  # as before: the CI's sessions are unchanged
    assert short.comparisons() == 3  # both first arms as finalists, one dose
    first = next_step(_session(2, -1, {}).model_copy(update={"calls": [
        _call(1, "build_dataset", {"builder": "winner_sft"}, {"artifact_id": 2})], "checkpoints": []}), CFG)
    assert (first.tool, first.args["snapshots"]) == ("train", [10, 20])


@pytest.mark.parametrize("update", [{"trajectory": (30,)}, {"trajectory": (20, 10)}, {"stage": "judge_every"}])
def test_trajectory_steps_must_lie_inside_the_arms_and_need_the_screen(update):
    with pytest.raises(ValidationError, match="trajectory"):
        PlaybookSettings(**(PlaybookSettings().model_dump() | update))


def test_recorded_settings_round_trip_and_an_older_record_is_one_clear_refusal():
    from agent.errors import SessionError

    for name in ("full", "test", "short"):
        s = PlaybookSettings.named(name)
        assert PlaybookSettings.recorded(s.model_dump(mode="json"), "s1") == s
    # A test-protocol session of the flags era recorded before trajectory selection: no `trajectory` key, so the
    # full protocol's default then, (10, 20), with screening off: that record does not fit, one clear refusal.
    older = flags_era(PlaybookSettings.test(), screen=False)
    del older["trajectory"]
    older["trajectory"] = [10, 20]
    with pytest.raises(SessionError, match=r"session s1: .*trajectory.*--protocol"):
        PlaybookSettings.recorded(older, "s1")
    with pytest.raises(SessionError, match=r"session s1: .*version"):  # a record of a later version of the rules
        PlaybookSettings.recorded(PlaybookSettings.test().model_dump(mode="json") | {"version": 99}, "s1")


def test_version_4_arms_take_the_labs_train_settings():
    full = PlaybookSettings()  # version 4: arms from [train], snapshots at shares of the run, sweeps as lr multiples
    s = _session(2, -1, {}).model_copy(update={"calls": [
        _call(1, "build_dataset", {"builder": "winner_sft"}, {"artifact_id": 2})], "checkpoints": []})
    first = next_step(s, full.model_copy(update={"families": ("sft",)}))
    assert (first.tool, first.args) == ("train", {"trainer": "sft", "parent": 1, "dataset": 2,
                                                  "snapshot_fractions": [1 / 3, 2 / 3]})
    assert "lr" not in first.args and "the lab's [train] settings" in first.rationale
    from agent.planners.stages import train_args

    assert train_args(s, "sft", 2, full, 2.0)["lr_scale"] == 2.0
    assert train_args(s, "sft", 2, PlaybookSettings.short()) == {"trainer": "sft", "parent": 1, "dataset": 2,
                                                                  "steps": 16}
