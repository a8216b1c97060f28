"""The language-model head and its losses without float32 logits for every position.

A plain forward returns logits [B, T, V]: at batch 2 x 4096 and a 131k vocabulary that is 4.3 GB in float32, more
again for log_softmax and its gradient. Here the head runs only at supervised positions (the N positions whose
next token carries loss), in chunks of `chunk` positions, each under activation checkpointing: forward keeps one
[chunk, V] block at a time and stores only the chunk's inputs; backward recomputes one block at a time (the
torchtune "chunked output" recipe, arXiv 2404.14219-style chunking; Liger's fused linear cross-entropy does the
same in one kernel).

How the head is reached: for the duration of one forward, the model's output-embedding module (lm_head; the peft
ModulesToSaveWrapper when the head trains under LoRA) gets an instance-level `forward` that receives the final
hidden states and returns the per-position results. The head therefore still runs inside the model's own forward,
which is what FSDP2 needs: the root unit's weights (the head included) are gathered during that forward and
again when backward reaches it. Parameter names, state dicts and hooks are untouched.

Each function returns values at the supervised positions in row-major order, with `rows` (the row of each).
The positions can be found on the host before the batch moves to the GPU (`Positions.of(cpu_batch).to(device)`):
the hidden states are then gathered by index, and nothing in the forward waits for the GPU to say how many
positions there are (a boolean-mask selection on the GPU is such a wait, with the GPU idle while the host
launches what follows).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from trainers.batch import Batch


@dataclass(frozen=True)
class Positions:
    """Which next-token predictions carry loss: `index` of each of the N into the flattened [B, T] hidden states,
    `rows` the row of each, `targets` the token each predicts."""

    index: torch.Tensor
    rows: torch.Tensor
    targets: torch.Tensor

    @classmethod
    def of(cls, batch: Batch) -> Positions:
        select = batch.loss_mask > 0
        rows, cols = select.nonzero(as_tuple=True)
        width = batch.input_ids.shape[1]
        return cls(rows * width + cols, rows, batch.input_ids[rows, cols + 1])

    @property
    def count(self) -> int:
        return self.index.shape[0]

    def to(self, device: torch.device) -> Positions:
        return Positions(self.index.to(device), self.rows.to(device), self.targets.to(device))

    def gather(self, hidden: torch.Tensor) -> torch.Tensor:
        """The hidden states [B, T, d] at the N positions: [N, d]."""
        return hidden.reshape(-1, hidden.shape[-1]).index_select(0, self.index)

    def per_row(self, values: torch.Tensor, n_rows: int) -> torch.Tensor:
        """Sums per-position values into their rows: [N] -> [B]."""
        return torch.zeros(n_rows, dtype=values.dtype, device=values.device).index_add(0, self.rows, values)


@contextmanager
def _head_returns(model: torch.nn.Module, fn: Callable) -> Iterator[Callable]:
    """Inside, the head's forward is `fn(hidden, head_forward)`; yields the head's own forward."""
    head = model.get_output_embeddings()
    own = head.forward
    head.forward = lambda hidden: fn(hidden, own)
    try:
        yield own
    finally:
        del head.forward


def _forward(model, batch: Batch):
    return model(**batch.model_inputs()).logits


def _chunks(n: int, chunk: int) -> list[slice]:
    return [slice(s, min(s + chunk, n)) for s in range(0, n, chunk)]


def _logp_chunk(head: Callable, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = head(hidden).float()
    return logits.gather(-1, targets[:, None])[:, 0] - logits.logsumexp(-1)


def token_logprobs(model, batch: Batch, chunk: int, pos: Positions | None = None) -> tuple[torch.Tensor, Positions]:
    """log p(target) at each supervised position [N] (float32), computed chunk by chunk; `pos`: the batch's
    positions when found already (on the host, before the batch moved)."""
    pos = pos if pos is not None else Positions.of(batch)

    def head_fn(hidden, head):
        h = pos.gather(hidden)
        return torch.cat([checkpoint(_logp_chunk, head, h[s], pos.targets[s], use_reentrant=False)
                          for s in _chunks(h.shape[0], chunk)] or [h.new_zeros(0, dtype=torch.float32)])

    with _head_returns(model, head_fn):
        return _forward(model, batch), pos


def sequence_logprobs(model, batch: Batch, chunk: int, pos: Positions | None = None) -> torch.Tensor:
    """Summed log-probability of each row's supervised tokens: [B]."""
    logp, pos = token_logprobs(model, batch, chunk, pos)
    return pos.per_row(logp, batch.input_ids.shape[0])


def supervised_hidden(model, batch: Batch) -> torch.Tensor:
    """The final hidden states at the supervised positions [N, d], with the head skipped (a frozen parent's
    input to `ce_and_kl`)."""
    pos = Positions.of(batch)
    with _head_returns(model, lambda hidden, _head: pos.gather(hidden)):
        return _forward(model, batch)


def _ce_kl_chunk(head: Callable, parent_head: Callable, hidden, parent_hidden, targets):
    logp = F.log_softmax(head(hidden).float(), -1)
    with torch.no_grad():
        parent_logp = F.log_softmax(parent_head(parent_hidden).float(), -1)
    ce = -logp.gather(-1, targets[:, None])[:, 0]
    kl = (parent_logp.exp() * (parent_logp - logp)).sum(-1)  # KL(parent || policy), full vocabulary
    return torch.stack([ce, kl], -1)


def ce_and_kl(model, batch: Batch, parent_hidden: torch.Tensor, parent_head: Callable | None,
              chunk: int) -> tuple[torch.Tensor, torch.Tensor, Positions]:
    """Per supervised position: cross-entropy of the target and forward KL(parent || policy), each [N].

    `parent_hidden` is the parent's `supervised_hidden` for the same batch; `parent_head` maps it to the parent's
    logits (None: the policy's own head, frozen, when the parent differs only by a LoRA adapter)."""
    pos = Positions.of(batch)

    def head_fn(hidden, head):
        h = pos.gather(hidden)
        theirs = parent_head or head
        return torch.cat([checkpoint(_ce_kl_chunk, head, theirs, h[s], parent_hidden[s], pos.targets[s],
                                     use_reentrant=False) for s in _chunks(h.shape[0], chunk)])

    with _head_returns(model, head_fn):
        out = _forward(model, batch)
    return out[:, 0], out[:, 1], pos


def frozen_head(head: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """A callable for a frozen model's head usable outside that model's forward: its weight gathered once when
    the model is FSDP-sharded (one [V, d] copy per rank)."""
    from torch.distributed.tensor import DTensor

    weight = head.weight.full_tensor() if isinstance(head.weight, DTensor) else head.weight
    bias = head.bias
    if isinstance(bias, DTensor):
        bias = bias.full_tensor()
    weight, bias = weight.detach(), None if bias is None else bias.detach()
    return lambda hidden: F.linear(hidden.to(weight.dtype), weight, bias)
