"""Supervised fine-tuning on assistant turns: `SFTConfig` and the `train` job.

Loss: token-level cross-entropy over the assistant tokens (content + its end-of-turn token) of all rows of an
optimizer step, divided by the number of those tokens (so micro-batching does not change it).

Packing (optional) concatenates rows into sequences of at most `max_len` tokens with position ids
restarting per row; transformers turns that into a block-diagonal causal mask for attention layers.
Nemotron-H packs too where its Mamba mixers run mamba-ssm's Triton SSD kernels (a GPU with the
kernels, trainers/mamba_kernels.py): each pack also carries `seq_idx`, the row of each token, and the
convolution and the scan restart their state at every row. Elsewhere the mixers' PyTorch path takes no
per-sequence boundaries (transformers' reference implementation raises on `seq_idx`), so state would
flow from one row into the next: packing is refused there, as for the other recurrent model types.

Why not TRL's SFTTrainer: its packing does not know about Mamba state either, and the resume
contract (signal-time checkpoint, same final weights) lives in `trainers/loop.py` for all trainers.
TRL is the reference for the loss instead: SFTTrainer with `assistant_only_loss` gives the same mask
and loss on the same rows (tests/trainers/test_trl_reference.py).

Command:

    .venv/bin/python -m trainers.sft CONFIG.json
"""

from __future__ import annotations

import sys

import torch
from pydantic import Field

from core import loading
from trainers import data_cache, losses
from trainers.batch import (
    Encoded,
    check_supervised,
    encode,
    pack_batch,
    pack_rows,
    pad_batch,
)
from trainers.common import (
    ConfigError,
    TrainConfig,
    TrainResult,
    check_lora_targets,
    is_recurrent,
    load_tokenizer,
    packing_keeps_rows_apart,
)
from trainers.loop import MicroLoss, run_job
from trainers.rows import SFTRow, read_rows


class SFTConfig(TrainConfig):
    """Supervised fine-tuning; data rows are `trainers.rows.SFTRow`."""

    packing: bool = Field(False, description="Pack rows into max_len sequences (Mamba/recurrent models: only "
                          "Nemotron-H on a GPU with the Triton SSD kernels; refused elsewhere).")


class SFTObjective:
    """Assistant-only cross-entropy; with packing, a 'row' of the loop is one pack of rows."""

    def __init__(self, encoded: list[Encoded], pad_id: int, packs: list[list[int]] | None, chunk: int = 1024,
                 seq_idx: bool = False):
        self.encoded, self.chunk, self.seq_idx = encoded, chunk, seq_idx
        self.pad_id = pad_id
        self.packs = packs
        self.n_rows = len(packs) if packs is not None else len(encoded)

    def _rows(self, rows: list[int]) -> list[Encoded]:
        if self.packs is None:
            return [self.encoded[i] for i in rows]
        return [self.encoded[j] for i in rows for j in self.packs[i]]

    def normalizer(self, rows: list[int]) -> float:
        return float(sum(r.supervised for r in self._rows(rows)))

    def batch(self, rows: list[int]):
        if self.packs is None:
            return pad_batch(self._rows(rows), self.pad_id)
        return pack_batch([[self.encoded[j] for j in self.packs[i]] for i in rows], self.pad_id, self.seq_idx)

    def loss(self, model: torch.nn.Module, rows: list[int], normalizer: float) -> MicroLoss:
        # Positions and counts from the host copy: the forward then never waits on the GPU (trainers/losses.py).
        host = self.batch(rows)
        pos = losses.Positions.of(host)
        batch = host.to(model.device)
        logp, _ = losses.token_logprobs(model, batch, self.chunk, pos.to(model.device))  # chunked head
        return MicroLoss(-logp.sum() / normalizer, host.tokens, pos.count)


def encode_rows(tokenizer, rows: list[SFTRow], system_prompt: str | None, max_len: int) -> list[Encoded]:
    return [encode(tokenizer, r.messages, system_prompt, max_len) for r in rows]


def validate(config: SFTConfig) -> list[SFTRow]:
    """Every check that can fail before compute: data rows, LoRA targets, packing on recurrent models."""
    rows = read_rows(config.data_path, SFTRow)
    if config.lora is not None:
        check_lora_targets(config.model_path, config.lora)
    model_type = loading.load_config(config.model_path).model_type
    if config.packing and not packing_keeps_rows_apart(model_type):
        raise ConfigError(
            f"packing: refused for {config.model_path}: its Mamba layers would carry state across packed rows "
            "(a Nemotron-H model packs on a GPU with mamba-ssm's Triton SSD kernels)"
        )
    return rows


def train(config: SFTConfig) -> TrainResult:
    """Runs (or resumes, or returns the finished result of) one SFT run."""
    rows = validate(config)
    tokenizer = load_tokenizer(config.model_path)
    encoded, _ = data_cache.encoded_rows(rows, config.data_path, config.model_path, config.system_prompt,
                                         config.max_len, "sft")
    check_supervised(encoded, config.data_path, config.max_len)
    packs = pack_rows(encoded, config.max_len) if config.packing else None
    objective = SFTObjective(encoded, tokenizer.pad_token_id, packs, config.loss_chunk_tokens,
                             seq_idx=is_recurrent(config.model_path))
    return run_job(config, objective, truncated_rows=sum(e.truncated for e in encoded))


def main(argv: list[str] | None = None) -> int:
    """`python -m trainers.sft CONFIG.json`: runs SFT with the config file's settings."""
    from core.entry import run_main
    from trainers.common import ConfigError
    from trainers.rows import RowsError

    return run_main("python -m trainers.sft", (SFTConfig, train), argv, bad_input=(ConfigError, RowsError))


if __name__ == "__main__":
    sys.exit(main())
