"""Cross-entropy with a KL leash to the frozen parent: `KLCEConfig` and the `train` job.

Over the supervised positions S of an optimizer step (assistant content + end-of-turn token of every
row), with C the positions of rows that are not replay (`kl_only` false):

    L = ( sum_{t in C} -log pi(y_t | x_<t)  +  kl_coef * sum_{t in S} KL(p_parent(. | x_<t) || pi(. | x_<t)) ) / |S|

The KL is the full-distribution forward KL from the parent (all vocabulary entries, not a sampled
token), the distillation term of Hinton et al. 2015 ("Distilling the Knowledge in a Neural
Network") used here as a leash: replay rows (the parent's own answers, `kl_only`) carry only it,
so they hold the policy near the parent without one-hot targets.

Why in-house: TRL has no trainer for per-row CE/KL masks against a frozen parent; this is the
`compute_loss` override the issue mentions, written as an objective of the shared loop.

Command:

    .venv/bin/python -m trainers.klce CONFIG.json
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator

from trainers import data_cache, losses
from trainers.batch import Encoded, check_supervised, pad_batch
from trainers.common import (
    TrainConfig,
    TrainResult,
    check_lora_targets,
    finished_result,
    load_frozen,
    load_tokenizer,
)
from trainers.loop import MicroLoss, run_job
from trainers.rows import KLCERow, read_rows


class KLCEConfig(TrainConfig):
    """KL-leashed cross-entropy; data rows are `trainers.rows.KLCERow`."""

    kl_coef: float = Field(0.1, ge=0, description="Weight of the forward KL to the parent on all supervised tokens.")
    parent_path: Path | None = Field(None, description="Frozen parent model directory; None = model_path.")

    kl_to_parent: ClassVar[bool] = True

    def separate_parent(self) -> Path | None:
        """A LoRA policy whose parent is its own base reads the parent through its disabled adapter: no second copy."""
        if self.lora is not None and self.parent_path in (None, self.model_path):
            return None
        return self.parent_path or self.model_path

    @model_validator(mode="after")
    def _parent_exists(self) -> KLCEConfig:
        if self.parent_path is not None and not (self.parent_path / "config.json").is_file():
            raise ValueError(f"parent_path: {self.parent_path} has no config.json")
        return self


def forward_kl(parent_logits: torch.Tensor, policy_logits: torch.Tensor) -> torch.Tensor:
    """KL(parent || policy) per position over the full vocabulary: [B, T]."""
    parent_logp = F.log_softmax(parent_logits, dim=-1)
    policy_logp = F.log_softmax(policy_logits, dim=-1)
    return (parent_logp.exp() * (parent_logp - policy_logp)).sum(-1)


class KLCEObjective:
    """CE on non-replay rows' assistant tokens + kl_coef * KL to the parent on all of them.

    `parent=None` means the parent is the policy's own base weights: a LoRA policy with its adapter
    (and trainable lm_head copy) switched off, so no second copy of the model is held in memory.
    """

    def __init__(self, encoded: list[Encoded], kl_only: list[bool], parent, pad_id: int, kl_coef: float,
                 chunk: int = 1024):
        self.encoded, self.kl_only, self.parent = encoded, kl_only, parent
        self.pad_id, self.kl_coef, self.chunk = pad_id, kl_coef, chunk
        self.n_rows = len(encoded)
        # A separate parent's head is called outside that model's forward: gathered once if it is sharded.
        self.parent_head = None if parent is None else losses.frozen_head(parent.get_output_embeddings())

    def normalizer(self, rows: list[int]) -> float:
        return float(sum(self.encoded[i].supervised for i in rows))

    def loss(self, model, rows: list[int], normalizer: float) -> MicroLoss:
        batch = pad_batch([self.encoded[i] for i in rows], self.pad_id).to(model.device)
        with torch.no_grad():
            parent_hidden, parent_head = self._parent(model, batch)
        # Head and losses at supervised positions only, in chunks (trainers/losses.py): no [B, T, V] logits.
        ce, kl, pos = losses.ce_and_kl(model, batch, parent_hidden, parent_head, self.chunk)
        ce_rows = torch.tensor([0.0 if self.kl_only[i] else 1.0 for i in rows], device=ce.device)[pos.rows]
        ce_sum = (ce * ce_rows).sum()
        kl_sum = kl.sum()
        loss = (ce_sum + self.kl_coef * kl_sum) / normalizer
        metrics = {"ce": float(ce_sum.detach()) / normalizer, "kl": float(kl_sum.detach()) / normalizer}
        return MicroLoss(loss, batch.tokens, int(batch.loss_mask.sum()), metrics)


    def _parent(self, model, batch):
        """The parent's final hidden states at the supervised positions, and the head that maps them to logits."""
        if self.parent is not None:
            return losses.supervised_hidden(self.parent, batch), self.parent_head
        from peft.utils import ModulesToSaveWrapper

        trainable = [p for p in model.parameters() if p.requires_grad]
        with model.disable_adapter():
            hidden = losses.supervised_hidden(model, batch)
        # peft re-enables the head copy's requires_grad through its wrapper, which misses FSDP2's sharded
        # parameters (the adapter then silently stopped training): restore the flags it turned off.
        for p in trainable:
            p.requires_grad_(True)
        head = model.get_output_embeddings()
        # With a trained head copy the parent's head is the wrapper's frozen original; else the shared frozen head.
        return hidden, head.original_module if isinstance(head, ModulesToSaveWrapper) else None


def validate(config: KLCEConfig) -> list[KLCERow]:
    """Every check that can fail before compute: data rows and LoRA targets."""
    rows = read_rows(config.data_path, KLCERow)
    if config.lora is not None:
        check_lora_targets(config.model_path, config.lora)
    return rows


def train(config: KLCEConfig) -> TrainResult:
    """Runs (or resumes, or returns the finished result of) one KL-leashed CE run."""
    rows = validate(config)
    done = finished_result(config)  # a requeued finished job does no compute
    if done is not None:
        return done
    tokenizer = load_tokenizer(config.model_path)
    encoded, _ = data_cache.encoded_rows(rows, config.data_path, config.model_path, config.system_prompt,
                                         config.max_len, "klce")
    check_supervised(encoded, config.data_path, config.max_len)
    # A LoRA policy over the parent's own weights reads the parent by switching its adapter off.
    own_base = config.lora is not None and config.parent_path in (None, config.model_path)
    parent = None if own_base else load_frozen(config.parent_path or config.model_path, config.compute_dtype)
    objective = KLCEObjective(encoded, [r.kl_only for r in rows], parent, tokenizer.pad_token_id, config.kl_coef,
                              config.loss_chunk_tokens)
    return run_job(config, objective, truncated_rows=sum(e.truncated for e in encoded))


def main(argv: list[str] | None = None) -> int:
    """`python -m trainers.klce CONFIG.json`: runs KL-leashed CE with the config file's settings."""
    from core.entry import run_main
    from trainers.common import ConfigError
    from trainers.rows import RowsError

    return run_main("python -m trainers.klce", (KLCEConfig, train), argv, bad_input=(ConfigError, RowsError))


if __name__ == "__main__":
    sys.exit(main())
