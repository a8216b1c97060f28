"""Noise floor, promotion bars, compare and sealed suites on a real notebook file.

Every compare, open_sealed, calibrate and record_result call below goes through a checker (the
autouse fixture `_judged_first`) that first asks the pure judgment, asserts it wrote nothing, then
runs the recording path and asserts both gave the same verdict.
"""

from __future__ import annotations

import pytest

from evals import bars as bars_mod
from evals import compare as compare_mod
from evals import noise, records, sealed
from evals.decoding import Decoding
from evals.job import EvalResult, SuiteResult
from evals.judgment import Refusal
from evals.types import Outcome, suite_metrics
from memory.notebook import Notebook
from memory.records import BarsSpec
from memory.state import fold, resolution

TABLES = ["session", "decision", "tool_call", "job", "artifact", "eval", "noise_floor", "bars", "comparison"]
_RECORDING = {"open_sealed": sealed.open_sealed, "calibrate": noise.calibrate}


def _snapshot(nb: Notebook) -> tuple[int, dict[str, int]]:
    counts = {t: nb.db.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in TABLES}
    return nb.db.conn.total_changes, counts


def compare(nb, session, candidate, incumbent, bars_id, served):
    before = _snapshot(nb)
    state = fold(nb, session)
    judged = compare_mod.judge(nb, state, candidate, incumbent, state.registered(bars_id), served)
    assert _snapshot(nb) == before, "judge wrote to the notebook"
    out = compare_mod.compare(nb, session, candidate, incumbent, bars_id, served)
    if isinstance(judged, Refusal):
        assert out.refused and out.reasons == judged.reasons
    else:
        assert not out.refused and (out.verdicts, out.cleared) == (judged.verdicts, judged.cleared)
        assert nb.comparisons(session)[-1].adjustment == judged.adjustment
    return out


def record_result(nb, session, artifact_id, result, job_key=None):
    before = _snapshot(nb)
    judged = records.judge_result(nb, session, artifact_id, result)
    assert _snapshot(nb) == before, "judge_result wrote to the notebook"
    try:
        rows = records.record_result(nb, session, artifact_id, result, job_key)
    except sealed.SealedRefused as refused:
        assert isinstance(judged, Refusal) and str(refused) == "; ".join(judged.reasons)
        raise
    assert isinstance(judged, records.Admitted) and sorted({r.suite for r in rows}) == judged.suites
    return rows


def _judged_open_sealed(nb, session, suite, artifact_id):
    before = _snapshot(nb)
    judged = sealed.judge_open(nb, session, suite, artifact_id)
    assert _snapshot(nb) == before, "judge_open wrote to the notebook"
    try:
        decision = _RECORDING["open_sealed"](nb, session, suite, artifact_id)
    except sealed.SealedRefused as refused:
        assert isinstance(judged, Refusal) and str(refused) == "; ".join(judged.reasons)
        raise
    assert isinstance(judged, sealed.SealedOpen) and decision.payload.suite == judged.suite
    return decision


def _judged_calibrate(nb, session, evals):
    before = _snapshot(nb)
    judged = noise.judge_calibration(evals)
    assert _snapshot(nb) == before
    try:
        floors = _RECORDING["calibrate"](nb, session, evals)
    except ValueError as refused:
        assert isinstance(judged, Refusal) and str(refused) == "; ".join(judged.reasons)
        raise
    assert [(f.metric, f.k, f.spread, f.mean_abs_delta, f.max_abs_t) for f in floors] == [
        (f.metric, f.k, f.spread, f.mean_abs_delta, f.max_abs_t) for f in judged.floors]
    return floors


@pytest.fixture(autouse=True)
def _judged_first(monkeypatch):
    monkeypatch.setattr(sealed, "open_sealed", _judged_open_sealed)
    monkeypatch.setattr(noise, "calibrate", _judged_calibrate)

SERVED = Decoding(temperature=0.7, top_p=0.95, max_new_tokens=64, stop_token_ids=(3,))
GREEDY = Decoding(max_new_tokens=64, stop_token_ids=(3,))

# The replicates' floor as it is, however fine: these tests pin that rule's arithmetic (the `resolvable` default,
# never finer than the suite resolves, is tested at the end of the file).
BARS = """floor_unit = "replicates"
[[bar]]
suite = "math"
metric = "correct"
rule = "delta >= -1.0 * noise_floor"

[[bar]]
suite = "math"
metric = "correct"
rule = "ci_low > -0.05"
"""
P_BAR = '[[bar]]\nsuite = "math"\nmetric = "correct"\nrule = "p <= 0.05"\ntest = "mcnemar_exact"\n'


def _result(values: list[float], decoding: Decoding = SERVED, replicate: int = 0, suite: str = "math",
            ids: list[str] | None = None, sealed: bool = False) -> EvalResult:
    ids = ids or [f"i{k}" for k in range(len(values))]
    outs = [Outcome(item_id=i, label="x", values={"correct": v}) for i, v in zip(ids, values, strict=True)]
    suite_result = SuiteResult(suite=suite, scorer="math", sealed=sealed, replicate=replicate, seed=replicate,
                               resampled=False, metrics=suite_metrics(outs), outcomes=outs, completions_path=None)
    return EvalResult(checkpoint="ckpt", decoding=decoding, decoding_sha256=decoding.fingerprint(), served=True,
                      suites=[suite_result], generated_tokens=0, generation_s=0.0, load_s=0.0)


@pytest.fixture
def lab(tmp_path):
    nb = Notebook.open(tmp_path / "notebook.db")
    nb.open_session("s1", lab="test", budget_gpuh=10, reserve_gpuh=1, planner="playbook", executor="local", config={})
    inc = nb.add_artifact(kind="checkpoint", name="incumbent", path="/inc", sha256="a" * 64, session="s1").id
    cand = nb.add_artifact(kind="checkpoint", name="candidate", path="/cand", sha256="b" * 64, session="s1").id
    yield nb, inc, cand
    nb.close()


BASE = [1, 0, 1, 0, 1, 1, 0, 1, 0, 1] * 4  # 40 items, 24 correct
BETTER = [1] * 36 + [0] * 4  # 14 wins, 2 losses against BASE: delta 0.3


def _calibrate(nb, inc):
    # 24/40, item 0 flipped to wrong (23/40), item 1 flipped to right (25/40).
    reps = [BASE, [0, *BASE[1:]], [1, 1, *BASE[2:]]]
    evs = [record_result(nb, "s1", inc, _result(r, replicate=k))[0] for k, r in enumerate(reps)]
    return noise.calibrate(nb, "s1", evs)


def test_floor_stats_hand_values():
    reps = [[("a", 0.5), ("b", 0.5)], [("a", 0.6), ("b", 0.6)], [("a", 0.7), ("b", 0.7)]]
    fs = noise.floor_stats(reps, "m")
    assert fs.spread == pytest.approx(0.2)
    assert fs.mean_abs_delta == pytest.approx((0.1 + 0.2 + 0.1) / 3)
    assert fs.max_abs_t == float("inf")  # a constant shift on every item is infinitely sharp
    with pytest.raises(ValueError, match="at least 3"):
        noise.floor_stats(reps[:2], "m")
    # Item resamples (different item sequences) use Welch's t: 0/1 samples 3/4 vs 1/4 correct.
    welch = noise.floor_stats([[("a", 1), ("b", 1), ("c", 1), ("d", 0)], [("a", 1), ("a", 0), ("c", 0), ("c", 0)],
                               [("b", 1), ("b", 1), ("d", 0), ("d", 0)]], "m")
    # means .75 vs .25, variances 1/4 each, se = sqrt(1/16 + 1/16): t = 0.5 / 0.35355 = 1.4142
    assert welch.max_abs_t == pytest.approx(1.41421, abs=1e-4)


def test_calibrate_records_floor(lab):
    nb, inc, _ = lab
    floors = _calibrate(nb, inc)
    assert [f.metric for f in floors] == ["correct"] and floors[0].k == 3
    assert floors[0].spread == pytest.approx(0.05)
    assert floors[0].mean_abs_delta == pytest.approx((0.025 + 0.025 + 0.05) / 3)
    # Replicates 1 vs 2 differ on two items by -1: mean -0.05, sd sqrt(1.9/39), t = -1.4327.
    assert floors[0].max_abs_t == pytest.approx(1.4327, abs=1e-4)
    assert nb.decisions("s1", kind="calibrate")


def test_bars_file_parsing(tmp_path):
    path = tmp_path / "bars.toml"
    path.write_text(BARS)
    parsed = bars_mod.load(path)
    assert parsed.bar[0].in_noise_units and parsed.bar[0].value == -1.0
    assert BarsSpec.model_validate(parsed.canonical()) == parsed.spec()  # the stored form reads back typed
    path.write_text(BARS + '\n[[bar]]\nsuite = "math"\nmetric = "correct"\nrule = "delta ~ 3"\n')
    with pytest.raises(ValueError, match=r"bars.toml: 1 problem\(s\):\n  bar\[2\]: rule 'delta ~ 3'"):
        bars_mod.load(path)
    path.write_text('[[bar]]\nsuite = "m"\nmetric = "c"\nrule = "p <= 0.05"\n')
    with pytest.raises(ValueError, match="a p bar needs `test`"):
        bars_mod.load(path)
    path.write_text(P_BAR)
    with pytest.raises(ValueError, match="p bars need p_family"):
        bars_mod.load(path)
    path.write_text("[[bar]\n")
    with pytest.raises(ValueError, match="not valid TOML"):
        bars_mod.load(path)


def _register(nb, text=BARS):
    return bars_mod.register(nb, "s1", bars_mod.Bars.model_validate(__import__("tomllib").loads(text)).spec())


def test_candidate_clearing_all_bars_is_promoted(lab):
    nb, inc, cand = lab
    _calibrate(nb, inc)
    reg = _register(nb)
    record_result(nb, "s1", cand, _result(BETTER))
    out = compare(nb, "s1", cand, inc, reg.id, SERVED)
    assert not out.refused and out.cleared, out
    assert [v.holds for v in out.verdicts] == [True, True]
    assert nb.comparisons("s1")[0].promoted and nb.decisions("s1", kind="promote")


def test_one_failing_bar_blocks(lab):
    nb, inc, cand = lab
    _calibrate(nb, inc)
    reg = _register(nb, BARS + '\n[[bar]]\nsuite = "math"\nmetric = "correct"\nrule = "delta >= 0.5"\n')
    record_result(nb, "s1", cand, _result(BETTER))
    out = compare(nb, "s1", cand, inc, reg.id, SERVED)
    assert not out.refused and not out.cleared
    assert [v.holds for v in out.verdicts] == [True, True, False]
    assert nb.decisions("s1", kind="reject")[0].rationale == "bars failed: math/correct delta"


def test_bars_registered_after_eval_refused(lab):
    nb, inc, cand = lab
    _calibrate(nb, inc)
    record_result(nb, "s1", cand, _result([1] * 40))
    reg = _register(nb)
    out = compare(nb, "s1", cand, inc, reg.id, SERVED)
    assert out.refused and "after eval" in out.reasons[0]
    assert nb.comparisons("s1") == [] and nb.decisions("s1", kind="refuse")


def test_wrong_decoding_refused(lab):
    nb, inc, cand = lab
    _calibrate(nb, inc)
    reg = _register(nb)
    record_result(nb, "s1", cand, _result([1] * 40, decoding=GREEDY))
    out = compare(nb, "s1", cand, inc, reg.id, SERVED)
    assert out.refused and "not the candidate's served decoding" in out.reasons[0]
    # A served-decoding eval makes the greedy one a diagnostic: it is ignored, not used.
    record_result(nb, "s1", cand, _result(BETTER))
    assert compare(nb, "s1", cand, inc, reg.id, SERVED).cleared


def test_noise_units_without_floor_refused(lab):
    nb, inc, cand = lab
    record_result(nb, "s1", inc, _result(BASE))
    reg = _register(nb)
    record_result(nb, "s1", cand, _result([1] * 40))
    out = compare(nb, "s1", cand, inc, reg.id, SERVED)
    assert out.refused and "no noise floor" in out.reasons[0]


def test_holm_over_the_preregistered_session_family(lab):
    nb, inc, cand = lab
    reg = _register(nb, "p_family = 3\n" + P_BAR)
    record_result(nb, "s1", inc, _result(BASE))
    # 10 discordant pairs all in the candidate's favour: one-sided raw p = 1 / 2^10.
    record_result(nb, "s1", cand, _result([1 if k < 25 else b for k, b in enumerate(BASE)]))
    first = compare(nb, "s1", cand, inc, reg.id, SERVED)
    # The two untested p-values count as 1: Holm multiplies the smallest by the family size, 3.
    assert first.verdicts[0].raw_p == pytest.approx(1 / 1024) and first.verdicts[0].value == pytest.approx(3 / 1024)
    second = compare(nb, "s1", cand, inc, reg.id, SERVED)
    # Sorted (p, p, 1): 3p and 2p, made monotone: 3p.
    assert second.verdicts[0].value == pytest.approx(3 / 1024)
    adj = nb.comparisons("s1")[1].adjustment
    assert (adj.family_size, adj.tested, adj.prior_comparisons) == (3, 2, [first.comparison_id])
    compare(nb, "s1", cand, inc, reg.id, SERVED)
    fourth = compare(nb, "s1", cand, inc, reg.id, SERVED)
    assert fourth.refused and "family of 3 p-values is used up" in fourth.reasons[0]
    assert len(nb.comparisons("s1")) == 3


def test_holm_family_cannot_grow_after_registration(lab):
    nb, inc, cand = lab
    _register(nb, "p_family = 2\n" + P_BAR)
    wider = _register(nb, "p_family = 50\n" + P_BAR)
    record_result(nb, "s1", inc, _result(BASE))
    record_result(nb, "s1", cand, _result(BETTER))
    out = compare(nb, "s1", cand, inc, wider.id, SERVED)
    assert out.refused and "differs from the session's pre-registered family of 2" in out.reasons[0]


def test_sealed_once_for_nominee(lab):
    nb, inc, cand = lab
    with pytest.raises(sealed.SealedRefused, match="nominee only"):
        sealed.open_sealed(nb, "s1", "confirm", cand)
    nb.record_decision("s1", "nominate", "nominee chosen", {"artifact_id": cand})
    with pytest.raises(sealed.SealedRefused, match="nominee only"):
        sealed.open_sealed(nb, "s1", "confirm", inc)
    assert sealed.open_sealed(nb, "s1", "confirm", cand).kind == "confirm"
    with pytest.raises(sealed.SealedRefused, match="already opened"):
        sealed.open_sealed(nb, "s1", "confirm", cand)
    assert len(nb.decisions("s1", kind="refuse")) == 3
    assert nb.verify().ok


def test_p_bar_is_one_sided_a_significantly_worse_candidate_fails(lab):
    nb, inc, cand = lab
    reg = _register(nb, "p_family = 1\n" + P_BAR)
    record_result(nb, "s1", inc, _result(BETTER))
    record_result(nb, "s1", cand, _result(BASE))  # 2 wins, 14 losses: two-sided p = 0.0042
    out = compare(nb, "s1", cand, inc, reg.id, SERVED)
    assert not out.refused and not out.cleared
    # One-sided: P(X >= 2), X ~ Binomial(16, 1/2) = 1 - (1 + 16) / 2^16.
    assert out.verdicts[0].raw_p == pytest.approx(1 - 17 / 65536) and not out.verdicts[0].holds


def test_items_paired_by_id_not_position(lab):
    nb, inc, cand = lab
    reg = _register(nb, "p_family = 1\n" + P_BAR)
    record_result(nb, "s1", inc, _result([1] * 20 + [0] * 20))
    # The candidate's outcomes arrive in reverse item order; by id it is BETTER: 16 wins, no loss
    # (by position it would be 20 wins and 4 losses).
    ids = [f"i{k}" for k in range(40)]
    record_result(nb, "s1", cand, _result(BETTER[::-1], ids=ids[::-1]))
    out = compare(nb, "s1", cand, inc, reg.id, SERVED)
    # One-sided P(X >= 16), X ~ Binomial(16, 1/2) = 1 / 2^16.
    assert out.verdicts[0].n == 40 and out.verdicts[0].raw_p == pytest.approx(1 / 65536)


def test_different_item_sets_refused(lab):
    nb, inc, cand = lab
    reg = _register(nb, "p_family = 1\n" + P_BAR)
    record_result(nb, "s1", inc, _result(BASE))
    record_result(nb, "s1", cand, _result(BETTER, ids=[f"i{k}" for k in range(39)] + ["extra"]))
    out = compare(nb, "s1", cand, inc, reg.id, SERVED)
    assert out.refused and "different items" in out.reasons[0] and "['extra']" in out.reasons[0]
    assert nb.comparisons("s1") == []


def test_first_served_eval_counts_not_a_later_rerun(lab):
    nb, inc, cand = lab
    reg = _register(nb, '[[bar]]\nsuite = "math"\nmetric = "correct"\nrule = "delta >= 0.2"\n')
    record_result(nb, "s1", inc, _result(BASE))
    record_result(nb, "s1", cand, _result(BASE))  # first look: no better
    record_result(nb, "s1", cand, _result(BETTER))  # a luckier re-run of a sampled eval
    out = compare(nb, "s1", cand, inc, reg.id, SERVED)
    assert not out.refused and not out.cleared and out.verdicts[0].value == 0.0


def test_floor_must_be_the_incumbents_at_its_decoding(lab):
    nb, inc, cand = lab
    other = nb.add_artifact(kind="checkpoint", name="noisy", path="/noisy", sha256="c" * 64, session="s1").id
    _calibrate(nb, other)  # a floor measured on another model
    reg = _register(nb)
    record_result(nb, "s1", inc, _result(BASE))
    record_result(nb, "s1", cand, _result(BETTER))
    out = compare(nb, "s1", cand, inc, reg.id, SERVED)
    assert out.refused and "was calibrated on the incumbent" in out.reasons[0]
    # The incumbent's own floor, but at a decoding other than the one of its compared eval.
    reps = [BASE, [0, *BASE[1:]], [1, 1, *BASE[2:]]]
    hot = Decoding(temperature=1.5, max_new_tokens=64, stop_token_ids=(3,))
    noise.calibrate(nb, "s1", [record_result(nb, "s1", inc, _result(r, decoding=hot, replicate=k))[0]
                               for k, r in enumerate(reps)])
    out = compare(nb, "s1", cand, inc, reg.id, SERVED)
    assert out.refused and "was calibrated on the incumbent" in out.reasons[0]
    first = _calibrate(nb, inc)[0]
    out = compare(nb, "s1", cand, inc, reg.id, SERVED)
    assert out.cleared and out.verdicts[0].threshold == pytest.approx(-first.mean_abs_delta)


def test_recalibrating_cannot_widen_the_floor(lab):
    nb, inc, cand = lab
    first = _calibrate(nb, inc)[0]
    # A second, much wider calibration of the same incumbent (replicates 3..5 of a later job).
    wide = [[1] * 40, [0] * 40, BASE]
    noise.calibrate(nb, "s1", [record_result(nb, "s1", inc, _result(r, replicate=3 + k))[0] for k, r in enumerate(wide)])
    reg = _register(nb, 'floor_unit = "replicates"\n[[bar]]\nsuite = "math"\nmetric = "correct"\nrule = "delta >= -1.0 * noise_floor"\n')
    record_result(nb, "s1", cand, _result([0] * 6 + BASE[6:]))  # 4 items worse: delta -0.1
    out = compare(nb, "s1", cand, inc, reg.id, SERVED)
    assert out.verdicts[0].threshold == pytest.approx(-first.mean_abs_delta) and not out.cleared


def test_zero_floor_refused(lab):
    nb, inc, cand = lab
    noise.calibrate(nb, "s1", [record_result(nb, "s1", inc, _result(BASE, replicate=k))[0] for k in range(3)])
    reg = _register(nb, 'floor_unit = "replicates"\n[[bar]]\nsuite = "math"\nmetric = "correct"\nrule = "delta >= 1.0 * noise_floor"\n')
    record_result(nb, "s1", cand, _result(BASE))  # no better at all: would clear 'delta >= 1 * 0'
    out = compare(nb, "s1", cand, inc, reg.id, SERVED)
    assert out.refused and "is 0" in out.reasons[0]
    # Allowing a loss of one floor only gets stricter at zero (delta >= 0): that bar stands.
    lenient = _register(nb, 'floor_unit = "replicates"\n[[bar]]\nsuite = "math"\nmetric = "correct"\nrule = "delta >= -1.0 * noise_floor"\n')
    out = compare(nb, "s1", cand, inc, lenient.id, SERVED)
    assert out.refused and "after eval" in out.reasons[0]  # registered after the candidate's eval
    other = nb.add_artifact(kind="checkpoint", name="c2", path="/c2", sha256="d" * 64, session="s1").id
    record_result(nb, "s1", other, _result([0] + BASE[1:]))
    out = compare(nb, "s1", other, inc, lenient.id, SERVED)
    assert not out.refused and out.verdicts[0].threshold == 0.0 and not out.cleared


def test_calibrate_refuses_repeated_replicates(lab):
    nb, inc, _ = lab
    ev = record_result(nb, "s1", inc, _result(BASE))[0]
    with pytest.raises(ValueError, match="distinct replicates"):
        noise.calibrate(nb, "s1", [ev, ev, ev])
    # Three jobs' replicate 0 (a greedy re-run repeats itself): the same index three times.
    reruns = [record_result(nb, "s1", inc, _result(BASE))[0] for _ in range(3)]
    with pytest.raises(ValueError, match="replicate indices"):
        noise.calibrate(nb, "s1", reruns)
    assert nb.decisions("s1", kind="calibrate") == []


def test_sealed_scores_recorded_once_and_only_after_opening(lab):
    nb, inc, cand = lab
    sealed_result = _result(BETTER, suite="confirm", sealed=True)
    with pytest.raises(sealed.SealedRefused, match="not opened for artifact"):
        record_result(nb, "s1", cand, sealed_result)  # scored by a job, but never opened
    assert nb.evals(suite="confirm") == []
    nb.record_decision("s1", "nominate", "nominee chosen", {"artifact_id": cand})
    sealed.open_sealed(nb, "s1", "confirm", cand)
    with pytest.raises(sealed.SealedRefused, match="not opened for artifact"):
        record_result(nb, "s1", inc, _result(BASE, suite="confirm", sealed=True))  # opened for another
    assert len(record_result(nb, "s1", cand, sealed_result)) == 1
    with pytest.raises(sealed.SealedRefused, match="already has scores"):
        record_result(nb, "s1", cand, sealed_result)
    assert len(nb.evals(suite="confirm")) == 1 and len(nb.decisions("s1", kind="refuse")) == 3


def test_bars_registered_while_the_eval_job_ran_refused(lab):
    nb, inc, cand = lab
    _calibrate(nb, inc)
    # The candidate's eval job is submitted, bars are registered while it generates, then it records.
    nb.start_job("eval-cand", session="s1", kind="eval", executor="local", resources={}, forecast_gpuh=0.0)
    reg = _register(nb)
    record_result(nb, "s1", cand, _result(BETTER), job_key="eval-cand")
    assert nb.evals(artifact_id=cand)[0].created_at > reg.registered_at  # recorded after the bars...
    out = compare(nb, "s1", cand, inc, reg.id, SERVED)
    assert out.refused and "after eval" in out.reasons[0]  # ...but began before them


def test_a_peek_under_another_artifact_id_of_the_same_weights_refused(lab):
    nb, inc, cand = lab
    _calibrate(nb, inc)
    record_result(nb, "s1", cand, _result(BETTER))  # looked at before the bars...
    reg = _register(nb)
    twin = nb.add_artifact(kind="checkpoint", name="again", path="/cand", sha256="b" * 64, session="s1").id
    record_result(nb, "s1", twin, _result(BETTER))  # ...then registered again and re-evaluated
    out = compare(nb, "s1", twin, inc, reg.id, SERVED)
    assert out.refused and "after eval" in out.reasons[0]


REPLICATED = 'floor_unit = "replicates"\nreplicates = 3\n' + P_BAR.replace("mcnemar_exact", "paired_t") + """
[[bar]]
suite = "math"
metric = "correct"
rule = "delta >= -1.0 * noise_floor"
"""


def test_bars_read_the_mean_of_the_preregistered_draws_a_side(lab):
    nb, inc, cand = lab
    floor = _calibrate(nb, inc)[0]  # incumbent replicates 0-2: 24, 23 and 25 of 40 correct (mean 0.6)
    reg = _register(nb, "p_family = 2\n" + REPLICATED)
    assert nb.bars(reg.id).spec.replicates == 3
    # The candidate's first draw loses 4 items (a one-look delta of -0.1, below the floor of -0.05): an unlucky
    # draw; its replicates 1 and 2 win 2 items each (mean over 3 draws: 23.33 of 40 against 24).
    unlucky = [0] * 4 + BASE[4:]
    record_result(nb, "s1", cand, _result(unlucky))
    out = compare(nb, "s1", cand, inc, reg.id, SERVED)
    assert out.refused and "lacks replicate(s) [1, 2]" in out.reasons[0] and "replicates = 3" in out.reasons[0]
    two_more = BASE[:1] + [1] + BASE[2:3] + [1] + BASE[4:]  # items 1 and 3 right as well
    for k in (1, 2):
        record_result(nb, "s1", cand, _result(two_more, replicate=k))
    out = compare(nb, "s1", cand, inc, reg.id, SERVED)
    p_bar, delta_bar = out.verdicts
    cand_mean = (sum(unlucky) + 2 * (sum(BASE) + 2)) / 3 / 40
    assert delta_bar.value == pytest.approx(cand_mean - 0.6) and delta_bar.threshold == pytest.approx(-floor.mean_abs_delta)
    assert delta_bar.holds and delta_bar.value > -floor.mean_abs_delta > -0.1
    # The p bar reads the first draws alone: the unlucky look is worse, so it is far from significant.
    assert p_bar.raw_p > 0.5 and not out.cleared


def test_one_look_bars_unchanged_and_their_hash_kept(lab, tmp_path):
    nb, inc, cand = lab
    one = bars_mod.Bars.model_validate(__import__("tomllib").loads(BARS))
    assert "replicates" not in one.canonical()  # bars registered before the key keep their sha256
    assert BarsSpec.model_validate(one.canonical()) == one.spec()
    three = bars_mod.Bars.model_validate(__import__("tomllib").loads("replicates = 3\n" + BARS))
    assert BarsSpec.model_validate(three.canonical()).replicates == 3
    for bad, why in (("replicates = 0", "greater than or equal to 1"), ('replicates = "3"', "valid integer"),
                     ("replicates = 17", "less than or equal to 16")):
        path = tmp_path / "bars.toml"
        path.write_text(bad + "\n" + BARS)
        with pytest.raises(bars_mod.BarsError) as err:
            bars_mod.load(path)
        assert "replicates" in str(err.value) and why in str(err.value), str(err.value)


def test_greedy_sides_read_their_one_exact_look(lab):
    nb, inc, cand = lab
    reps = [BASE, [0, *BASE[1:]], [1, 1, *BASE[2:]]]
    noise.calibrate(nb, "s1", [record_result(nb, "s1", inc, _result(r, decoding=GREEDY, replicate=k))[0]
                               for k, r in enumerate(reps)])
    reg = _register(nb, "replicates = 3\n" + BARS)
    record_result(nb, "s1", cand, _result(BETTER, decoding=GREEDY))
    out = compare(nb, "s1", cand, inc, reg.id, GREEDY)
    assert not out.refused and out.verdicts[0].value == pytest.approx((sum(BETTER) - sum(BASE)) / 40)


GUARD = '[[bar]]\nsuite = "math"\nmetric = "correct"\nrule = "delta >= -1.0 * noise_floor"\n'


def test_resolution_is_one_item_or_the_standard_error():
    assert resolution([1.0] * 40) == pytest.approx(1 / 40)  # no spread at all: one item of 40
    rate = [1.0] * 24 + [0.0] * 16  # 0.6 of 40: sqrt(0.6 * 0.4 / 40) with the sample's n - 1
    assert resolution(rate) == pytest.approx((0.6 * 0.4 * 40 / 39 / 40) ** 0.5)
    assert resolution([1.0] * 400 + [0.0] * 400) == pytest.approx(0.5 * (800 / 799) ** 0.5 / 800 ** 0.5)


def test_the_floor_is_never_finer_than_its_suite_resolves(lab):
    nb, inc, cand = lab
    # Three replicates that differ by one item at most: a floor of 1.33 items, finer than one standard error.
    floor = _calibrate(nb, inc)[0]
    resolved = resolution([float(v) for v in BASE])
    assert floor.mean_abs_delta < resolved
    reg = _register(nb, GUARD)  # no floor_unit: the default, `resolvable`
    assert nb.bars(reg.id).spec.floor_unit == "resolvable"
    record_result(nb, "s1", cand, _result([0] * 3 + BASE[3:]))  # 2 items worse: delta -0.05
    out = compare(nb, "s1", cand, inc, reg.id, SERVED)
    assert out.verdicts[0].threshold == pytest.approx(-resolved) and out.cleared  # within one standard error
    # The same candidate under the replicates' floor alone is rejected: -0.05 < -0.033.
    old = _register(nb, 'floor_unit = "replicates"\n' + GUARD)
    other = nb.add_artifact(kind="checkpoint", name="c2", path="/c2", sha256="e" * 64, session="s1").id
    record_result(nb, "s1", other, _result([0] * 3 + BASE[3:]))
    out = compare(nb, "s1", other, inc, old.id, SERVED)
    assert out.verdicts[0].threshold == pytest.approx(-floor.mean_abs_delta) and not out.cleared


def test_bars_recorded_before_the_rule_replay_with_the_replicates_floor():
    spec = bars_mod.Bars.model_validate(__import__("tomllib").loads(GUARD)).canonical()
    assert spec["floor_unit"] == "resolvable"
    recorded = {k: v for k, v in spec.items() if k != "floor_unit"}  # what a session registered before the key
    assert BarsSpec.model_validate(recorded).floor_unit == "replicates"
    assert BarsSpec.model_validate(recorded).canonical() == recorded  # and its hash stays what it was
    assert BarsSpec.model_validate(spec).floor_unit == "resolvable"
