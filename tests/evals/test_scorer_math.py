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


def test_math_variants_classified_as_listed(item, completion):
    rows = _rows()
    assert Counter(r["label"] for r in rows)["wrong"] >= 15
    items = [item(f"m{k}", gold=r["gold"]) for k, r in enumerate(rows)]
    comps = [completion(f"m{k}", r["answer"]) for k, r in enumerate(rows)]
    outs = math.score(items, comps, timeout_s=60)
    wrong = [(r["note"], r["gold"], r["answer"], o.label) for r, o in zip(rows, outs, strict=True) if o.label != r["label"]]
    assert not wrong, wrong


@pytest.mark.parametrize(("text", "normal"), [
    ("1{,}000", "1000"), ("$1\\,000$", "$1000$"), ("12\\,345.6", "12345.6"), ("1,234,567", "1234567"),
    ("1,2", "1,2"), ("10,0", "10,0"), ("1,234,5678", "1,234,5678"), ("(1, 2, 3)", "(1, 2, 3)"),
    ("50 percent", "50\\%"), ("$50\\,\\%$", "$50\\%$"), ("25\\text{\\%}", "25\\%"),
    ("\\textbf{\\text{12}}", "12"), ("\u22127", "-7"), ("\\$1,500", "1500"), ("5\\,\\mathrm{cm}", "5 cm"),
])
def test_normalize_rewrites_only_the_notations_that_fool_math_verify(text, normal):
    assert math.normalize(text) == normal
