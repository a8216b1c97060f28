"""What a job asks for and what an executor reports about it: `Resources`, `Run`, `Charge` and the `Backend`
protocol that the local and the Slurm backends (tools/jobs/local.py, tools/jobs/slurm.py) implement.

    Resources(time_limit_min=60, gpus=1)            # one run's limit and its devices; see the fields
    backend.runs(job_id, folder, resources)          # [Run(state="COMPLETED", elapsed_s=..., devices=1, ...)]
    backend.charge(run.elapsed_s * run.devices)      # Charge(gpu_hours=..., charge="measured")
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Protocol

import submitit
from pydantic import BaseModel, ConfigDict, Field, model_validator

from tools.jobs.jobrun import Resumable

# submitit requeues in place on the preemption signal; our own wrapper enforces the limits, so
# submitit's countdown (which counts every signal of a job under 10 minutes as a timeout) is off.
NO_SUBMITIT_LIMIT = 1000


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

    def stop_strays(self, folder: Path) -> list[int]: ...

    def unfit(self, resources: Resources) -> str | None: ...

    def pending_reason(self, job_id: str) -> str: ...
