"""The toy world's prompt language: task families with computable answers, and the solver that reads them back.

Families: the six synthetic families of `evals.synthetic` (letter and word counting, digit sums, long
division, arithmetic chains, string edits) plus two of the world's own:

- `json_format`: a numeric task whose answer must come as a JSON object `{"answer": <number>}` and nothing
  else (a format-constrained request);
- `follow_up`: a two-turn conversation: a numeric task, its correct worked answer, then "Now add 7 to
  that." (or subtract / multiply), answered from the earlier result (multi-turn).

`solve(text)` parses any world prompt, as the pairwise judge reads it (`evals.judge.judged_prompt`: the last
user turn, or the whole exchange fenced as `[user]` / `[assistant]` blocks), back into its family, gold
answer and a correct worked reference, so the oracle needs no table of answers and judges fresh prompts
too. The worked references are byte-identical to `evals.synthetic`'s (tests/world checks it), so every
SFT target in the world has one style.

The world draws its own instances in those templates, smaller than evals.synthetic's (short words,
numbers below 10,000, one or two chain steps), so a ~1M-parameter model has headroom on every family;
the solver reads either size. Drawing (`draw`) is deterministic in (family, n, seed) and skips every prompt the caller's leak index
already matches (`tools.data.leak.ReferenceIndex`), adding each accepted prompt to it: the pools of a world
(battles, suites, training data, truth samples) are disjoint under the same audit the agent's dataset
builders run.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Callable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from core.chat import Message
from evals import synthetic
from evals.synthetic import FINISH, Family
from evals.types import Item
from tools.data.leak import Reference, ReferenceIndex, prompt_text

WorldFamily = Literal["letter_count", "word_count", "digit_sum", "long_division", "arithmetic_chain",
                      "string_edit", "json_format", "follow_up"]
WORLD_FAMILIES: tuple[WorldFamily, ...] = (*synthetic.FAMILIES, "json_format", "follow_up")
# Bases of the derived families: single-number answers, so JSON and follow-up arithmetic apply.
NUMERIC_BASES: tuple[Family, ...] = ("letter_count", "word_count", "digit_sum", "arithmetic_chain")
JSON_INSTRUCTION = 'Reply with only a JSON object whose "answer" key holds the result.'
_FOLLOW_OPS = {"add": ("Now add {k} to that.", "+"), "subtract": ("Now subtract {k} from that.", "-"),
               "multiply": ("Now multiply that by {k}.", "×")}


class WorldTask(BaseModel):
    """One world prompt with its gold answer and a correct worked reference answer."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(description="Stable id: '<family>/<16 hex of the conversation's sha256>'.")
    family: WorldFamily = Field(description="Task family.")
    messages: tuple[Message, ...] = Field(description="The conversation to answer; the last turn is the user's.")
    gold: str = Field(description="The correct final answer, in the form the checker compares.")
    reference: str = Field(description="A correct worked answer (an SFT target), ending in the answer.")

    def item(self, prefix: str) -> Item:
        """The task as an eval item with id '<prefix>/<id>'."""
        return Item(id=f"{prefix}/{self.id}", messages=self.messages, gold=self.gold)

    def prompt(self) -> str:
        """The audited prompt text (user turns), as tools.data.leak sees it."""
        return prompt_text([m.model_dump() for m in self.messages])


class Solved(BaseModel):
    """What a prompt asks, read back from its text."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    family: WorldFamily = Field(description="The family the prompt belongs to.")
    gold: str = Field(description="The correct final answer.")
    reference: str = Field(description="A correct worked answer.")


# ---- solving a base prompt (the six synthetic families) ------------------------------------------

def _letter_count(m: re.Match) -> tuple[str, str]:
    letter, phrase = m["letter"], m["phrase"]
    k = phrase.count(letter)
    spelled = " / ".join("-".join(c.upper() if c == letter else c for c in w) for w in phrase.split())
    return str(k), f'Spelled out, with each "{letter}" in capitals: {spelled}.\nAnswer: {k}'


def _word_count(m: re.Match) -> tuple[str, str]:
    ws = m["sentence"].split()
    numbered = ", ".join(f"{i} {w}" for i, w in enumerate(ws, start=1))
    return str(len(ws)), f"Numbering the words: {numbered}.\nAnswer: {len(ws)}"


def _digit_sum(m: re.Match) -> tuple[str, str]:
    digits = [int(c) for c in m["n"]]
    return str(sum(digits)), f"{' + '.join(map(str, digits))} = {sum(digits)}.\nAnswer: {sum(digits)}"


def _long_division(m: re.Match) -> tuple[str, str]:
    a, b = int(m["a"]), int(m["b"])
    q, r = divmod(a, b)
    gold = f"{q} remainder {r}"
    return gold, f"{b} × {q} = {b * q}, and {a} - {b * q} = {r}.\nAnswer: {gold}"


_STEP = re.compile(r"(add|subtract|times) (\d+)")
_STEP_FN: dict[str, tuple[Callable[[int, int], int], str]] = {
    "add": (lambda x, k: x + k, "+"), "subtract": (lambda x, k: x - k, "-"), "times": (lambda x, k: x * k, "×")}


def _arithmetic_chain(m: re.Match) -> tuple[str, str] | None:
    steps = [s.strip() for s in m["steps"].split(",")]
    parsed = [_STEP.fullmatch(s.lower()) for s in steps]
    if not steps or any(p is None for p in parsed):
        return None
    x, lines = int(m["start"]), []
    for p in parsed:
        fn, sym = _STEP_FN[p.group(1)]
        k = int(p.group(2))
        lines.append(f"{x} {sym} {k} = {fn(x, k)}")
        x = fn(x, k)
    return str(x), "\n".join(lines) + f"\nAnswer: {x}"


def _reverse(m: re.Match) -> tuple[str, str]:
    gold = m["text"][::-1]
    return gold, f"Reversed: {gold}\nAnswer: {gold}"


def _remove(m: re.Match) -> tuple[str, str]:
    gold = m["text"].replace(m["letter"], "")
    return gold, f'Without "{m["letter"]}": {gold}\nAnswer: {gold}'


def _replace(m: re.Match) -> tuple[str, str]:
    letter, new = m["letter"], m["new"]
    gold = m["text"].replace(letter, new)
    return gold, f'With each "{letter}" replaced by "{new}": {gold}\nAnswer: {gold}'


_BASES: tuple[tuple[Family, re.Pattern, Callable[[re.Match], tuple[str, str] | None]], ...] = (
    ("letter_count", re.compile(r'How many times does the letter "(?P<letter>.)" appear in "(?P<phrase>[^"]+)"\?'),
     _letter_count),
    ("word_count", re.compile(r'How many words are in this sentence: "(?P<sentence>[^"]+)"\?'), _word_count),
    ("digit_sum", re.compile(r"What is the sum of the digits of (?P<n>\d+)\?"), _digit_sum),
    ("long_division", re.compile(r"Divide (?P<a>\d+) by (?P<b>[1-9]\d*)\. Give the quotient and the remainder\."),
     _long_division),
    ("arithmetic_chain", re.compile(r"Start with (?P<start>-?\d+)\. (?P<steps>[^.]+)\."), _arithmetic_chain),
    ("string_edit", re.compile(r'Write "(?P<text>[^"]+)" backwards, letter by letter\.'), _reverse),
    ("string_edit", re.compile(r'Remove every "(?P<letter>.)" from "(?P<text>[^"]+)"\.'), _remove),
    ("string_edit", re.compile(r'Replace every "(?P<letter>.)" with "(?P<new>.)" in "(?P<text>[^"]+)"\.'), _replace),
)


def _solve_base(question: str) -> tuple[Family, str, str] | None:
    """(family, gold, reference) of a synthetic question without its closing instruction."""
    for family, pattern, solver in _BASES:
        m = pattern.fullmatch(question)
        if m is not None:
            solved = solver(m)
            return None if solved is None else (family, *solved)
    return None


def _solve_turn(text: str) -> Solved | None:
    """A single-turn world prompt: a base question closed by FINISH or by the JSON instruction."""
    for suffix, fmt in ((f" {FINISH}", False), (f" {JSON_INSTRUCTION}", True)):
        if text.endswith(suffix):
            base = _solve_base(text[: -len(suffix)])
            if base is None or (fmt and base[0] not in NUMERIC_BASES):
                return None
            family, gold, reference = base
            if fmt:
                return Solved(family="json_format", gold=gold, reference=json.dumps({"answer": int(gold)}))
            return Solved(family=family, gold=gold, reference=reference)
    return None


_FOLLOW = re.compile(r"Now (?:(?P<op>add) (?P<k1>\d+) to that|(?P<op2>subtract) (?P<k2>\d+) from that|"
                     r"(?P<op3>multiply) that by (?P<k3>\d+))\.")
_TURN = re.compile(r"\[(user|assistant)\]\n")


def _turns(text: str) -> list[tuple[str, str]]:
    """The (role, content) blocks of a judged multi-turn prompt (evals.judge.judged_prompt's layout)."""
    marks = list(_TURN.finditer(text))
    if not marks or marks[0].start() != 0:
        return []
    ends = [m.start() for m in marks[1:]] + [len(text)]
    return [(m.group(1), text[m.end():end].removesuffix("\n\n")) for m, end in zip(marks, ends, strict=True)]


def _follow_up(first: str, follow: str) -> Solved | None:
    base = _solve_turn(first)
    m = _FOLLOW.fullmatch(follow)
    if base is None or m is None or base.family not in NUMERIC_BASES:
        return None
    op = m["op"] or m["op2"] or m["op3"]
    k = int(m["k1"] or m["k2"] or m["k3"])
    x = int(base.gold)
    y = {"add": x + k, "subtract": x - k, "multiply": x * k}[op]
    return Solved(family="follow_up", gold=str(y), reference=f"{x} {_FOLLOW_OPS[op][1]} {k} = {y}.\nAnswer: {y}")


def solve(text: str) -> Solved | None:
    """What a world prompt asks (text as the judge reads it); None for text that is not a world prompt.

    A follow-up is solved from its own first question, not from the earlier assistant answer shown: the
    world's conversations carry a correct earlier answer, and the gold must not depend on that text."""
    turns = _turns(text)
    if not turns:
        return _solve_turn(text)
    roles = [r for r, _ in turns]
    if roles != ["user", "assistant", "user"]:
        return None
    return _follow_up(turns[0][1], turns[2][1])


# ---- grading -------------------------------------------------------------------------------------

def answer_of(solved: Solved, text: str) -> str | None:
    """The final answer a reply gives, in the gold's form; None when none can be read."""
    if solved.family == "json_format":
        try:
            obj = json.loads(text.strip())
        except json.JSONDecodeError:
            return None
        value = obj.get("answer") if isinstance(obj, dict) else None
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else None
    family: Family = "digit_sum" if solved.family == "follow_up" else solved.family
    return synthetic.extract(family, text)


def is_correct(solved: Solved, text: str) -> bool:
    return answer_of(solved, text) == solved.gold


# ---- drawing disjoint pools ----------------------------------------------------------------------

def _task(family: WorldFamily, messages: list[Message], gold: str, reference: str) -> WorldTask:
    digest = hashlib.sha256(json.dumps([m.model_dump() for m in messages]).encode()).hexdigest()[:16]
    return WorldTask(id=f"{family}/{digest}", family=family, messages=tuple(messages), gold=gold, reference=reference)


# Short words and small numbers: the world's tasks are sized for a ~1M-parameter model, which at
# evals.synthetic's sizes (12-digit sums, 6-step chains) scored near 0% on every family but letter counts.
_WORDS = (
    "cat dog sun hat pen cup box map egg owl fox bee ant cow pig hen ice oak jar key kite lamp moon nest "
    "rose star tree boat cake door fish frog gold king leaf milk rain ring sand ship snow sock tent wind "
    "apple bread chair cloud grape horse lemon mango melon onion pearl plant river stone table tiger water"
).split()
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _phrase(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(lo, hi)))


def _q_letter_count(rng: random.Random) -> str:
    phrase = _phrase(rng, 1, 2)
    present = sorted(set(phrase.replace(" ", "")))
    letter = rng.choice(present) if rng.random() < 0.8 else rng.choice(_LETTERS)
    return f'How many times does the letter "{letter}" appear in "{phrase}"?'


def _q_word_count(rng: random.Random) -> str:
    return f'How many words are in this sentence: "{_phrase(rng, 2, 6)}"?'


def _q_digit_sum(rng: random.Random) -> str:
    return f"What is the sum of the digits of {rng.randint(10, 9999)}?"


def _q_long_division(rng: random.Random) -> str:
    b = rng.randint(2, 9)
    return f"Divide {rng.randint(b, 199)} by {b}. Give the quotient and the remainder."


def _q_arithmetic_chain(rng: random.Random) -> str:
    steps = []
    for _ in range(rng.randint(1, 2)):
        op = rng.choice(("add", "subtract", "times"))
        steps.append(f"{op} {rng.randint(2, 5) if op == 'times' else rng.randint(1, 20)}")
    return f"Start with {rng.randint(1, 20)}. {', '.join(steps).capitalize()}."


def _q_string_edit(rng: random.Random) -> str:
    word = rng.choice(_WORDS)
    kind = rng.choice(("reverse", "remove", "replace"))
    # Removing a letter must leave something (a one-letter word would give an empty gold).
    removable = sorted(c for c in set(word) if word.replace(c, ""))
    if kind == "reverse" or not removable:
        return f'Write "{word}" backwards, letter by letter.'
    letter = rng.choice(removable)
    if kind == "remove":
        return f'Remove every "{letter}" from "{word}".'
    new = rng.choice([c for c in _LETTERS if c != letter])
    return f'Replace every "{letter}" with "{new}" in "{word}".'


_QUESTIONS: dict[Family, Callable[[random.Random], str]] = {
    "letter_count": _q_letter_count, "word_count": _q_word_count, "digit_sum": _q_digit_sum,
    "long_division": _q_long_division, "arithmetic_chain": _q_arithmetic_chain, "string_edit": _q_string_edit,
}
# Bases of follow-ups: questions of 13+ words, so no single-turn prompt of 8-12 words (an arithmetic
# chain) can sit whole inside a follow-up conversation and trip the leak audit across splits.
FOLLOW_BASES: tuple[Family, ...] = ("letter_count", "word_count", "digit_sum")


def _single(family: WorldFamily, text: str) -> WorldTask:
    solved = _solve_turn(text)
    return _task(family, [Message(role="user", content=text)], solved.gold, solved.reference)


def _new_task(family: WorldFamily, rng: random.Random) -> WorldTask:
    """One task of a family, drawn from `rng`; gold and reference come from the solver (one source)."""
    if family in _QUESTIONS:
        return _single(family, f"{_QUESTIONS[family](rng)} {FINISH}")
    if family == "json_format":
        return _single(family, f"{_QUESTIONS[rng.choice(NUMERIC_BASES)](rng)} {JSON_INSTRUCTION}")
    first = _single(family, f"{_QUESTIONS[rng.choice(FOLLOW_BASES)](rng)} {FINISH}")
    op = rng.choice(sorted(_FOLLOW_OPS))
    k = rng.randint(2, 5) if op == "multiply" else rng.randint(1, 20)
    follow = _FOLLOW_OPS[op][0].format(k=k)
    solved = _follow_up(first.messages[0].content, follow)
    messages = [first.messages[0], Message(role="assistant", content=first.reference),
                Message(role="user", content=follow)]
    return _task(family, messages, solved.gold, solved.reference)


def draw(family: WorldFamily, n: int, seed: int, index: ReferenceIndex, source: str) -> list[WorldTask]:
    """`n` tasks of one family that the index does not match; each accepted prompt is added to it."""
    rng = random.Random(f"world:{family}:{seed}")
    out: list[WorldTask] = []
    for _ in range(50 * n):  # redraw prompts the index matches instead of returning fewer
        if len(out) == n:
            break
        task = _new_task(family, rng)
        if index.match(0, task.prompt()) is not None:
            continue
        index.add(Reference(source=source, key=task.id, text=task.prompt()))
        out.append(task)
    if len(out) < n:
        raise ValueError(f"world: family {family} gave only {len(out)} prompts disjoint from the rest, {n} asked")
    return out


def hash_seed(*parts: object) -> int:
    """A 63-bit seed derived from any parts (stages of a world draw from seeds derived apart)."""
    return int(hashlib.sha256(":".join(map(str, parts)).encode()).hexdigest()[:15], 16)


def draw_mix(n: int, seed: int, index: ReferenceIndex, source: str,
             families: tuple[WorldFamily, ...] = WORLD_FAMILIES) -> list[WorldTask]:
    """`n` tasks spread evenly over `families` (the first n % len get one more), interleaved by family."""
    per = [n // len(families) + (i < n % len(families)) for i in range(len(families))]
    pools = [draw(f, k, hash_seed(seed, source, f), index, source) for f, k in zip(families, per, strict=True)]
    return [pool[i] for i in range(max(per)) for pool in pools if i < len(pool)]
