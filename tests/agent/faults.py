"""Job functions with an injected failure, for the injected-failures session (test_failures_session.py).

Each is an ordinary job (one config in, the trainer's result out) that the session's `train` tool is
pointed at; they run as real subprocesses and import by name (the test puts this folder on the
workers' PYTHONPATH). What fails is real past the injection point: the launcher classifies the
error text, retries, records.

- `sft_oom_at_full_batch`: a CUDA OOM cannot happen on the CPU, so the first attempt (micro-batch =
  batch) raises torch's own OutOfMemoryError, as a GPU would; the launcher's retry (half the
  micro-batch, twice the accumulation) trains for real.
- `klce_diverging`: a real divergence: the real KL-CE trainer at a learning rate of 1e30 (past the
  tool's validated range) reaches a non-finite loss by its third step and raises `nan_loss:`.
"""

from __future__ import annotations

import torch

from trainers.common import TrainResult
from trainers.klce import KLCEConfig
from trainers.klce import train as klce_train
from trainers.sft import SFTConfig
from trainers.sft import train as sft_train

DIVERGING_LR = 1e30


def sft_oom_at_full_batch(config: SFTConfig) -> TrainResult:
    if config.micro_batch_size >= config.batch_size:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected: the micro-batch "
                                     f"{config.micro_batch_size} does not fit)")
    return sft_train(config)


def klce_diverging(config: KLCEConfig) -> TrainResult:
    return klce_train(config.model_copy(update={"lr": DIVERGING_LR}))
