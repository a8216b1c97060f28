"""Executor settings: where jobs run and with what Slurm parameters.

They live beside the launcher (tools/jobs/launcher.py) that consumes them; the lab config (agent/config.py)
composes them as its `[executor]` section.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# The most any job may ask for, past every machine a lab runs on: a value beyond is a slip or an attack, refused at
# load (a time_limit_min of 2**63 - 1 was a 3,150-year limit, `gpus = 1000` on a host without GPUs was accepted and
# then every eval refused by the budget). What the partition's nodes (sinfo) or this host really have is checked
# before a session opens: tools.jobs.launcher.slurm_problems, local_problems below.
MAX_TIME_LIMIT_MIN = 30 * 24 * 60  # 30 days: Slurm sites cap their partitions far below this
MAX_GPUS_PER_NODE = 64
MAX_NODES = 4096
MAX_CPUS_PER_TASK = 4096
MAX_MEM_GB = 64 * 1024  # per node


class _Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SlurmSection(_Settings):
    partition: str = Field(description="Slurm partition jobs are submitted to.")
    account: str | None = Field(None, description="Slurm account to charge.")
    qos: str | None = Field(None, description="Slurm quality of service.")
    gpus_per_node: int = Field(1, ge=0, le=MAX_GPUS_PER_NODE, description="GPUs of one node: a training job's default (one task per GPU); "
                               "eval, reference, truth and bundle jobs default to 1 of them, merge and data jobs to 0.")
    cpus_per_task: int = Field(8, ge=1, le=MAX_CPUS_PER_TASK, description="CPUs per task (a job runs one task per GPU): check them against "
                               "the partition's nodes; a job no node can hold is refused before submission.")
    mem_gb: int = Field(64, ge=1, le=MAX_MEM_GB, description="Memory per job (per node) in GB.")
    pending_report_min: float = Field(10.0, gt=0, description="Minutes a job may wait in the queue before the session "
                                      "reports it (a `wait` decision and a CLI line, with Slurm's reason).")
    extra_sbatch: list[str] = Field(default_factory=list, description="Extra `#SBATCH` lines, verbatim.")
    zygote: bool = Field(
        False, description="Single-host clusters only (scripts/slurm-up's loopback cluster, a workstation running "
        "Slurm): each task forks from a warm zygote on the submitting host, as local jobs do (tools/jobs/zygote.py). A "
        "task on another node finds no zygote there and runs a plain python; off by default so that no login node "
        "imports torch for nothing. POSTLAB_ZYGOTE=0 turns it off too.",
    )


JobKind = Literal["train", "eval", "reference", "merge", "data", "bundle", "truth"]
# Kinds whose default is one GPU (a model generates: evals, reference answers, the truth scorer, and the bundle job,
# whose check-bundle reload serves the bundle on its GPU in bfloat16); merges and data jobs default to none;
# training to a node's.
ONE_GPU_KINDS: frozenset[str] = frozenset({"eval", "reference", "truth", "bundle"})
CPU_KINDS: frozenset[str] = frozenset({"merge", "data"})


class KindResources(_Settings):
    """`[executor.resources.<kind>]`: what the jobs of one kind ask for. An absent key takes the default."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)  # lab.toml's `gpus = "2"` is an error

    gpus: int | None = Field(
        None, ge=0, le=MAX_GPUS_PER_NODE, description="GPUs per node. Default: eval, reference, truth and bundle 1; merge and data 0; train "
        "executor.slurm.gpus_per_node on Slurm. On the local executor the GPU defaults are capped at the GPUs this "
        "host has (0 on a host without one).")
    nodes: int = Field(1, ge=1, le=MAX_NODES, description="Nodes (Slurm; more than 1 only for train: one task per GPU on each, "
                       "the torch.distributed rendezvous from Slurm's environment).")
    cpus: int | None = Field(None, ge=1, le=MAX_CPUS_PER_TASK, description="CPUs per task; default executor.slurm.cpus_per_task.")
    mem_gb: int | None = Field(None, ge=1, le=MAX_MEM_GB, description="Memory per node in GB; default executor.slurm.mem_gb. "
                          "Local: the job's resident memory bound (its tasks together), default 80% of the host's "
                          "(tools/jobs/warden.py).")
    time_limit_min: int | None = Field(None, ge=1, le=MAX_TIME_LIMIT_MIN, description="Wall-clock limit of one run in minutes; default "
                                       "executor.time_limit_min.")


class ResourcesSection(_Settings):
    """`[executor.resources]`: per job kind (train, eval, reference, merge, data, bundle, truth)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    train: KindResources = Field(default_factory=KindResources, description="Training jobs (sft, dpo, klce, rft).")
    eval: KindResources = Field(default_factory=KindResources, description="Eval jobs (suites, replicates).")
    reference: KindResources = Field(default_factory=KindResources, description="Reference answers of judge suites.")
    merge: KindResources = Field(default_factory=KindResources, description="Weight merges (soups, LoRA, dose).")
    data: KindResources = Field(default_factory=KindResources, description="Ingest and dataset builds.")
    bundle: KindResources = Field(default_factory=KindResources, description="Serving bundle write and check.")
    truth: KindResources = Field(default_factory=KindResources, description="The ground-truth scorer's job.")


# The launcher kinds the tools submit, by the resource kind lab.toml sets for them.
_FAMILY: dict[str, JobKind] = {"sft": "train", "dpo": "train", "klce": "train", "rft": "train", "eval": "eval",
                               "reference": "reference", "merge": "merge", "ingest": "data", "build": "data",
                               "bundle": "bundle", "truth": "truth"}
# Kinds whose function runs once, on rank 0; trainers and evals share their work by rank.
SINGLE_PROCESS_KINDS: frozenset[str] = frozenset({"merge", "data", "bundle", "truth"})


def job_family(kind: str) -> JobKind | None:
    """The `[executor.resources.<kind>]` a launcher kind (sft, eval, ingest, ...) takes; None: none (tests' kinds)."""
    return _FAMILY.get(kind)


def local_gpus(env: Mapping[str, str]) -> int:
    """GPUs this host offers its jobs, without loading torch: the NVIDIA driver's devices (/proc/driver/nvidia/gpus;
    in a container that lacks it, the /dev/nvidiaN device files), as many as CUDA_VISIBLE_DEVICES lets through."""
    root = Path("/proc/driver/nvidia/gpus")
    if root.is_dir():
        present = len(list(root.iterdir()))
    else:
        present = sum(1 for dev in Path("/dev").glob("nvidia[0-9]*") if dev.name[6:].isdigit())
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return present
    return min(present, len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"]))


def host_memory_gb(meminfo: Path = Path("/proc/meminfo")) -> float:
    """GB (2**30 bytes) of memory this host's jobs can have: MemTotal, or this process's cgroup limit when lower (a
    container's memory.max)."""
    total = next(int(line.split()[1]) * 1024 for line in meminfo.read_text().splitlines()
                 if line.startswith("MemTotal:"))
    limit = Path("/sys/fs/cgroup/memory.max")
    if limit.is_file() and limit.read_text().strip().isdigit():
        total = min(total, int(limit.read_text().strip()))
    return total / 1024**3


def local_problems(section: ExecutorSection, host_gpus: int, host_mem_gb: float) -> list[str]:
    """Before a session opens on the local executor: the `[executor.resources.<kind>]` values this host cannot give
    (every local job runs here): more GPUs than it has (each job would be refused by its forecast, or fail), more
    memory than it has. One line per kind and key; [] when all fit. Defaults are not checked: the GPU defaults are
    capped at the host's, and mem_gb's default is the Slurm section's, unused here."""
    problems = []
    for kind in ResourcesSection.model_fields:
        given = getattr(section.resources, kind)
        if given.gpus is not None and given.gpus > host_gpus:
            problems.append(f"[executor.resources.{kind}] gpus = {given.gpus}: this host has {host_gpus} GPU(s) and "
                            f"the local executor runs every job here; expected at most {host_gpus}")
        if given.mem_gb is not None and given.mem_gb > host_mem_gb:
            problems.append(f"[executor.resources.{kind}] mem_gb = {given.mem_gb}: this host has {host_mem_gb:.0f} GB "
                            f"of memory and the local executor runs every job here; expected at most "
                            f"{int(host_mem_gb)}")
    return problems


class ExecutorSection(_Settings):
    kind: Literal["local", "slurm"] = Field("local", description="Where jobs run: local subprocesses or Slurm.")
    time_limit_min: int = Field(240, ge=1, le=MAX_TIME_LIMIT_MIN, description="Explicit wall-clock limit of every job, in minutes.")
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
    gpu_dtype: Literal["bfloat16", "float16", "float32"] = Field(
        "bfloat16", description="Dtype of eval, reference and truth jobs on GPUs (training computes in bfloat16 on a "
        "GPU: TrainConfig.dtype auto); a job on the CPU runs in float32.")
    eval_batch_size: int | None = Field(
        None, ge=1, description="Prompts an eval job generates together; None: chosen from the GPU's free memory "
        "(evals/job.py), 64 on the CPU.")
    resources: ResourcesSection = Field(default_factory=ResourcesSection,
                                        description="Per job kind: GPUs, nodes, CPUs, memory and time limit.")
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
        multi = [k for k in ResourcesSection.model_fields if getattr(self.resources, k).nodes > 1]
        if multi and (self.kind != "slurm" or multi != ["train"]):
            raise ValueError(f"resources.{multi[0]}.nodes > 1: only training jobs run on several nodes, and only "
                             "on Slurm (kind = 'slurm')")
        return self

    def kind_resources(self, kind: JobKind, local_gpus: int) -> KindResources:
        """The resources of a job kind with every default filled in (`local_gpus`: the GPUs of this host, which
        caps the local executor's GPU defaults)."""
        given = getattr(self.resources, kind)
        gpus = given.gpus
        if gpus is None:
            slurm_node = self.slurm.gpus_per_node if self.slurm is not None else 0
            node = slurm_node if self.kind == "slurm" else local_gpus
            gpus = 0 if kind in CPU_KINDS else min(1, node) if kind in ONE_GPU_KINDS else node
        cpus = given.cpus or (self.slurm.cpus_per_task if self.slurm is not None else None)
        mem = given.mem_gb or (self.slurm.mem_gb if self.slurm is not None else None)
        return KindResources(gpus=gpus, nodes=given.nodes, cpus=cpus, mem_gb=mem,
                             time_limit_min=given.time_limit_min or self.time_limit_min)
