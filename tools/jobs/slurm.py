"""The Slurm backend: submitit's SlurmExecutor, run states and elapsed times from `sacct` (slurmdbd accounting),
and what a partition's nodes can hold (`sinfo`), checked before a job is submitted."""

from __future__ import annotations

import math
import os
import re
import subprocess
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import submitit
from pydantic import BaseModel, ConfigDict, Field

from core.display import shown
from tools.jobs.executor import ExecutorSection, ResourcesSection, SlurmSection
from tools.jobs.jobrun import Resumable
from tools.jobs.resources import NO_SUBMITIT_LIMIT, Charge, Resources, Run, measured
from tools.jobs.zygote import TIME_LIMIT_VAR, Zygote


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
        ex = submitit.SlurmExecutor(folder=folder, max_num_timeout=NO_SUBMITIT_LIMIT, python=python)
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

    def stop_strays(self, folder: Path) -> list[int]:
        # Not done on Slurm: an agent killed after sbatch returned and before submitit wrote the pickle leaves a job
        # this agent cannot name (no id was stored); it fails on its node after submitit's 60 s wait for the pickle.
        return []

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
