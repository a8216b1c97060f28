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
- `eval_awaiting_preemption`: the session's first eval job (of any kind) writes its pid to the file
  `$POSTLAB_FAULT_PREEMPT` names and waits there for the preemption signal, so the test's preempter
  cannot miss it however fast a small eval runs; every later eval (the requeue too) runs for real.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from evals.job import EvalJobConfig, EvalResult
from evals.job import run as eval_run
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


PREEMPT_WAIT_S = 300.0  # a preemption that never comes fails the test at its assertions, not at CI's limit


def eval_awaiting_preemption(config: EvalJobConfig) -> EvalResult:
    marker = Path(os.environ["POSTLAB_FAULT_PREEMPT"])
    try:
        with marker.open("x") as f:  # only the first eval job of the session claims it
            f.write(str(os.getpid()))
    except FileExistsError:
        return eval_run(config)
    time.sleep(PREEMPT_WAIT_S)  # SIGUSR2 ends this attempt here
    return eval_run(config)
