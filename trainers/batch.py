"""Collation and log-probabilities shared by the trainers.

Rows become `Encoded` (ids + assistant-only mask, from `core.chat.render`); micro-batches are
right-padded tensors, or, for SFT packing, several rows concatenated in one sequence with position ids
restarting at each row (transformers then builds a block-diagonal causal mask, so no row attends to
another) and, for Mamba models, `seq_idx` numbering the rows (the Mamba state restarts at each row).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedTokenizerBase

from core import chat
from trainers.common import ConfigError


@dataclass(frozen=True)
class Encoded:
    """One tokenized row: ids and the 0/1 loss mask, same length."""

    input_ids: list[int]
    loss_mask: list[int]
    truncated: bool

    @property
    def supervised(self) -> int:
        # Position 0 is never predicted, so its mask value cannot carry loss.
        return sum(self.loss_mask[1:])


@dataclass(frozen=True)
class Batch:
    """Model inputs plus the next-token loss mask (`loss_mask[:, t]` weighs the prediction of token t+1)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor | None
    loss_mask: torch.Tensor
    # Packed Mamba models only: the row index of each token within its pack (int32), passed to the model as
    # `seq_idx` so the Mamba mixers restart their state per row (trainers/mamba_kernels.py).
    seq_idx: torch.Tensor | None = None

    def to(self, device: torch.device) -> Batch:
        def move(t):
            return None if t is None else t.to(device)

        return Batch(move(self.input_ids), move(self.attention_mask), move(self.position_ids), move(self.loss_mask),
                     move(self.seq_idx))

    def model_inputs(self) -> dict[str, torch.Tensor | None | bool]:
        """The keywords of the model's forward for this batch (no KV cache: training and scoring)."""
        extra = {} if self.seq_idx is None else {"seq_idx": self.seq_idx}
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask,
                "position_ids": self.position_ids, "use_cache": False, **extra}

    @property
    def tokens(self) -> int:
        if self.attention_mask is None:
            return int(self.input_ids.numel())
        return int(self.attention_mask.sum())


def encode(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence, system_prompt: str | None, max_len: int
) -> Encoded:
    """Renders a conversation with the one renderer and cuts it at max_len tokens."""
    r = chat.render(tokenizer, messages, system_prompt)
    cut = len(r.input_ids) > max_len
    return Encoded(r.input_ids[:max_len], r.loss_mask[:max_len], cut)


def cut_answer(tokenizer: PreTrainedTokenizerBase, prompt: Sequence, answer: str, *, system_prompt: str | None,
               max_len: int, max_prompt_length: int | None, max_completion_length: int | None) -> Encoded | None:
    """One side of a preference pair: the prompt cut from the left to max_prompt_length, the answer whole (None when
    it is longer than max_completion_length), then the max_len cut on the right as for every row."""
    r = chat.render(tokenizer, [*prompt, {"role": "assistant", "content": answer}], system_prompt)
    start = _answer_start(r.loss_mask)
    ids, mask = r.input_ids, r.loss_mask
    if max_completion_length is not None and sum(mask[start:]) > max_completion_length:
        return None
    cut = max_prompt_length is not None and start > max_prompt_length
    if cut:
        keep = start - max_prompt_length
        ids, mask = ids[keep:], [0] * max_prompt_length + mask[start:]
    over = len(ids) > max_len
    return Encoded(ids[:max_len], mask[:max_len], cut or over)


def _answer_start(mask: list[int]) -> int:
    """Index of the final assistant answer's first token (the last run of supervised tokens)."""
    end = max(i for i, m in enumerate(mask) if m)
    while end > 0 and mask[end - 1]:
        end -= 1
    return end


def check_supervised(encoded: Sequence[Encoded], data_path, max_len: int) -> None:
    """Refuses rows left with no supervised token after the cut at max_len (their loss would be 0/0)."""
    empty = [i + 1 for i, e in enumerate(encoded) if e.supervised == 0]
    if empty:
        raise ConfigError(f"{data_path}: rows {empty[:5]} (1-based) have no assistant token within max_len={max_len}")


def pad_batch(rows: Sequence[Encoded], pad_id: int) -> Batch:
    """Right-padded batch; the loss mask is shifted to line up with next-token predictions."""
    width = max(len(r.input_ids) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, r in enumerate(rows):
        n = len(r.input_ids)
        ids[i, :n] = torch.tensor(r.input_ids)
        attn[i, :n] = 1
        mask[i, :n] = torch.tensor(r.loss_mask, dtype=torch.float32)
    return Batch(ids, attn, None, mask[:, 1:])


def pack_batch(packs: Sequence[Sequence[Encoded]], pad_id: int, seq_idx: bool = False) -> Batch:
    """Each pack is one sequence of concatenated rows with restarting position ids (no attention mask);
    `seq_idx` also numbers the rows of each pack (for Mamba models, whose state must restart per row)."""
    flat = [Encoded(sum((r.input_ids for r in p), []), sum((r.loss_mask for r in p), []), False) for p in packs]
    width = max(len(f.input_ids) for f in flat)
    ids = torch.full((len(flat), width), pad_id, dtype=torch.long)
    pos = torch.zeros((len(flat), width), dtype=torch.long)
    mask = torch.zeros((len(flat), width), dtype=torch.float32)
    for i, (pack, f) in enumerate(zip(packs, flat, strict=True)):
        ids[i, : len(f.input_ids)] = torch.tensor(f.input_ids)
        mask[i, : len(f.loss_mask)] = torch.tensor(f.loss_mask, dtype=torch.float32)
        pos[i, : len(f.input_ids)] = torch.cat([torch.arange(len(r.input_ids)) for r in pack])
        # Padding forms its own trailing segment (positions restart at 0), never attended by real rows.
        pos[i, len(f.input_ids):] = torch.arange(width - len(f.input_ids))
    # A row's first token (a BOS or the first turn's header) is unsupervised, so no loss crosses a row boundary.
    # Row k of a pack starts where its positions restart; the padding tail is one more row.
    rows = torch.cumsum((pos == 0).int(), dim=1, dtype=torch.int32) - 1
    return Batch(ids, None, pos, mask[:, 1:], rows if seq_idx else None)


def pack_rows(rows: Sequence[Encoded], max_len: int) -> list[list[int]]:
    """Greedy in-order packing: indices of rows per pack, each pack at most max_len tokens."""
    packs: list[list[int]] = []
    used = max_len + 1
    for i, r in enumerate(rows):
        if used + len(r.input_ids) > max_len:
            packs.append([])
            used = 0
        packs[-1].append(i)
        used += len(r.input_ids)
    return packs


def logits(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """Next-token logits [B, T-1, V] in FP32."""
    return model(**batch.model_inputs()).logits[:, :-1].float()


def token_logprobs(step_logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """log p(token t+1 | prefix) for every position: [B, T-1]."""
    return -F.cross_entropy(step_logits.transpose(1, 2), input_ids[:, 1:], reduction="none")


def sequence_logprobs(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """Summed log-probability of the supervised tokens of each row: [B]."""
    logp = token_logprobs(logits(model, batch), batch.input_ids)
    return (logp * batch.loss_mask).sum(-1)
