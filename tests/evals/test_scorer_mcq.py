"""The MCQ extractor on a corpus of answer forms (tests/evals/corpus/mcq_forms.jsonl), and its counts."""

from __future__ import annotations

import json
from pathlib import Path

from evals import mcq
from evals.types import suite_metrics

CORPUS = Path(__file__).parent / "corpus" / "mcq_forms.jsonl"
CHOICES = ("red", "blue", "green", "white")


def _rows() -> list[dict]:
    return [json.loads(line) for line in CORPUS.read_text().splitlines()]


def test_answer_forms_extracted_as_listed():
    rows = _rows()
    assert sum(r["letter"] is None for r in rows) >= 15 and len(rows) >= 50
    wrong = [(r["note"], r["text"], mcq.extract(r["text"], CHOICES)) for r in rows
             if mcq.extract_letter(r["text"], CHOICES) != r["letter"]]
    assert not wrong, wrong


def test_unparsed_and_ambiguous_counted_apart_from_wrong(item, completion):
    texts = {"right": "The answer is (B).", "wrong": "Answer: C", "two": "A or B", "none": "I don't know."}
    items = [item(k, gold="B", choices=CHOICES) for k in texts]
    outs = mcq.score(items, [completion(k, t) for k, t in texts.items()])
    assert [o.label for o in outs] == ["correct", "wrong", "unparsed", "unparsed"]
    assert [o.values["ambiguous"] for o in outs] == [0.0, 0.0, 1.0, 0.0]
    metrics = suite_metrics(outs)
    assert (metrics["correct"], metrics["unparsed"], metrics["ambiguous"]) == (0.25, 0.5, 0.25)
