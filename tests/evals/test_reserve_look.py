"""The reserve look on a real notebook file (issue 41, rules version 7): in a session whose split holds a reserve, the
last registered look of a p bar reads the candidate's draws of the dev holdout together with its first look at the
reserve's prompts (`<suite>@reserve`), one look of the registered rule at its registered share (p* recomputed here
from the eval rows), recorded with how many reserve prompts it read; the look's evidence cannot be chosen after the
fact (a reserve look anywhere but the last, or a last look that leaves out a reserve draw, is refused); and the rule
keeps its level under the null with the reserve look in it, by simulation.
"""

from __future__ import annotations

import random

import pytest
from scipy import stats as scipy_stats

from evals import compare as compare_mod
from evals import stats
from evals.job import reserve_suite
from evals.records import record_result
from memory.notebook import Notebook
from memory.records import BarsSpec
from memory.state import fold
from tests.evals.test_bars_compare import BASE, SERVED, _result
from tests.evals.test_sequential_audit import EVEN, HOLD_P, SEQUENTIAL, N, _win, calibrated_incumbent

R = 30  # reserve prompts
HOLD_R = reserve_suite("hold")
RESERVE_IDS = [f"r{k}" for k in range(R)]


def _reserve_win(wins: int, losses: int) -> list[float]:
    return [1.0] * wins + [0.0] * losses + [0.5] * (R - wins - losses)


def _lab(tmp_path, reserve: int):
    """As test_sequential_audit's lab, with an ingest decision whose split holds `reserve` battles (0: none)."""
    (tmp_path / "bars.toml").write_text(SEQUENTIAL)
    nb = Notebook.open(tmp_path / "notebook.db")
    nb.open_session("s1", lab="test", budget_gpuh=10, reserve_gpuh=1, planner="playbook", executor="local", config={})
    counts = {"train": 100, "dev": N, "sealed": 10} | ({"reserve": reserve} if reserve else {})
    nb.record_decision("s1", "ingest", "feedback split", {"split_id": 1, "sha256": "0" * 64, "counts": counts}
                       | ({"reserve_suites": ["hold"]} if reserve else {}))
    inc, bars = calibrated_incumbent(nb, tmp_path / "bars.toml")
    return nb, inc, bars.id


@pytest.fixture
def lab(tmp_path):
    nb, inc, bars_id = _lab(tmp_path, R)
    yield nb, inc, bars_id
    nb.close()


def _candidate(nb, name: str, draws: list[list[float]]) -> int:
    cand = nb.add_artifact(kind="checkpoint", name=name, path=f"/{name}", sha256=name[0] * 64, session="s1").id
    record_result(nb, "s1", cand, _result(BASE))
    for k, values in enumerate(draws):
        record_result(nb, "s1", cand, _result(values, suite="hold", replicate=k))
    return cand


def _reserve(nb, artifact: int, values: list[float]) -> None:
    record_result(nb, "s1", artifact, _result(values, suite=HOLD_R, ids=RESERVE_IDS))


def _p(cand: list[float], inc: list[float]) -> float:
    return scipy_stats.ttest_rel(cand, inc, alternative="greater").pvalue


def test_the_last_look_reads_the_dev_draws_with_the_reserve_one_look_of_the_registered_rule(lab):
    nb, inc, bars_id = lab
    weights = nb.bars(bars_id).spec.look_weights()
    draws = [_win(9, 4), _win(10, 4)]  # leads (raw p <= 0.25) on 40 prompts without clearing
    cand = _candidate(nb, "cand", draws)
    assert compare_mod.compare(nb, "s1", cand, inc, bars_id, SERVED, look=1).unresolved
    assert compare_mod.compare(nb, "s1", cand, inc, bars_id, SERVED, look=2).unresolved
    # the reserve look needs both sides' first looks at the reserve's prompts: refused (nothing judged) without them
    refused = compare_mod.compare(nb, "s1", cand, inc, bars_id, SERVED, look=3, reserve=True)
    assert refused.refused and any(HOLD_R in r for r in refused.reasons)
    assert fold(nb, "s1").p_family.spent == 0
    _reserve(nb, inc, [0.5] * R)  # the incumbent judged against its own answers
    _reserve(nb, cand, _reserve_win(14, 2))
    out = compare_mod.compare(nb, "s1", cand, inc, bars_id, SERVED, look=3, reserve=True)
    assert not out.refused and not out.unresolved and out.comparison_id is not None
    # p* recomputed from the rows: looks 1-2 on the means of draws 0 and 0..1, look 3 on draws 0..1 and the reserve
    mean1 = draws[0]
    mean2 = [(a + b) / 2 for a, b in zip(*draws, strict=True)]
    ps = [_p(mean1, EVEN) / weights[0], _p(mean2, EVEN) / weights[1],
          _p(mean2 + _reserve_win(14, 2), EVEN + [0.5] * R) / weights[2]]
    (comparison,) = nb.comparisons("s1")
    assert comparison.adjustment.raw_p == [pytest.approx(min(1.0, min(ps)))]
    assert comparison.adjustment.reserve == R and comparison.adjustment.look == 3
    assert [n for n, _, _ in comparison.adjustment.looks[0]] == [N, N, N + R]
    state = fold(nb, "s1")
    assert state.p_family.spent == 1  # one member of the Holm family, whatever the looks read
    last = state.looks[-1].payload
    assert (last.look, last.reserve, last.n, last.outcome) == (3, R, N + R, "decided")
    assert f"{R} reserve prompt(s)" in last.reason and f"{N} dev holdout item(s) on 2 draw(s)" in last.reason
    assert [x.payload.reserve for x in state.looks[:-1]] == [None, None]
    # the look decisions are stored without the reserve key when they read the dev holdout alone (as before it)
    payloads = [d.payload.model_dump(mode="json") for d in nb.decisions("s1", kind="look")]
    assert "reserve" not in payloads[0] and payloads[-1]["reserve"] == R
    assert out.cleared == (comparison.adjustment.adjusted_p[0] <= 0.05)


def test_the_reserve_is_read_at_the_last_look_only_and_never_left_out_once_drawn(lab, tmp_path):
    nb, inc, bars_id = lab
    cand = _candidate(nb, "cand", [_win(9, 4), _win(10, 4)])
    _reserve(nb, inc, [0.5] * R)
    _reserve(nb, cand, _reserve_win(14, 2))
    early = compare_mod.compare(nb, "s1", cand, inc, bars_id, SERVED, look=2, reserve=True)
    assert early.refused and any("last registered look" in r for r in early.reasons)
    # a last look without the reserve, once the candidate has a reserve draw: its data would be read, then left out
    left_out = compare_mod.compare(nb, "s1", cand, inc, bars_id, SERVED, look=3)
    assert left_out.refused and any("reserve draw of hold" in r for r in left_out.reasons)
    assert fold(nb, "s1").p_family.spent == 0
    # a session whose split holds no reserve has no reserve look
    other = tmp_path / "other"
    other.mkdir()
    nb2, inc2, bars2 = _lab(other, 0)
    cand2 = _candidate(nb2, "cand", [_win(9, 4), _win(10, 4)])
    none = compare_mod.compare(nb2, "s1", cand2, inc2, bars2, SERVED, look=3, reserve=True)
    assert none.refused and any("holds none" in r for r in none.reasons)
    nb2.close()


def test_the_rule_keeps_its_level_under_the_null_with_the_reserve_look():
    # H0 at its boundary: every prompt's true win rate 0.5, dev prompts and reserve prompts alike; the policy of
    # version 7 with a reserve: looks 1-2 on draws of the 40 dev prompts, look 3 on draws 0-1 and 30 reserve prompts,
    # continuing while a look leads (raw p <= 0.25). 3000 simulated comparisons.
    rng = random.Random(43)
    weights = BarsSpec(bars=(HOLD_P,), p_family=1, looks=3, look_spending=0.5).look_weights()
    alpha, sims, rejected = 0.05, 3000, 0

    def judged(ties: list[float]) -> list[float]:
        return [0.5 if rng.random() < t else float(rng.random() < 0.5) for t in ties]

    for _ in range(sims):
        ties = [rng.random() * 0.8 for _ in range(N)]
        draws, looks = [], []
        for i in range(3):
            if i < 2:
                draws.append(judged(ties))
            mean = [sum(d[k] for d in draws) / len(draws) for k in range(N)]
            cand, base = mean, EVEN
            if i == 2:  # the reserve look: fresh prompts, one draw each
                cand, base = mean + judged([rng.random() * 0.8 for _ in range(R)]), EVEN + [0.5] * R
            p = stats.paired_t(cand, base, alternative="greater").p_value
            looks.append((p, weights[i]))
            if compare_mod.sequential_p(looks) <= alpha or p > 0.25:
                break
        rejected += compare_mod.sequential_p(looks) <= alpha
    se = (alpha * (1 - alpha) / sims) ** 0.5
    assert rejected / sims <= alpha + 3 * se, rejected / sims
