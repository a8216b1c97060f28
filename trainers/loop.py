"""The optimizer loop every trainer runs, with checkpoint/resume.

Why in-house rather than TRL's Trainer: a preempted Slurm job gets SIGUSR2/SIGTERM and must save
optimizer, scheduler, RNG and data position *at that step* and then continue to the same final
weights when the launcher calls `train(config)` again; transformers' Trainer only checkpoints on a
save schedule and resumes through a separate `resume_from_checkpoint` argument. The loop is small:
deterministic data order (a seeded permutation per epoch, so the data position is just the step),
gradient accumulation with one normaliser per optimizer step (so the loss does not depend on the
micro-batch size the launcher picks after an OOM), AdamW with linear warm-up and decay, a NaN/inf
stop that names the step, and metrics.jsonl lines.

The objective is the plug point: `Objective.normalizer(rows)` and `Objective.loss(model, rows, norm)`.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Protocol

import torch
from safetensors.torch import load_file, save_file

from core.chat import chat_template
from core.util import file_sha256, write_json_atomic
from trainers.common import (
    NonFiniteLoss,
    Preempted,
    RunPaths,
    TrainConfig,
    TrainResult,
    finished_result,
    load_policy,
    load_tokenizer,
    start_run,
    trainable_state,
)

PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR2)


@dataclass
class MicroLoss:
    """One micro-batch's contribution: loss already divided by the step's normaliser."""

    loss: torch.Tensor
    tokens: int
    supervised: int
    metrics: dict[str, float] = field(default_factory=dict)


class Objective(Protocol):
    """What a trainer plugs into the loop."""

    n_rows: int

    def normalizer(self, rows: list[int]) -> float:
        """The divisor of the summed loss over one optimizer step's rows (tokens or pairs)."""
        ...

    def loss(self, model: torch.nn.Module, rows: list[int], normalizer: float) -> MicroLoss:
        """The micro-batch loss (sum over its rows / normalizer) and its counts."""
        ...


@dataclass
class LoopState:
    """Counters that survive a resume."""

    step: int = 0
    tokens: int = 0
    supervised: int = 0
    wall_time_s: float = 0.0
    last_loss: float = float("nan")
    resumed_at: list[int] = field(default_factory=list)
    last_metrics: dict[str, float] = field(default_factory=dict)


@lru_cache(maxsize=8)
def _epoch_order(n_rows: int, seed: int, epoch: int) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return tuple(torch.randperm(n_rows, generator=g).tolist())


def rows_for_step(step: int, batch_size: int, n_rows: int, seed: int) -> list[int]:
    """The rows of optimizer step `step`: a fresh seeded permutation per epoch, read in order."""
    positions = range(step * batch_size, (step + 1) * batch_size)
    return [_epoch_order(n_rows, seed, p // n_rows)[p % n_rows] for p in positions]


def _schedule(warmup: int, steps: int):
    def factor(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        return max(0.0, (steps - s) / (steps - warmup))

    return factor


@contextmanager
def preemption_flag() -> Iterator[dict]:
    """Turns SIGTERM/SIGUSR2 into a flag the loop checks between steps; restores old handlers after.

    Signal handlers can only be installed from the main thread; elsewhere the flag never sets and a
    signal keeps its previous meaning.
    """
    flag: dict = {"signal": None}
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return
    previous = {s: signal.getsignal(s) for s in PREEMPT_SIGNALS}
    for s in PREEMPT_SIGNALS:
        signal.signal(s, lambda signum, _frame: flag.update(signal=signum))
    try:
        yield flag
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def save_resume(paths: RunPaths, model, optimizer, scheduler, state: LoopState) -> None:
    """Writes resume state to a temp dir and swaps it in, so a kill mid-save keeps the previous one."""
    tmp = paths.root / "resume.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file(trainable_state(model), tmp / "trainable.safetensors")
    torch.save({
        "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
        "torch_rng": torch.get_rng_state(), "python_rng": random.getstate(), "loop": state.__dict__,
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }, tmp / "state.pt")
    old = paths.root / "resume.old"
    shutil.rmtree(old, ignore_errors=True)
    if paths.resume.exists():
        paths.resume.rename(old)
    tmp.rename(paths.resume)
    shutil.rmtree(old, ignore_errors=True)


def load_resume(paths: RunPaths, model, optimizer, scheduler) -> LoopState:
    """Restores weights, optimizer, scheduler and RNG; trims metrics written after the saved step."""
    saved = load_file(paths.resume / "trainable.safetensors")
    params = dict(model.named_parameters())
    if set(saved) != {n for n, p in params.items() if p.requires_grad}:
        raise RuntimeError(f"{paths.resume}: saved trainable parameters do not match the model")
    with torch.no_grad():
        for name, tensor in saved.items():
            params[name].copy_(tensor)
    blob = torch.load(paths.resume / "state.pt", weights_only=False)
    optimizer.load_state_dict(blob["optimizer"])
    scheduler.load_state_dict(blob["scheduler"])
    torch.set_rng_state(blob["torch_rng"])
    if blob["cuda_rng"]:
        torch.cuda.set_rng_state_all(blob["cuda_rng"])
    random.setstate(blob["python_rng"])
    state = LoopState(**blob["loop"])
    state.resumed_at.append(state.step)
    _trim_metrics(paths, state.step)
    return state


def _trim_metrics(paths: RunPaths, step: int) -> None:
    if not paths.metrics.is_file():
        return
    lines = [ln for ln in paths.metrics.read_text().splitlines() if json.loads(ln)["step"] <= step]
    paths.metrics.write_text("".join(ln + "\n" for ln in lines))


def _optimizer(model, config: TrainConfig):
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=config.lr, weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule(config.warmup_steps, config.steps))
    return optimizer, scheduler


def _one_step(model, objective: Objective, rows: list[int], micro: int) -> tuple[float, MicroLoss]:
    """Forward/backward over the micro-batches of one step; returns (loss, summed counts)."""
    norm = objective.normalizer(rows)
    loss = 0.0
    total = MicroLoss(torch.zeros(()), 0, 0, {})
    for start in range(0, len(rows), micro):
        part = objective.loss(model, rows[start : start + micro], norm)
        part.loss.backward()
        loss += float(part.loss.detach())
        total.tokens += part.tokens
        total.supervised += part.supervised
        for k, v in part.metrics.items():
            total.metrics[k] = total.metrics.get(k, 0.0) + v
    return loss, total


def run_loop(config: TrainConfig, paths: RunPaths, model, objective: Objective) -> LoopState:
    """Trains `model` in place for config.steps steps, resuming from paths.resume when it exists."""
    torch.manual_seed(config.seed)
    random.seed(config.seed)
    optimizer, scheduler = _optimizer(model, config)
    state = load_resume(paths, model, optimizer, scheduler) if paths.resume.exists() else LoopState()
    model.train()
    with preemption_flag() as flag, open(paths.metrics, "a") as metrics:
        while state.step < config.steps:
            t0 = time.perf_counter()
            rows = rows_for_step(state.step, config.batch_size, objective.n_rows, config.seed)
            loss, counts = _one_step(model, objective, rows, config.micro_batch_size)
            if not math.isfinite(loss):
                raise NonFiniteLoss(state.step + 1, loss)
            grad_norm = torch.nn.utils.clip_grad_norm_(
                [p for p in model.parameters() if p.requires_grad], config.grad_clip
            )
            lr = scheduler.get_last_lr()[0]
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            dt = time.perf_counter() - t0
            state.step += 1
            state.tokens += counts.tokens
            state.supervised += counts.supervised
            state.wall_time_s += dt
            state.last_loss = loss
            state.last_metrics = counts.metrics
            if state.step % config.log_every == 0 or state.step == config.steps:
                line = {"step": state.step, "loss": loss, "lr": lr, "grad_norm": float(grad_norm),
                        "tokens_per_s": counts.tokens / dt, "tokens": state.tokens, **counts.metrics}
                metrics.write(json.dumps(line) + "\n")
                metrics.flush()
            if flag["signal"] is not None:
                save_resume(paths, model, optimizer, scheduler, state)
                raise Preempted(state.step, paths.resume)
            if config.save_every and state.step % config.save_every == 0:
                save_resume(paths, model, optimizer, scheduler, state)
    return state


def save_model(model, tokenizer, out_dir) -> None:
    """Full weights (safetensors) or, for a peft model, the adapter; the tokenizer goes alongside."""
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def run_job(
    config: TrainConfig,
    objective: Objective,
    final_metrics: Callable[[torch.nn.Module], dict[str, float]] | None = None,
    truncated_rows: int = 0,
) -> TrainResult:
    """Setup, run, save, clean up: the body every trainer's `train(config)` shares.

    The caller has validated config and data and built the objective. A finished run returns its stored result; a run
    directory with resume state continues from it.
    """
    done = finished_result(config)
    if done is not None:
        return done
    paths = start_run(config)
    tokenizer = load_tokenizer(config.model_path)
    # The saved checkpoint carries the template its rows were rendered with: training and serving cannot drift.
    tokenizer.chat_template = chat_template(config.system_prompt)
    model = load_policy(config.model_path, config.dtype, config.lora, config.seed)
    state = run_loop(config, paths, model, objective)
    model.eval()
    metrics = {**state.last_metrics, **(final_metrics(model) if final_metrics else {})}
    save_model(model, tokenizer, paths.model)
    result = TrainResult(
        run_dir=paths.root, model_dir=paths.model, adapter=config.lora is not None, base_model_path=config.model_path,
        steps=state.step, tokens_seen=state.tokens, supervised_tokens=state.supervised, truncated_rows=truncated_rows,
        wall_time_s=state.wall_time_s, data_sha256=file_sha256(config.data_path), final_loss=state.last_loss,
        resumed_at_steps=state.resumed_at, metrics=metrics,
    )
    write_json_atomic(paths.result, json.loads(result.model_dump_json()))
    shutil.rmtree(paths.resume, ignore_errors=True)
    return result
