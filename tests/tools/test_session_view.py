"""The session state's rules (memory/state.py, asked through tools/session.py), on states built in the test with
typed bars and verdicts, and one state folded from a real notebook."""

from __future__ import annotations

from pathlib import Path

import pytest

from evals.bars import Bars
from memory.notebook import Notebook
from memory.records import Adjustment
from memory.state import PFamily, SessionState
from tests.agent.views import HOLDOUT_P, SYNTHETIC_GUARD, TOY_RULES, bar_verdict, bars, ledger, state, verdict
from tools.session import view


def _view(**changes) -> SessionState:
    base = {"ledger": ledger(10.0, 4.0, 1.0, 1.0), "parent": 1, "chain": [1], "bars": bars(*TOY_RULES, p_family=3),
            "verdicts": [verdict(1, 1, True, [bar_verdict(HOLDOUT_P, 0.01, 0.05, True)], candidate=3),
                         verdict(2, 1, False, [bar_verdict(HOLDOUT_P, 0.01, 0.05, True),
                                               bar_verdict(SYNTHETIC_GUARD, -0.2, -0.05, False)], candidate=4)],
            "p_family": PFamily(size=3, spent=2, per_comparison=1), "failed_arms_in_row": 0}
    return state(**(base | changes))


def test_admission_keeps_the_reserve_except_for_the_nomination():
    led = _view().ledger  # 10 budget - 4 spent - 1 reserved - 1 reserve = 4 left above the reserve
    assert led.left_above_reserve_gpuh == pytest.approx(4.0)
    assert led.admission(4.0).admitted and not led.admission(4.01).admitted
    refused = led.admission(4.5)
    assert refused.reason == "forecast 4.500 GPU-h + spent 4.000 + reserved 1.000 + reserve 1.000 > budget 10.000"
    assert led.admission(4.5, nomination=True).admitted and not led.admission(5.01, nomination=True).admitted
    # A job's own pending reservation is not counted against it twice when its attempt is admitted again.
    assert led.without(1.0).admission(5.0).admitted


def test_the_time_limit_shrinks_to_what_the_budget_pays_for():
    led = ledger(10.0, 9.0, 0.0, 0.5)  # 0.5 GPU-h left above the reserve
    assert led.time_limit_min(240, minute_gpuh=0.1) == 5.0
    assert led.time_limit_min(240, minute_gpuh=0.001) == 240  # the lab's limit fits
    assert led.time_limit_min(240, minute_gpuh=1.0) == 240  # under a minute: admission refuses it instead
    assert led.time_limit_min(240, minute_gpuh=0.1, nomination=True) == 10.0


def test_promotion_gives_every_reason():
    v = _view()
    assert v.promotion(3).promotable and v.promotion(3).comparison_id == 1
    failed = v.promotion(4)
    assert not failed.promotable
    assert failed.reasons == ["its comparison 2 against incumbent 1 failed 1 bar(s): synthetic/correct delta=-0.2 >= "
                              "-0.05: fails"]
    moved = _view(chain=[1, 3])
    assert moved.promotion(4).reasons == ["artifact 4 has no comparison at its served decoding against incumbent 3"]
    assert moved.promotion(3).reasons[0] == "artifact 3 is already the incumbent"
    assert moved.promotion(1).reasons[0] == "artifact 1 was an incumbent before: the chain only moves forward"
    assert _view().promotion(9).reasons == ["artifact 9 has no comparison at its served decoding against incumbent 1"]


def test_the_p_value_family():
    assert _view().p_family.left == 1 and _view().p_family.fits_one_more
    assert not _view(p_family=PFamily(size=3, spent=3, per_comparison=1)).p_family.fits_one_more
    assert not PFamily(size=4, spent=3, per_comparison=2).fits_one_more  # a comparison tests every p bar at once
    assert PFamily(size=None, spent=0, per_comparison=0).fits_one_more  # no p bars: no family to spend


def test_the_loop_stops_on_failed_arms_or_a_spent_budget():
    assert _view().must_stop(max_failed_arms=3) is None
    assert _view(failed_arms_in_row=3).must_stop(3) == "3 arms in a row failed or missed the bars (limit 3)"
    spent = _view(ledger=ledger(10.0, 8.0, 1.0, 1.0)).must_stop(3)
    assert spent.startswith("budget spent: 8.000 of 10.000 GPU-h, 0.000 left above the reserve")
    assert _view().must_stop(3, min_step_gpuh=4.0) is not None and _view().must_stop(3, min_step_gpuh=3.9) is None


def test_a_view_read_from_the_notebook_is_typed(tmp_path: Path):
    spec = Bars.model_validate({"bar": [{"suite": "holdout", "metric": "win_score", "rule": "p <= 0.05",
                                         "test": "mcnemar_exact"},
                                        {"suite": "synthetic", "metric": "correct", "rule": "delta >= -1 * noise_floor"}],
                                "p_family": 4})
    with Notebook.open(tmp_path / "nb.db") as nb:
        nb.open_session("s", lab=str(tmp_path), budget_gpuh=10, reserve_gpuh=1, planner="playbook", executor="local",
                        config={})
        parent = nb.add_artifact(kind="checkpoint", name="parent", path="p", sha256="a", session="s",
                                 recipe={"role": "parent"}).id
        arm = nb.add_artifact(kind="checkpoint", name="arm", path="q", sha256="b", session="s", recipe={}).id
        record = nb.register_bars("s", spec.spec())
        verdicts = [bar_verdict(r, v, t, h) for r, v, t, h in zip(spec.spec().bars, (0.01, 0.0), (0.05, -0.02),
                                                                     (True, True), strict=True)]
        nb.add_comparison(session="s", candidate=arm, incumbent=parent, bars_id=record.id, verdicts=verdicts,
                          promoted=True, adjustment=Adjustment(raw_p=[0.01]), rationale="all bars hold")
        nb.record_decision("s", "incumbent", "arm becomes the incumbent", {"action": "incumbent", "artifact_id": arm,
                                                                          "comparison_id": 1, "previous": parent})
        v = view(nb, "s")
    assert (v.parent, v.incumbent, v.chain) == (parent, arm, [parent, arm])
    assert v.bars.primary == HOLDOUT_P and v.bars.suites() == (["synthetic"], ["holdout"])
    assert v.verdicts[0].bars[0].bar == HOLDOUT_P and v.verdicts[0].held == 2
    assert (v.p_family.size, v.p_family.spent, v.p_family.left) == (4, 1, 3)
    assert v.ledger.left_above_reserve_gpuh == 9.0


def test_an_interrupted_calls_own_reservation_is_not_counted_against_it_twice(tmp_path: Path):
    from memory.notebook import tool_call_key
    from tools.session import ledger as session_ledger
    from tools.session import own_reservation

    with Notebook.open(tmp_path / "nb.db") as nb:
        nb.open_session("s", lab=str(tmp_path), budget_gpuh=10, reserve_gpuh=1, planner="playbook", executor="local",
                        config={})
        nb.start_job("old", session="s", kind="eval", executor="local", resources={}, forecast_gpuh=2.0)
        nb.update_job("old", 1, state="completed", gpu_hours=1.5)
        args = {"trainer": "sft", "parent": 1}
        nb.record_tool_call("s", "train", args)
        nb.start_job("arm", session="s", kind="sft", executor="local", resources={}, forecast_gpuh=6.0)
        # The crash left the arm's job reserved: 10 - 1.5 spent - 6 reserved - 1 reserve = 1.5 left for anything new.
        led = session_ledger(nb, "s")
        assert not led.admission(6.0).admitted
        own = own_reservation(nb, "s", "train", args)
        assert own == 6.0 and led.without(own).admission(6.0).admitted
        assert own_reservation(nb, "s", "train", {"trainer": "dpo", "parent": 1}) == 0.0  # another step: no credit
        nb.finish_tool_call(nb.tool_call("s", tool_call_key("train", args)).id, "done", {})
        assert own_reservation(nb, "s", "train", args) == 0.0  # a finished call re-runs nothing
