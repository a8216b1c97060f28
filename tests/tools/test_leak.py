"""Leak audit: exact (normalized) copies and shared 13-grams of holdout prompts are found; near misses are not."""

from __future__ import annotations

import pytest

from tools.data.leak import Reference, audit, normalized_hash

HOLDOUT = "Explain why the sky looks blue during the day but red and orange at sunset, in simple words"
SHORT = "Write a haiku about autumn rain in Kyoto"  # 8 words: too short to have a 13-gram
REFS = [Reference(source="dev", key="b7", text=HOLDOUT), Reference(source="eval:math.jsonl", key="m1", text="What is 2+2?"),
        Reference(source="sealed", key="s3", text=SHORT)]


@pytest.mark.parametrize(("prompt", "kind"), [
    (HOLDOUT, "exact"),
    ("  explain WHY the sky looks blue\n during the day,  but red and orange at SUNSET in simple words!", "exact"),
    ("Hi! I have homework. " + " ".join(HOLDOUT.split()[2:15]) + " Thanks a lot.", "ngram"),
    ("what is 2 + 2", "exact"),
    ("Hello. " + SHORT.upper() + ", and then explain the imagery.", "ngram"),
])
def test_planted_prompt_is_found(prompt, kind):
    result = audit(["An unrelated prompt", prompt], REFS)
    assert [(h.row, h.kind) for h in result.hits] == [(1, kind)]
    assert not result.passed


def test_short_reference_is_found_whole_but_not_below_eight_words():
    hit = audit(["Please write a haiku about autumn rain in Kyoto today"], REFS).hits[0]
    assert (hit.source, hit.key, hit.ngram) == ("sealed", "s3", " ".join(SHORT.lower().split()))
    # Seven of its words, or a 4-word reference inside a longer prompt, are not evidence of a copy.
    assert audit(["Write a haiku about autumn rain in Paris", "so what is 2+2? asking for a friend"], REFS).passed


def test_twelve_shared_words_are_not_a_hit():
    prompt = "Tell me: " + " ".join(HOLDOUT.split()[:12]) + " please?"
    assert audit([prompt], REFS).passed


def test_result_records_what_was_checked_and_the_rows_that_hit():
    result = audit(["a", HOLDOUT, "b", HOLDOUT.lower()], REFS)
    assert result.rows_checked == 4 and result.references == {"dev": 1, "eval:math.jsonl": 1, "sealed": 1}
    assert result.sha256() == audit(["a", HOLDOUT, "b", HOLDOUT.lower()], REFS).sha256()
    assert [(h.row, h.source, h.key) for h in result.hits] == [(1, "dev", "b7"), (3, "dev", "b7")]


def test_normalization_ignores_case_spacing_and_punctuation_only():
    assert normalized_hash("Hello,  World!") == normalized_hash("hello world")
    assert normalized_hash("hello world") != normalized_hash("hello word")
