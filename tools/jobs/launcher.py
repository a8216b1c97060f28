"""The job launcher: submit a job function through submitit (local subprocesses or Slurm), with
idempotency keys, budget admission, GPU-hour settlement and failure handling, all in the notebook.

    launcher = Launcher.from_section(notebook, "s1", ExecutorSection(kind="local"), Path("lab/jobs"))
    job = launcher.submit("sft", trainers.sft.train, SFTConfig(...), Resources(time_limit_min=60, gpus=1))
    result = job.result()          # a TrainResult, or raises JobFailed with the failure class
    key = job.key                  # all a resumed agent needs to keep: launcher.attach(key) is the same job

What happens, in order (DESIGN.md invariants 5 and 6):
1. The key is sha256(kind + function + session + canonical args). A key already in the notebook is
   re-attached by its external id (pending/running), read back (completed) or reported (failed):
   a job is never submitted twice, also after the agent was killed and resumed. Each job row names
   its function and result model ("module:qualname"), so `attach(key)` rebuilds the handle from
   the notebook alone.
2. Admission: the forecast (declared estimate, else measured throughput of earlier jobs of the same
   kind and model, else the time-limit bound) plus spent plus reserved plus the session's reserve
   must fit the budget; otherwise a `refuse` decision is recorded and `BudgetRefused` raised.
3. The attempt row (state pending, forecast reserved) and a `launch` decision are written, then the
   job is submitted. Every job runs inside `Resumable` (tools/jobs/jobrun.py): on the preemption/timeout
   signal the run ends as `preempted`/`timeout`; it is never requeued in place behind the ledger's
   back (Slurm jobs are submitted `--no-requeue`). A job runs `tasks` processes (one per GPU by
   default) with the torch.distributed rendezvous exported.
4. Each run of the job is one attempt row with its own settled cost: Slurm `sacct` elapsed times
   allocated GPUs (a CPU job holds none and is charged none), or local wall time times devices (a local CPU-only
   job counts one device per process: the toy world's machine stands in for its GPUs).
   The row keeps the measured device-seconds and the GPU-hours charged for them: the same number
   (/3600) unless the lab declares a simulated cost (the toy world's `simulated_gpuh_per_device_s`,
   local executor only), then `charge = 'simulated'`. A failed run is classified
   (tools/jobs/failures.py) and the policy applied (requeue, OOM retry, or record).
   Training jobs (a trainers.common.TrainConfig) are also admitted by memory: the estimate per GPU
   (trainers/memory.py, at the configured micro-batch on `tasks` ranks) is recorded on the attempt
   row, and a job on GPUs whose estimate exceeds the lab's `gpu_memory_gib` is a `refuse` decision
   with the numbers (MemoryRefused).
5. Every requeue and retry is admitted again, as a new attempt submitted with the same config (a job
   resumes from the state in its output directory): its forecast is the job's forecast or, when
   larger, the most one run can cost (its time limit on its devices: a run that overran its forecast
   once is not re-admitted on it), against what is left of the budget above the reserve (nomination
   checks may use the reserve). A refused requeue is a `refuse` decision; the job then ends failed
   with the run's class, the refusal in its detail and a `fail` decision. A run that Slurm requeued
   anyway (a lab whose extra_sbatch passes `--requeue`) is admitted the same way when the launcher sees
   it, and cancelled when it does not fit.
6. The checkpoint signal comes `signal_delay_s` before the time limit (Slurm `--signal=USR2@N`). Left
   unset, it is derived from the longest save measured by earlier completed jobs of the same kind and
   model (trainers report `max_save_s`): twice that, at least 30 s, at most half the time limit.
"""

from __future__ import annotations

import importlib
import inspect
import math
import os
import re
import signal
import socket
import subprocess
import time
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Generic, Literal, Protocol, TypeVar

import submitit
from pydantic import BaseModel, ConfigDict, Field, model_validator
from submitit.core.utils import FailedJobError, JobPaths, UncompletedJobError

from core.display import shown
from core.redact import redact
from core.wall import wall_of
from memory.notebook import JobRecord, Notebook, now, tool_call_key
from memory.records import (
    BudgetRefusal,
    FailPayload,
    LaunchPayload,
    MemoryRefusal,
    PartitionRefusal,
    WaitPayload,
)
from tools.jobs import forecast
from tools.jobs.executor import ExecutorSection, ResourcesSection, SlurmSection, local_gpus
from tools.jobs.failures import MESSAGE_LIMIT, Failure, classify, decide, message_of, smaller_batch_config
from tools.jobs.forecast import fitting_alternatives
from tools.jobs.jobrun import Resumable, RunPaths, near_time_limit, read_events
from tools.jobs.zygote import TIME_LIMIT_VAR, Zygote
from tools.jobs.zygote import default_dir as zygote_dir
from tools.paths import portable
from tools.session import ledger as session_ledger

R = TypeVar("R", bound=BaseModel)
C = TypeVar("C", bound=BaseModel)

# States after which the last run will not change any more (sacct's State column, first word; the
# local backend reports the same names). REQUEUED is not among them: the job runs again.
_FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "PREEMPTED", "NODE_FAIL", "BOOT_FAIL",
                 "OUT_OF_MEMORY", "DEADLINE", "REVOKED"}
# submitit requeues in place on the preemption signal; our own wrapper enforces the limits, so
# submitit's countdown (which counts every signal of a job under 10 minutes as a timeout) is off.
_NO_SUBMITIT_LIMIT = 1000
_REQUEUED_CLASSES = {"preempted", "timeout", "lost"}  # failure classes that count against max_requeues
_SLACK_S = 5.0  # seconds: a killed local run this close to its limit was stopped by the limit
# The signal lead time: the longest measured save times this factor, never under the floor (Slurm's
# own signal timing is only good to about a minute, and a step must end before the save begins).
SIGNAL_LEAD_FACTOR = 2.0
SIGNAL_LEAD_FLOOR_S = 30
GIB = 1024**3


class BudgetRefused(Exception):
    """The job's forecast does not fit the session budget; the refusal is a recorded decision."""


class MemoryRefused(BudgetRefused):
    """A training job's memory estimate exceeds the GPUs it asks for; the refusal is a recorded decision.

    A kind of BudgetRefused (GPU memory is a budget too), so every caller that turns an admission
    refusal into data (tools.context.invoke) handles it the same way."""


class PartitionRefused(BudgetRefused):
    """No node of the job's Slurm partition has what the job asks for; the refusal is a recorded decision (a kind of
    BudgetRefused: the partition's nodes are a budget too, and callers turn refusals into data alike)."""


class JobFailed(Exception):
    """The job ended without a result after the failure policy ran out of options."""

    def __init__(self, record: JobRecord):
        super().__init__(f"job {record.kind} {record.key[:12]} attempt {record.attempt}: "
                         f"{record.failure_class}: {record.failure_detail}")
        self.record = record


class Resources(BaseModel):
    """What one job asks for and what it is expected to cost."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    time_limit_min: float = Field(gt=0, description="Wall-clock limit of one run in minutes (Slurm rounds up to whole minutes).")
    gpus: int | None = Field(None, ge=0, description="GPUs; None takes the executor's default (local: 0, Slurm: gpus_per_node).")
    tasks: int | None = Field(
        None, ge=1, description="Processes of the job on each node, each with its torch.distributed rank; "
        "None: one per GPU (one for a CPU-only job).",
    )
    nodes: int = Field(1, ge=1, description="Nodes of the job (Slurm): `tasks` processes on each, one rendezvous.")
    single_process: bool = Field(
        False, description="The function runs once, on rank 0 (merges, data, bundle jobs); the other ranks of a "
        "multi-task job return at once. False: every rank runs it (trainers, evals: they share the work by rank).")
    device: Literal["cuda", "cpu"] | None = Field(
        None, description="Where the job's model runs (the tools set it from the GPUs): cuda fails the job at once, "
        "class no_gpu, on a host with no usable GPU; cpu hides the GPUs. None: no model, no check.")
    cpus: int | None = Field(None, ge=1, description="CPUs per task on Slurm; None takes the executor's default.")
    mem_gb: int | None = Field(None, ge=1, description="Memory in GB on Slurm; None takes the executor's default.")
    estimate_gpuh: float | None = Field(None, ge=0, description="Declared forecast in GPU-hours; wins over measured throughput.")
    model: str | None = Field(None, description="Model the job works on; earlier jobs of the same kind and model give throughput.")
    work_units: float | None = Field(None, gt=0, description="Size of the job (tokens, items) for throughput forecasts.")
    tokens: float | None = Field(None, gt=0, description="Tokens the job trains on (every epoch) or generates at most: "
                                 "with active_params, the model-based forecast (tools/jobs/forecast.py).")
    active_params: int | None = Field(None, gt=0, description="Active parameters of the job's model (an MoE counts "
                                      "the experts a token is routed to).")
    job_class: Literal["train", "eval"] | None = Field(None, description="Whether the job trains or generates.")
    max_requeues: int = Field(3, ge=0, description="Most requeues after preemption or timeout before the job is a failure "
                              "(each one admitted against the budget first).")
    nomination: bool = Field(False, description="A nomination check (bundle, sealed confirmation): admitted against what "
                             "is left including the reserve, which is kept for it.")
    signal_delay_s: int | None = Field(
        None, ge=1, description="Seconds before the time limit when the job gets the checkpoint signal; None: derived "
        "from the save time measured by earlier jobs of the same kind and model (signal_lead_s).",
    )
    metrics_file: Path | None = Field(None, description="metrics.jsonl the job appends to; the progress line shows its last record.")

    @model_validator(mode="after")
    def _signal_inside_limit(self) -> Resources:
        if self.signal_delay_s is not None and self.signal_delay_s >= self.time_limit_min * 60:
            raise ValueError("signal_delay_s must be shorter than the time limit")
        return self


# ---- what an executor reports about a job ------------------------------------------------------

class Run(BaseModel):
    """One execution of a submitted job (a Slurm record, or one start of the local worker)."""

    model_config = ConfigDict(frozen=True)

    state: str = Field(description="PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, TIMEOUT, REQUEUED, ...")
    started: float | None = Field(description="Epoch seconds the run started; None while pending.")
    ended: float | None = Field(description="Epoch seconds the run ended; None while pending or running.")
    elapsed_s: float = Field(description="Seconds the run held its allocation.")
    devices: int = Field(description="Devices charged: allocated GPUs; a local CPU job one per process, a Slurm "
                         "CPU job none.")
    exit_code: int | None = Field(description="Exit code when the executor reports one.")


class Charge(BaseModel):
    """What a run (or a forecast) costs in the ledger's units."""

    model_config = ConfigDict(frozen=True)

    device_seconds: float = Field(description="Measured seconds held times devices.")
    gpu_hours: float = Field(description="GPU-hours charged for them.")
    charge: Literal["measured", "simulated"] = Field(
        description="measured: device-seconds / 3600; simulated: device-seconds times the lab's declared factor.")


def measured(device_seconds: float) -> Charge:
    return Charge(device_seconds=device_seconds, gpu_hours=device_seconds / 3600, charge="measured")


def signal_lead_s(measured_save_s: float | None, time_limit_s: float) -> int:
    """Seconds of warning before the time limit for a job whose longest measured save took `measured_save_s`.

    SIGNAL_LEAD_FACTOR times the save, at least SIGNAL_LEAD_FLOOR_S; capped at half the time limit (a job
    whose save needs more than that needs a longer limit: each run would spend half of it saving)."""
    lead = SIGNAL_LEAD_FLOOR_S
    if measured_save_s:
        lead = max(lead, math.ceil(SIGNAL_LEAD_FACTOR * measured_save_s))
    return max(1, min(lead, int(time_limit_s // 2)))


def _max_save_s(result: dict[str, Any] | None) -> float:
    """The longest resume save a completed trainer job measured (TrainResult.metrics, or an RFT run's train)."""
    train = (result or {}).get("train", result) or {}
    return float(train.get("metrics", {}).get("max_save_s", 0.0))


class Backend(Protocol):
    """One way of running submitit jobs: `LocalBackend` or `SlurmBackend`."""

    name: Literal["local", "slurm"]

    def submit(self, folder: Path, kind: str, resources: Resources, wrapped: Resumable,
               args: BaseModel) -> submitit.Job[Any]: ...

    def worker_env(self) -> dict[str, str]: ...

    def runs(self, job_id: str, folder: Path, resources: Resources) -> list[Run]: ...

    def devices(self, resources: Resources) -> int: ...

    def gpus(self, resources: Resources) -> int: ...

    def tasks(self, resources: Resources) -> int: ...

    def ranks(self, resources: Resources) -> int: ...

    def charge(self, device_seconds: float) -> Charge: ...

    def job(self, folder: Path, job_id: str, task: int) -> submitit.Job[Any]: ...

    def cancel(self, job_id: str, folder: Path) -> None: ...

    def unfit(self, resources: Resources) -> str | None: ...

    def pending_reason(self, job_id: str) -> str: ...


class LocalBackend:
    """submitit's LocalExecutor: real subprocesses on this machine, which outlive the agent.

    `simulated_gpuh_per_device_s` (the toy world's cost model): each run is charged its measured
    device-seconds times this factor, and marked simulated; None charges measured GPU-hours.
    `zygote`: each task forks from a warm server that has torch, transformers and the job modules
    imported already (tools/jobs/zygote.py), falling back to a plain python whenever it cannot; None: plain."""

    name: Literal["local"] = "local"

    def __init__(self, simulated_gpuh_per_device_s: float | None = None, zygote: Zygote | None = None,
                 host_gpus: int = 0) -> None:
        self.simulated_gpuh_per_device_s = simulated_gpuh_per_device_s
        self.zygote = zygote
        self.host_gpus = host_gpus
        # Jobs this process submitted: their controllers are our children, polled (and reaped) through
        # submitit's LocalJob; a resumed agent reads the others' liveness from /proc.
        self._submitted: dict[str, submitit.local.local.LocalJob[Any]] = {}

    def executor(self, folder: Path, kind: str, resources: Resources) -> submitit.LocalExecutor:
        # The controller copies this environment to the tasks: the zygote is chosen for it.
        python = self.zygote.prepare(os.environ) if self.zygote is not None else None
        ex = submitit.LocalExecutor(folder=folder, max_num_timeout=_NO_SUBMITIT_LIMIT, python=python)
        ex.update_parameters(timeout_min=resources.time_limit_min, gpus_per_node=resources.gpus or 0,
                             tasks_per_node=self.tasks(resources), signal_delay_s=resources.signal_delay_s)
        return ex

    def submit(self, folder: Path, kind: str, resources: Resources, wrapped: Resumable,
               args: BaseModel) -> submitit.Job[Any]:
        job = self.executor(folder, kind, resources).submit(wrapped, args)
        self._submitted[job.job_id] = job
        return job

    def worker_env(self) -> dict[str, str]:
        # torchrun's single-node rendezvous: loopback and a port free now (the workers bind it seconds later).
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}

    def _alive(self, job_id: str, folder: Path) -> bool:
        job = self._submitted.get(job_id)
        if job is None:
            return _controller_alive(int(job_id), folder)
        if job.get_info()["jobState"] == "RUNNING":  # polls the controller's process (and reaps it once exited)
            return True
        del self._submitted[job_id]
        return False

    def gpus(self, resources: Resources) -> int:
        return resources.gpus or 0

    def tasks(self, resources: Resources) -> int:
        return resources.tasks or max(1, resources.gpus or 0)

    def ranks(self, resources: Resources) -> int:
        return self.tasks(resources)  # one node: a lab config with nodes > 1 is Slurm's only

    def devices(self, resources: Resources) -> int:
        # The local machine's CPU processes are its devices when it has no GPU (the toy world's cost model); on a
        # host with GPUs a CPU job (a merge, a dataset build) holds none and is charged none, as on Slurm.
        if resources.gpus:
            return resources.gpus
        return 0 if self.host_gpus else self.tasks(resources)

    def charge(self, device_seconds: float) -> Charge:
        if self.simulated_gpuh_per_device_s is None:
            return measured(device_seconds)
        return Charge(device_seconds=device_seconds, gpu_hours=device_seconds * self.simulated_gpuh_per_device_s,
                      charge="simulated")

    def job(self, folder: Path, job_id: str, task: int) -> submitit.Job[Any]:
        return submitit.local.local.LocalJob(folder=folder, job_id=job_id, tasks=(task,))

    def runs(self, job_id: str, folder: Path, resources: Resources) -> list[Run]:
        devices, paths = self.devices(resources), RunPaths(folder, job_id)
        # Liveness before the events: a worker that ends between the two reads then still counts as
        # alive for this poll, instead of as killed mid-run with its end event unread.
        alive = self._alive(job_id, folder)
        runs, start = _runs_from_events(read_events(paths.events), devices)
        if alive:
            if start is not None:
                runs.append(Run(state="RUNNING", started=start, ended=None, elapsed_s=time.time() - start,
                                devices=devices, exit_code=None))
            elif runs:
                # The function returned but the worker is still writing its result: not over yet.
                runs[-1] = runs[-1].model_copy(update={"state": "RUNNING"})
            else:
                runs.append(Run(state="PENDING", started=None, ended=None, elapsed_s=0.0, devices=devices,
                                exit_code=None))
        elif start is not None:  # killed from outside mid-run (cancel, time limit, OOM killer)
            end = _last_write(folder, job_id)
            runs.append(Run(state=self._death_state(paths, end - start, resources), started=start,
                            ended=end, elapsed_s=end - start, devices=devices, exit_code=None))
        elif not runs:  # died before the function started
            runs.append(Run(state=self._death_state(paths, 0.0, resources), started=None, ended=None,
                            elapsed_s=0.0, devices=devices, exit_code=None))
        elif runs[-1].state == "FAILED" and not paths.result_pickle.exists():
            # Interrupted from outside (a cancel, or the controller's kill at the time limit): the
            # function logged its end as a failure but the worker never got to pickle an outcome.
            state = self._death_state(paths, runs[-1].elapsed_s, resources)
            runs[-1] = runs[-1].model_copy(update={"state": state})
        return runs

    def _death_state(self, paths: RunPaths, elapsed_s: float, resources: Resources) -> str:
        if paths.cancelled.exists():
            return "CANCELLED"
        if elapsed_s >= resources.time_limit_min * 60 - _SLACK_S:
            return "TIMEOUT"
        return "FAILED"

    def unfit(self, resources: Resources) -> str | None:
        return None  # this host runs what it is given (a job on GPUs it lacks fails as no_gpu)

    def pending_reason(self, job_id: str) -> str:
        return ""

    def cancel(self, job_id: str, folder: Path) -> None:
        # The marker tells any later observer (also a resumed agent) that the end was a cancel.
        RunPaths(folder, job_id).cancelled.touch()
        if not self._alive(job_id, folder):
            return
        if not _ignores_sigint(int(job_id)):
            # submitit's local controller stops its tasks on SIGINT (SIGINT, then SIGKILL after 1 s).
            os.kill(int(job_id), signal.SIGINT)
            return
        # An agent started in the background of a script ignores SIGINT, and so do the controllers
        # it spawns: stop the workers instead; the controller then sees them gone and exits.
        for pid in _children(int(job_id)):
            os.kill(pid, signal.SIGKILL)


def _runs_from_events(events: list[dict[str, Any]], devices: int) -> tuple[list[Run], float | None]:
    """Closed runs from the wrapper's events, and the start time of a run left open (or None)."""
    runs, start = [], None
    for e in events:
        if e["event"] == "start":
            start = e["t"]
        elif start is not None:
            state = "COMPLETED" if e.get("ok") else "FAILED"
            runs.append(Run(state=state, started=start, ended=e["t"], elapsed_s=e["t"] - start,
                            devices=devices, exit_code=None))
            start = None
    return runs, start


_CMDLINE_WAIT_S = 2.0  # how long an empty /proc cmdline (a process mid-exec) is read again


def _controller_alive(pid: int, folder: Path) -> bool:
    """Whether `pid` is a live submitit local controller of `folder` (not a reused pid, not a zombie).

    Read from /proc, for controllers another (killed) agent started. The launcher's own children are
    polled through their LocalJob instead: right after the fork a child's cmdline is still its parent's."""
    deadline = time.monotonic() + _CMDLINE_WAIT_S
    while True:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (FileNotFoundError, ProcessLookupError):
            return False
        if stat.rsplit(")", 1)[1].split()[0] == "Z":
            return False
        # A process in the middle of its exec reads an empty cmdline for a moment (seen under load right after
        # the Popen that started it returned): read again rather than call a starting controller dead.
        if cmdline or time.monotonic() >= deadline:
            return "submitit.local._local" in cmdline and str(folder) in cmdline
        time.sleep(0.01)


def _ignores_sigint(pid: int) -> bool:
    """Whether process `pid` ignores SIGINT (bit 1 of SigIgn in /proc/<pid>/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return bool(int(line.split()[1], 16) >> (signal.SIGINT - 1) & 1)
    raise RuntimeError(f"/proc/{pid}/status has no SigIgn line")


def _children(pid: int) -> list[int]:
    """Live child processes of `pid` (the local controller's workers)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):  # exited while we looked
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            children.append(int(stat.parent.name))
    return children


def _last_write(folder: Path, job_id: str) -> float:
    """When a killed local run last wrote anything (its heartbeat included): its end, to within
    tools.jobs.jobrun.HEARTBEAT_S."""
    return max((p.stat().st_mtime for p in folder.glob(f"{job_id}_*")), default=time.time())


class SlurmBackend:
    """submitit's SlurmExecutor; run states and elapsed times come from `sacct` (slurmdbd accounting).

    A job asks for one node with `tasks` processes (one per GPU by default), each with
    `cpus_per_task` CPUs; it is charged the GPUs sacct reports allocated (AllocTRES gres/gpu).
    `zygote` (single-host clusters, `executor.slurm.zygote`): each task forks from a warm server on this
    host, as a local job's does; a task on another node finds none and runs a plain python."""

    name: Literal["slurm"] = "slurm"

    def __init__(self, partition: str, *, account: str | None = None, qos: str | None = None, gpus_per_node: int = 1,
                 cpus_per_task: int = 8, mem_gb: int = 64, extra_sbatch: Sequence[str] = (),
                 zygote: Zygote | None = None):
        self.partition, self.account, self.qos = partition, account, qos
        self.gpus_per_node, self.cpus_per_task, self.mem_gb = gpus_per_node, cpus_per_task, mem_gb
        self.additional_parameters = _sbatch_lines(list(extra_sbatch))
        self.zygote = zygote
        self._nodes: list[PartitionNode] | None = None  # the partition's node shapes, read from sinfo once

    @classmethod
    def from_section(cls, section: SlurmSection, zygote: Zygote | None = None) -> SlurmBackend:
        return cls(section.partition, account=section.account, qos=section.qos, gpus_per_node=section.gpus_per_node,
                   cpus_per_task=section.cpus_per_task, mem_gb=section.mem_gb, extra_sbatch=section.extra_sbatch,
                   zygote=zygote)

    def executor(self, folder: Path, kind: str, resources: Resources) -> submitit.SlurmExecutor:
        # sbatch passes this environment on to the tasks (--export=ALL): the zygote is chosen for it.
        python = self.zygote.prepare(os.environ) if self.zygote is not None else None
        ex = submitit.SlurmExecutor(folder=folder, max_num_timeout=_NO_SUBMITIT_LIMIT, python=python)
        params: dict[str, Any] = {
            "job_name": kind, "partition": self.partition, "time": math.ceil(resources.time_limit_min),
            "nodes": resources.nodes, "gpus_per_node": self.gpus(resources), "ntasks_per_node": self.tasks(resources),
            "cpus_per_task": resources.cpus or self.cpus_per_task, "mem": f"{resources.mem_gb or self.mem_gb}GB",
            "signal_delay_s": resources.signal_delay_s,
            # Slurm would requeue a preempted or failed-node job in place, a new run no admission saw: the
            # job ends instead and the launcher admits (or refuses) the requeue.
            "additional_parameters": {"no-requeue": True, **self.additional_parameters},
            # A task that fails ends the job's other tasks at once: they would otherwise wait in a collective or
            # the rendezvous until the time limit, holding their GPUs.
            "srun_args": ["--kill-on-bad-exit=1"],
        }
        if python is not None:  # how long a task may wait for a zygote still importing is a share of this
            params["setup"] = [f"export {TIME_LIMIT_VAR}={int(60 * resources.time_limit_min)}"]
        if self.account:
            params["account"] = self.account
        if self.qos:
            params["qos"] = self.qos
        ex.update_parameters(**params)
        return ex

    def submit(self, folder: Path, kind: str, resources: Resources, wrapped: Resumable,
               args: BaseModel) -> submitit.Job[Any]:
        return self.executor(folder, kind, resources).submit(wrapped, args)

    def worker_env(self) -> dict[str, str]:
        return {}  # the rendezvous is read on the node from Slurm's environment (tools/jobs/jobrun.py)

    def gpus(self, resources: Resources) -> int:
        return self.gpus_per_node if resources.gpus is None else resources.gpus

    def tasks(self, resources: Resources) -> int:
        return resources.tasks or max(1, self.gpus(resources))

    def ranks(self, resources: Resources) -> int:
        return self.tasks(resources) * resources.nodes

    def devices(self, resources: Resources) -> int:
        # GPUs of every node; a CPU job holds none and is charged none (the ledger counts GPU-hours).
        return self.gpus(resources) * resources.nodes

    def charge(self, device_seconds: float) -> Charge:
        return measured(device_seconds)

    def job(self, folder: Path, job_id: str, task: int) -> submitit.Job[Any]:
        return submitit.SlurmJob(folder=folder, job_id=job_id, tasks=(task,))

    def runs(self, job_id: str, folder: Path, resources: Resources) -> list[Run]:
        out = _sacct(["sacct", "-j", job_id, "--duplicates", "-X", "-P", "-n",
                      "-o", "State,ElapsedRaw,AllocTRES,Start,End,ExitCode"])
        runs = [_sacct_run(line) for line in out.splitlines() if line.strip()]
        # Just after sbatch the accounting record may not exist yet: the job is pending.
        return runs or [Run(state="PENDING", started=None, ended=None, elapsed_s=0.0, devices=self.devices(resources),
                            exit_code=None)]

    def cancel(self, job_id: str, folder: Path) -> None:
        subprocess.run(["scancel", job_id], check=True, timeout=60)

    def need(self, resources: Resources) -> NodeNeed:
        """What one node of the job must have, as `executor` asks Slurm for it."""
        return NodeNeed(cpus=(resources.cpus or self.cpus_per_task) * self.tasks(resources),
                        mem_gb=resources.mem_gb or self.mem_gb, gpus=self.gpus(resources),
                        time_limit_min=math.ceil(resources.time_limit_min))

    def unfit(self, resources: Resources) -> str | None:
        """Why no node of the partition can run the job (it would pend forever), or None; None too when sinfo
        cannot be asked (sbatch then says what is wrong)."""
        if self._nodes is None:
            self._nodes = partition_nodes(self.partition)
        return None if self._nodes is None else partition_problem(self.partition, self._nodes, self.need(resources))

    def pending_reason(self, job_id: str) -> str:
        """Slurm's reason a job waits (squeue %r: Resources, Priority, PartitionNodeLimit, ...); '' when unknown."""
        try:
            out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%r"], capture_output=True, text=True,
                                 timeout=60, check=True).stdout
        except (OSError, subprocess.SubprocessError):
            return ""
        return shown(out.strip())[:200]


class PartitionNode(BaseModel):
    """One shape of node of a Slurm partition, as `sinfo -o "%l %c %m %G"` groups them."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    cpus: int = Field(description="CPUs of one node.")
    mem_mb: int = Field(description="Memory of one node, MB.")
    gpus: int = Field(description="GPUs of one node (its gres/gpu).")
    time_limit_min: int | None = Field(None, description="The partition's time limit in minutes; None: infinite.")


class NodeNeed(BaseModel):
    """What one node of a job asks for: CPUs of all its tasks, memory, GPUs."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    cpus: int = Field(description="CPUs per task times tasks per node.")
    mem_gb: int = Field(description="Memory per node, GB (sbatch --mem=<n>GB: n x 1024 MB).")
    gpus: int = Field(description="GPUs per node.")
    time_limit_min: int | None = Field(None, description="The job's time limit in minutes (sbatch --time).")


_LEADING_INT = re.compile(r"\d+")
_GRES_GPU = re.compile(r"(?:^|,)gpu(?::[^:,()]+)?:(\d+)")


def partition_nodes(partition: str) -> list[PartitionNode] | None:
    """The node shapes of a partition (`sinfo -h -p PART -o "%l %c %m %G"`); [] when the partition does not exist,
    None when sinfo cannot be asked (not installed, the controller down)."""
    try:
        out = subprocess.run(["sinfo", "-h", "-p", partition, "-o", "%l %c %m %G"], capture_output=True, text=True,
                             timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return sinfo_nodes(out)


def sinfo_nodes(out: str) -> list[PartitionNode]:
    """The node shapes of `sinfo -h -o "%l %c %m %G"`'s lines (time limit, CPUs, memory MB, gres)."""
    nodes = []
    for line in out.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        cpus, mem = (_LEADING_INT.match(f) for f in fields[1:3])  # "64+" when a group's nodes differ: its least
        gres = fields[3] if len(fields) > 3 else ""
        if cpus and mem:
            nodes.append(PartitionNode(cpus=int(cpus.group()), mem_mb=int(mem.group()),
                                       gpus=sum(int(n) for n in _GRES_GPU.findall(gres)),
                                       time_limit_min=sinfo_minutes(fields[0])))
    return nodes


_SINFO_TIME = re.compile(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?")


def sinfo_minutes(text: str) -> int | None:
    """A Slurm time limit as sinfo prints it (`infinite`, `D-HH:MM:SS`, `HH:MM:SS`, `MM:SS`, minutes), in whole
    minutes (seconds round up); None: no limit (or one sinfo does not state)."""
    match = _SINFO_TIME.fullmatch(text)
    if match is None:
        return None  # "infinite", "UNLIMITED", "n/a"
    days, *parts = match.groups()
    units = [int(p) for p in parts if p is not None]
    hours, minutes, seconds = [0] * (3 - len(units)) + units if len(units) > 1 else [0, units[0], 0]
    return int(days or 0) * 24 * 60 + hours * 60 + minutes + (1 if seconds else 0)


def slurm_problems(section: ExecutorSection) -> list[str]:
    """Before a session opens on Slurm: each job kind's resources (lab.toml's [executor.resources.<kind>] over the
    [executor.slurm] defaults) that no node of the partition can hold, by the rule the launcher refuses a job with
    before submission (SlurmBackend.unfit); one line per distinct problem, naming its kinds. [] when sinfo cannot be
    asked."""
    assert section.slurm is not None, "called for a slurm executor section"
    backend, found = SlurmBackend.from_section(section.slurm), {}
    for kind in ResourcesSection.model_fields:
        given = section.kind_resources(kind, 0)  # type: ignore[arg-type]
        problem = backend.unfit(Resources(time_limit_min=given.time_limit_min or section.time_limit_min, gpus=given.gpus,
                                          nodes=given.nodes, cpus=given.cpus, mem_gb=given.mem_gb))
        if problem is not None:
            found.setdefault(problem, []).append(kind)
    return [f"[executor] jobs of kind {', '.join(kinds)}: {problem}" for problem, kinds in found.items()]


def partition_problem(partition: str, nodes: Sequence[PartitionNode], need: NodeNeed) -> str | None:
    """Why no node of the partition has what one node of the job needs, or None: a job no node can hold pends
    forever, without a word from Slurm to the one who submitted it."""
    if not nodes:
        return f"Slurm partition {partition!r} has no nodes (sinfo -p {partition} lists none): check [executor.slurm] partition"
    limits = [n.time_limit_min for n in nodes]
    if need.time_limit_min is not None and None not in limits and need.time_limit_min > max(limits):
        return (f"Slurm partition {partition!r} allows jobs of at most {max(limits)} minutes (sinfo's time limit) and "
                f"the job asks {need.time_limit_min}; it would pend forever: set [executor] time_limit_min or "
                "[executor.resources.<kind>] time_limit_min to at most the partition's limit")
    if any(n.cpus >= need.cpus and n.mem_mb >= need.mem_gb * 1024 and n.gpus >= need.gpus for n in nodes):
        return None
    big = max(nodes, key=lambda n: (n.gpus, n.cpus, n.mem_mb))
    return (f"no node of Slurm partition {partition!r} has {need.cpus} CPU(s), {need.mem_gb} GB and {need.gpus} GPU(s) "
            f"(its largest: {big.cpus} CPUs, {big.mem_mb // 1024} GB, {big.gpus} GPU(s)); the job would pend forever: "
            "set [executor.slurm] cpus_per_task and mem_gb (defaults 8 and 64) or [executor.resources.<kind>] to "
            "what the partition has")


SACCT_RETRY_S = (1.0, 2.0, 4.0, 8.0, 15.0)  # waits between tries: about half a minute in all


def _sacct(command: list[str]) -> str:
    """sacct's output. slurmdbd answers with an error while it restarts or is busy (a loaded node, a database
    lock): a job's accounting is asked again after a wait instead of failing the session on one bad answer; a
    slurmdbd still down after about 30 s is one clear error naming the command and its last message."""
    for wait in SACCT_RETRY_S:
        try:
            return _run_sacct(command)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
            time.sleep(wait)
    try:
        return _run_sacct(command)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        said = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr or ""
        raise RuntimeError(f"{' '.join(command[:3])}: Slurm accounting did not answer after "
                           f"{len(SACCT_RETRY_S) + 1} tries: {said.strip() or exc}") from None


def _run_sacct(command: list[str]) -> str:
    return subprocess.run(command, check=True, capture_output=True, text=True, timeout=60).stdout


def _sacct_run(line: str) -> Run:
    """One sacct record; its devices are the GPUs it was allocated (all nodes), none for a CPU job."""
    state, elapsed, tres, start, end, exit_code = line.split("|")
    gpus = re.search(r"gres/gpu=(\d+)", tres)
    return Run(state=state.split()[0], started=_sacct_time(start), ended=_sacct_time(end),
               elapsed_s=float(elapsed or 0), devices=int(gpus.group(1)) if gpus else 0,
               exit_code=int(exit_code.split(":")[0]) if exit_code else None)


def _sacct_time(text: str) -> float | None:
    return None if text in {"", "Unknown", "None"} else datetime.fromisoformat(text).timestamp()


def _raised(paths: RunPaths) -> tuple[str, Failure | None] | None:
    """What the job wrapper recorded of the last run's own exception (tools/jobs/jobrun.py): its type and
    class; None when the run ended without one (killed, or a rank other than 0 failed)."""
    events = read_events(paths.events)
    last = events[-1] if events else {}
    if last.get("event") != "end" or last.get("ok") is not False or not isinstance(last.get("error"), str):
        return None
    return last["error"], None if last.get("failure") is None else Failure.model_validate(last["failure"])


def _raised_message(paths: RunPaths) -> str:
    """The job's own error message as its wrapper recorded it (already safe there), made safe again here: this
    process holds the lab's keys, which a worker may not; '' when the run recorded none."""
    events = read_events(paths.events)
    message = events[-1].get("message") if events and events[-1].get("event") == "end" else None
    return shown(redact(message))[:2 * MESSAGE_LIMIT] if isinstance(message, str) else ""


def _sbatch_lines(lines: list[str]) -> dict[str, Any]:
    """`#SBATCH --constraint=h100` / `--exclusive` lines from lab.toml into submitit's parameters."""
    params: dict[str, Any] = {}
    for line in lines:
        flag = line.removeprefix("#SBATCH").strip()
        if not flag.startswith("--"):
            raise ValueError(f"executor.slurm.extra_sbatch: {line!r} is not a long option like '--constraint=h100'")
        key, _, value = flag[2:].partition("=")
        params[key] = value if value else True
    return params


def make_backend(section: ExecutorSection) -> Backend:
    """The backend of a lab's `[executor]` section."""
    if section.kind == "slurm":
        assert section.slurm is not None, "ExecutorSection validates that kind = 'slurm' has a slurm section"
        on = section.slurm.zygote and env_allows_zygote(os.environ)
        return SlurmBackend.from_section(section.slurm, zygote=Zygote(zygote_dir(os.environ)) if on else None)
    return LocalBackend(section.simulated_gpuh_per_device_s, zygote=local_zygote(section, os.environ),
                        host_gpus=local_gpus(os.environ))


def local_zygote(section: ExecutorSection, env: typing.Mapping[str, str]) -> Zygote | None:
    """The local jobs' fork server: on unless lab.toml's `executor.zygote = false` or POSTLAB_ZYGOTE=0;
    its zygotes live in POSTLAB_ZYGOTE_DIR (default /tmp/postlab-zygote-UID)."""
    if not section.zygote or not env_allows_zygote(env):
        return None
    return Zygote(zygote_dir(env))


def env_allows_zygote(env: typing.Mapping[str, str]) -> bool:
    return env.get("POSTLAB_ZYGOTE", "1") != "0"


# ---- what the notebook keeps of a job, and rebuilding it ---------------------------------------

# Modules that moved into tools/ subpackages keep their old names in job keys, and their old recorded paths still
# resolve, so a session recorded before the move replays and resumes to the same keys.
MOVED = {f"tools.{old}": f"tools.{package}.{old}" for package, olds in {
    "jobs": ("launcher", "zygote", "executor", "jobrun", "failures", "progress", "probe"),
    "nomination": ("bundle", "card", "check_bundle", "publish"),
    "data": ("feedback", "splits", "leak", "datasets")}.items() for old in olds}
_KEY_MODULE = {new: old for old, new in MOVED.items()}


def import_path(obj: Callable[..., Any] | type) -> str:
    """'module:qualname' of a module-level function or class."""
    return f"{obj.__module__}:{obj.__qualname__}"


def resolve(path: str) -> Any:
    """The object an `import_path` names."""
    module, _, qualname = path.partition(":")
    obj: Any = importlib.import_module(MOVED.get(module, module))
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


@dataclass(frozen=True)
class _Spec:
    """Everything needed to (re)submit and read back one keyed job; rebuilt from its rows by `attach`."""

    kind: str
    fn: Callable[[Any], Any]
    args: BaseModel
    resources: Resources
    result_type: type[BaseModel]


def _spec_of_call(kind: str, fn: Callable[..., Any], args: BaseModel, resources: Resources) -> _Spec:
    """Check that `fn` is a job `attach` can rebuild: importable, one pydantic config in, a pydantic model out."""
    name = f"{fn.__module__}.{fn.__qualname__}"
    hints = typing.get_type_hints(fn)
    result_type = hints.get("return")
    if not (isinstance(result_type, type) and issubclass(result_type, BaseModel)):
        raise TypeError(f"{name} must be annotated to return a pydantic model")
    params = list(inspect.signature(fn).parameters)
    config_type = hints.get(params[0]) if len(params) == 1 else None
    if not (isinstance(config_type, type) and isinstance(args, config_type)):
        raise TypeError(f"{name} must take one argument annotated with the config's type {type(args).__name__}")
    try:
        importable = resolve(import_path(fn)) is fn
    except (ImportError, AttributeError):
        importable = False
    if not importable or fn.__module__ == "__main__":
        raise TypeError(f"{name} must be a module-level function of an importable module "
                        "(a resumed agent re-imports it as module:qualname)")
    return _Spec(kind, fn, args, resources, result_type)


def _spec_of_record(first: JobRecord, args: BaseModel | None = None, latest: JobRecord | None = None) -> _Spec:
    """The spec stored with a job's first attempt: its function, result model and config (`args`: the config as
    its caller has it, used instead of validating the stored one again: a config's checks of the world held when it
    was made, and no longer do once the job ran, e.g. a merge's fresh output directory that the job, living on after
    its agent was killed, has since created), with the resources of its `latest` attempt (a requeue's time limit is
    shortened to what the budget has left, Launcher._requeue_spec)."""
    if first.fn is None or first.result_type is None:
        raise LookupError(f"job {first.key[:12]} was recorded before jobs named their function; "
                          "submit it again with its function to re-attach")
    try:
        fn, result_type = resolve(first.fn), resolve(first.result_type)
    except (ImportError, AttributeError) as err:
        raise LookupError(f"job {first.key[:12]}: its function {first.fn} or result model {first.result_type} "
                          f"no longer imports ({err})") from err
    hints = typing.get_type_hints(fn)
    config_type = hints[next(iter(inspect.signature(fn).parameters))]
    recorded = first.resources["args"]
    stored = dict((latest or first).resources)
    stored.pop("args")
    args = args if args is not None else config_type.model_validate(recorded)
    stored.pop("memory", None)  # the memory estimate recorded with a training job, not a resource
    stored.pop("forecast", None)  # the attempt's forecast, recorded beside what it cost
    return _Spec(first.kind, fn, args, Resources.model_validate(stored), result_type)


# ---- the launcher ------------------------------------------------------------------------------

class Forecast(BaseModel):
    gpuh: float = Field(description="Forecast GPU-hours of the job, in the units the ledger charges.")
    source: Literal["declared", "throughput", "model", "time_limit"] = Field(description="Where the forecast came from.")
    device_s: float = Field(0.0, description="The same forecast in device-seconds (seconds held x devices), the unit "
                            "a settled run records (JobRecord.device_seconds).")


class Launcher:
    """Submits, re-attaches and settles jobs for one session of one notebook; see the module docstring."""

    def __init__(self, notebook: Notebook, session: str, backend: Backend, root: Path, *, poll_s: float | None = None,
                 gpu_memory_gib: float | None = None, lab_roots: Sequence[str] = (),
                 pending_report_s: float | None = None):
        self.nb, self.session, self.backend, self.root = notebook, session, backend, Path(root)
        # An attempt still pending this long is reported once (a `wait` decision; the CLI prints it); None: never.
        self.pending_report_s = pending_report_s
        self._reported: set[tuple[str, int]] = set()
        # The spellings of the lab's root (LabPaths.spellings): paths under it enter job keys lab-relative.
        self.lab_roots = tuple(lab_roots)
        self.gpu_memory_gib = gpu_memory_gib  # one GPU's memory; None: training jobs are not admitted by memory
        # Each Slurm poll is one sacct call through slurmdbd: keep it gentle on a shared cluster.
        self.poll_s = poll_s if poll_s is not None else (2.0 if backend.name == "slurm" else 0.25)
        self._specs: dict[str, _Spec] = {}

    @classmethod
    def from_section(cls, notebook: Notebook, session: str, section: ExecutorSection, root: Path,
                     *, poll_s: float | None = None, lab_roots: Sequence[str] = ()) -> Launcher:
        """The launcher of a lab's `[executor]` section."""
        pending = section.slurm.pending_report_min * 60 if section.kind == "slurm" and section.slurm else None
        return cls(notebook, session, make_backend(section), root, poll_s=poll_s, gpu_memory_gib=section.gpu_memory_gib,
                   lab_roots=lab_roots, pending_report_s=pending)

    # -- handles ---------------------------------------------------------------------------------

    def submit(self, kind: str, fn: Callable[[C], R], args: C, resources: Resources) -> Job[R]:
        """Submit `fn(args)` once per (kind, fn, session, args); later calls re-attach to it."""
        spec = _spec_of_call(kind, fn, args, self.with_signal_lead(kind, resources))
        key = self.key(kind, fn, args)
        if self.nb.get_job(key) is None:
            self._specs[key] = spec
            self._launch(key, spec, attempt=1, reason="new job")
            job: Job[R] = Job(self, key, spec.result_type)
            return job
        first = self.nb.get_job(key, 1)
        if first.fn is None:  # a row from before jobs named their function: only the call has it
            self._specs.setdefault(key, spec)
        else:  # the caller's config is the recorded one (same key), already validated where it was made
            self._specs.setdefault(key, _spec_of_record(first, spec.args, self.nb.get_job(key)))
        return self.attach(key)

    def attach(self, key: str) -> Job[Any]:
        """The handle of a recorded job, from the notebook alone (a resumed agent keeps only keys).

        Finishes what a crash interrupted: an attempt recorded but never submitted is submitted, a
        submission whose id was not stored is adopted by its files, a failure settled but not yet
        followed up gets its policy applied. Never submits a job the executor already has."""
        first = self.nb.get_job(key, 1)
        if first is None or first.session != self.session:
            raise LookupError(f"no job {key[:12]} in session {self.session!r} of {self.nb.path}")
        if first.executor != self.backend.name:
            raise LookupError(f"job {key[:12]} ran on the {first.executor} executor; "
                              f"this launcher is {self.backend.name}")
        spec = self._spec(key)
        self._recover(key, spec)
        return Job(self, key, spec.result_type)

    def key(self, kind: str, fn: Callable[..., Any], args: BaseModel) -> str:
        """Idempotency key: the tool (kind and function) and the canonical args, within this session; paths
        inside the lab enter lab-relative, so a lab reached by another spelling, copied or moved keeps its keys."""
        module = _KEY_MODULE.get(fn.__module__, fn.__module__)
        return tool_call_key(f"{kind}:{module}.{fn.__qualname__}",
                             {"session": self.session, "args": portable(args.model_dump(mode="json"), self.lab_roots)})

    def attempts(self, key: str) -> list[JobRecord]:
        return self.nb.jobs(session=self.session, key=key)

    def _spec(self, key: str) -> _Spec:
        if key not in self._specs:
            first = self.nb.get_job(key, 1)
            assert first is not None, "specs are looked up for recorded keys only"
            self._specs[key] = _spec_of_record(first, latest=self.nb.get_job(key))
        return self._specs[key]

    # -- admission -------------------------------------------------------------------------------

    def forecast(self, kind: str, resources: Resources) -> Forecast:
        """The job's cost: as declared; else one run's seconds from this lab's earlier runs, their start-up and
        write-out apart from their work (forecast.run_seconds); else its work units at the throughput of earlier jobs
        of its kind and model; else from its tokens and model; else its time limit on its devices. Never above one
        run's bound."""
        if resources.estimate_gpuh is not None:
            return self._forecast(resources.estimate_gpuh, "declared")
        bound = self.run_bound(resources)
        devices = self.backend.devices(resources)
        size = forecast.RunSize(kind=kind, model_job=resources.device is not None, units=resources.work_units,
                                tokens=resources.tokens, active_params=resources.active_params,
                                job_class=resources.job_class)
        seconds = forecast.run_seconds(size, self.measured_runs())
        if seconds is not None:
            made = self._forecast(self.backend.charge(seconds * devices).gpu_hours, "throughput")
            return min(made, bound, key=lambda f: f.gpuh)
        rate = self._throughput(kind, resources.model)
        if rate is not None and resources.work_units is not None:
            return self._forecast(resources.work_units / rate, "throughput")
        if resources.tokens is not None and resources.active_params is not None and resources.job_class is not None:
            # Nothing measured yet: the model's work at a declared MFU after a declared start-up (a first job's
            # forecast was its work alone, near zero, while its start-up alone took seconds).
            startup = self.backend.charge(forecast.DEFAULT_HARDWARE.startup_s(kind) * devices).gpu_hours
            work = self._model_forecast(resources)
            return min(self._forecast(startup + work.gpuh, "model"), bound, key=lambda f: f.gpuh)
        return bound

    def _forecast(self, gpuh: float, source: Literal["declared", "throughput", "model", "time_limit"]) -> Forecast:
        per_device_s = self.backend.charge(1.0).gpu_hours
        return Forecast(gpuh=gpuh, source=source, device_s=gpuh / per_device_s if per_device_s else 0.0)

    def measured_runs(self) -> list[forecast.MeasuredRun]:
        """This notebook's completed jobs whose results split their wall (core/wall.py), for run_seconds."""
        runs = []
        for j in self.nb.jobs():
            wall = wall_of(j.result) if j.state == "completed" else None
            if wall is None:
                continue
            r = j.resources
            runs.append(forecast.MeasuredRun(
                kind=j.kind, model_job=r.get("device") is not None, fixed_s=wall.startup_s + wall.write_s,
                work_s=wall.work_s, units=r.get("work_units"), tokens=r.get("tokens"),
                active_params=r.get("active_params")))
        return runs

    def _model_forecast(self, resources: Resources) -> Forecast:
        """From the job's tokens and its model's active parameters, at the speed this lab's earlier jobs of the same
        class achieved (in the ledger's own GPU-hours), else a declared MFU; never above one run's bound."""
        measured = [forecast.MeasuredJob(kind=resources.job_class, tokens=j.resources["tokens"],
                                         gpu_seconds=j.gpu_hours * 3600, active_params=j.resources["active_params"])
                    for j in self.nb.jobs() if j.state == "completed" and j.gpu_hours
                    and j.resources.get("job_class") == resources.job_class and j.resources.get("tokens")
                    and j.resources.get("active_params")]
        model = forecast.ModelCompute(total_params=resources.active_params, active_params=resources.active_params)
        size = forecast.train_forecast if resources.job_class == "train" else forecast.eval_forecast
        gpus = max(1, self.backend.devices(resources))
        bound = self.run_bound(resources)
        return min(self._forecast(size(resources.tokens, model, gpus, measured).gpu_hours, "model"), bound,
                   key=lambda f: f.gpuh)

    def run_bound(self, resources: Resources) -> Forecast:
        """The most one run can cost: its whole time limit on all its devices, charged as runs are."""
        device_seconds = resources.time_limit_min * 60 * self.backend.devices(resources)
        return Forecast(gpuh=self.backend.charge(device_seconds).gpu_hours, source="time_limit",
                        device_s=device_seconds)

    def predicted(self, kind: str, resources: Resources, payload: LaunchPayload) -> Forecast:
        """What the attempt is expected to cost, recorded on its row beside what it then cost: its admission
        forecast, or for a job admitted on a declared cost (the nomination's jobs on the reserve, data jobs declared
        free) the launcher's own forecast of it."""
        if resources.estimate_gpuh is None:
            return self._forecast(payload.forecast_gpuh, payload.forecast_source)
        return self.forecast(kind, resources.model_copy(update={"estimate_gpuh": None}))

    def admission_forecast(self, kind: str, resources: Resources, attempt: int) -> Forecast:
        """What an attempt is admitted on: the job's forecast; for a requeue or retry at least one run's
        bound, since the run before it already outlived any smaller estimate."""
        forecast = self.forecast(kind, resources)
        if attempt == 1:
            return forecast
        bound = self.run_bound(resources)
        return bound if bound.gpuh > forecast.gpuh else forecast

    def with_signal_lead(self, kind: str, resources: Resources) -> Resources:
        """The resources with their signal lead time set: as given, else derived from measured saves."""
        if resources.signal_delay_s is not None:
            return resources
        lead = signal_lead_s(self.measured_save_s(kind, resources.model), resources.time_limit_min * 60)
        return resources.model_copy(update={"signal_delay_s": lead})

    def measured_save_s(self, kind: str, model: str | None) -> float | None:
        """The longest save earlier completed jobs of this kind and model measured (None: none saved)."""
        saves = [_max_save_s(j.result) for j in self.nb.jobs(kind=kind)
                 if j.state == "completed" and j.resources.get("model") == model]
        return max(saves, default=0.0) or None

    def check_memory(self, key: str, kind: str, args: BaseModel, resources: Resources, attempt: int = 1
                     ) -> dict[str, Any] | None:
        """A training job's memory estimate per GPU (GiB, by part) for its attempt row; a job on GPUs whose
        estimate exceeds one GPU is a recorded refusal (MemoryRefused). None for jobs that do not train."""
        # Imported here: the launcher serves data and eval jobs without loading torch and transformers.
        from trainers.common import TrainConfig
        from trainers.memory import estimate_job

        if not isinstance(args, TrainConfig):
            return None
        gpus, world = self.backend.gpus(resources), self.backend.ranks(resources)
        est = estimate_job(args, world)
        parts = {k: round(v / GIB, 3) for k, v in est.model_dump().items() if k != "world_size"}
        memory = {"world_size": world, "per_gpu_gib": round(est.total / GIB, 3), "parts_gib": parts}
        if gpus == 0 or self.gpu_memory_gib is None or est.total <= self.gpu_memory_gib * GIB:
            return memory
        top = ", ".join(f"{k} {v:.1f}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1])[:3])
        options = fitting_alternatives(args, world, self.gpu_memory_gib)
        would_fit = [f"{o.change} ({o.per_gpu_gib:.1f} GiB)" for o in options]
        fit = "; would fit: " + ", ".join(would_fit) if would_fit else \
            "; neither micro-batch 1, LoRA nor more GPUs would fit"
        self.nb.record_decision(
            self.session, "refuse", f"{kind} cannot fit its GPUs: estimated {est.total / GIB:.1f} GiB per GPU on "
            f"{gpus} GPU(s) > {self.gpu_memory_gib:g} GiB ({top} GiB){fit}",
            MemoryRefusal(key=key, kind=kind, attempt=attempt, gpus=gpus, estimate_gib=memory["per_gpu_gib"],
                          gpu_memory_gib=self.gpu_memory_gib, parts_gib=parts, would_fit=would_fit))
        raise MemoryRefused(f"{kind}: estimated {est.total / GIB:.1f} GiB per GPU exceeds {self.gpu_memory_gib:g} GiB "
                            f"on {gpus} GPU(s){fit}")

    def check_partition(self, key: str, kind: str, resources: Resources, attempt: int = 1) -> None:
        """A job no node of its partition can hold is a recorded refusal (PartitionRefused), before submission."""
        problem = self.backend.unfit(resources)
        if problem is None:
            return
        self.nb.record_decision(self.session, "refuse", f"{kind} cannot run on its partition: {problem}",
                                PartitionRefusal(key=key, kind=kind, attempt=attempt, reason=problem))
        raise PartitionRefused(f"{kind}: {problem}")

    def _report_pending(self, key: str, record: JobRecord) -> None:
        """Once per attempt, a job still pending past the bound: a `wait` decision with the executor's reason."""
        if self.pending_report_s is None or (key, record.attempt) in self._reported:
            return
        pending_s = time.time() - datetime.fromisoformat(record.submitted_at).timestamp()
        if pending_s < self.pending_report_s:
            return
        self._reported.add((key, record.attempt))
        if any(d.payload.key == key and d.payload.attempt == record.attempt
               for d in self.nb.decisions(self.session, kind="wait")):
            return  # reported before a resume
        reason = self.backend.pending_reason(record.external_id or "")
        self.nb.record_decision(
            self.session, "wait", f"{record.kind} still pending after {pending_s / 60:.0f} min"
            + (f" (Slurm: {reason})" if reason else "") + ": close the session (run_agent.py close) or wait",
            WaitPayload(key=key, kind=record.kind, attempt=record.attempt, pending_s=round(pending_s, 1), reason=reason))

    def _throughput(self, kind: str, model: str | None) -> float | None:
        """Work units per GPU-hour over completed earlier jobs of this kind and model (all attempts count)."""
        attempts = [j for j in self.nb.jobs(kind=kind) if j.resources.get("model") == model]
        done = {j.key: j.resources.get("work_units") or 0.0 for j in attempts if j.state == "completed"}
        units = sum(done.values())
        hours = sum(j.gpu_hours or 0.0 for j in attempts if j.key in done)
        return units / hours if units and hours else None

    def admit(self, key: str, kind: str, resources: Resources, attempt: int = 1) -> LaunchPayload:
        """The launch payload of an attempt whose forecast fits what is left of the budget (above the
        reserve, unless it is a nomination check); otherwise a recorded refusal and BudgetRefused."""
        forecast = self.admission_forecast(kind, resources, attempt)
        payload = LaunchPayload(key=key, kind=kind, attempt=attempt, forecast_gpuh=forecast.gpuh,
                                forecast_source=forecast.source, executor=self.backend.name)
        admission = session_ledger(self.nb, self.session).admission(forecast.gpuh, resources.nomination)
        if admission.admitted:
            return payload
        what = kind if attempt == 1 else f"{kind} attempt {attempt}"
        self.nb.record_decision(self.session, "refuse", f"{what} would overrun the budget: {admission.reason} GPU-h",
                                BudgetRefusal(**payload.model_dump()))
        raise BudgetRefused(f"{what}: forecast {forecast.gpuh:.3f} GPU-h does not fit; "
                            f"{admission.left_gpuh:.3f} GPU-h left above the reserve")

    def _requeue_spec(self, key: str, spec: _Spec) -> _Spec:
        """A later attempt's spec: its time limit shortened, like a new job's (tools/session.py time_limit_min), to
        what the budget has left now that the runs before it are spent (a job sized to the budget's last minutes
        would otherwise never fit again after a lost run); the key's spec from here on."""
        r = spec.resources
        minute_gpuh = self.run_bound(r.model_copy(update={"time_limit_min": 1.0})).gpuh
        limit = session_ledger(self.nb, self.session).time_limit_min(r.time_limit_min, minute_gpuh, r.nomination)
        if limit >= r.time_limit_min:
            return spec
        lead = None if r.signal_delay_s is None else max(1, min(r.signal_delay_s, int(limit * 60 // 2)))
        spec = replace(spec, resources=r.model_copy(update={"time_limit_min": limit, "signal_delay_s": lead}))
        self._specs[key] = spec
        return spec

    def _launch(self, key: str, spec: _Spec, attempt: int, reason: str) -> None:
        """Admission, then the attempt row and the launch decision, then the submission."""
        if attempt > 1:
            spec = self._requeue_spec(key, spec)
        args = self._attempt_args(key, spec)
        self.check_partition(key, spec.kind, spec.resources, attempt)
        memory = self.check_memory(key, spec.kind, args, spec.resources, attempt)
        payload = self.admit(key, spec.kind, spec.resources, attempt)
        folder = self.root / f"{key[:16]}-{attempt}"
        resources = {**spec.resources.model_dump(mode="json"), "args": args.model_dump(mode="json"),
                     "forecast": self.predicted(spec.kind, spec.resources, payload).model_dump(mode="json")}
        if memory is not None:
            resources["memory"] = memory
        # The row and its decision together; the submission after them (a crash in between is
        # recovered by `attach`: the row says what to submit).
        with self.nb.transaction():
            self.nb.start_job(key, session=self.session, kind=spec.kind, executor=self.backend.name,
                              resources=resources, forecast_gpuh=payload.forecast_gpuh, attempt=attempt,
                              folder=str(folder), fn=import_path(spec.fn), result_type=import_path(spec.result_type))
            self.nb.record_decision(self.session, "launch", f"{spec.kind}: {reason}", payload)
        self._submit(key, spec, folder, attempt, args)

    def _submit(self, key: str, spec: _Spec, folder: Path, attempt: int, args: BaseModel) -> None:
        wrapped = Resumable(spec.fn, spec.resources.time_limit_min * 60, spec.resources.signal_delay_s,
                            env=self.backend.worker_env(), device=spec.resources.device,
                            every_rank=not spec.resources.single_process, memory_gb=spec.resources.mem_gb)
        sub = self.backend.submit(folder, spec.kind, spec.resources, wrapped, args)
        self.nb.update_job(key, attempt, external_id=sub.job_id, log_path=str(sub.paths.stderr))

    def _attempt_args(self, key: str, spec: _Spec) -> BaseModel:
        """The config of the next attempt: the smaller-batch config once an earlier attempt ran out of memory."""
        if any(a.failure_class == "oom" for a in self.attempts(key)):
            smaller = smaller_batch_config(spec.args)
            assert smaller is not None, "an OOM retry is only decided when the config can shrink"
            return smaller
        return spec.args

    def _recover(self, key: str, spec: _Spec) -> None:
        """After a crash: finish the failure policy of an attempt settled as failed but not followed
        up; find an attempt recorded but not yet submitted by its files, else submit it."""
        record = self.record(key)
        if record.state == "failed" and not self._policy_applied(key, record):
            failure = Failure(failure_class=record.failure_class, detail=record.failure_detail or "")
            self._apply_policy(key, spec, record, failure)
            return
        if record.external_id or record.state != "pending":
            return
        folder = Path(record.folder or "")
        # submitit names the pickle after the job id it got: read the id back from the file name.
        pattern = JobPaths(folder, job_id="*").submitted_pickle
        found = sorted(folder.glob(pattern.name))
        if found:
            job_id = found[0].name.removesuffix(pattern.name.removeprefix("*"))
            self.nb.update_job(key, record.attempt, external_id=job_id)
        else:
            self._submit(key, spec, folder, record.attempt, self._attempt_args(key, spec))

    def _policy_applied(self, key: str, record: JobRecord) -> bool:
        """Whether a failed last attempt was followed up: a later attempt exists (then it is not the
        last) or a `fail` decision names it."""
        return any(isinstance(d.payload, FailPayload) and (d.payload.key, d.payload.attempt) == (key, record.attempt)
                   for d in self.nb.decisions(self.session, kind="fail"))

    def record(self, key: str) -> JobRecord:
        """The latest attempt's row of a recorded job."""
        record = self.nb.get_job(key)
        assert record is not None, "a Job handle exists only for a recorded key"
        return record

    # -- observing and settling ------------------------------------------------------------------

    def settle_orphans(self) -> list[JobRecord]:
        """The session's attempts left pending or running by an agent that died, brought up to date with the
        executor: one that ended meanwhile is settled (its cost spent, its result stored, or its failure classified:
        killed with the agent, it is lost), so the ledger holds no reservation of a process that is gone. Its failure
        policy (a requeue, admitted against the budget) is left to the step that re-attaches to it (`_recover`),
        after the gates have seen that step again. The attempts settled."""
        latest = {j.key: j for j in self.nb.jobs(session=self.session)}
        settled = []
        for key, record in latest.items():
            if record.state in {"pending", "running"} and record.external_id:
                after = self.poll(key, follow_up=False)
                if after.state in {"completed", "failed"}:
                    settled.append(after)
        return settled

    def poll(self, key: str, follow_up: bool = True) -> JobRecord:
        """Bring the notebook up to date with the executor; apply the failure policy once per attempt
        (`follow_up`; otherwise `_recover` applies it when the job is re-attached)."""
        record = self.record(key)
        if record.state in {"completed", "failed"} or not record.external_id:
            return record
        spec, folder = self._spec(key), Path(record.folder or "")
        runs = self.backend.runs(record.external_id, folder, spec.resources)
        record = self._close_requeued_runs(key, spec, record, runs)
        if record.state == "failed":  # a requeue the budget refused: cancelled
            return record
        last = runs[-1]
        if last.state == "RUNNING" and record.state != "running":
            return self.nb.update_job(key, record.attempt, state="running", started_at=_iso(last.started))
        if last.state not in _FINAL_STATES:  # pending, running, requeued, suspended, ...
            if last.state == "PENDING":
                self._report_pending(key, record)
            return record
        return self._settle(key, spec, record, last, folder, follow_up)

    def cancel(self, key: str) -> None:
        record = self.record(key)
        if record.external_id and record.state in {"pending", "running"}:
            self.backend.cancel(record.external_id, Path(record.folder or ""))

    def _cost(self, run: Run) -> dict[str, Any]:
        charge = self.backend.charge(run.elapsed_s * run.devices)
        return {"started_at": _iso(run.started), "ended_at": _iso(run.ended) or now(),
                "gpu_hours": charge.gpu_hours, "device_seconds": charge.device_seconds, "charge": charge.charge}

    def _close_requeued_runs(self, key: str, spec: _Spec, record: JobRecord, runs: list[Run]) -> JobRecord:
        """Runs before the last one were requeued in place by Slurm itself (jobs are submitted
        `--no-requeue`; a lab's extra_sbatch `--requeue` overrides that): each closes its attempt as
        preempted, and the next run is admitted like any requeue, or refused and the job cancelled."""
        same = [a for a in self.attempts(key) if a.external_id == record.external_id]
        for i in range(len(same) - 1, len(runs) - 1):
            detail = f"requeued in place by the executor (run {i + 1}: {runs[i].state})"
            with self.nb.transaction():
                record = self.nb.update_job(key, record.attempt, state="failed", failure_class="preempted",
                                            failure_detail=detail, **self._cost(runs[i]))
                try:
                    payload = self.admit(key, spec.kind, spec.resources, record.attempt + 1)
                except BudgetRefused as refused:
                    return self._refuse_requeue(key, spec, record, Failure(failure_class="preempted", detail=detail),
                                                refused, cancel=True)
                self.nb.start_job(key, session=self.session, kind=spec.kind, executor=self.backend.name,
                                  resources=record.resources, forecast_gpuh=payload.forecast_gpuh,
                                  attempt=record.attempt + 1, folder=record.folder, fn=record.fn,
                                  result_type=record.result_type)
                self.nb.record_decision(self.session, "launch", f"{spec.kind}: requeued in place by the executor",
                                        payload)
                record = self.nb.update_job(key, record.attempt + 1, external_id=record.external_id,
                                            log_path=record.log_path)
        return record

    def _refuse_requeue(self, key: str, spec: _Spec, record: JobRecord, failure: Failure, refused: BudgetRefused,
                        cancel: bool = False) -> JobRecord:
        """The job ends with its last run's failure; the refusal (already a `refuse` decision) is in
        its detail and in the `fail` decision."""
        if cancel and record.external_id:
            self.backend.cancel(record.external_id, Path(record.folder or ""))
        detail = f"{failure.detail}; requeue refused: {refused}"
        record = self.nb.update_job(key, record.attempt, failure_detail=failure.model_copy(update={"detail": detail}).line())
        payload = FailPayload(key=key, attempt=record.attempt, failure_class=failure.failure_class, detail=detail,
                              message=failure.message)
        self.nb.record_decision(self.session, "fail", f"{spec.kind} failed ({failure.failure_class}); the retry "
                                "did not fit the budget", payload)
        return record

    def _settle(self, key: str, spec: _Spec, record: JobRecord, run: Run, folder: Path,
                follow_up: bool = True) -> JobRecord:
        """The last run is over: settle its cost, store the result or classify the failure."""
        outcome = self._outcome(spec, folder, record.external_id or "", completed=run.state == "COMPLETED")
        if isinstance(outcome, BaseModel):
            return self.nb.update_job(key, record.attempt, state="completed",
                                      result=outcome.model_dump(mode="json"), **self._cost(run))
        paths = RunPaths(folder, record.external_id or "")
        failure = classify(run.state, run.exit_code, outcome, raised=_raised(paths))
        # The job's own words beside its class, for a person (the CLI, the notebook, the report): never the planner's.
        failure = failure.model_copy(update={"message": _raised_message(paths) or message_of(outcome)})
        if failure.failure_class == "preempted" and near_time_limit(
                run.elapsed_s, spec.resources.time_limit_min * 60, spec.resources.signal_delay_s):
            # A job that handles the signal itself (trainers/loop.py) reports any signal as a preemption.
            failure = failure.model_copy(update={"failure_class": "timeout"})
        record = self.nb.update_job(key, record.attempt, state="failed", failure_class=failure.failure_class,
                                    failure_detail=failure.line(), **self._cost(run))
        if follow_up:
            self._apply_policy(key, spec, record, failure)
        return self.record(key)

    def _outcome(self, spec: _Spec, folder: Path, job_id: str, completed: bool) -> BaseModel | str:
        """Rank 0's result, or the error text of the first task without one (its pickled trace, else
        its stderr tail): a job of several processes succeeds only when every rank returned."""
        results = []
        for task in range(self.backend.ranks(spec.resources)):
            sub = self.backend.job(folder, job_id, task)
            # A completed run may still be writing its pickle on a slow file system: submitit waits for it.
            if not (completed or sub.paths.result_pickle.exists()):
                return _tail(sub.paths.stderr)
            try:
                results.append(sub.result())
            except FailedJobError as err:
                return str(err)
            except UncompletedJobError:
                return _tail(sub.paths.stderr)
        return results[0]

    def _apply_policy(self, key: str, spec: _Spec, record: JobRecord, failure: Failure) -> None:
        earlier = self.attempts(key)
        action = decide(
            failure.failure_class,
            oom_retries=sum(1 for a in earlier[:-1] if a.failure_class == "oom"),
            requeues=sum(1 for a in earlier[:-1] if a.failure_class in _REQUEUED_CLASSES),
            max_requeues=spec.resources.max_requeues,
            can_halve_batch=smaller_batch_config(spec.args) is not None,
        )
        payload = FailPayload(key=key, attempt=record.attempt, **failure.model_dump())
        if action == "record":
            self.nb.record_decision(self.session, "fail", f"{spec.kind} failed: {failure.failure_class}", payload)
            return
        reason = ("OOM: retry with half the micro-batch and twice the accumulation" if action == "retry_smaller_batch"
                  else f"{failure.failure_class}: requeue from the last checkpoint")
        try:
            self._launch(key, spec, record.attempt + 1, reason)
        except BudgetRefused as refused:
            self._refuse_requeue(key, spec, record, failure, refused)


class Job(Generic[R]):
    """A typed handle on one keyed job and all its attempts: the launcher does the work.

    `done()` polls the executor (and settles, and applies the failure policy, through the launcher);
    `result()` waits for the last attempt and returns its result or raises JobFailed."""

    def __init__(self, launcher: Launcher, key: str, result_type: type[BaseModel]):
        self.launcher, self.key, self.result_type = launcher, key, result_type

    @property
    def record(self) -> JobRecord:
        """The latest attempt's notebook row."""
        return self.launcher.record(self.key)

    @property
    def kind(self) -> str:
        return self.record.kind

    def attempts(self) -> list[JobRecord]:
        return self.launcher.attempts(self.key)

    def done(self) -> bool:
        return self.launcher.poll(self.key).state in {"completed", "failed"}

    def result(self, timeout_s: float | None = None) -> R:
        """Wait for the job (and any retries); return its result or raise JobFailed."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self.done():
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {self.kind} {self.key[:12]} still {self.record.state} after {timeout_s} s")
            time.sleep(self.launcher.poll_s)
        record = self.record
        if record.state == "failed":
            raise JobFailed(record)
        return typing.cast(R, self.result_type.model_validate(record.result))

    def cancel(self) -> None:
        self.launcher.cancel(self.key)


def _tail(path: Path, chars: int = 4000) -> str:
    if not path.exists():
        return ""
    with open(path, "rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - chars))
        return f.read().decode(errors="replace")


def _iso(t: float | None) -> str | None:
    return None if t is None else datetime.fromtimestamp(t, UTC).isoformat(timespec="microseconds")
