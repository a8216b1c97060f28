"""The shared records of evaluation: an item of a suite, a generated completion, a scored outcome.

Every scorer is a plain function `(items, completions) -> list[Outcome]`; a suite's metrics are the
means over items of each per-item value, so paired statistics can line two models up item by item.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from core.chat import Message
from core.ids import checked_id
from evals.constraint_rules import Constraint


class Battle(BaseModel):
    """A recorded side-by-side battle for the prompt of an item (holdout feedback)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    chosen: str = Field(description="The answer the human preferred.")
    rejected: str = Field(description="The answer the human did not prefer.")
    recorded: str = Field(
        "", description="The served model's own recorded answer (reward-proxy reference); chosen if empty."
    )


class Item(BaseModel):
    """One prompt of a suite with whatever its scorer needs to judge an answer."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(description="Stable item id, unique within its suite (a short printable token: core/ids.py).")
    messages: tuple[Message, ...] = Field(min_length=1, description="The conversation to answer; last turn is the user's.")
    gold: str | None = Field(None, description="Reference answer (math expression, MCQ letter).")
    choices: tuple[str, ...] = Field((), description="MCQ options, in letter order A, B, C...")
    constraints: tuple[Constraint, ...] = Field((), description="Instruction-following constraints to check.")
    battle: Battle | None = Field(None, description="The recorded battle for this prompt, for battle suites.")

    @field_validator("id")
    @classmethod
    def _id_is_a_token(cls, v: str) -> str:
        # An item id is public text stored and shown everywhere: a short printable token (core/ids.py).
        return checked_id(v)

    @model_validator(mode="after")
    def _last_turn_is_user(self) -> Item:
        if self.messages[-1].role != "user":
            raise ValueError(f"item {self.id}: the last message must be the user's, got {self.messages[-1].role}")
        return self

    @property
    def prompt(self) -> str:
        """The last user turn's text (what constraint checks such as repeat-the-request look at)."""
        return self.messages[-1].content


class Completion(BaseModel):
    """What the generation engine produced for one item under one decoding and seed."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    item_id: str = Field(description="The item this answers.")
    text: str = Field(description="Decoded answer text, stop token excluded.")
    n_tokens: int = Field(ge=0, description="Generated tokens, stop token included if one was produced.")
    stopped: bool = Field(description="Generation ended on one of the stop token ids.")
    truncated: bool = Field(description="Generation hit max_new_tokens without a stop token.")
    empty: bool = Field(description="The answer text is empty after stripping whitespace.")
    has_replacement_char: bool = Field(description="The text contains U+FFFD (broken byte decoding).")

    @model_validator(mode="after")
    def _stop_xor_truncated(self) -> Completion:
        if self.stopped and self.truncated:
            raise ValueError(f"completion {self.item_id}: cannot be both stopped and truncated")
        return self


def completion_from_text(item_id: str, text: str, n_tokens: int, stopped: bool) -> Completion:
    """Build a Completion with the derived flags computed once, here."""
    return Completion(
        item_id=item_id,
        text=text,
        n_tokens=n_tokens,
        stopped=stopped,
        truncated=not stopped,
        empty=not text.strip(),
        has_replacement_char="\ufffd" in text,
    )


class Outcome(BaseModel):
    """One item's score: per-metric values (a missing metric means not scorable, never guessed)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    item_id: str = Field(description="The item scored.")
    label: str = Field(description="Short class of the outcome, e.g. correct / wrong / unparsed / timeout.")
    values: dict[str, float] = Field(description="Per-item metric values; a suite metric is their mean over items.")
    reasons: tuple[str, ...] = Field((), description="Why the label was given (failed checks, loop evidence).")


def check_aligned(items: list[Item], completions: list) -> None:
    """Scorers pair items and completions by position; refuse a misaligned pair of lists."""
    if len(items) != len(completions):
        raise ValueError(f"{len(items)} items but {len(completions)} completions")
    for item, comp in zip(items, completions, strict=True):
        if item.id != comp.item_id:
            raise ValueError(f"item {item.id} is paired with a completion for {comp.item_id}")


def suite_metrics(outcomes: list[Outcome]) -> dict[str, float]:
    """Mean of each per-item value over the items that have it, plus `n_<metric>` counts."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for out in outcomes:
        for name, value in out.values.items():
            sums[name] = sums.get(name, 0.0) + value
            counts[name] = counts.get(name, 0) + 1
    metrics = {name: sums[name] / counts[name] for name in sums}
    metrics.update({f"n_{name}": float(counts[name]) for name in counts})
    return metrics
