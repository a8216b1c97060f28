"""Synthetic tasks with programmatically computed gold answers, and THE checker that grades them.

The families are where the seed models looped or erred: letter counting, word counting, digit sums,
long division, arithmetic chains and string edits. Every prompt ends by asking for a final line
`Answer: <result>`; the checker reads that line (or, failing it, the last number or line).

One checker for eval and reward (DESIGN.md): the `synthetic` eval suite scores with `score`, the RFT
trainer rewards with `check`, and the `synthetic_verified` builder keeps a reference answer only if
`check` accepts it. Generation is deterministic in (family, n, seed).

Prompt templates keep every run of fixed words shorter than 13 words, so two different items never
share a word 13-gram and a training set generated with one seed passes the leak audit against an
eval suite generated with another (tests/evals/test_synthetic.py checks this).
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Callable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from core.chat import Message
from evals.types import Completion, Item, Outcome, check_aligned

Family = Literal["letter_count", "word_count", "digit_sum", "long_division", "arithmetic_chain", "string_edit"]
FAMILIES: tuple[Family, ...] = (
    "letter_count", "word_count", "digit_sum", "long_division", "arithmetic_chain", "string_edit",
)
ID_PREFIX = "synthetic"
FINISH = 'Finish with "Answer: <result>".'

_WORDS = (
    "apple river stone cloud garden window pencil orange yellow silver marble planet rocket candle "
    "basket ladder mirror pocket butter coffee dragon forest island jacket kettle lemon mountain "
    "needle ocean pepper rabbit saddle tomato tunnel valley wagon zebra anchor bridge castle desert "
    "engine feather guitar hammer jungle kitten lantern meadow nectar oyster parrot quartz ribbon "
    "shadow thunder umbrella violin walnut yogurt banana cherry strawberry blueberry mississippi "
    "committee bookkeeper balloon coconut pineapple letter little bottle coffee puzzle giraffe "
    "spaghetti broccoli tennessee assessment address happiness success possess embarrass necessary "
    "the a of and to in is that was for on are with as his they be at one have this from by hot "
    "word but what some we can out other were all there when up use your how said an each she which "
    "do their time if will way about many then them write would like so these her long make thing see"
).split()


class Task(BaseModel):
    """A generated item plus a reference answer that the checker accepts."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    item: Item = Field(description="The eval item: id 'synthetic/<family>/<hash>', one user turn, gold answer.")
    reference: str = Field(description="A short worked answer ending in 'Answer: <gold>' (SFT target).")


def _item(family: Family, prompt: str, gold: str) -> Item:
    text = f"{prompt} {FINISH}"
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    return Item(id=f"{ID_PREFIX}/{family}/{digest}", messages=(Message(role="user", content=text),), gold=gold)


def family_of(item_id: str) -> Family:
    """The family of a synthetic item from its id; ValueError for any other id."""
    parts = item_id.split("/")
    if len(parts) != 3 or parts[0] != ID_PREFIX or parts[1] not in FAMILIES:
        raise ValueError(f"item id {item_id!r} is not a synthetic item ('{ID_PREFIX}/<family>/<hash>')")
    return parts[1]  # type: ignore[return-value]


# ---- generators: each returns (prompt, gold, reference) -------------------------------------------


def _letter_count(rng: random.Random) -> tuple[str, str, str]:
    phrase = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 3)))
    letters = sorted(set(phrase.replace(" ", "")))
    letter = rng.choice(letters) if rng.random() < 0.8 else rng.choice("abcdefghijklmnopqrstuvwxyz")
    k = phrase.count(letter)
    spelled = " / ".join("-".join(c.upper() if c == letter else c for c in w) for w in phrase.split())
    prompt = f'How many times does the letter "{letter}" appear in "{phrase}"?'
    return prompt, str(k), f'Spelled out, with each "{letter}" in capitals: {spelled}.\nAnswer: {k}'


def _word_count(rng: random.Random) -> tuple[str, str, str]:
    ws = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
    numbered = ", ".join(f"{i} {w}" for i, w in enumerate(ws, start=1))
    prompt = f'How many words are in this sentence: "{" ".join(ws)}"?'
    return prompt, str(len(ws)), f"Numbering the words: {numbered}.\nAnswer: {len(ws)}"


def _digit_sum(rng: random.Random) -> tuple[str, str, str]:
    d = rng.randint(4, 12)
    n = rng.randint(10 ** (d - 1), 10**d - 1)
    digits = [int(c) for c in str(n)]
    prompt = f"What is the sum of the digits of {n}?"
    return prompt, str(sum(digits)), f"{' + '.join(map(str, digits))} = {sum(digits)}.\nAnswer: {sum(digits)}"


def _long_division(rng: random.Random) -> tuple[str, str, str]:
    b = rng.randint(2, 99)
    a = rng.randint(b, 999_999)
    q, r = divmod(a, b)
    prompt = f"Divide {a} by {b}. Give the quotient and the remainder."
    gold = f"{q} remainder {r}"
    return prompt, gold, f"{b} × {q} = {b * q}, and {a} - {b * q} = {r}.\nAnswer: {gold}"


_OPS: dict[str, tuple[str, Callable[[int, int], int], str]] = {
    "add": ("add {k}", lambda x, k: x + k, "+"),
    "sub": ("subtract {k}", lambda x, k: x - k, "-"),
    "mul": ("times {k}", lambda x, k: x * k, "×"),
}


def _arithmetic_chain(rng: random.Random) -> tuple[str, str, str]:
    x = rng.randint(1, 60)
    start, steps, lines = x, [], []
    for _ in range(rng.randint(3, 6)):
        op = rng.choice(list(_OPS))
        k = rng.randint(2, 12) if op == "mul" else rng.randint(1, 99)
        words, fn, sym = _OPS[op]
        steps.append(words.format(k=k))
        y = fn(x, k)
        lines.append(f"{x} {sym} {k} = {y}")
        x = y
    # Two words per step: every 13-gram of the prompt then holds the start or four drawn steps.
    prompt = f"Start with {start}. {', '.join(steps).capitalize()}."
    return prompt, str(x), "\n".join(lines) + f"\nAnswer: {x}"


def _string_edit(rng: random.Random) -> tuple[str, str, str]:
    text = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 3)))
    # Removing a letter must not empty a word: the gold would then hold doubled or edge spaces.
    removable = sorted(c for c in set(text.replace(" ", "")) if all(w.replace(c, "") for w in text.split()))
    kind = rng.choice(("remove", "reverse", "replace"))
    if kind == "reverse" or (kind == "remove" and not removable):
        gold = text[::-1]
        return f'Write "{text}" backwards, letter by letter.', gold, f"Reversed: {gold}\nAnswer: {gold}"
    letter = rng.choice(removable if kind == "remove" else sorted(set(text.replace(" ", ""))))
    if kind == "remove":
        gold = text.replace(letter, "")
        return f'Remove every "{letter}" from "{text}".', gold, f'Without "{letter}": {gold}\nAnswer: {gold}'
    new = rng.choice([c for c in "abcdefghijklmnopqrstuvwxyz" if c != letter])
    gold = text.replace(letter, new)
    prompt = f'Replace every "{letter}" with "{new}" in "{text}".'
    return prompt, gold, f'With each "{letter}" replaced by "{new}": {gold}\nAnswer: {gold}'


_GENERATORS: dict[Family, Callable[[random.Random], tuple[str, str, str]]] = {
    "letter_count": _letter_count,
    "word_count": _word_count,
    "digit_sum": _digit_sum,
    "long_division": _long_division,
    "arithmetic_chain": _arithmetic_chain,
    "string_edit": _string_edit,
}


def generate(family: Family, n: int, seed: int, exclude: Callable[[Item], bool] | None = None) -> list[Task]:
    """`n` distinct tasks of one family, deterministic in (family, n, seed, exclude).

    `exclude` drops items a caller must not use (the dataset builder passes its leak-audit index, so
    training tasks never coincide with eval or holdout prompts: small families such as one-word letter
    counts do repeat across seeds).
    """
    rng = random.Random(f"{family}:{seed}")
    tasks: dict[str, Task] = {}
    for _ in range(50 * n):  # redraw repeats and excluded items instead of returning fewer
        if len(tasks) == n:
            break
        prompt, gold, reference = _GENERATORS[family](rng)
        item = _item(family, prompt, gold)
        if exclude is not None and exclude(item):
            continue
        tasks.setdefault(item.id, Task(item=item, reference=reference))
    if len(tasks) < n:
        raise ValueError(f"synthetic: family {family} produced only {len(tasks)} distinct items, {n} asked")
    return list(tasks.values())


# ---- the checker ----------------------------------------------------------------------------------

_ANSWER = re.compile(r"answer\s*[:：]\s*", re.IGNORECASE)
_INT = re.compile(r"[-−]?\d(?:[\d,]*\d)?")
_NUMERIC: frozenset[Family] = frozenset(FAMILIES) - {"string_edit"}
_DECOR = " \t*_`\"'“”"  # markdown emphasis, code ticks and quotes a model may wrap the answer in


def _answer_segment(text: str) -> str | None:
    """The text after the last 'Answer:' marker, up to the end of that line; None without a marker."""
    matches = list(_ANSWER.finditer(text))
    if not matches:
        return None
    return text[matches[-1].end():].split("\n", 1)[0].strip()


def _ints(text: str) -> list[int]:
    return [int(m.replace(",", "").replace("−", "-")) for m in _INT.findall(text)]


def extract(family: Family, text: str) -> str | None:
    """The final answer a completion gives, in the gold's format; None when none can be read."""
    segment = _answer_segment(text)
    if family in _NUMERIC:
        # Without a marker, the last numbers of the text are the answer (models often end on it).
        ints = _ints(segment) if segment is not None else _ints(text)[-2:]
        if family == "long_division":
            return f"{ints[0]} remainder {ints[1]}" if len(ints) >= 2 else None
        if not ints:
            return None
        return str(ints[0] if segment is not None else ints[-1])
    if segment is None:
        lines = [ln for ln in text.strip().splitlines() if ln.strip()]
        segment = lines[-1].strip() if lines else None
    return None if segment is None else segment.strip(_DECOR).rstrip(".").strip(_DECOR) or None


def check(item: Item, completion: str) -> bool:
    """True iff the completion's final answer equals the item's gold answer (the RFT reward and eval score)."""
    answer = extract(family_of(item.id), completion)
    return answer is not None and answer == item.gold


def score_item(item: Item, completion: Completion) -> Outcome:
    answer = extract(family_of(item.id), completion.text)
    if answer is None:
        return Outcome(item_id=item.id, label="unparsed", values={"correct": 0.0, "unparsed": 1.0},
                       reasons=("no final answer found",))
    correct = answer == item.gold
    return Outcome(item_id=item.id, label="correct" if correct else "wrong",
                   values={"correct": float(correct), "unparsed": 0.0},
                   reasons=() if correct else (f"answered {answer!r}, gold {item.gold!r}",))


def score(items: list[Item], completions: list[Completion]) -> list[Outcome]:
    """The `synthetic` suite scorer: one Outcome per item with `correct` and `unparsed` values."""
    check_aligned(items, completions)
    return [score_item(i, c) for i, c in zip(items, completions, strict=True)]
