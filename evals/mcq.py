"""Multiple-choice scorer: extract the chosen letter, tolerant of the usual answer phrasings.

Accepted forms (first match in this order wins): "answer is (B)" / "Answer: B" style statements,
a bold **B** or **(B)**, a line that is just the letter ("B", "(B)", "B)", "B." or "B: text"), or an
answer that is exactly one option's text. Anything else is `unparsed`, counted apart from `wrong`:
a model that never commits to a letter has a different problem from one that picks the wrong one.
"""

from __future__ import annotations

import re
import string

from evals.types import Completion, Item, Outcome, check_aligned


def _patterns(letters: str) -> list[re.Pattern[str]]:
    cls = f"[{letters}]"
    return [
        # Only the word "answer" is case-insensitive: "the answer is a bit tricky" must not read as A.
        re.compile(rf"(?i:answer)\s*(?:(?i:is)|:)?\s*:?\s*\**\(?({cls})\)?\**(?![A-Za-z])"),
        re.compile(rf"\*\*\s*\(?({cls})\)?\s*\*\*"),
        re.compile(rf"^\s*\(?({cls})\)?\s*(?:[.):]\s*.*)?$", re.MULTILINE),
    ]


def extract_letter(text: str, choices: tuple[str, ...]) -> str | None:
    """The letter the answer commits to, or None when it commits to none (or to several)."""
    letters = string.ascii_uppercase[: len(choices)]
    for pattern in _patterns(letters):
        found = {m.group(1).upper() for m in pattern.finditer(text)}
        if len(found) == 1:
            return found.pop()
        if len(found) > 1:
            return None  # two different letters asserted the same way: no commitment
    body = text.strip().rstrip(".").lower()
    exact = [letters[i] for i, choice in enumerate(choices) if body == choice.strip().lower()]
    return exact[0] if len(exact) == 1 else None


def score_item(item: Item, completion: Completion) -> Outcome:
    if not item.choices or item.gold is None:
        raise ValueError(f"item {item.id}: an MCQ item needs choices and a gold letter")
    letter = extract_letter(completion.text, item.choices)
    if letter is None:
        return Outcome(item_id=item.id, label="unparsed", values={"correct": 0.0, "unparsed": 1.0})
    correct = letter == item.gold.strip().upper()
    return Outcome(
        item_id=item.id,
        label="correct" if correct else "wrong",
        values={"correct": float(correct), "unparsed": 0.0},
        reasons=(f"chose {letter}",),
    )


def score(items: list[Item], completions: list[Completion]) -> list[Outcome]:
    """Score each MCQ item: correct / wrong / unparsed."""
    check_aligned(items, completions)
    return [score_item(item, comp) for item, comp in zip(items, completions, strict=True)]
