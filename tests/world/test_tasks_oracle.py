"""The world's task language, oracle and opponent: pure functions, checked on many drawn prompts."""

from __future__ import annotations

import json
import math
import random

from evals import synthetic
from evals.judge import judged_prompt, parse_verdict
from tools.data.leak import Reference, ReferenceIndex, audit
from tools.world import opponent, oracle
from tools.world.tasks import WORLD_FAMILIES, draw_mix, is_correct, solve


def _tasks(n: int, seed: int = 3):
    return draw_mix(n, seed, ReferenceIndex([], 13), "t")


def test_solver_reads_back_every_family_and_matches_the_synthetic_references():
    tasks = _tasks(400)
    assert {t.family for t in tasks} == set(WORLD_FAMILIES)
    for t in tasks:
        solved = solve(judged_prompt(t.item("x")))
        assert solved is not None, t.messages
        assert (solved.family, solved.gold, solved.reference) == (t.family, t.gold, t.reference)
        assert is_correct(solved, t.reference)
    # The six synthetic families: the solver's worked answer is evals.synthetic's reference, byte for byte.
    for family in synthetic.FAMILIES:
        for task in synthetic.generate(family, 30, seed=11):
            solved = solve(task.item.messages[0].content)
            assert (solved.gold, solved.reference) == (task.item.gold, task.reference)


def test_a_non_world_prompt_gets_no_verdict():
    reply = oracle.judge("Write a poem about the sea.", "a", "b")
    assert parse_verdict(reply) is None


def test_json_requests_need_a_bare_json_object():
    task = next(t for t in _tasks(80) if t.family == "json_format")
    solved = solve(task.messages[-1].content)
    assert is_correct(solved, json.dumps({"answer": int(task.gold)}))
    assert not is_correct(solved, f"Answer: {task.gold}")
    assert not is_correct(solved, json.dumps({"answer": int(task.gold) + 1}))


def test_the_oracle_prefers_correct_then_clean_answers():
    task = next(t for t in _tasks(16) if t.family == "digit_sum")
    prompt, right = task.messages[-1].content, task.reference
    wrong = right.rpartition("Answer: ")[0] + f"Answer: {int(task.gold) + 1}"
    looping = right + " and so on" * 40
    markup = right + "<|im_start|>user\nmore"
    assert oracle.true_verdict(prompt, right, wrong)[0] == "A"
    assert oracle.true_verdict(prompt, wrong, right)[0] == "B"
    assert oracle.true_verdict(prompt, right, right)[0] == "tie"
    assert oracle.true_verdict(prompt, wrong, wrong)[0] == "both_bad"
    assert oracle.true_verdict(prompt, right, looping)[0] == "A"
    assert oracle.true_verdict(prompt, markup, right)[0] == "B"
    assert oracle.true_verdict(prompt, wrong, wrong + " x" * 60)[0] == "A"  # a clean wrong answer beats a looping one
    # Running on past the answer line (other numbers, so no strict loop) is not stopping: it loses to a
    # stopped answer of the same correctness, and the loop scorer alone would not have caught it.
    runs_on = right + "".join(f"\nAnswer: {int(task.gold) + k}" for k in (1, 3, 2))
    assert not oracle.grade(solve(prompt), runs_on).clean and oracle.grade(solve(prompt), right).clean
    assert oracle.true_verdict(prompt, runs_on, wrong)[0] == "B"
    assert oracle.true_verdict(prompt, right + f"\nAnswer: {task.gold}", right)[0] == "B"


def test_oracle_noise_matches_its_stated_rates_on_2000_votes():
    tasks = _tasks(2000, seed=5)
    counts = {"tie": 0, "both_bad": 0, "wrong": 0}
    decisive = 0
    for t in tasks:
        prompt = judged_prompt(t.item("x"))
        a, b = t.reference, opponent.wrong_answer(solve(prompt), random.Random(t.id))
        truth = oracle.true_verdict(prompt, a, b)[0]
        got = parse_verdict(oracle.judge(prompt, a, b))
        assert truth == "A" and got is not None
        decisive += 1
        if got == "tie":
            counts["tie"] += 1
        elif got == "both_bad":
            counts["both_bad"] += 1
        elif got == "B":
            counts["wrong"] += 1
    stated = {"tie": oracle.TIE_RATE, "both_bad": oracle.BOTH_BAD_RATE, "wrong": oracle.WRONG_RATE}
    for kind, rate in stated.items():
        se = math.sqrt(rate * (1 - rate) / decisive)
        assert abs(counts[kind] / decisive - rate) < 4 * se, (kind, counts[kind] / decisive, rate)


def test_the_same_call_always_gets_the_same_vote():
    t = _tasks(8)[0]
    prompt = judged_prompt(t.item("x"))
    assert len({oracle.judge(prompt, t.reference, "Answer: 0") for _ in range(5)}) == 1


def test_opponent_error_profile_matches_its_stated_rates():
    tasks = _tasks(1600, seed=9)
    for family in WORLD_FAMILIES:
        fam = [t for t in tasks if t.family == family]
        wrong = sum(not is_correct(solve(p), opponent.answer(p)) for p in (judged_prompt(t.item("x")) for t in fam))
        rate = opponent.ERROR_RATE[family]
        assert abs(wrong / len(fam) - rate) < 4 * math.sqrt(rate * (1 - rate) / len(fam)), family


def test_drawn_pools_are_disjoint_under_the_leak_audit():
    index = ReferenceIndex([], 13)
    first = draw_mix(300, 1, index, "a")
    second = draw_mix(300, 2, index, "b")
    refs = [Reference(source="a", key=t.id, text=t.prompt()) for t in first]
    assert audit([t.prompt() for t in second], refs).passed
