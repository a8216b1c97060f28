"""Executor settings: where jobs run and with what Slurm parameters.

They live beside the launcher (tools/jobs/launcher.py) that consumes them; the lab config (agent/config.py)
composes them as its `[executor]` section.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SlurmSection(_Settings):
    partition: str = Field(description="Slurm partition jobs are submitted to.")
    account: str | None = Field(None, description="Slurm account to charge.")
    qos: str | None = Field(None, description="Slurm quality of service.")
    gpus_per_node: int = Field(1, ge=0, description="GPUs per job (one node per job).")
    cpus_per_task: int = Field(8, ge=1, description="CPUs per job.")
    mem_gb: int = Field(64, ge=1, description="Memory per job in GB.")
    extra_sbatch: list[str] = Field(default_factory=list, description="Extra `#SBATCH` lines, verbatim.")
    zygote: bool = Field(
        False, description="Single-host clusters only (scripts/slurm-up's loopback cluster, a workstation running "
        "Slurm): each task forks from a warm zygote on the submitting host, as local jobs do (tools/jobs/zygote.py). A "
        "task on another node finds no zygote there and runs a plain python; off by default so that no login node "
        "imports torch for nothing. POSTLAB_ZYGOTE=0 turns it off too.",
    )


class ExecutorSection(_Settings):
    kind: Literal["local", "slurm"] = Field("local", description="Where jobs run: local subprocesses or Slurm.")
    time_limit_min: int = Field(240, ge=1, description="Explicit wall-clock limit of every job, in minutes.")
    slurm: SlurmSection | None = Field(None, description="Slurm parameters; required when kind = 'slurm'.")
    gpu_memory_gib: float | None = Field(
        None, gt=0,
        description="GiB of one GPU of the jobs' nodes (an H200: 139). Training jobs whose memory estimate per GPU "
        "exceeds it are refused at admission; None: not checked.",
    )
    zygote: bool = Field(
        True, description="Local executor: each job forks from a warm process with torch, transformers and the "
        "job modules imported (tools/jobs/zygote.py) instead of importing them again; false (or POSTLAB_ZYGOTE=0 in "
        "the environment): a fresh python per job.",
    )
    simulated_gpuh_per_device_s: float | None = Field(
        None, gt=0,
        description="Toy world only: GPU-hours charged per measured device-second of a local job (simulated cost). "
        "Absent on a real lab, where jobs are settled from the executor's own accounting.",
    )

    @model_validator(mode="after")
    def _slurm_needs_section(self) -> ExecutorSection:
        if self.kind == "slurm" and self.slurm is None:
            raise ValueError("kind = 'slurm' needs an [executor.slurm] section with at least `partition`")
        if self.kind == "slurm" and self.simulated_gpuh_per_device_s is not None:
            raise ValueError("simulated_gpuh_per_device_s is for the local executor only: "
                             "Slurm jobs are charged from sacct's accounting")
        return self
