"""Issue 41 on a real notebook file: a p bar read look by look under the registered sequential rule (every look a
decision, an unresolved look spending no p-value, p* = min p/w recomputed here from the evals), the rule's error
rate under the null by simulation, and the suite audit (a guard the judge contradicts is flagged, read at the wider
margin until a person clears the suite, and never lets a loss past the wider margin through).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from scipy import stats as scipy_stats

from evals import bars as bars_mod
from evals import compare as compare_mod
from evals import noise, stats
from evals.records import record_result
from memory.notebook import Notebook
from memory.records import BarsSpec, Rule
from memory.state import fold
from tests.evals.test_bars_compare import BASE, SERVED, _result

SEQUENTIAL = """p_family = 4
floor_unit = "replicates"
looks = 3
look_spending = 0.5
continue_p = 0.25
audit_margin = 3.0

[[bar]]
suite = "hold"
metric = "correct"
rule = "p <= 0.05"
test = "paired_t"

[[bar]]
suite = "math"
metric = "correct"
rule = "delta >= -1.0 * noise_floor"
"""
N = 40
HOLD_P = Rule(suite="hold", metric="correct", statistic="p", op="<=", value=0.05, unit="absolute", test="paired_t",
              confidence=None)
EVEN = [0.5] * N  # the incumbent judged against its own answers


def _win(wins: int, losses: int) -> list[float]:
    return [1.0] * wins + [0.0] * losses + [0.5] * (N - wins - losses)


def calibrated_incumbent(nb: Notebook, bars_file: Path):
    """Session s1's incumbent with its noise floors (three replicates), its answers on the holdout suite, and the bars
    of `bars_file` registered: (incumbent id, bars record)."""
    inc = nb.add_artifact(kind="checkpoint", name="incumbent", path="/inc", sha256="a" * 64, session="s1",
                          recipe={"role": "parent"}).id
    reps = [BASE, [0, *BASE[1:]], [1, 1, *BASE[2:]]]
    noise.calibrate(nb, "s1", [record_result(nb, "s1", inc, _result(r, replicate=k))[0] for k, r in enumerate(reps)])
    record_result(nb, "s1", inc, _result(EVEN, suite="hold"))
    return inc, bars_mod.register(nb, "s1", bars_mod.load(bars_file).spec())


@pytest.fixture
def lab(tmp_path):
    """An incumbent calibrated on `math` (floor 1/30), its first look on `hold`, and the sequential bars registered
    before any candidate is scored."""
    (tmp_path / "bars.toml").write_text(SEQUENTIAL)
    nb = Notebook.open(tmp_path / "notebook.db")
    nb.open_session("s1", lab="test", budget_gpuh=10, reserve_gpuh=1, planner="playbook", executor="local", config={})
    inc, bars = calibrated_incumbent(nb, tmp_path / "bars.toml")
    yield nb, inc, bars.id
    nb.close()


def _candidate(nb, name: str, draws: list[list[float]], math: list[float] = BASE) -> int:
    cand = nb.add_artifact(kind="checkpoint", name=name, path=f"/{name}", sha256=name[0] * 64, session="s1").id
    record_result(nb, "s1", cand, _result(math))
    for k, values in enumerate(draws):
        record_result(nb, "s1", cand, _result(values, suite="hold", replicate=k))
    return cand


def _p_star(draws: list[list[float]], weights: list[float]) -> float:
    """p* computed here: look i pairs the per-item mean of draws 0 .. i-1 with the incumbent, one-sided paired t."""
    ps = []
    for i in range(1, len(draws) + 1):
        mean = [sum(d[k] for d in draws[:i]) / i for k in range(N)]
        ps.append(scipy_stats.ttest_rel(mean, EVEN, alternative="greater").pvalue / weights[i - 1])
    return min(1.0, min(ps))


def _kinds(nb) -> list[str]:
    return [d.kind for d in nb.decisions("s1")]


def test_an_unresolved_look_spends_nothing_and_the_deciding_look_reads_min_p_over_w(lab):
    nb, inc, bars_id = lab
    weights = nb.bars(bars_id).spec.look_weights()
    assert weights == pytest.approx([(1 / 3) ** 0.5, (2 / 3) ** 0.5 - (1 / 3) ** 0.5, 1 - (2 / 3) ** 0.5])
    # a first draw that leads (raw p about 0.04, <= continue_p) but cannot clear 0.05 / 4 (Holm) x 0.58 (its share)
    first = _win(9, 3)
    second = _win(17, 1)
    cand = _candidate(nb, "cand", [first])
    look1 = compare_mod.compare(nb, "s1", cand, inc, bars_id, SERVED, look=1)
    assert look1.unresolved and not look1.cleared and look1.comparison_id is None
    assert nb.comparisons("s1") == [] and _kinds(nb)[-1] == "look"
    state = fold(nb, "s1")
    assert state.p_family.spent == 0 and state.open_look(cand) is not None  # nothing spent, the look is open
    (look,) = state.looks
    assert (look.payload.look, look.payload.outcome) == (1, "continue")
    assert look.payload.sequential_p == pytest.approx(_p_star([first], weights))
    # look 2 reads draw 1, which is not there yet: refused, nothing judged
    refused = compare_mod.compare(nb, "s1", cand, inc, bars_id, SERVED, look=2)
    assert refused.refused and any("replicate(s) [1]" in r for r in refused.reasons)
    # the evidence bought: draw 1; look 2 decides on min(p1/w1, p2/w2), one member of the Holm family
    record_result(nb, "s1", cand, _result(second, suite="hold", replicate=1))
    look2 = compare_mod.compare(nb, "s1", cand, inc, bars_id, SERVED, look=2)
    assert look2.cleared and not look2.unresolved
    expected = _p_star([first, second], weights)
    (comparison,) = nb.comparisons("s1")
    assert comparison.adjustment.raw_p == [pytest.approx(expected)]
    assert comparison.adjustment.adjusted_p == [pytest.approx(min(1.0, 4 * expected))]
    assert (comparison.adjustment.look, comparison.adjustment.max_looks) == (2, 3)
    assert [w for _, _, w in comparison.adjustment.looks[0]] == pytest.approx(weights[:2])
    assert _kinds(nb)[-2:] == ["look", "promote"]  # the deciding look, then the verdict
    state = fold(nb, "s1")
    assert state.p_family.spent == 1 and state.open_look(cand) is None
    assert [x.payload.outcome for x in state.looks] == ["continue", "decided"]
    # past the registered looks: refused
    assert any("past the 3 look(s)" in r for r in compare_mod.compare(nb, "s1", cand, inc, bars_id, SERVED,
                                                                      look=4).reasons)


def test_one_look_without_continuation_and_a_trailing_candidate_decide_at_once(lab):
    nb, inc, bars_id = lab
    weights = nb.bars(bars_id).spec.look_weights()
    lead = _candidate(nb, "lead", [_win(9, 3)])
    # a policy that asks no look (versions 1-5) reads look 1 decided: p1 / w1, no continuation
    once = compare_mod.compare(nb, "s1", lead, inc, bars_id, SERVED)
    assert not once.unresolved and not once.cleared and once.comparison_id is not None
    assert nb.comparisons("s1")[0].adjustment.raw_p == [pytest.approx(_p_star([_win(9, 3)], weights))]
    # a candidate that does not lead by continue_p (raw p > 0.25) decides at look 1: no evidence is bought for it
    trailing = _candidate(nb, "trail", [_win(5, 5)])
    out = compare_mod.compare(nb, "s1", trailing, inc, bars_id, SERVED, look=1)
    assert not out.unresolved and not out.cleared and out.comparison_id is not None
    assert fold(nb, "s1").looks[-1].payload.outcome == "decided"


def test_the_sequential_p_keeps_its_level_under_optional_continuation_where_min_p_does_not():
    # H0 at its boundary: every prompt's true win rate 0.5 (prompts differ in how noisy their judgments are); the
    # policy looks again while a look is unresolved, as version 6 does. 3000 simulated comparisons of 40 prompts.
    rng = random.Random(41)
    weights = BarsSpec(bars=(HOLD_P,), p_family=1, looks=3, look_spending=0.5).look_weights()
    alpha, sims, rejected, naive = 0.05, 3000, 0, 0
    for _ in range(sims):
        ties = [rng.random() * 0.8 for _ in range(N)]
        draws, looks, seen = [], [], []
        for i in range(3):
            draws.append([0.5 if rng.random() < t else float(rng.random() < 0.5) for t in ties])
            mean = [sum(d[k] for d in draws) / len(draws) for k in range(N)]
            p = stats.paired_t(mean, EVEN, alternative="greater").p_value
            looks.append((p, weights[i]))
            seen.append(p)
            if compare_mod.sequential_p(looks) <= alpha or p > 0.25:
                break
        rejected += compare_mod.sequential_p(looks) <= alpha
        naive += min(seen) <= alpha
    se = (alpha * (1 - alpha) / sims) ** 0.5
    assert rejected / sims <= alpha + 3 * se, rejected / sims
    assert naive / sims > rejected / sims  # testing every look at the full alpha would spend more than it has


def test_a_guard_the_judge_contradicts_is_flagged_widened_until_cleared_and_never_past_the_wider_margin(lab):
    nb, inc, bars_id = lab
    strong = [_win(30, 0)]
    # math 2 items worse (delta -0.05): past the one-floor guard (-1/30) but inside 3 floors (-0.1)
    worse = [0 if k in (0, 2) else v for k, v in enumerate(BASE)]
    first = _candidate(nb, "first", strong, math=worse)
    out = compare_mod.compare(nb, "s1", first, inc, bars_id, SERVED, look=1)
    assert out.cleared, out
    kinds = _kinds(nb)
    assert kinds[-3:] == ["audit", "look", "promote"]
    state = fold(nb, "s1")
    finding = state.flagged("math")
    assert finding is not None and finding.payload.candidate == first
    assert finding.payload.guard_threshold == pytest.approx(-1 / 30)
    assert finding.payload.widened_threshold == pytest.approx(-0.1)
    guard = next(v for v in out.verdicts if v.bar.suite == "math")
    assert guard.holds and guard.threshold == pytest.approx(-0.1) and guard.value == pytest.approx(-0.05)
    # harmful: 6 items worse (-0.15) is past the wider margin too: refused, whatever the judge says
    harmful = _candidate(nb, "harm", strong, math=[0 if k in (0, 2, 4, 5, 7, 9) else v for k, v in enumerate(BASE)])
    out = compare_mod.compare(nb, "s1", harmful, inc, bars_id, SERVED, look=1)
    assert not out.cleared and not out.unresolved  # no evidence bought for a guard past even the wider margin
    assert _kinds(nb).count("audit") == 1  # flagged once
    # a person clears the suite: the guard reads its registered margin again
    compare_mod.clear_suite(nb, "s1", "math", by="reviewer", note="labels checked")
    assert fold(nb, "s1").flagged("math") is None
    with pytest.raises(ValueError, match="not flagged"):
        compare_mod.clear_suite(nb, "s1", "math", by="reviewer", note="again")
    # a candidate the judge does not prefer flags nothing: its guard failure stands at one floor
    nb2_cand = _candidate(nb, "weak", [_win(2, 2)], math=worse)
    out = compare_mod.compare(nb, "s1", nb2_cand, inc, bars_id, SERVED, look=1)
    guard = next(v for v in out.verdicts if v.bar.suite == "math")
    assert not guard.holds and guard.threshold == pytest.approx(-1 / 30)
    assert _kinds(nb).count("audit") == 1 and fold(nb, "s1").flagged("math") is None


def test_bars_refuse_looks_with_mcnemar_or_without_a_p_bar(tmp_path):
    path = tmp_path / "b.toml"
    path.write_text('p_family = 2\nlooks = 2\n[[bar]]\nsuite = "m"\nmetric = "correct"\nrule = "p <= 0.05"\n'
                    'test = "mcnemar_exact"\n')
    with pytest.raises(bars_mod.BarsError, match="paired_t or wilcoxon"):
        bars_mod.load(path)
    path.write_text('looks = 2\n[[bar]]\nsuite = "m"\nmetric = "correct"\nrule = "delta >= 0"\n')
    with pytest.raises(bars_mod.BarsError, match="no bar is one"):
        bars_mod.load(path)
    # bars without the keys keep their canonical form (and sha256): one look, no audit
    path.write_text('[[bar]]\nsuite = "m"\nmetric = "correct"\nrule = "delta >= 0"\n')
    assert set(bars_mod.load(path).canonical()) == {"bars", "p_family", "floor_unit"}


def test_the_report_shows_every_look_and_the_audit_finding(lab, tmp_path):
    from memory.report import write_report

    nb, inc, bars_id = lab
    cand = _candidate(nb, "first", [_win(9, 3)], math=[0 if k in (0, 2) else v for k, v in enumerate(BASE)])
    compare_mod.compare(nb, "s1", cand, inc, bars_id, SERVED, look=1)  # unresolved: its guard could widen
    record_result(nb, "s1", cand, _result(_win(30, 0), suite="hold", replicate=1))
    assert compare_mod.compare(nb, "s1", cand, inc, bars_id, SERVED, look=2).cleared  # the judge: flagged
    _, out = write_report(tmp_path / "notebook.db", "s1", tmp_path / "report.html")
    html = out.read_text()
    looks = html[html.index('id="looks"'):html.index("</article>", html.index('id="looks"'))]
    assert looks.count("<tr><td>") == 2 and "continue" in looks and "decided" in looks
    audit = html[html.index('id="suite-audit"'):html.index("</article>", html.index('id="suite-audit"'))]
    assert "math/correct" in audit and "in force" in audit and "-0.1" in audit
