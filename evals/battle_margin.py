"""Battle-margin scorer: does the model's own likelihood prefer the answer the human preferred?

For each holdout battle, the summed log-probability of the chosen and of the rejected answer given
the prompt (rendered by the one renderer at the served system prompt) is measured by the engine;
the item scores `prefers_chosen` = 1 if chosen > rejected (0.5 on an exact tie) and `margin` =
logp(chosen) - logp(rejected). This is the implicit preference that DPO trains (Rafailov et al.
2023, arXiv:2305.18290, with the reference model's terms left out), read without generating.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from evals.decoding import Decoding
from evals.generate import Loaded, answer_logprobs
from evals.types import Item, Outcome, check_aligned


class BattleLogprobs(BaseModel):
    """Summed answer log-probabilities of one battle under the evaluated model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    item_id: str = Field(description="The battle item.")
    chosen: float = Field(description="Summed log-prob of the human-preferred answer.")
    rejected: float = Field(description="Summed log-prob of the other answer.")


def _battles(items: list[Item]) -> None:
    missing = [item.id for item in items if item.battle is None]
    if missing:
        raise ValueError(f"battle-margin items without a recorded battle: {missing[:5]}")


def measure(loaded: Loaded, items: list[Item], decoding: Decoding) -> list[BattleLogprobs]:
    """Ask the model for both answers' log-probabilities (two batched forward passes)."""
    _battles(items)
    chosen = answer_logprobs(loaded, items, [item.battle.chosen for item in items], decoding)
    rejected = answer_logprobs(loaded, items, [item.battle.rejected for item in items], decoding)
    return [BattleLogprobs(item_id=item.id, chosen=c, rejected=r)
            for item, c, r in zip(items, chosen, rejected, strict=True)]


def score(items: list[Item], logprobs: list[BattleLogprobs]) -> list[Outcome]:
    """Per battle: prefers_chosen (1 / 0.5 / 0) and the log-prob margin."""
    check_aligned(items, logprobs)
    _battles(items)
    outcomes = []
    for lp in logprobs:
        margin = lp.chosen - lp.rejected
        prefers = 1.0 if margin > 0 else (0.5 if margin == 0 else 0.0)
        label = {1.0: "prefers_chosen", 0.5: "tie", 0.0: "prefers_rejected"}[prefers]
        outcomes.append(Outcome(item_id=lp.item_id, label=label,
                                values={"prefers_chosen": prefers, "margin": margin}))
    return outcomes
