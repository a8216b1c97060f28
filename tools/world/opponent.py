"""The opponent: a rule-based answerer with its own error profile.

It reads a prompt the way the judge does (`tools.world.tasks.solve`), writes the world's worked
reference answer and, with a per-family probability (`ERROR_RATE`), corrupts the result: a number off
by one to three, a quotient or remainder off by one, a string with one letter dropped or two swapped.
It always stops and never loops, so it beats a parent that rambles even when both are wrong. Each
answer is a pure function of the prompt text (seeded by its sha256), so battles and truth samples
are reproducible without any model.
"""

from __future__ import annotations

import hashlib
import json
import random

from tools.world.tasks import Solved, WorldFamily, solve

# Per-family chance of a wrong final answer: weak on long computations, better on short lookups. Often
# wrong, so that the demo parent (wrong on most prompts, and often running on) wins 30-50% against it.
ERROR_RATE: dict[WorldFamily, float] = {
    "letter_count": 0.6, "word_count": 0.6, "digit_sum": 0.7, "long_division": 0.9,
    "arithmetic_chain": 0.85, "string_edit": 0.6, "json_format": 0.7, "follow_up": 0.7,
}
SALT = "toy-world-opponent-v1"


def _wrong_number(gold: int, rng: random.Random) -> int:
    return gold + rng.choice((-3, -2, -1, 1, 2, 3))


def _wrong_text(gold: str, rng: random.Random) -> str:
    chars = list(gold)
    i = rng.randrange(len(chars))
    if len(chars) > 1 and rng.random() < 0.5:
        j = i + 1 if i + 1 < len(chars) else i - 1
        chars[i], chars[j] = chars[j], chars[i]
    else:
        del chars[i]
    wrong = "".join(chars)
    return wrong if wrong and wrong != gold else gold + gold[-1]


def wrong_answer(solved: Solved, rng: random.Random) -> str:
    """A plausible wrong final answer in the gold's form."""
    if solved.family == "long_division":
        q, r = (int(x) for x in solved.gold.split(" remainder "))
        return f"{q + rng.choice((-1, 1))} remainder {r}" if rng.random() < 0.5 else f"{q} remainder {r + 1}"
    if solved.family == "string_edit":
        return _wrong_text(solved.gold, rng)
    return str(_wrong_number(int(solved.gold), rng))


def answer(prompt: str) -> str:
    """The opponent's reply to a world prompt (as the judge reads it); a refusal line for anything else."""
    solved = solve(prompt)
    if solved is None:
        return "I cannot answer that."
    rng = random.Random(int(hashlib.sha256(f"{SALT}\x00{prompt}".encode()).hexdigest()[:16], 16))
    if rng.random() >= ERROR_RATE[solved.family]:
        return solved.reference
    wrong = wrong_answer(solved, rng)
    if solved.family == "json_format":
        return json.dumps({"answer": int(wrong)})
    body, _, _ = solved.reference.rpartition("Answer: ")
    return f"{body}Answer: {wrong}"
