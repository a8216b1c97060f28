"""Pure judgments apart from recording: every reason listed, nothing written, scoring modes never
paired, and the outcome recorded in one transaction with the tool call that asked for it."""

from __future__ import annotations

import pytest

from evals import compare as compare_mod
from evals import noise, records, sealed
from evals.decoding import Decoding
from evals.job import EvalResult, SuiteResult
from evals.judgment import Refusal
from evals.types import Outcome, suite_metrics
from memory.notebook import Notebook
from memory.records import BarsSpec, CalibrationRefusal, CompareRefusal
from memory.state import fold

SERVED = Decoding(temperature=0.7, top_p=0.95, max_new_tokens=64, stop_token_ids=(3,))
GREEDY = Decoding(max_new_tokens=64, stop_token_ids=(3,))
BASE = [1, 0, 1, 0, 1, 1, 0, 1, 0, 1] * 4
BETTER = [1] * 36 + [0] * 4
DELTA_BAR = BarsSpec.model_validate({"bars": [{"suite": "ifeval", "metric": "correct", "statistic": "delta", "op": ">=",
                                               "value": 0.1, "unit": "absolute", "test": None, "confidence": None}],
                                     "p_family": None})
TABLES = ["session", "decision", "tool_call", "job", "artifact", "eval", "noise_floor", "bars", "comparison"]


def _result(values, *, suite="ifeval", mode: float | None = None, decoding=SERVED, replicate=0, sealed_suite=False):
    """An eval result; `mode` is the constraint scorer's per-item flag scoring_mode_ifeval (1.0 ifeval, 0.0 plain)."""
    flag = {} if mode is None else {"scoring_mode_ifeval": mode}
    outs = [Outcome(item_id=f"i{k}", label="x", values={"correct": v, **flag}) for k, v in enumerate(values)]
    suite_result = SuiteResult(suite=suite, scorer="constraints", sealed=sealed_suite, replicate=replicate,
                               seed=replicate, resampled=False, metrics=suite_metrics(outs), outcomes=outs,
                               completions_path=None)
    return EvalResult(checkpoint="ckpt", decoding=decoding, decoding_sha256=decoding.fingerprint(), served=True,
                      suites=[suite_result], generated_tokens=0, generation_s=0.0, load_s=0.0)


def _counts(nb: Notebook) -> dict[str, int]:
    return {t: nb.db.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in TABLES}


@pytest.fixture
def lab(tmp_path):
    nb = Notebook.open(tmp_path / "notebook.db")
    nb.open_session("s1", lab="test", budget_gpuh=10, reserve_gpuh=1, planner="playbook", executor="local", config={})
    inc = nb.add_artifact(kind="checkpoint", name="incumbent", path="/inc", sha256="a" * 64, session="s1").id
    cand = nb.add_artifact(kind="checkpoint", name="candidate", path="/cand", sha256="b" * 64, session="s1").id
    yield nb, inc, cand
    nb.close()


def _mode(flag: float | None) -> str:
    return "none declared" if flag is None else f"scoring_mode_ifeval={flag}"


@pytest.mark.parametrize(("inc_mode", "cand_mode"), [(0.0, 1.0), (1.0, 0.0), (None, 1.0), (0.0, None)])
def test_evals_scored_in_different_modes_are_never_paired(lab, inc_mode, cand_mode):
    nb, inc, cand = lab
    bars = nb.register_bars("s1", DELTA_BAR)
    records.record_result(nb, "s1", inc, _result(BASE, mode=inc_mode))
    records.record_result(nb, "s1", cand, _result(BETTER, mode=cand_mode))
    out = compare_mod.compare(nb, "s1", cand, inc, bars.id, SERVED)
    assert out.refused and f"candidate eval 2 was scored in mode {_mode(cand_mode)}," in out.reasons[0], out.reasons
    assert f"incumbent eval 1 in mode {_mode(inc_mode)}:" in out.reasons[0]
    assert nb.comparisons("s1") == []


def test_a_scoring_mode_label_is_compared_too(lab):
    nb, inc, cand = lab
    nb.register_bars("s1", DELTA_BAR)
    for artifact, values, label in ((inc, BASE, "plain"), (cand, BETTER, "ifeval")):
        ev = records.record_result(nb, "s1", artifact, _result(values))[0]
        nb.add_eval(session="s1", artifact_id=artifact, suite="labelled", replicate=0, decoding=ev.decoding,
                    decoding_sha256=ev.decoding_sha256, served=True, metrics={**ev.metrics, "scoring_mode": label},
                    items=ev.items)
    labelled = DELTA_BAR.model_copy(update={"bars": (DELTA_BAR.bars[0].model_copy(update={"suite": "labelled"}),)})
    state = fold(nb, "s1")
    judged = compare_mod.judge(nb, state, cand, inc, state.bars.model_copy(update={"spec": labelled}), SERVED)
    assert isinstance(judged, Refusal) and "mode scoring_mode=ifeval" in judged.reasons[0]
    assert "mode scoring_mode=plain" in judged.reasons[0]


def test_evals_scored_in_the_same_mode_are_compared(lab):
    nb, inc, cand = lab
    bars = nb.register_bars("s1", DELTA_BAR)
    records.record_result(nb, "s1", inc, _result(BASE, mode=1.0))
    records.record_result(nb, "s1", cand, _result(BETTER, mode=1.0))
    out = compare_mod.compare(nb, "s1", cand, inc, bars.id, SERVED)
    assert not out.refused and out.cleared and out.verdicts[0].value == pytest.approx(0.3)


def test_a_refusal_lists_every_reason_and_writes_nothing(lab):
    nb, inc, cand = lab
    records.record_result(nb, "s1", cand, _result(BETTER, decoding=GREEDY))  # looked at before the bars, greedy
    spec = DELTA_BAR.model_copy(update={"bars": (
        DELTA_BAR.bars[0].model_copy(update={"unit": "noise_floor", "value": 1.0}),  # no floor calibrated
        DELTA_BAR.bars[0].model_copy(update={"suite": "math"}),  # never evaluated for either side
    )})
    bars = nb.register_bars("s1", spec)
    before = _counts(nb)
    state = fold(nb, "s1")
    judged = compare_mod.judge(nb, state, cand, inc, state.bars, SERVED)
    assert _counts(nb) == before
    assert isinstance(judged, Refusal) and isinstance(judged.payload, CompareRefusal)
    expected = ["after eval 1", "only at decoding", "artifact 2 has no eval of suite ifeval",
                "artifact 1 has no eval of suite ifeval", "artifact 2 has no eval of suite math",
                "artifact 1 has no eval of suite math"]
    assert len(judged.reasons) == len(expected), judged.reasons
    for reason, fragment in zip(judged.reasons, expected, strict=True):
        assert fragment in reason, (fragment, reason)
    out = compare_mod.compare(nb, "s1", cand, inc, bars.id, SERVED)
    assert out.reasons == judged.reasons
    assert nb.decisions("s1", kind="refuse")[0].payload.reasons == judged.reasons


def test_judge_answers_for_other_bars_without_registering_them(lab):
    """What replay asks: would a stricter bar have promoted? The answer writes nothing."""
    nb, inc, cand = lab
    nb.register_bars("s1", DELTA_BAR)
    records.record_result(nb, "s1", inc, _result(BASE))
    records.record_result(nb, "s1", cand, _result(BETTER))
    state = fold(nb, "s1")
    stricter = state.bars.model_copy(update={"spec": DELTA_BAR.model_copy(update={
        "bars": (DELTA_BAR.bars[0].model_copy(update={"value": 0.5}),)})})
    before = _counts(nb)
    as_registered = compare_mod.judge(nb, state, cand, inc, state.bars, SERVED)
    as_stricter = compare_mod.judge(nb, state, cand, inc, stricter, SERVED)
    assert _counts(nb) == before
    assert as_registered.cleared and not as_stricter.cleared
    assert as_stricter.rationale == "bars failed: ifeval/correct delta"


def test_the_outcome_and_its_tool_call_land_in_one_transaction(lab):
    nb, inc, cand = lab
    bars = nb.register_bars("s1", DELTA_BAR)
    records.record_result(nb, "s1", inc, _result(BASE))
    records.record_result(nb, "s1", cand, _result(BETTER))
    call = nb.record_tool_call("s1", "compare", {"candidate": cand, "incumbent": inc, "bars_id": bars.id})
    before = _counts(nb)
    with pytest.raises(RuntimeError), nb.transaction():
        compare_mod.compare(nb, "s1", cand, inc, bars.id, SERVED, tool_call=call)
        raise RuntimeError("the agent died before its step committed")
    assert _counts(nb) == before and nb.tool_call("s1", call.args_hash).status == "open"
    out = compare_mod.compare(nb, "s1", cand, inc, bars.id, SERVED, tool_call=call)
    closed = nb.tool_call("s1", call.args_hash)
    (promote,) = nb.decisions("s1", kind="promote")
    assert out.cleared and closed.status == "done" and closed.decision_seq == promote.seq
    assert closed.result == out.model_dump(mode="json")


def test_a_refused_tool_call_is_closed_with_its_refusal(lab):
    nb, inc, cand = lab
    records.record_result(nb, "s1", cand, _result(BETTER))
    bars = nb.register_bars("s1", DELTA_BAR)  # after the candidate's eval
    call = nb.record_tool_call("s1", "compare", {"candidate": cand})
    out = compare_mod.compare(nb, "s1", cand, inc, bars.id, SERVED, tool_call=call)
    closed = nb.tool_call("s1", call.args_hash)
    assert out.refused and closed.status == "refused" and closed.result["reasons"] == out.reasons
    assert closed.decision_seq == nb.decisions("s1", kind="refuse")[0].seq


def test_sealed_judgment_lists_both_reasons(lab):
    nb, inc, cand = lab
    nb.record_decision("s1", "nominate", "nominee chosen", {"artifact_id": cand})
    sealed.open_sealed(nb, "s1", "confirm", cand)
    before = _counts(nb)
    judged = sealed.judge_open(nb, "s1", "confirm", inc)
    assert _counts(nb) == before
    assert isinstance(judged, Refusal) and len(judged.reasons) == 2
    assert "already opened" in judged.reasons[0] and "nominee only" in judged.reasons[1]
    call = nb.record_tool_call("s1", "evaluate", {"suite": "confirm", "artifact": inc})
    with pytest.raises(sealed.SealedRefused, match="already opened.*nominee only"):
        sealed.open_sealed(nb, "s1", "confirm", inc, tool_call=call)
    assert nb.tool_call("s1", call.args_hash).status == "refused"
    assert nb.decisions("s1", kind="refuse")[-1].payload.reasons == judged.reasons


def test_a_refused_calibration_is_recorded_with_every_reason(lab):
    nb, inc, cand = lab
    ev_inc = records.record_result(nb, "s1", inc, _result(BASE))[0]
    ev_cand = records.record_result(nb, "s1", cand, _result(BASE))[0]
    judged = noise.judge_calibration([ev_inc, ev_cand])
    assert isinstance(judged, Refusal) and len(judged.reasons) == 3, judged.reasons
    with pytest.raises(ValueError, match="one artifact.*distinct replicates.*K >= 3"):
        noise.calibrate(nb, "s1", [ev_inc, ev_cand])
    (refusal,) = nb.decisions("s1", kind="refuse")
    assert isinstance(refusal.payload, CalibrationRefusal) and refusal.payload.eval_ids == [ev_inc.id, ev_cand.id]
    assert nb.decisions("s1", kind="calibrate") == []


def test_a_calibration_ignores_labels_among_metrics(lab):
    nb, inc, _ = lab
    reps = [BASE, [0, *BASE[1:]], [1, 1, *BASE[2:]]]
    evs = [records.record_result(nb, "s1", inc, _result(r, replicate=k, mode=0.0))[0] for k, r in enumerate(reps)]
    judged = noise.judge_calibration(evs)
    assert [f.metric for f in judged.floors] == ["correct"]
    call = nb.record_tool_call("s1", "calibrate", {"suite": "ifeval"})
    floors = noise.calibrate(nb, "s1", evs, tool_call=call)
    (decision,) = nb.decisions("s1", kind="calibrate")
    assert decision.payload.noise_floor_ids == [f.id for f in floors]
    assert nb.tool_call("s1", call.args_hash).decision_seq == decision.seq


def test_recording_an_eval_result_closes_its_tool_call_atomically(lab):
    nb, _, cand = lab
    call = nb.record_tool_call("s1", "evaluate", {"artifact": cand})
    rows = records.record_result(nb, "s1", cand, _result(BETTER), tool_call=call)
    closed = nb.tool_call("s1", call.args_hash)
    assert closed.status == "done" and closed.result == {"eval_ids": [r.id for r in rows]}
    sealed_call = nb.record_tool_call("s1", "evaluate", {"artifact": cand, "sealed": True})
    before = _counts(nb)
    with pytest.raises(sealed.SealedRefused, match="not opened for artifact"):
        records.record_result(nb, "s1", cand, _result(BETTER, suite="confirm", sealed_suite=True), tool_call=sealed_call)
    after = _counts(nb)
    assert after["eval"] == before["eval"] and after["decision"] == before["decision"] + 1
    assert nb.tool_call("s1", sealed_call.args_hash).status == "refused"
