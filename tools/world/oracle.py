"""The toy world's oracle: a pairwise judge with a known preference and stated noise.

It is a `evals.judge.Judge` like any other, a callable `(prompt, answer_a, answer_b) -> reply` whose
reply ends in one `VERDICT:` line; lab.toml names it as the world's judge and eval jobs reach it as the
callable `tools.world.oracle:judge`.

Preference (the noise-free oracle, `truth_judge`, which is the world's ground truth): each answer is
graded on the prompt's computed gold (`tools.world.tasks.solve`):

- correct: its final answer equals the gold (the eval checker's reading, `evals.synthetic.extract`; JSON
  requests need a bare JSON object);
- clean: not looping (`evals.loops.loop_flags`), not empty, free of chat markup (an answer that did not
  stop runs on into `<|im_start|>` turns), and ending at its answer: a reply with more than one
  `Answer:` line ran on past it (a parent that fails to stop repeats answer lines, often with other
  numbers, until the token cap: no strict repetition for the loop scorer to flag, yet not stopped).

Grade = 2 x correct + clean. The higher grade wins; equal grades give TIE when both are correct and
BOTH_BAD when both are wrong. A prompt that is not a world prompt gets a reply without a verdict
(recorded as unparsed, never guessed).

Noise (`judge`, what battles and holdout suites are voted with), like people: for each call, with
probability `TIE_RATE` the reply is TIE, with `BOTH_BAD_RATE` it is BOTH_BAD, with `WRONG_RATE` it is a
wrong vote (the other side of a decisive verdict; a random side when the true verdict is TIE or
BOTH_BAD), otherwise the true verdict. The draw is seeded by the sha256 of the call's text, so the
same call always gets the same vote (replay stays exact) while the two orders of a pair and different
answers draw independently.
"""

from __future__ import annotations

import hashlib
import random
import re

from pydantic import BaseModel, ConfigDict, Field

from core.templates import FAMILY
from evals.judge import Verdict
from evals.loops import loop_flags
from tools.world.tasks import Solved, answer_of, solve

# The special tokens of every template family a world can be built on: one of them in an answer is markup.
MARKUP = tuple(sorted({t for fam in FAMILY.values() for t in fam.specials}))

TIE_RATE = 0.05
BOTH_BAD_RATE = 0.05
WRONG_RATE = 0.10
NOISE_SALT = "toy-world-oracle-v1"
_REPLY = {"A": "A", "B": "B", "tie": "TIE", "both_bad": "BOTH_BAD"}
# The final-answer marker as the eval checker reads it (evals.synthetic).
_ANSWER_LINE = re.compile(r"answer\s*[:：]", re.IGNORECASE)


class OracleNoise(BaseModel):
    """The oracle's stated vote noise (recorded in the world's world.json)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    tie_rate: float = Field(TIE_RATE, description="Share of calls answered TIE whatever the answers.")
    both_bad_rate: float = Field(BOTH_BAD_RATE, description="Share of calls answered BOTH_BAD whatever the answers.")
    wrong_rate: float = Field(WRONG_RATE, description="Share of calls given the wrong side (a random side for true ties).")


class Grade(BaseModel):
    """How the oracle sees one answer."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    correct: bool = Field(description="The final answer equals the gold.")
    clean: bool = Field(description="Not looping, not empty, no chat markup.")
    note: str = Field(description="Short human-readable reason.")

    @property
    def score(self) -> int:
        return 2 * self.correct + self.clean


def grade(solved: Solved, answer: str) -> Grade:
    """Correctness and cleanliness of one answer to a solved prompt."""
    given = answer_of(solved, answer)
    correct = given == solved.gold
    problems = []
    if not answer.strip():
        problems.append("empty")
    if any(tok in answer for tok in MARKUP):
        problems.append("chat markup (did not stop)")
    if loop_flags(answer).values["looping"]:
        problems.append("looping")
    elif len(_ANSWER_LINE.findall(answer)) > 1:
        problems.append("runs on past its answer")
    what = "correct" if correct else ("no answer" if given is None else f"wrong ({given!r})")
    return Grade(correct=correct, clean=not problems, note=", ".join([what, *problems]))


def true_verdict(prompt: str, answer_a: str, answer_b: str) -> tuple[Verdict, str] | None:
    """The noise-free verdict and its reason; None when the prompt is not a world prompt."""
    solved = solve(prompt)
    if solved is None:
        return None
    a, b = grade(solved, answer_a), grade(solved, answer_b)
    reason = f"A: {a.note}; B: {b.note}"
    if a.score != b.score:
        return ("A" if a.score > b.score else "B"), reason
    return ("tie" if a.correct else "both_bad"), reason


def noisy(verdict: Verdict, rng: random.Random, noise: OracleNoise) -> Verdict:
    """One draw of the stated noise applied to a true verdict."""
    u = rng.random()
    if u < noise.tie_rate:
        return "tie"
    if u < noise.tie_rate + noise.both_bad_rate:
        return "both_bad"
    if u < noise.tie_rate + noise.both_bad_rate + noise.wrong_rate:
        if verdict in ("A", "B"):
            return "B" if verdict == "A" else "A"
        return rng.choice(("A", "B"))
    return verdict


def _rng(prompt: str, answer_a: str, answer_b: str) -> random.Random:
    digest = hashlib.sha256("\x00".join((NOISE_SALT, prompt, answer_a, answer_b)).encode()).hexdigest()
    return random.Random(int(digest[:16], 16))


def _reply(verdict: Verdict, reason: str) -> str:
    return f"{reason}\nVERDICT: {_REPLY[verdict]}"


def truth_judge(prompt: str, answer_a: str, answer_b: str) -> str:
    """The noise-free oracle (ground truth)."""
    found = true_verdict(prompt, answer_a, answer_b)
    if found is None:
        return "not a toy-world prompt: no verdict"
    return _reply(*found)


def judge(prompt: str, answer_a: str, answer_b: str) -> str:
    """The oracle with its stated noise: the toy world's judge."""
    return judge_with(prompt, answer_a, answer_b, OracleNoise())


def judge_with(prompt: str, answer_a: str, answer_b: str, noise: OracleNoise) -> str:
    """The oracle with the given noise (a world variant's voters, tools/world/variants.py); the same call draws the
    same number whatever the noise, so only the rates decide how often a vote is changed."""
    found = true_verdict(prompt, answer_a, answer_b)
    if found is None:
        return "not a toy-world prompt: no verdict"
    verdict, reason = found
    return _reply(noisy(verdict, _rng(prompt, answer_a, answer_b), noise), reason)
