"""Multiple-choice scorer: extract the chosen letter, tolerant of the usual answer phrasings.

Accepted forms, in tiers; the first tier that names any letter decides:
1. answer statements: "Answer: B", "The answer is (B)", "Final answer: **B**", "The correct option
   is B.", "I choose B", "B is correct", "\\boxed{B}";
2. bold: "**B**", "**(B)**", "**B. blue**";
3. a line that is just the letter, alone or before its option text: "B", "(B)", "B)", "B.", "b",
   "B: blue";
4. the option's text itself, alone or stated as the answer: "blue", "**Blue.**", "The answer is blue".
A tier that names two different letters ("A or B", "**A** and **B**", a list of the options) is
ambiguous: the answer commits to nothing, and is not rescued by a lower tier. Ambiguous and
unrecognised answers are both `unparsed` (value `ambiguous` tells them apart), counted apart from `wrong`: a model that never commits to a
letter has a different problem from one that picks the wrong one (a probe that mixed the two
measured format compliance more than knowledge).

Only capital letters count in running text ("the answer is a bit tricky" names no A); a lone
lowercase letter on its own line, or in parentheses, does.
"""

from __future__ import annotations

import re
import string

from evals.types import Completion, Item, Outcome, check_aligned


def _tiers(letters: str) -> list[list[re.Pattern[str]]]:
    """Per tier, patterns with the letter in group `l` and any further letters listed in `more`."""
    up, low = f"[{letters}]", f"[{letters.lower()}]"
    end = r"(?![\w'])"
    joined = r"\s*(?:,|/|&|\bor\b|\band\b)\s*"
    lead = r"(?i:\b(?:answer|option|choice)\b)(?:(?i:\s+is)|\s*[:\-])?[\s*:]*"
    return [
        [
            # Only the lead-in words are case-insensitive: the letter itself must be a capital.
            re.compile(rf"{lead}\(?(?P<l>{up})\)?{end}(?P<more>(?:{joined}\(?{up}\)?{end})*)"),
            re.compile(rf"{lead}\((?P<l>{low})\){end}"),
            re.compile(rf"(?i:\b(?:choose|pick|select|go with)\b)\s+(?i:option\s+)?\(?(?P<l>{up})\)?{end}"),
            re.compile(rf"(?<![\w(])(?P<more>(?:\(?{up}\)?{joined})*)\(?(?P<l>{up})\)?\s+"
                       r"(?i:(?:is|are)\s+(?:the\s+)?(?:correct|right|answer))"),
            re.compile(rf"\\boxed\{{\s*(?:\\text\{{)?(?P<l>{up})\}}?\s*\}}"),
        ],
        [re.compile(rf"\*\*\s*\(?(?P<l>{up})\)?(?:[.):]?\s[^*\n]*|[.):])?\s*\*\*")],
        [re.compile(rf"^[ \t]*\(?(?P<l>{up}|{low})\)?(?P<more>(?:{joined}\(?{up}\)?)*)[ \t]*(?:[.):\-][ \t]*.*)?$",
                    re.MULTILINE)],
    ]


def _letters_of(match: re.Match[str], letters: str) -> set[str]:
    more = match.groupdict().get("more") or ""
    return {match["l"].upper()} | set(re.findall(f"[{letters}]", more))


def _plain(text: str) -> str:
    """Text reduced for comparison with an option: no markdown stars, outer punctuation, case."""
    return text.replace("*", "").strip().strip(".!").strip().lower()


def _by_text(text: str, choices: tuple[str, ...], letters: str) -> set[str]:
    stated = re.search(r"(?i:\banswer\b)(?:\s+is|\s*:)\s*(.+?)\s*$", text.strip())
    candidates = [_plain(text)] + ([_plain(stated.group(1))] if stated else [])
    return {letters[k] for k, choice in enumerate(choices) if _plain(choice) in candidates}


def extract(text: str, choices: tuple[str, ...]) -> tuple[str | None, str]:
    """(letter, how): the letter the answer commits to and the tier that found it, or (None, why)."""
    letters = string.ascii_uppercase[: len(choices)]
    for tier, patterns in enumerate(_tiers(letters), start=1):
        found = {c for p in patterns for m in p.finditer(text) for c in _letters_of(m, letters)}
        if len(found) > 1:
            return None, "ambiguous"
        if found:
            return found.pop(), f"tier {tier}"
    found = _by_text(text, choices, letters)
    if len(found) == 1:
        return found.pop(), "option text"
    return None, "ambiguous" if found else "none"


def extract_letter(text: str, choices: tuple[str, ...]) -> str | None:
    """The letter the answer commits to, or None when it commits to none (or to several)."""
    return extract(text, choices)[0]


def score_item(item: Item, completion: Completion) -> Outcome:
    if not item.choices or item.gold is None:
        raise ValueError(f"item {item.id}: an MCQ item needs choices and a gold letter")
    letter, how = extract(completion.text, item.choices)
    if letter is None:
        return Outcome(item_id=item.id, label="unparsed", reasons=(f"no letter committed to ({how})",),
                       values={"correct": 0.0, "unparsed": 1.0, "ambiguous": float(how == "ambiguous")})
    correct = letter == item.gold.strip().upper()
    return Outcome(
        item_id=item.id,
        label="correct" if correct else "wrong",
        values={"correct": float(correct), "unparsed": 0.0, "ambiguous": 0.0},
        reasons=(f"chose {letter} ({how})",),
    )


def score(items: list[Item], completions: list[Completion]) -> list[Outcome]:
    """Score each MCQ item: correct / wrong / unparsed (`ambiguous` marks the unparsed that named several)."""
    check_aligned(items, completions)
    return [score_item(item, comp) for item, comp in zip(items, completions, strict=True)]
