"""Repetition scorer: repeated n-gram ratio, tail loops and catastrophic loops, with reasons.

Text is split into word tokens (runs of letters/digits) and single punctuation marks, so a long
number like 100000000000 or 0.3333333333 is a few tokens, not a loop: a legitimately long digit run
is never catastrophic. Definitions:
- `ngram_repeat_ratio`: 1 - distinct n-grams / all n-grams (n = 4 by default); 0 for no repetition.
- tail loop: the answer ends in a unit of 1..`max_period` tokens repeated back to back at least
  `tail_min_repeats` times and covering at least `tail_min_tokens` tokens (a degenerate ending).
- catastrophic: some unit of 1..`max_period` tokens repeated back to back 100+ times anywhere.

`max_period` = 64 tokens: models loop whole sentences (20-40 tokens), not only phrases, and 100
copies of a unit longer than 64 tokens would not fit in any usual max_new_tokens anyway.
"""

from __future__ import annotations

import re

from evals.types import Completion, Item, Outcome, check_aligned

_TOKEN = re.compile(r"\w+|[^\w\s]")


def tokens(text: str) -> list[str]:
    return _TOKEN.findall(text.lower())


def ngram_repeat_ratio(toks: list[str], n: int = 4) -> float:
    grams = [tuple(toks[i:i + n]) for i in range(len(toks) - n + 1)]
    return 1.0 - len(set(grams)) / len(grams) if grams else 0.0


def longest_tandem_run(toks: list[str], max_period: int) -> tuple[int, int, int]:
    """(repeats, period, start) of the longest back-to-back repetition of any short unit.

    For each period p, a run is a stretch where toks[i] == toks[i + p]; a stretch of length L
    holds 1 + L // p copies of the unit. O(len * max_period).
    """
    best = (1, 1, 0)
    for p in range(1, max_period + 1):
        run = 0
        for i in range(len(toks) - p):
            run = run + 1 if toks[i] == toks[i + p] else 0
            copies = 1 + run // p
            if copies > best[0]:
                best = (copies, p, i + p + 1 - copies * p)
    return best


def tail_repeats(toks: list[str], max_period: int) -> tuple[int, int]:
    """(repeats, period) of the best unit that repeats back to back up to the very end."""
    best = (1, 1)
    for p in range(1, min(max_period, len(toks) // 2) + 1):
        k = len(toks) - 1
        while k - p >= 0 and toks[k] == toks[k - p]:
            k -= 1
        copies = (len(toks) - 1 - k) // p + 1
        if copies * p > best[0] * best[1]:
            best = (copies, p)
    return best


def loop_flags(text: str, n: int = 4, max_period: int = 64, tail_min_repeats: int = 4,
               tail_min_tokens: int = 24, catastrophic_repeats: int = 100) -> Outcome:
    toks = tokens(text)
    ratio = ngram_repeat_ratio(toks, n)
    run_copies, run_period, run_start = longest_tandem_run(toks, max_period)
    tail_copies, tail_period = tail_repeats(toks, max_period)
    catastrophic = run_copies >= catastrophic_repeats
    tail = tail_copies >= tail_min_repeats and tail_copies * tail_period >= tail_min_tokens
    reasons = []
    if catastrophic:
        unit = " ".join(toks[run_start:run_start + run_period])
        reasons.append(f"catastrophic: {unit!r} repeated {run_copies} times")
    if tail:
        unit = " ".join(toks[len(toks) - tail_period:])
        reasons.append(f"tail loop: {unit!r} repeated {tail_copies} times at the end")
    values = {"ngram_repeat_ratio": ratio, "tail_loop": float(tail), "catastrophic": float(catastrophic),
              "looping": float(tail or catastrophic)}
    label = "catastrophic" if catastrophic else ("tail_loop" if tail else "clean")
    return Outcome(item_id="", label=label, values=values, reasons=tuple(reasons))


def score(items: list[Item], completions: list[Completion]) -> list[Outcome]:
    """Flag each completion's repetition: clean / tail_loop / catastrophic, with the evidence."""
    check_aligned(items, completions)
    return [loop_flags(c.text).model_copy(update={"item_id": c.item_id}) for c in completions]
