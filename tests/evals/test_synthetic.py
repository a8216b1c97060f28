"""Synthetic task families: gold answers, the one checker (eval score = RFT reward), leak-free seeds."""

from __future__ import annotations

import re

import pytest

from core.chat import Message
from evals.synthetic import FAMILIES, check, extract, family_of, generate, score
from evals.types import Item, completion_from_text
from tools.data.leak import Reference, audit, prompt_text


def _item(family: str, gold: str, prompt: str = "q") -> Item:
    return Item(id=f"synthetic/{family}/x", messages=(Message(role="user", content=prompt),), gold=gold)


@pytest.mark.parametrize("family", FAMILIES)
def test_references_pass_and_generation_is_deterministic(family):
    tasks = generate(family, 40, seed=5)
    assert len({t.item.id for t in tasks}) == 40
    assert tasks == generate(family, 40, seed=5) and tasks != generate(family, 40, seed=6)
    for t in tasks:
        assert family_of(t.item.id) == family
        assert t.item.messages[0].content.endswith('Finish with "Answer: <result>".')
        assert check(t.item, t.reference)
        assert not check(t.item, t.reference.rsplit("Answer:", 1)[0] + "Answer: 999999999")


def _numbers(prompt: str) -> list[int]:
    return [int(x) for x in re.findall(r"-?\d+", prompt)]


def test_gold_answers_are_right_on_independent_recomputation():
    for t in generate("digit_sum", 30, seed=1):
        (n,) = _numbers(t.item.messages[0].content)
        assert int(t.item.gold) == sum(int(c) for c in str(n))
    for t in generate("long_division", 30, seed=1):
        a, b = _numbers(t.item.messages[0].content)
        assert t.item.gold == f"{a // b} remainder {a % b}"
    for t in generate("letter_count", 30, seed=1):
        letter, phrase = re.findall(r'"([^"]*)"', t.item.messages[0].content)[:2]
        assert int(t.item.gold) == phrase.count(letter)
    for t in generate("word_count", 30, seed=1):
        (sentence,) = re.findall(r'sentence: "([^"]*)"', t.item.messages[0].content)
        assert int(t.item.gold) == len(sentence.split())
    for t in generate("arithmetic_chain", 30, seed=1):
        text = t.item.messages[0].content
        x = int(re.match(r"Start with (\d+)", text).group(1))
        steps = re.findall(r"(add|subtract|times) (\d+)", text.lower())
        assert 3 <= len(steps) <= 6
        for op, k in steps:
            x = {"add": x + int(k), "subtract": x - int(k), "times": x * int(k)}[op]
        assert t.item.gold == str(x)


def test_string_edit_gold():
    for t in generate("string_edit", 30, seed=2):
        q = re.findall(r'"([^"]*)"', t.item.messages[0].content)
        text = t.item.messages[0].content
        if text.startswith("Write"):
            assert t.item.gold == q[0][::-1]
        elif text.startswith("Remove"):
            assert t.item.gold == q[1].replace(q[0], "")
        else:
            assert t.item.gold == q[2].replace(q[0], q[1])


@pytest.mark.parametrize(("family", "gold", "completion", "ok"), [
    ("digit_sum", "14", "1 + 3 + 6 + 4 = 14.\nAnswer: 14", True),
    ("digit_sum", "14", "The digits add up to 14.", True),  # no marker: the last number
    ("digit_sum", "14", "Answer: 15\n(14 would be wrong)", False),  # the marker wins over later numbers
    ("digit_sum", "1234", "**Answer:** 1,234", True),
    ("arithmetic_chain", "-52", "Answer: −52", True),
    ("long_division", "7453 remainder 42", "Answer: 7453 R 42", True),
    ("long_division", "7453 remainder 42", "Answer: 7453", False),
    ("string_edit", "stove", "Replacing gives:\n**Answer:** `stove`.", True),
    ("string_edit", "stove", "Answer: Stove", False),
    ("string_edit", "stove", "stove", True),
    ("letter_count", "3", "r r r r r r r r r r r", False),
    ("word_count", "7", "", False),
])
def test_checker_on_hand_written_completions(family, gold, completion, ok):
    assert check(_item(family, gold), completion) is ok


def test_score_outcomes_and_alignment():
    items = [_item("digit_sum", "14"), Item(id="synthetic/word_count/y", messages=(Message(role="user", content="q"),), gold="3")]
    comps = [completion_from_text(items[0].id, "Answer: 14", 3, True), completion_from_text(items[1].id, "no idea", 2, True)]
    out = score(items, comps)
    assert [(o.label, o.values) for o in out] == [("correct", {"correct": 1.0, "unparsed": 0.0}),
                                                   ("unparsed", {"correct": 0.0, "unparsed": 1.0})]
    with pytest.raises(ValueError, match="paired with a completion"):
        score(items, comps[::-1])
    with pytest.raises(ValueError, match="not a synthetic item"):
        extract(family_of("mcq/1"), "x")


def test_train_and_eval_seeds_share_no_13_gram_except_whole_repeats():
    # Templates keep fixed word runs under 13 words: two different items never share a 13-gram, so a
    # training set and an eval suite from different seeds only collide on identical items (which the
    # builder redraws).
    for family in FAMILIES:
        evals = [Reference(source="eval", key=t.item.id, text=t.item.messages[0].content) for t in generate(family, 150, 1)]
        train = [prompt_text([m.model_dump() for m in t.item.messages]) for t in generate(family, 150, 2)]
        assert all(h.kind == "exact" for h in audit(train, evals).hits), family
        excluded = {r.text for r in evals}
        clean = generate(family, 150, 2, exclude=lambda item, seen=excluded: item.messages[0].content in seen)
        assert audit([t.item.messages[0].content for t in clean], evals).passed
