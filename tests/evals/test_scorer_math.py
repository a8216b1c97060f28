"""The math scorer on a corpus of notation variants, equivalent and not (tests/evals/corpus/math_variants.jsonl).

Each row names the notation it tests; rows marked "math-verify alone" are ones math-verify 0.9
gets wrong without `evals.math.normalize` in front of it.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from evals import math

CORPUS = Path(__file__).parent / "corpus" / "math_variants.jsonl"


def _rows() -> list[dict]:
    return [json.loads(line) for line in CORPUS.read_text().splitlines()]


def test_math_variants_classified_as_listed():
    # verify_answer is what each pool worker runs per item; calling it here spares the test two
    # worker start-ups (tests/evals/test_scorers_text.py covers the pool and its time bound).
    rows = _rows()
    assert Counter(r["label"] for r in rows)["wrong"] >= 15
    wrong = [(r["note"], r["gold"], r["answer"], label) for r in rows
             if (label := math.verify_answer(r["gold"], r["answer"])[0]) != r["label"]]
    assert not wrong, wrong


def test_scorer_applies_the_normalisation(item, completion):
    items = [item("a", gold="1000"), item("b", gold="0.5")]
    outs = math.score(items, [completion("a", "$\\boxed{1\\,000}$"), completion("b", "50%")], workers=1, timeout_s=60)
    assert [o.label for o in outs] == ["correct", "correct"]


@pytest.mark.parametrize(("text", "normal"), [
    ("1{,}000", "1000"), ("$1\\,000$", "$1000$"), ("12\\,345.6", "12345.6"), ("1,234,567", "1234567"),
    ("1,2", "1,2"), ("10,0", "10,0"), ("1,234,5678", "1,234,5678"), ("(1, 2, 3)", "(1, 2, 3)"),
    ("50 percent", "50\\%"), ("$50\\,\\%$", "$50\\%$"), ("25\\text{\\%}", "25\\%"),
    ("\\textbf{\\text{12}}", "12"), ("\u22127", "-7"), ("\\$1,500", "1500"), ("5\\,\\mathrm{cm}", "5 cm"),
])
def test_normalize_rewrites_only_the_notations_that_fool_math_verify(text, normal):
    assert math.normalize(text) == normal
