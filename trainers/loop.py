"""The optimizer loop every trainer runs, with checkpoint/resume.

Why in-house rather than TRL's Trainer: a preempted Slurm job gets SIGUSR2/SIGTERM and must save
optimizer, scheduler, RNG and data position *at that step* and then continue to the same final
weights when the launcher calls `train(config)` again; transformers' Trainer only checkpoints on a
save schedule and resumes through a separate `resume_from_checkpoint` argument. The loop is small:
deterministic data order (a seeded permutation per epoch, so the data position is just the step),
gradient accumulation with one normaliser per optimizer step (so the loss does not depend on the
micro-batch size the launcher picks after an OOM), AdamW with linear warm-up and a linear or cosine
decay to a floor, a NaN/inf stop that names the step, and metrics.jsonl lines.

Distributed (one process per GPU, `trainers/distributed.py`): every rank walks the same step sequence and takes
its contiguous share of each step's rows; the normaliser still covers the whole step, so the loss and gradient
equal one process's over the same global batch. Resume state is a DCP checkpoint (`trainers/checkpoint.py`),
saved on a signal seen by any rank (the flag is all-reduced every step), every `save_every` steps and every
`save_every_minutes`; the longest save is recorded (`max_save_s`: the launcher's signal lead time must exceed
it). Rank 0 writes metrics, the memory estimate, the result and the consolidated model, and a whole-model snapshot
after each of `snapshot_steps` (for trajectory selection: resume state is not a model anyone can evaluate).

The objective is the plug point: `Objective.normalizer(rows)` and `Objective.loss(model, rows, norm)`.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import signal
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Protocol

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from core import chat
from core.placement import measured
from core.util import file_sha256, write_json_atomic
from core.wall import Laps
from trainers import checkpoint, distributed, memory
from trainers.common import (
    ConfigError,
    NonFiniteLoss,
    Preempted,
    RunPaths,
    Snapshot,
    TrainConfig,
    TrainResult,
    finished_result,
    load_policy,
    load_tokenizer,
    start_run,
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


@dataclass(frozen=True)
class LoopPlan:
    """What the optimizer loop reads, built once from the run's config (`run_job`)."""

    steps: int
    batch_size: int
    micro_batch_size: int
    seed: int
    grad_clip: float
    log_every: int
    save_every: int | None
    save_every_minutes: float | None
    snapshot_steps: tuple[int, ...]
    save_dtype: torch.dtype  # what full-weight snapshots are saved in (`save_dtype`)


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
    save_s: float = 0.0  # longest resume save so far (the launcher's signal lead time must exceed it)
    lr_sum: float = 0.0  # the per-step learning rates summed: how far the schedule carried the weights so far
    warmup_s: float = 0.0  # this session's first step beyond its typical one: compilation, graph capture (start-up)


@lru_cache(maxsize=8)
def _epoch_order(n_rows: int, seed: int, epoch: int) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return tuple(torch.randperm(n_rows, generator=g).tolist())


def rows_for_step(step: int, batch_size: int, n_rows: int, seed: int) -> list[int]:
    """The rows of optimizer step `step`: a fresh seeded permutation per epoch, read in order."""
    positions = range(step * batch_size, (step + 1) * batch_size)
    return [_epoch_order(n_rows, seed, p // n_rows)[p % n_rows] for p in positions]


def _schedule(warmup: int, steps: int, kind: str = "linear", floor: float = 0.0):
    """The lr multiplier of step s: linear warm-up over `warmup` steps, then a decay from 1 to `floor` at the end,
    linear or half a cosine (Loshchilov & Hutter 2017, "SGDR", without restarts; the floor keeps late steps learning,
    as the seeds' cosine schedules did)."""
    def factor(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        left = max(0.0, (steps - s) / (steps - warmup))  # 1 at the end of the warm-up, 0 after the last step
        shape = left if kind == "linear" else 0.5 * (1.0 - math.cos(math.pi * left))
        return floor + (1.0 - floor) * shape

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


def save_resume(paths: RunPaths, model, optimizer, scheduler, state: LoopState) -> float:
    """Collective: writes resume state (DCP, swapped in when complete); returns the seconds it took."""
    t0 = time.perf_counter()
    checkpoint.save(paths.resume, model, optimizer, {"scheduler": scheduler.state_dict(), "loop": state.__dict__})
    return time.perf_counter() - t0


def load_resume(paths: RunPaths, model, optimizer, scheduler, seed: int) -> LoopState:
    """Restores weights, optimizer, scheduler and RNG; trims metrics written after the saved step."""
    blob = checkpoint.load(paths.resume, model, optimizer, seed)
    scheduler.load_state_dict(blob["scheduler"])
    state = LoopState(**blob["loop"])
    state.resumed_at.append(state.step)
    if distributed.setup().is_main:
        _trim_metrics(paths, state.step)
    return state


def _trim_metrics(paths: RunPaths, step: int) -> None:
    if not paths.metrics.is_file():
        return
    lines = [ln for ln in paths.metrics.read_text().splitlines() if json.loads(ln)["step"] <= step]
    paths.metrics.write_text("".join(ln + "\n" for ln in lines))


def make_optimizer(model, *, lr: float, weight_decay: float, warmup_steps: int, steps: int, schedule: str,
                   min_lr_ratio: float):
    """AdamW over the trainable parameters and its lr schedule (`_schedule`)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    # One fused kernel per dtype on a single GPU (FSDP2's DTensor parameters keep the default foreach step).
    fused = all(p.is_cuda and not isinstance(p, DTensor) for p in trainable)
    optimizer = torch.optim.AdamW(trainable, lr=lr, weight_decay=weight_decay, fused=fused or None)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule(warmup_steps, steps, schedule, min_lr_ratio))
    return optimizer, scheduler


def _one_step(model, objective: Objective, rows: list[int], micro: int) -> tuple[float, MicroLoss]:
    """Forward/backward over this rank's micro-batches of one step; returns (loss, counts) summed over ranks.

    The normaliser covers the whole step's rows (all ranks) and each rank backpropagates the sum over its own rows
    divided by it, times world_size because FSDP averages gradients over ranks: the same gradient as one process
    over the whole batch (exact for power-of-two world sizes; gloo has no pre-scaled sum to ask FSDP for instead).
    """
    env = distributed.setup()
    norm = objective.normalizer(rows)
    mine = distributed.rank_share(rows, env)
    starts = range(0, len(mine), micro)
    loss = 0.0
    total = MicroLoss(torch.zeros(()), 0, 0, {})
    for start in starts:
        if isinstance(model, FSDPModule):  # reduce-scatter gradients once, after the last micro-batch
            model.set_requires_gradient_sync(start == starts[-1])
        part = objective.loss(model, mine[start : start + micro], norm)
        (part.loss * env.world_size).backward()
        loss += float(part.loss.detach())
        total.tokens += part.tokens
        total.supervised += part.supervised
        for k, v in part.metrics.items():
            total.metrics[k] = total.metrics.get(k, 0.0) + v
    keys = sorted(total.metrics)
    summed = distributed.all_sum([loss, total.tokens, total.supervised] + [total.metrics[k] for k in keys])
    total.tokens, total.supervised = int(summed[1]), int(summed[2])
    total.metrics = dict(zip(keys, summed[3:], strict=True))
    return summed[0], total


def _check_layout(batch_size: int) -> None:
    world = distributed.setup().world_size
    if batch_size % world:
        raise ConfigError(f"batch_size ({batch_size}) must be a multiple of the job's {world} ranks")


def _grad_norm(model, clip: float) -> float:
    norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], clip)
    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)


def save_dtype(model_path: Path, compute_dtype: str) -> torch.dtype:
    """Full weights are saved in the starting model's stored dtype (checkpoint.stored_dtype)."""
    return checkpoint.stored_dtype(model_path, getattr(torch, compute_dtype))


def save_snapshot(paths: RunPaths, model, tokenizer, dtype: torch.dtype, state: LoopState, lr: float) -> None:
    """Collective: the model after step `state.step`, whole (trainers/checkpoint.py), with its step, learning rate
    so far and loss. Written before that step's resume save, so resume state at or past a snapshot step always
    has its snapshot on disk, and state from before it re-runs the step and writes it again."""
    info = {"step": state.step, "lr": lr, "lr_sum": state.lr_sum, "loss": state.last_loss, "tokens_seen": state.tokens}
    checkpoint.save_snapshot(model, tokenizer, paths.snapshot(state.step), dtype, info)


def read_snapshot(paths: RunPaths, step: int) -> Snapshot:
    """The snapshot of `step`, as save_snapshot wrote it."""
    where = paths.snapshot(step)
    info = where / checkpoint.SNAPSHOT_INFO
    if not info.is_file():
        raise RuntimeError(f"{where}: snapshot of step {step} missing at the end of the run")
    return Snapshot(model_dir=where, **json.loads(info.read_text()))


def run_loop(plan: LoopPlan, paths: RunPaths, model, optimizer, scheduler, objective: Objective,
             tokenizer) -> LoopState:
    """Trains `model` in place for plan.steps steps, resuming from paths.resume when it exists; saves a snapshot
    (with `tokenizer`) after each of plan.snapshot_steps."""
    env = distributed.setup()
    resuming = distributed.broadcast_object(paths.resume.exists())
    state = load_resume(paths, model, optimizer, scheduler, plan.seed) if resuming else LoopState()
    model.train()
    last_save = time.monotonic()
    steps_s: list[float] = []
    with preemption_flag() as flag, open(paths.metrics, "a") if env.is_main else nullcontext() as metrics:
        while state.step < plan.steps:
            t0 = time.perf_counter()
            rows = rows_for_step(state.step, plan.batch_size, objective.n_rows, plan.seed)
            loss, counts = _one_step(model, objective, rows, plan.micro_batch_size)
            if not math.isfinite(loss):
                raise NonFiniteLoss(state.step + 1, loss)
            grad_norm = _grad_norm(model, plan.grad_clip)
            lr = scheduler.get_last_lr()[0]
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            dt = time.perf_counter() - t0
            steps_s.append(dt)
            state.step += 1
            state.tokens += counts.tokens
            state.supervised += counts.supervised
            state.wall_time_s += dt
            state.last_loss = loss
            state.last_metrics = counts.metrics
            state.lr_sum += lr
            if metrics is not None and (state.step % plan.log_every == 0 or state.step == plan.steps):
                line = {"step": state.step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                        "tokens_per_s": counts.tokens / dt, "tokens": state.tokens, **counts.metrics}
                metrics.write(json.dumps(line) + "\n")
                metrics.flush()
            if state.step in plan.snapshot_steps:  # before any resume save of this step: see save_snapshot
                save_snapshot(paths, model, tokenizer, plan.save_dtype, state, lr)
            # One collective agrees on both: a signal seen by any rank stops all of them at this step.
            minutes = (time.monotonic() - last_save) / 60
            stop, due = (v > 0 for v in distributed.all_sum([
                float(flag["signal"] is not None),
                float(bool(plan.save_every_minutes) and minutes >= (plan.save_every_minutes or 0)),
            ]))
            if stop:
                state.save_s = max(state.save_s, save_resume(paths, model, optimizer, scheduler, state))
                raise Preempted(state.step, paths.resume)
            if due or (plan.save_every and state.step % plan.save_every == 0):
                state.save_s = max(state.save_s, save_resume(paths, model, optimizer, scheduler, state))
                last_save = time.monotonic()
    if len(steps_s) > 1:
        state.warmup_s = max(0.0, steps_s[0] - statistics.median(steps_s[1:]))
    return state


def run_job(
    config: TrainConfig,
    objective: Objective,
    final_metrics: Callable[[torch.nn.Module], dict[str, float]] | None = None,
    truncated_rows: int = 0,
) -> TrainResult:
    """Setup, run, save, clean up: the body every trainer's `train(config)` shares (on every rank of a job).

    The caller has validated config and data and built the objective. A finished run returns its stored result; a run
    directory with resume state continues from it. Rank 0 writes the run directory's files. The config stops here: it
    becomes the run's paths, the model, the optimizer and its schedule and the loop's plan, which the functions below
    take.
    """
    laps = Laps()
    env = distributed.setup()
    done = finished_result(config)
    if done is not None:
        return done
    paths = start_run(config)  # on every rank: a refusal stops all of them; identical atomic writes do not collide
    estimate = memory.estimate_job(config, env.world_size)
    if env.is_main:
        write_json_atomic(paths.root / "memory_estimate.json", {**estimate.model_dump(), "total": estimate.total})
    distributed.barrier()
    tokenizer = load_tokenizer(config.model_path)
    # The saved checkpoint carries the template its rows were rendered with (the model's own, or ChatML when it
    # had none): training and serving cannot drift. The serving system prompt is the bundle's to bake in.
    tokenizer.chat_template = chat.chat_format(tokenizer).template
    model = load_policy(config.model_path, config.compute_dtype, config.lora, config.seed,
                        config.activation_checkpointing, config.compile_blocks)
    laps.startup("load")
    _check_layout(config.batch_size)
    torch.manual_seed(config.seed)
    random.seed(config.seed)
    optimizer, scheduler = make_optimizer(model, lr=config.lr, weight_decay=config.weight_decay,
                                          warmup_steps=config.warmup_steps, steps=config.steps,
                                          schedule=config.schedule, min_lr_ratio=config.min_lr_ratio)
    dtype = save_dtype(config.model_path, config.compute_dtype)
    plan = LoopPlan(steps=config.steps, batch_size=config.batch_size, micro_batch_size=config.micro_batch_size,
                    seed=config.seed, grad_clip=config.grad_clip, log_every=config.log_every,
                    save_every=config.save_every, save_every_minutes=config.save_every_minutes,
                    snapshot_steps=tuple(config.snapshot_steps), save_dtype=dtype)
    state = run_loop(plan, paths, model, optimizer, scheduler, objective, tokenizer)
    laps.work()
    model.eval()
    metrics = {**state.last_metrics, **(final_metrics(model) if final_metrics else {}), "max_save_s": state.save_s,
               "estimated_peak_gib": estimate.total / memory.GIB}
    if torch.cuda.is_available():
        metrics["peak_gpu_gib"] = torch.cuda.max_memory_allocated() / memory.GIB
    checkpoint.save_final(model, tokenizer, paths.model, dtype)
    laps.write()
    result = TrainResult(
        run_dir=paths.root, model_dir=paths.model, adapter=config.lora is not None, base_model_path=config.model_path,
        steps=state.step, tokens_seen=state.tokens, supervised_tokens=state.supervised, truncated_rows=truncated_rows,
        wall_time_s=state.wall_time_s, data_sha256=file_sha256(config.data_path), final_loss=state.last_loss,
        resumed_at_steps=state.resumed_at, metrics=metrics, world_size=env.world_size,
        snapshots=[read_snapshot(paths, step) for step in config.snapshot_steps],
        placement=measured(str(distributed.device(env)), config.compute_dtype, state.tokens, state.wall_time_s,
                           devices=env.world_size),
        # the first step's compilation or graph capture is start-up; the result file after the last lap, write-out
        wall=laps.wall().to_startup("compile", state.warmup_s),
    )
    if env.is_main:
        write_json_atomic(paths.result, json.loads(result.model_dump_json()))
        shutil.rmtree(paths.resume, ignore_errors=True)
    distributed.barrier()
    return result
