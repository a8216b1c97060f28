"""The model card's building blocks: numbers with references, code spans, intervals, metric directions.

The card of a real session (every number found in the record it names, the usage snippet run
against the bundle) is tested in tests/tools/test_bundle.py.
"""

from __future__ import annotations

import math

import pytest
from scipy.stats import binomtest, t

from tools.nomination import card


def test_numbers_carry_their_reference_right_after_them():
    reference = card.ref("eval", 12, "metrics.correct")
    assert reference == "<!-- nb eval:12 metrics.correct -->"
    assert card.num(0.41666666, reference) == "0.4167" + reference
    assert card.num(16, card.ref("job", 3, "result.steps")) == "16<!-- nb job:3 result.steps -->"
    assert card.num(2.0, "") == "2"  # an integral float prints as an integer, exactly
    assert card.num(5e-3, "") == "0.005" and card.num(1.5e-7, "") == "1.5e-07"
    assert card.ref("job", [4, 5, 9], "sum(gpu_hours)") == "<!-- nb job:4+5+9 sum(gpu_hours) -->"


def test_non_numbers_are_refused_and_infinities_are_code():
    with pytest.raises(TypeError, match="not a number"):
        card.num(True, "")
    with pytest.raises(TypeError, match="not a number"):
        card.num("0.5", "")
    assert card.num(float("inf"), "x") == "`inf`"


def test_code_spans_cannot_break_out_of_a_table_cell():
    assert card.code("a|b`c\nd") == "`a/b'c\\nd`"  # a newline is shown as its escape (issue 34, section 6)
    assert card.code(12) == "`12`"


@pytest.mark.parametrize("values", [[1.0] * 7 + [0.0] * 5, [1.0] * 4, [0.0] * 3, [0.0, 1.0]])
def test_binary_interval_is_the_wilson_score_interval(values):
    ci = binomtest(int(sum(values)), len(values)).proportion_ci(confidence_level=0.95, method="wilson")
    low, high = card.mean_ci(values)
    assert math.isclose(low, ci.low, abs_tol=1e-12) and math.isclose(high, ci.high, abs_tol=1e-12)


def test_other_values_get_the_student_t_interval():
    values = [3.0, 5.0, 4.0, 9.0, 1.5]
    mean, sd = sum(values) / 5, math.sqrt(sum((v - 4.5) ** 2 for v in values) / 4)
    expected = t.interval(0.95, 4, loc=mean, scale=sd / math.sqrt(5))
    assert card.mean_ci(values) == pytest.approx(expected, abs=1e-12)
    assert card.mean_ci([7.0]) == (7.0, 7.0)


def test_metric_directions():
    assert card.worse("correct", 0.4, 0.5) and not card.worse("correct", 0.6, 0.5)
    assert card.worse("looping", 0.2, 0.1) and not card.worse("truncated", 0.0, 0.3)
    assert not card.worse("n_tokens", 80.0, 10.0)  # length alone is neither better nor worse
