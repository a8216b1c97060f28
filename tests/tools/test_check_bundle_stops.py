"""The reload check's stop rule: unstopped answers judged against the nominee's measured stop rate.

Pure: `stop_verdict` and `answer_problems` on hand-made answers. Reading the measured rate from a real
notebook is tested on the recorded toy session in tests/tools/test_bundle.py.
"""

from __future__ import annotations

import pytest

from tools.nomination.check_bundle import STOP_ALPHA, Answer, MeasuredStops, answer_problems, stop_verdict


def _answers(stopped: int, total: int = 5) -> list[Answer]:
    return [Answer(prompt=f"p{i}", text="an answer", n_tokens=8 if i < stopped else 64, stopped=i < stopped)
            for i in range(total)]


def _measured(stopped: int, answers: int) -> MeasuredStops:
    return MeasuredStops(answers=answers, stopped=stopped, suites=["stop"])


def test_every_answer_stopping_passes_silently_with_or_without_a_measurement():
    assert stop_verdict(_answers(5), 64, None) == (True, "")
    assert stop_verdict(_answers(5), 64, _measured(30, 32)) == (True, "")


def test_without_a_measured_rate_one_miss_fails_and_names_the_prompt():
    ok, why = stop_verdict(_answers(4), 64, None)
    assert not ok
    assert why.startswith("1 of 5 answers did not end on a stop id within 64 tokens ('p4')")
    assert "expected every answer to stop" in why


def test_a_miss_the_measured_rate_explains_is_tolerated_and_said():
    # measured 90 of 96 (the toy world's 94%): one miss of 5 is likely, and a bar already judged the rate
    ok, why = stop_verdict(_answers(4), 64, _measured(90, 96))
    assert ok and "tolerated" in why and "90 of 96" in why
    problems, tolerated = answer_problems(_answers(4), 64, _measured(90, 96))
    assert problems == [] and tolerated == [why]


def test_a_model_measured_to_always_stop_fails_on_two_misses():
    ok, _ = stop_verdict(_answers(4), 64, _measured(32, 32))  # q = 1/34: P(>= 1 of 5) = 0.14
    assert ok
    ok, why = stop_verdict(_answers(3), 64, _measured(32, 32))  # P(>= 2 of 5) = 0.008
    assert not ok and "does not stop as the nominee was measured to" in why
    # a refusal on other prompts than the measured ones says so (check-bundle without a notebook)
    problems, _ = answer_problems(_answers(3), 64, _measured(32, 32), hint="; on the fixed prompts")
    assert problems == [why + "; on the fixed prompts"]
    assert answer_problems(_answers(4), 64, _measured(32, 32), hint="; on the fixed prompts")[0] == []


def test_a_server_that_never_stops_fails_for_a_nominee_measured_to_stop_six_times_in_ten():
    for stopped in (60, 80, 96):
        ok, _ = stop_verdict(_answers(0), 64, _measured(stopped, 96))
        assert not ok, stopped
    ok, _ = stop_verdict(_answers(0), 64, _measured(48, 96))  # 5 misses at q = 1/2: P = 0.031
    assert ok


def test_the_threshold_is_the_binomial_tail_of_the_smoothed_miss_rate():
    # 60 of 96 stopped: q = 37/98; 4 misses of 5 has P = 5 q^4 (1-q) + q^5
    q = 37 / 98
    p = 5 * q**4 * (1 - q) + q**5
    ok, why = stop_verdict(_answers(1), 64, _measured(60, 96))
    assert ok == (p >= STOP_ALPHA)
    assert f"{p:.3g}" in why


@pytest.mark.parametrize("text, expected", [("", "is empty"), ("a \ufffd b", "contains U+FFFD")])
def test_empty_and_broken_answers_fail_whatever_the_stop_rate(text, expected):
    answers = [a.model_copy(update={"text": text}) if a.prompt == "p0" else a for a in _answers(5)]
    problems, tolerated = answer_problems(answers, 64, _measured(96, 96))
    assert len(problems) == 1 and expected in problems[0] and tolerated == []
