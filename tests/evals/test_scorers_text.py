"""Scorers on hand-written positive and negative cases."""

from __future__ import annotations

import pytest
from pydantic import TypeAdapter, ValidationError

from evals import constraints, length_stop, loops, math, mcq
from evals.constraint_rules import Constraint
from evals.types import suite_metrics

RULE = TypeAdapter(Constraint)


def _one(scorer, item, comp, **kw):
    return scorer.score([item], [comp], **kw)[0]


def test_math_equivalences(item, completion):
    cases = [
        (r"\frac{1}{2}", "So the probability is 0.5.", "correct"),
        ("1000", "The total is 1,000.", "correct"),
        ("1,000", "1000", "correct"),
        (r"\frac{1}{2}", r"Thus $\boxed{\frac{2}{4}}$", "correct"),
        ("3", "The answer is 4.", "wrong"),
        ("7", "I cannot tell.", "no_answer"),
    ]
    items = [item(f"m{i}", gold=g) for i, (g, _, _) in enumerate(cases)]
    comps = [completion(f"m{i}", t) for i, (_, t, _) in enumerate(cases)]
    outs = math.score(items, comps, timeout_s=20)
    assert [o.label for o in outs] == [c[2] for c in cases]
    assert suite_metrics(outs)["correct"] == pytest.approx(4 / 6)


def test_math_hang_is_killed_and_the_rest_scored(item, completion):
    # sympy tries to evaluate the tower exactly and never returns; the pool kills that worker.
    items = [item("hang", gold="1"), item("ok", gold="2")]
    comps = [completion("hang", "$9^{9^{9^{9}}}$"), completion("ok", "The answer is 2")]
    outs = math.score(items, comps, timeout_s=2)
    assert [o.label for o in outs] == ["timeout", "correct"]
    assert outs[0].values == {"correct": 0.0, "no_answer": 0.0}


def test_math_misaligned_refused(item, completion):
    with pytest.raises(ValueError, match="paired with a completion for"):
        math.score([item("a", gold="1")], [completion("b", "1")])


@pytest.mark.parametrize(
    ("text", "label"),
    [
        ("The answer is (B)", "correct"),
        ("**B**", "correct"),
        ("B) blue", "correct"),
        ("Answer: C", "wrong"),
        ("The answer is a bit tricky, maybe red or blue", "unparsed"),
        ("A. red\nB. blue", "unparsed"),
        ("blue", "correct"),
    ],
)
def test_mcq_extraction(item, completion, text, label):
    it = item("q", gold="B", choices=("red", "blue", "green", "white"))
    out = _one(mcq, it, completion("q", text))
    assert out.label == label
    assert out.values["unparsed"] == float(label == "unparsed")


@pytest.mark.parametrize(
    ("rule", "good", "bad"),
    [
        ({"kind": "word_count", "relation": "exactly", "n": 3}, "one two three", "one two"),
        ({"kind": "word_count", "relation": "at_most", "n": 2}, "don't stop", "one two three"),
        ({"kind": "sentence_count", "relation": "exactly", "n": 2}, "Hi there. How are you?", "Hi. Yo. Go."),
        ({"kind": "paragraph_count", "n": 2}, "para one\n\npara two", "just one paragraph"),
        ({"kind": "bullet_count", "n": 2}, "- a\n- b", "- a\n- b\n- c"),
        ({"kind": "include_keywords", "keywords": ["cat", "dog"]}, "A Cat and a dog.", "a cat only"),
        ({"kind": "forbidden_words", "forbidden": ["bad"]}, "badge is fine", "this is bad"),
        ({"kind": "keyword_frequency", "keyword": "go", "relation": "at_least", "n": 2}, "go go", "go gone"),
        ({"kind": "letter_frequency", "letter": "z", "relation": "at_least", "n": 2}, "zigzag", "zoo"),
        ({"kind": "starts_with", "prefix": "Dear"}, "Dear Bob, hi", "Hi Bob"),
        ({"kind": "ends_with", "suffix": "Is there anything else?"}, "Done. Is there anything else?", "Done."),
        ({"kind": "all_lowercase"}, "all lower here", "Not lower"),
        ({"kind": "all_uppercase"}, "ALL UPPER", "MOSTLY Upper"),
        ({"kind": "capital_words", "relation": "at_least", "n": 2}, "VERY IMPORTANT note", "Very important"),
        ({"kind": "json_format"}, '```json\n{"a": 1}\n```', "{'a': 1}"),
        ({"kind": "title"}, "<<My Poem>>\nroses", "My Poem\nroses"),
        ({"kind": "no_commas"}, "no commas here", "one, two"),
        ({"kind": "placeholders", "n": 2}, "Hi [name] at [address]", "Hi [name]"),
        ({"kind": "sections", "n": 2}, "SECTION 1\na\nSECTION 2\nb", "SECTION 1\na"),
        ({"kind": "highlights", "n": 2}, "*one* and *two*", "**bold** only"),
        ({"kind": "postscript"}, "Body.\nP.S. see you", "Body. PS see you"),
        ({"kind": "wrap_in_quotes"}, '"quoted answer"', "unquoted"),
        ({"kind": "repeat_request", "request": "Say hi."}, "Say hi. Hi!", "Hi! Say hi."),
    ],
)
def test_constraint_rules_strict(item, completion, rule, good, bad):
    it = item("c", constraints=(RULE.validate_python(rule),))
    assert _one(constraints, it, completion("c", good)).values["strict"] == 1.0
    assert _one(constraints, it, completion("c", bad)).values["strict"] == 0.0


def test_json_with_trailing_prose_fails_strict_passes_loose(item, completion):
    it = item("j", constraints=(RULE.validate_python({"kind": "json_format"}),))
    out = _one(constraints, it, completion("j", '{"answer": 42}\nHope this helps!'))
    assert (out.values["strict"], out.values["loose"], out.label) == (0.0, 1.0, "loose_pass")
    prose_only = _one(constraints, it, completion("j", "The answer is 42."))
    assert prose_only.values["loose"] == 0.0


def test_constraint_fraction_and_bad_rule(item, completion):
    rules = tuple(RULE.validate_python(r) for r in ({"kind": "no_commas"}, {"kind": "all_lowercase"}))
    out = _one(constraints, item("c", constraints=rules), completion("c", "Hello there"))
    assert out.values["strict_frac"] == 0.5 and out.reasons == ("strict fails all_lowercase",)
    with pytest.raises(ValidationError, match="word_count"):
        RULE.validate_python({"kind": "word_count", "relation": "around", "n": 3})


def test_loops_catastrophic_vs_digit_run(item, completion):
    phrase = "I am sorry. " * 120
    out = _one(loops, item("l"), completion("l", "Let me think. " + phrase))
    assert out.label == "catastrophic" and "repeated 120 times" in out.reasons[0]
    digits = "The number is 1" + "0" * 300 + " and 0." + "3" * 200 + " exactly."
    clean = _one(loops, item("d"), completion("d", digits))
    assert clean.label == "clean" and clean.values["catastrophic"] == 0.0


def test_loops_whole_sentence_repeated(item, completion):
    # A 27-token sentence: a unit longer than a phrase, as models loop it.
    sentence = ("The quick brown fox jumps over the lazy dog while the farmer watches from the porch and "
                "drinks his coffee slowly in the morning sun today. ")
    out = _one(loops, item("s"), completion("s", "Intro. " + sentence * 100))
    assert out.label == "catastrophic" and "repeated 100 times" in out.reasons[0]
    tail = _one(loops, item("t"), completion("t", "Intro. " + sentence * 5))
    assert tail.label == "tail_loop" and tail.values["catastrophic"] == 0.0


def test_loops_tail_and_ratio(item, completion):
    text = "The result is 12. " + "and then again " * 10
    out = _one(loops, item("t"), completion("t", text))
    assert out.label == "tail_loop" and out.values["catastrophic"] == 0.0
    assert out.values["ngram_repeat_ratio"] > 0.5
    fresh = _one(loops, item("f"), completion("f", "Each of these words appears only once in this sentence."))
    assert fresh.values["ngram_repeat_ratio"] == 0.0 and fresh.label == "clean"


def test_length_stop_rates(item, completion):
    items = [item("a"), item("b"), item("c")]
    comps = [completion("a", "fine answer", 2), completion("b", "cut off mid", 64, stopped=False),
             completion("c", "  ", 1)]
    metrics = suite_metrics(length_stop.score(items, comps))
    assert metrics["stopped"] == pytest.approx(2 / 3)
    assert metrics["truncated"] == pytest.approx(1 / 3)
    assert metrics["empty"] == pytest.approx(1 / 3)
    assert metrics["n_tokens"] == pytest.approx(67 / 3)
