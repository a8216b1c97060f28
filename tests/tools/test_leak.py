"""Leak audit: exact (normalized) copies and shared 13-grams of holdout prompts are found; near misses are not."""

from __future__ import annotations

import pytest

from tools.leak import LeakError, Reference, audit, normalized_hash

HOLDOUT = "Explain why the sky looks blue during the day but red and orange at sunset, in simple words"
REFS = [Reference(source="dev", key="b7", text=HOLDOUT), Reference(source="eval:math.jsonl", key="m1", text="What is 2+2?")]


@pytest.mark.parametrize(("prompt", "kind"), [
    (HOLDOUT, "exact"),
    ("  explain WHY the sky looks blue\n during the day,  but red and orange at SUNSET in simple words!", "exact"),
    ("Hi! I have homework. " + " ".join(HOLDOUT.split()[2:15]) + " Thanks a lot.", "ngram"),
    ("what is 2 + 2", "exact"),
])
def test_planted_prompt_is_found(prompt, kind):
    result = audit(["An unrelated prompt", prompt], REFS)
    assert [(h.row, h.kind) for h in result.hits] == [(1, kind)]
    assert not result.passed


def test_twelve_shared_words_are_not_a_hit():
    prompt = "Tell me: " + " ".join(HOLDOUT.split()[:12]) + " please?"
    assert audit([prompt], REFS).passed


def test_result_records_what_was_checked_and_error_lists_rows():
    result = audit(["a", HOLDOUT, "b", HOLDOUT.lower()], REFS)
    assert result.rows_checked == 4 and result.references == {"dev": 1, "eval:math.jsonl": 2 - 1}
    assert result.sha256() == audit(["a", HOLDOUT, "b", HOLDOUT.lower()], REFS).sha256()
    msg = str(LeakError("winner_sft -> out.jsonl", result))
    assert "2 training prompt(s)" in msg and "row 1 vs dev b7" in msg and "row 3 vs dev b7" in msg


def test_normalization_ignores_case_spacing_and_punctuation_only():
    assert normalized_hash("Hello,  World!") == normalized_hash("hello world")
    assert normalized_hash("hello world") != normalized_hash("hello word")
