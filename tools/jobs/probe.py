"""Probe jobs: small plain functions that exercise the job engine end to end without a model.

They check a cluster and the launcher (submit, requeue, resume, OOM retry, accounting) and measure
its overhead (`bench/job_overhead.py`). Like every job, each takes one pydantic config and returns a
pydantic result, so the same call runs in-process, as a local subprocess or on a Slurm node:

    from tools.jobs.probe import CountConfig, count
    count(CountConfig(steps=3, step_seconds=0.1, output_dir=Path("/tmp/p")))
"""

from __future__ import annotations

import datetime
import json
import math
import os
import resource
import signal
import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from core.util import address_space, write_atomic
from core.wall import Laps, Wall


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EmptyConfig(_Model):
    tag: str = Field(description="Distinguishes otherwise identical probes (the launcher keys jobs by args).")


class EmptyResult(_Model):
    started_at: float = Field(description="Epoch seconds when the job function began.")
    ended_at: float = Field(description="Epoch seconds when the job function returned.")
    pid: int = Field(description="Process id of the worker.")


def empty(config: EmptyConfig) -> EmptyResult:
    """Do nothing; the timestamps bound the executor's overhead from outside."""
    t = time.time()
    return EmptyResult(started_at=t, ended_at=time.time(), pid=os.getpid())


class FailConfig(_Model):
    message: str = Field(description="The message of the exception the job raises (text it was handed, as a data job "
                         "that quotes a bad row would).")


def fail(config: FailConfig) -> EmptyResult:
    """Raise ValueError(message): a job whose error text carries input text, for the failure classifier."""
    raise ValueError(config.message)


class HogConfig(_Model):
    tag: str = Field(description="Distinguishes otherwise identical probes.")
    grow_mb: int = Field(0, ge=0, description="MiB allocated, filled and kept at every step (0: none).")
    steps: int = Field(1, ge=1, description="Steps; each sleeps `step_seconds` after its allocation.")
    step_seconds: float = Field(0.0, ge=0, description="Sleep per step.")
    ignore_sigterm: bool = Field(False, description="Handle SIGTERM by doing nothing, as submitit's own handler does.")
    pid_file: Path | None = Field(None, description="Where the worker writes its pid when it starts.")


def hog(config: HogConfig) -> EmptyResult:
    """A job that grows its resident memory step by step and may ignore SIGTERM: the local job bounds' probe
    (tools/jobs/warden.py)."""
    t = time.time()
    if config.ignore_sigterm:
        signal.signal(signal.SIGTERM, lambda _signum, _frame: None)
    if config.pid_file is not None:
        write_atomic(config.pid_file, str(os.getpid()))
    kept = []
    for _ in range(config.steps):
        kept.append(b"\x01" * (config.grow_mb * 2**20))  # filled: resident, unlike a zeroed (calloc'd) buffer
        time.sleep(config.step_seconds)
    return EmptyResult(started_at=t, ended_at=time.time(), pid=os.getpid())


class JudgeCallConfig(_Model):
    judge: dict = Field(description="An evals.job judge spec (JSON): the judge one call is made to.")


def judge_call(config: JudgeCallConfig) -> EmptyResult:
    """One judgment through the judge an eval job would build: checks a judge endpoint from a job process."""
    from evals.job import OpenAIJudgeSpec, make_judge  # here: the other probes import no evals

    t = time.time()
    make_judge(OpenAIJudgeSpec.model_validate(config.judge))("probe prompt", "answer a", "answer b")
    return EmptyResult(started_at=t, ended_at=time.time(), pid=os.getpid())


class CountConfig(_Model):
    steps: int = Field(ge=1, description="Number of steps; each adds step*step to the running total.")
    step_seconds: float = Field(ge=0, description="Sleep per step, standing in for a training step.")
    output_dir: Path = Field(description="Where the checkpoint (state.json) and metrics.jsonl are written.")
    micro_batch_size: int = Field(8, ge=1, description="Items per step; with `item_mb` it sets the memory a step needs.")
    grad_accum: int = Field(1, ge=1, description="Accumulation steps; the OOM retry doubles it.")
    item_mb: int = Field(0, ge=0, description="MiB allocated per micro-batch item each step (0: none).")
    on_signal: Literal["requeue", "raise"] = Field(
        "requeue", description="On SIGUSR2: leave it to submitit's handler (the job wrapper ends the run as "
        "preempted), or raise 'preempted:' after the current step like trainers/loop.py does; either way the "
        "launcher admits the requeue and resubmits.",
    )
    nan_at_step: int | None = Field(None, ge=1, description="Step whose loss turns NaN; the job stops the way trainers do.")
    memory_limit_mb: int | None = Field(
        None, gt=0, description="Address-space headroom in MiB for the step's allocation; over it the step raises MemoryError.",
    )


class CountResult(_Model):
    total: int = Field(description="Sum of step*step over all steps: the same however often the run was interrupted.")
    resumed_from: int = Field(description="Step this process started from (0 unless it resumed a checkpoint).")
    micro_batch_size: int = Field(description="Micro-batch the finishing process ran with.")
    grad_accum: int = Field(description="Accumulation the finishing process ran with.")


def count(config: CountConfig) -> CountResult:
    """A resumable 'training loop': checkpoints after every step and resumes from the last one."""
    config.output_dir.mkdir(parents=True, exist_ok=True)
    state_file = config.output_dir / "state.json"
    state = json.loads(state_file.read_text()) if state_file.exists() else {"step": 0, "total": 0}
    start = state["step"]
    signalled: list[int] = []
    previous = signal.getsignal(signal.SIGUSR2)
    if config.on_signal == "raise":
        # Replaces submitit's handler for this run only; restored below so no caller keeps it.
        signal.signal(signal.SIGUSR2, lambda signum, _frame: signalled.append(signum))
    try:
        state = _count_steps(config, state, start, signalled, state_file)
    finally:
        signal.signal(signal.SIGUSR2, previous)
    return CountResult(total=state["total"], resumed_from=start,
                       micro_batch_size=config.micro_batch_size, grad_accum=config.grad_accum)


def _count_steps(config: CountConfig, state: dict, start: int, signalled: list[int], state_file: Path) -> dict:
    for step in range(start, config.steps):
        if signalled:
            raise RuntimeError(f"preempted: step {step}: state saved to {state_file}")
        _allocate(config.micro_batch_size * config.item_mb, config.memory_limit_mb)
        time.sleep(config.step_seconds)
        loss = math.nan if step + 1 == config.nan_at_step else 1.0 / (step + 1)
        if not math.isfinite(loss):
            # The trainers' contract: a non-finite loss stops the job with a message starting "nan_loss:".
            raise FloatingPointError(f"nan_loss: loss is {loss} at step {step + 1}")
        state = {"step": step + 1, "total": state["total"] + step * step}
        write_atomic(state_file, json.dumps(state))
        with open(config.output_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": step + 1, "of": config.steps, "loss": loss}) + "\n")
    return state


def _allocate(mb: int, limit_mb: int | None) -> None:
    """Touch `mb` MiB; under `limit_mb` of extra address space a too-large step fails for real."""
    if mb == 0:
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if limit_mb is not None:
        resource.setrlimit(resource.RLIMIT_AS, (address_space() + limit_mb * 2**20, hard))
    try:
        block = bytearray(mb * 2**20)
        del block
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


class AllReduceConfig(_Model):
    tag: str = Field(description="Distinguishes otherwise identical probes (the launcher keys jobs by args).")
    seconds: float = Field(0.0, ge=0, description="Seconds each rank works (sleeps) before the collective.")
    skip_rank: int | None = Field(None, ge=0, description="A rank that skips the collective (the others then hang).")
    timeout_s: float = Field(60.0, gt=0, description="The group's collective timeout: how long a hang lasts.")


class AllReduceResult(_Model):
    rank: int = Field(description="This process's rank (the job's result is rank 0's).")
    world_size: int = Field(description="Processes in the group.")
    rank_sum: int = Field(description="all_reduce(SUM) of rank + 1: world_size * (world_size + 1) / 2 "
                          "when every rank took part.")
    pids: list[int] = Field(description="Process id of every rank, gathered: distinct processes.")
    master: str = Field(description="MASTER_ADDR:MASTER_PORT the group met at.")
    no_multicast: dict[str, str] = Field(description="The NVLink multicast and Hub kernel switches as the job's environment had them.")


def all_reduce(config: AllReduceConfig) -> AllReduceResult:
    """Join the job's torch.distributed group on CPU (gloo; the launcher exported the rendezvous) and all-reduce."""
    import torch  # here, not at the top: the other probes start without paying for torch
    import torch.distributed as dist

    time.sleep(config.seconds)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=config.timeout_s))
    try:
        total = torch.tensor([dist.get_rank() + 1])
        if dist.get_rank() == config.skip_rank:
            time.sleep(config.timeout_s + 1)  # the others time out waiting for this rank
            raise RuntimeError(f"rank {config.skip_rank} skipped the all_reduce")
        dist.all_reduce(total)
        pids: list[int] = [0] * dist.get_world_size()
        dist.all_gather_object(pids, os.getpid())
        rank, world = dist.get_rank(), dist.get_world_size()
    finally:
        dist.destroy_process_group()
    switches = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS", "USE_HUB_KERNELS")
    return AllReduceResult(rank=rank, world_size=world, rank_sum=int(total.item()), pids=pids,
                           master=f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
                           no_multicast={name: os.environ.get(name, "") for name in switches})


class CallsConfig(_Model):
    output_dir: Path = Field(description="Directory of calls.txt, one line per process that ran the function.")
    fail_rank: int | None = Field(None, description="This rank raises once every rank wrote its line.")
    others_sleep_s: float = Field(0.0, ge=0, description="With fail_rank: how long the other ranks sleep after "
                                                          "their line (a rank waiting for one that died).")


class CallsResult(_Model):
    rank: int = Field(description="RANK of the process that returned this result.")
    cuda_visible_devices: str | None = Field(description="CUDA_VISIBLE_DEVICES as the function saw it.")


def calls(config: CallsConfig) -> CallsResult:
    """Append this process's rank to calls.txt: how many processes of a job ran the function, and which."""
    config.output_dir.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("RANK", "0"))
    with open(config.output_dir / "calls.txt", "a") as f:
        f.write(f"{rank} {os.getpid()}\n")
    if config.fail_rank is not None:
        if rank == config.fail_rank:
            # Fail once every rank has written its line (as a rank dies while the others wait on it in a
            # collective): on a loaded machine a rank still importing when this one failed would be killed unseen.
            world, deadline = int(os.environ.get("WORLD_SIZE", "1")), time.monotonic() + 60
            while time.monotonic() < deadline and len((config.output_dir / "calls.txt").read_text().splitlines()) < world:
                time.sleep(0.1)
            raise RuntimeError(f"rank {rank} fails on purpose")
        time.sleep(config.others_sleep_s)
    return CallsResult(rank=rank, cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"))


class StagedConfig(_Model):
    load_s: float = Field(ge=0, description="Seconds standing in for a model load (start-up).")
    units: int = Field(ge=1, description="Units of work.")
    unit_s: float = Field(ge=0, description="Seconds per unit of work.")
    write_s: float = Field(ge=0, description="Seconds standing in for writing the outputs.")


class StagedResult(_Model):
    units: int = Field(description="Units done.")
    wall: Wall | None = Field(None, description="Start-up, work and write-out (core/wall.py).")


def staged(config: StagedConfig) -> StagedResult:
    """A job in the three stretches every model job has (load, work, write), each timed by its laps."""
    laps = Laps()
    time.sleep(config.load_s)
    laps.startup("load")
    for _ in range(config.units):
        time.sleep(config.unit_s)
    laps.work()
    time.sleep(config.write_s)
    laps.write()
    return StagedResult(units=config.units, wall=laps.wall())
