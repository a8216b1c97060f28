"""Reward-proxy scorer: a local reward model compares the candidate's answer with the recorded one.

The reward model is a sequence-classification checkpoint with one output (the `reward_model` path of
lab.toml; `core.tiny.build_reward_model` builds a tiny one). Both answers are rendered as full
conversations by the one renderer without a system prompt, so they differ only in the answer, and tokenized
by it too (`core.chat.render`): a special token's text inside the public's prompt or answer (`<|im_end|>`) is split
into ordinary tokens, never read as the reward model's control token. Per
item: `win` = 1 if the candidate's reward beats the recorded answer's (0.5 on a tie, 0 otherwise)
and `margin` = reward(candidate) - reward(recorded). A proxy, not a human vote: report it as such.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel
from transformers import PreTrainedTokenizerBase as Tokenizer

from core import loading
from core.chat import render
from evals.types import Completion, Item, Outcome, check_aligned


@dataclass(frozen=True)
class RewardModel:
    """A loaded scalar reward model."""

    model: PreTrainedModel
    tokenizer: Tokenizer
    device: torch.device


def load(path: str | Path, device: str = "cpu", dtype: str = "float32") -> RewardModel:
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: not a reward-model directory (no config.json)")
    model = loading.load_sequence_classifier(path, dtype=getattr(torch, dtype))
    if model.config.num_labels != 1:
        raise ValueError(f"{path}: a reward model has one output, this one has {model.config.num_labels}")
    return RewardModel(model=model.to(device).eval(), tokenizer=loading.load_tokenizer(path),
                       device=torch.device(device))


def conversation_ids(tokenizer: Tokenizer, item: Item, answer: str) -> list[int]:
    """Token ids of the (prompt, answer) conversation in the reward model's own chat template (ChatML when it has
    none), special tokens only where the template wrote them (core.chat's one rule for the public's text)."""
    return render(tokenizer, [*item.messages, {"role": "assistant", "content": answer}]).input_ids


def rewards(rm: RewardModel, items: list[Item], answers: list[str], batch_size: int = 16) -> list[float]:
    """The scalar reward of each (prompt, answer) conversation."""
    rows = [{"input_ids": conversation_ids(rm.tokenizer, item, answer)}
            for item, answer in zip(items, answers, strict=True)]
    out: list[float] = []
    for start in range(0, len(rows), batch_size):
        # Right padding: the classification head reads the last non-pad token of each row.
        enc = rm.tokenizer.pad(rows[start:start + batch_size], padding=True, padding_side="right",
                               return_tensors="pt").to(rm.device)
        with torch.inference_mode():
            out.extend(rm.model(**enc).logits[:, 0].float().tolist())
    return out


def score(items: list[Item], completions: list[Completion], rm: RewardModel) -> list[Outcome]:
    """Per item: win (1 / 0.5 / 0) of the candidate over the recorded answer, and the reward margin."""
    check_aligned(items, completions)
    missing = [item.id for item in items if item.battle is None]
    if missing:
        raise ValueError(f"reward-proxy items without a recorded battle answer: {missing[:5]}")
    reference = [item.battle.recorded or item.battle.chosen for item in items]
    cand = rewards(rm, items, [c.text for c in completions])
    ref = rewards(rm, items, reference)
    outcomes = []
    for item, c, r in zip(items, cand, ref, strict=True):
        win = 1.0 if c > r else (0.5 if c == r else 0.0)
        outcomes.append(Outcome(item_id=item.id, label={1.0: "win", 0.5: "tie", 0.0: "loss"}[win],
                                values={"win": win, "margin": c - r}))
    return outcomes
