"""The job launcher: submit a job function through submitit (local subprocesses or Slurm), with
idempotency keys, budget admission, GPU-hour settlement and failure handling, all in the notebook.

    launcher = Launcher(notebook, session="s1", executor=ExecutorSection(kind="local"), root=Path("lab/jobs"))
    job = launcher.submit("sft", trainers.sft.train, SFTConfig(...), Resources(time_limit_min=60, gpus=1))
    result = job.result()          # a TrainResult, or raises JobFailed with the failure class

What happens, in order (DESIGN.md invariants 5 and 6):
1. The key is sha256(kind + function + session + canonical args). A key already in the notebook is
   re-attached by its external id (pending/running), read back (completed) or reported (failed):
   a job is never submitted twice, also after the agent was killed and resumed.
2. Admission: the forecast (declared estimate, else measured throughput of earlier jobs of the same
   kind and model, else the time-limit bound) plus spent plus reserved plus the session's reserve
   must fit the budget; otherwise a `refuse` decision is recorded and `BudgetRefused` raised.
3. The attempt row (state pending, forecast reserved) and a `launch` decision are written, then the
   job is submitted. Every job runs inside `Resumable`, a submitit Checkpointable: on the
   preemption/timeout signal it is requeued in place and the function is called again with the
   same config (trainers resume from their output directory).
4. Each run of the job is one attempt row with its own settled cost: Slurm `sacct` elapsed times
   allocated GPUs, or local wall time times devices (CPU-only counts as one device). A failed run
   is classified (tools/failures.py) and the policy applied (requeue, OOM retry, or record).
"""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import time
import typing
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Generic, Literal, Protocol, TypeVar

import submitit
from pydantic import BaseModel, ConfigDict, Field, model_validator
from submitit.core.utils import FailedJobError, UncompletedJobError

from memory.notebook import JobRecord, Notebook, now, tool_call_key
from tools.executor import ExecutorSection
from tools.failures import Failure, classify, decide, smaller_batch_config
from tools.jobrun import Resumable, near_time_limit, read_events

R = TypeVar("R", bound=BaseModel)
C = TypeVar("C", bound=BaseModel)

# States after which the last run will not change any more (sacct's State column, first word; the
# local backend reports the same names). REQUEUED is not among them: the job runs again.
_FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "PREEMPTED", "NODE_FAIL", "BOOT_FAIL",
                 "OUT_OF_MEMORY", "DEADLINE", "REVOKED"}
# submitit requeues in place on the preemption signal; our own wrapper enforces the limits, so
# submitit's countdown (which counts every signal of a job under 10 minutes as a timeout) is off.
_NO_SUBMITIT_LIMIT = 1000
_REQUEUED_CLASSES = {"preempted", "timeout"}  # failure classes that count against max_requeues
_SLACK_S = 5.0  # seconds: a killed local run this close to its limit was stopped by the limit


class BudgetRefused(Exception):
    """The job's forecast does not fit the session budget; the refusal is a recorded decision."""


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
    cpus: int | None = Field(None, ge=1, description="CPUs on Slurm; None takes the executor's default.")
    mem_gb: int | None = Field(None, ge=1, description="Memory in GB on Slurm; None takes the executor's default.")
    estimate_gpuh: float | None = Field(None, ge=0, description="Declared forecast in GPU-hours; wins over measured throughput.")
    model: str | None = Field(None, description="Model the job works on; earlier jobs of the same kind and model give throughput.")
    work_units: float | None = Field(None, gt=0, description="Size of the job (tokens, items) for throughput forecasts.")
    max_requeues: int = Field(3, ge=0, description="Most requeues after preemption or timeout before the job is a failure.")
    signal_delay_s: int = Field(30, ge=1, description="Seconds before the time limit when the job gets the checkpoint signal.")
    metrics_file: Path | None = Field(None, description="metrics.jsonl the job appends to; the progress line shows its last record.")

    @model_validator(mode="after")
    def _signal_inside_limit(self) -> Resources:
        if self.signal_delay_s >= self.time_limit_min * 60:
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
    devices: int = Field(description="Devices charged: allocated GPUs, at least one.")
    exit_code: int | None = Field(description="Exit code when the executor reports one.")


class Backend(Protocol):
    """One way of running submitit jobs: `LocalBackend` or `SlurmBackend`."""

    name: Literal["local", "slurm"]

    def executor(self, folder: Path, kind: str, resources: Resources) -> submitit.core.core.PicklingExecutor: ...

    def runs(self, job_id: str, folder: Path, resources: Resources) -> list[Run]: ...

    def devices(self, resources: Resources) -> int: ...

    def cancel(self, job_id: str, folder: Path) -> None: ...


class LocalBackend:
    """submitit's LocalExecutor: real subprocesses on this machine, which outlive the agent."""

    name: Literal["local"] = "local"

    def __init__(self) -> None:
        self._procs: dict[str, subprocess.Popen[bytes]] = {}

    def executor(self, folder: Path, kind: str, resources: Resources) -> submitit.LocalExecutor:
        ex = submitit.LocalExecutor(folder=folder, max_num_timeout=_NO_SUBMITIT_LIMIT)
        ex.update_parameters(timeout_min=resources.time_limit_min, gpus_per_node=resources.gpus or 0,
                             signal_delay_s=resources.signal_delay_s)
        return ex

    def devices(self, resources: Resources) -> int:
        return max(1, resources.gpus or 0)

    def track(self, job: submitit.local.local.LocalJob[Any]) -> None:
        # Our own child: keep its Popen so that polling reaps it (no zombie) and reads its status.
        self._procs[job.job_id] = job._process

    def runs(self, job_id: str, folder: Path, resources: Resources) -> list[Run]:
        devices = self.devices(resources)
        # Liveness before the events: a worker that ends between the two reads then still counts as
        # alive for this poll, instead of as killed mid-run with its end event unread.
        alive = self._alive(job_id, folder)
        runs, start = _runs_from_events(read_events(folder / f"{job_id}_events.jsonl"), devices)
        if alive:
            if start is not None:
                runs.append(Run(state="RUNNING", started=start, ended=None, elapsed_s=time.time() - start,
                                devices=devices, exit_code=None))
            elif runs and runs[-1].state != "REQUEUED":
                # The function returned but the worker is still writing its result: not over yet.
                runs[-1] = runs[-1].model_copy(update={"state": "RUNNING"})
            else:
                runs.append(Run(state="PENDING", started=None, ended=None, elapsed_s=0.0, devices=devices,
                                exit_code=None))
        elif start is not None:  # killed from outside mid-run (cancel, time limit, OOM killer)
            end = _last_write(folder, job_id)
            runs.append(Run(state=self._death_state(job_id, folder, end - start, resources), started=start,
                            ended=end, elapsed_s=end - start, devices=devices, exit_code=None))
        elif not runs or runs[-1].state == "REQUEUED":  # died before the function started
            runs.append(Run(state=self._death_state(job_id, folder, 0.0, resources), started=None, ended=None,
                            elapsed_s=0.0, devices=devices, exit_code=None))
        elif runs[-1].state == "FAILED" and not (folder / f"{job_id}_0_result.pkl").exists():
            # Interrupted from outside (a cancel, or the controller's kill at the time limit): the
            # function logged its end as a failure but the worker never got to pickle an outcome.
            state = self._death_state(job_id, folder, runs[-1].elapsed_s, resources)
            runs[-1] = runs[-1].model_copy(update={"state": state})
        return runs

    def _death_state(self, job_id: str, folder: Path, elapsed_s: float, resources: Resources) -> str:
        if (folder / f"{job_id}_cancelled").exists():
            return "CANCELLED"
        if elapsed_s >= resources.time_limit_min * 60 - _SLACK_S:
            return "TIMEOUT"
        return "FAILED"

    def _alive(self, job_id: str, folder: Path) -> bool:
        proc = self._procs.get(job_id)
        if proc is not None:
            return proc.poll() is None
        return _controller_alive(int(job_id), folder)

    def cancel(self, job_id: str, folder: Path) -> None:
        # The marker tells any later observer (also a resumed agent) that the end was a cancel.
        (folder / f"{job_id}_cancelled").touch()
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
            state = "REQUEUED" if e["event"] == "checkpoint" else "COMPLETED" if e.get("ok") else "FAILED"
            runs.append(Run(state=state, started=start, ended=e["t"], elapsed_s=e["t"] - start,
                            devices=devices, exit_code=None))
            start = None
    return runs, start


def _controller_alive(pid: int, folder: Path) -> bool:
    """Whether `pid` is a live submitit local controller of `folder` (not a reused pid, not a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z" and "submitit.local._local" in cmdline and str(folder) in cmdline


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
    tools.jobrun.HEARTBEAT_S."""
    return max((p.stat().st_mtime for p in folder.glob(f"{job_id}_*")), default=time.time())


class SlurmBackend:
    """submitit's SlurmExecutor; run states and elapsed times come from `sacct` (slurmdbd accounting)."""

    name: Literal["slurm"] = "slurm"

    def __init__(self, section: ExecutorSection):
        if section.slurm is None:
            raise ValueError("executor.kind = 'slurm' needs an [executor.slurm] section")
        self.slurm = section.slurm

    def executor(self, folder: Path, kind: str, resources: Resources) -> submitit.SlurmExecutor:
        s = self.slurm
        ex = submitit.SlurmExecutor(folder=folder, max_num_timeout=_NO_SUBMITIT_LIMIT)
        params: dict[str, Any] = {
            "job_name": kind, "partition": s.partition, "time": math.ceil(resources.time_limit_min),
            "gpus_per_node": s.gpus_per_node if resources.gpus is None else resources.gpus,
            "cpus_per_task": resources.cpus or s.cpus_per_task, "mem": f"{resources.mem_gb or s.mem_gb}GB",
            "signal_delay_s": resources.signal_delay_s, "additional_parameters": _sbatch_lines(s.extra_sbatch),
        }
        if s.account:
            params["account"] = s.account
        if s.qos:
            params["qos"] = s.qos
        ex.update_parameters(**params)
        return ex

    def devices(self, resources: Resources) -> int:
        return max(1, self.slurm.gpus_per_node if resources.gpus is None else resources.gpus)

    def runs(self, job_id: str, folder: Path, resources: Resources) -> list[Run]:
        out = subprocess.run(
            ["sacct", "-j", job_id, "--duplicates", "-X", "-P", "-n",
             "-o", "State,ElapsedRaw,AllocTRES,Start,End,ExitCode"],
            check=True, capture_output=True, text=True, timeout=60,
        ).stdout
        runs = [_sacct_run(line) for line in out.splitlines() if line.strip()]
        # Just after sbatch the accounting record may not exist yet: the job is pending.
        return runs or [Run(state="PENDING", started=None, ended=None, elapsed_s=0.0, devices=1, exit_code=None)]

    def cancel(self, job_id: str, folder: Path) -> None:
        subprocess.run(["scancel", job_id], check=True, timeout=60)


def _sacct_run(line: str) -> Run:
    state, elapsed, tres, start, end, exit_code = line.split("|")
    gpus = re.search(r"gres/gpu=(\d+)", tres)
    return Run(state=state.split()[0], started=_sacct_time(start), ended=_sacct_time(end),
               elapsed_s=float(elapsed or 0), devices=max(1, int(gpus.group(1)) if gpus else 0),
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


def make_backend(section: ExecutorSection) -> Backend:
    return SlurmBackend(section) if section.kind == "slurm" else LocalBackend()


# ---- the launcher ------------------------------------------------------------------------------

class Forecast(BaseModel):
    gpuh: float = Field(description="Forecast GPU-hours of the job.")
    source: Literal["declared", "throughput", "time_limit"] = Field(description="Where the forecast came from.")


class Launcher:
    """Submits jobs for one session of one notebook; see the module docstring."""

    def __init__(self, notebook: Notebook, session: str, executor: ExecutorSection, root: Path,
                 poll_s: float | None = None):
        self.nb, self.session, self.root = notebook, session, Path(root)
        self.backend = make_backend(executor)
        # Each Slurm poll is one sacct call through slurmdbd: keep it gentle on a shared cluster.
        self.poll_s = poll_s if poll_s is not None else (2.0 if executor.kind == "slurm" else 0.25)

    def submit(self, kind: str, fn: Callable[[C], R], args: C, resources: Resources) -> Job[R]:
        """Submit `fn(args)` once per (kind, fn, session, args); later calls re-attach to it."""
        key = self.key(kind, fn, args)
        job: Job[R] = Job(self, key, kind, fn, args, resources, _result_type(fn))
        if self.nb.get_job(key) is None:
            job._launch(attempt=1, reason="new job")
        else:
            job._recover_submission()
        return job

    def key(self, kind: str, fn: Callable[..., Any], args: BaseModel) -> str:
        """Idempotency key: the tool (kind and function) and the canonical args, within this session."""
        return tool_call_key(f"{kind}:{fn.__module__}.{fn.__qualname__}",
                             {"session": self.session, "args": args.model_dump(mode="json")})

    def forecast(self, kind: str, resources: Resources) -> Forecast:
        if resources.estimate_gpuh is not None:
            return Forecast(gpuh=resources.estimate_gpuh, source="declared")
        rate = self._throughput(kind, resources.model)
        if rate is not None and resources.work_units is not None:
            return Forecast(gpuh=resources.work_units / rate, source="throughput")
        # The most one run can cost: its whole time limit on all its devices. Requeues and retries
        # are forecast (and admitted) again when they happen.
        devices = self.backend.devices(resources)
        return Forecast(gpuh=resources.time_limit_min / 60 * devices, source="time_limit")

    def _throughput(self, kind: str, model: str | None) -> float | None:
        """Work units per GPU-hour over completed earlier jobs of this kind and model (all attempts count)."""
        attempts = [j for j in self.nb.jobs(kind=kind) if j.resources.get("model") == model]
        done = {j.key: j.resources.get("work_units") or 0.0 for j in attempts if j.state == "completed"}
        units = sum(done.values())
        hours = sum(j.gpu_hours or 0.0 for j in attempts if j.key in done)
        return units / hours if units and hours else None


def _result_type(fn: Callable[..., Any]) -> type[BaseModel]:
    hint = typing.get_type_hints(fn).get("return")
    if not (isinstance(hint, type) and issubclass(hint, BaseModel)):
        raise TypeError(f"{fn.__module__}.{fn.__qualname__} must be annotated to return a pydantic model")
    return hint


class Job(Generic[R]):
    """A typed handle on one keyed job and all its attempts; `result()` waits and applies the policy."""

    def __init__(self, launcher: Launcher, key: str, kind: str, fn: Callable[[Any], R], args: BaseModel,
                 resources: Resources, result_type: type[BaseModel]):
        self.launcher, self.key, self.kind, self.fn = launcher, key, kind, fn
        self.args, self.resources, self.result_type = args, resources, result_type

    # -- reading -------------------------------------------------------------------------------

    @property
    def record(self) -> JobRecord:
        """The latest attempt's notebook row."""
        record = self.launcher.nb.get_job(self.key)
        assert record is not None, "a Job handle exists only for a recorded key"
        return record

    @property
    def metrics_path(self) -> Path | None:
        """The run's metrics.jsonl: declared in the resources, else `<output_dir>/metrics.jsonl` of the config."""
        if self.resources.metrics_file is not None:
            return self.resources.metrics_file
        if "output_dir" in type(self.args).model_fields:
            return Path(typing.cast(Any, self.args).output_dir) / "metrics.jsonl"
        return None

    def attempts(self) -> list[JobRecord]:
        return [j for j in self.launcher.nb.jobs(session=self.launcher.session) if j.key == self.key]

    def done(self) -> bool:
        return self.poll().state in {"completed", "failed"}

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
        record = self.record
        if record.external_id and record.state in {"pending", "running"}:
            self.launcher.backend.cancel(record.external_id, Path(record.folder or ""))

    # -- submitting ------------------------------------------------------------------------------

    def _launch(self, attempt: int, reason: str) -> None:
        """Admission, then the attempt row and the launch decision, then the submission."""
        nb, session = self.launcher.nb, self.launcher.session
        args = self._attempt_args()
        forecast = self.launcher.forecast(self.kind, self.resources)
        payload = {"key": self.key, "kind": self.kind, "attempt": attempt, "forecast_gpuh": forecast.gpuh,
                   "forecast_source": forecast.source, "executor": self.launcher.backend.name}
        ledger = nb.ledger(session)
        if not ledger.admits(forecast.gpuh):
            nb.record_decision(session, "refuse", f"{self.kind} would overrun the budget: forecast "
                               f"{forecast.gpuh:.3f} + spent {ledger.spent_gpuh:.3f} + reserved {ledger.reserved_gpuh:.3f}"
                               f" + reserve {ledger.reserve_gpuh:.3f} > budget {ledger.budget_gpuh:.3f} GPU-h", payload)
            raise BudgetRefused(f"{self.kind}: forecast {forecast.gpuh:.3f} GPU-h does not fit; "
                                f"{ledger.left_gpuh - ledger.reserve_gpuh:.3f} GPU-h left above the reserve")
        folder = self.launcher.root / f"{self.key[:16]}-{attempt}"
        resources = {**self.resources.model_dump(mode="json"), "args": args.model_dump(mode="json")}
        nb.start_job(self.key, session=session, kind=self.kind, executor=self.launcher.backend.name,
                     resources=resources, forecast_gpuh=forecast.gpuh, attempt=attempt, folder=str(folder))
        nb.record_decision(session, "launch", f"{self.kind}: {reason}", payload)
        self._submit(folder, attempt, args)

    def _submit(self, folder: Path, attempt: int, args: BaseModel) -> None:
        backend = self.launcher.backend
        ex = backend.executor(folder, self.kind, self.resources)
        # Requeues are counted over the whole job: a resubmission (after a job raised 'preempted:')
        # may requeue in place only as often as the earlier attempts left.
        used = sum(1 for a in self.attempts() if a.attempt < attempt and a.failure_class in _REQUEUED_CLASSES)
        wrapped = Resumable(self.fn, self.resources.time_limit_min * 60, self.resources.signal_delay_s,
                            max(0, self.resources.max_requeues - used))
        sub = ex.submit(wrapped, args)
        if isinstance(backend, LocalBackend):
            backend.track(sub)
        self.launcher.nb.update_job(self.key, attempt, external_id=sub.job_id, log_path=str(sub.paths.stderr))

    def _recover_submission(self) -> None:
        """After a crash: finish the failure policy of an attempt settled as failed but not followed
        up; find an attempt recorded but not yet submitted by its files, else submit it."""
        record = self.record
        if record.state == "failed" and not self._policy_applied(record):
            failure = Failure(failure_class=record.failure_class, detail=record.failure_detail or "")
            self._apply_policy(record, failure)
            return
        if record.external_id or record.state != "pending":
            return
        folder = Path(record.folder or "")
        found = sorted(folder.glob("*_submitted.pkl"))
        if found:
            job_id = found[0].name.removesuffix("_submitted.pkl")
            self.launcher.nb.update_job(self.key, record.attempt, external_id=job_id)
        else:
            self._submit(folder, record.attempt, self._attempt_args())

    def _policy_applied(self, record: JobRecord) -> bool:
        """Whether a failed last attempt was followed up: a later attempt exists (then it is not the
        last) or a `fail` decision names it."""
        return any(d.payload.get("key") == self.key and d.payload.get("attempt") == record.attempt
                   for d in self.launcher.nb.decisions(self.launcher.session, kind="fail"))

    def _attempt_args(self) -> BaseModel:
        """The config of the next attempt: the smaller-batch config once an earlier attempt ran out of memory."""
        if any(a.failure_class == "oom" for a in self.attempts()):
            smaller = smaller_batch_config(self.args)
            assert smaller is not None, "an OOM retry is only decided when the config can shrink"
            return smaller
        return self.args

    # -- observing -------------------------------------------------------------------------------

    def poll(self) -> JobRecord:
        """Bring the notebook up to date with the executor; apply the failure policy once per attempt."""
        record = self.record
        if record.state in {"completed", "failed"} or not record.external_id:
            return record
        folder = Path(record.folder or "")
        runs = self.launcher.backend.runs(record.external_id, folder, self.resources)
        record = self._close_requeued_runs(record, runs)
        last = runs[-1]
        if last.state == "RUNNING" and record.state != "running":
            return self.launcher.nb.update_job(self.key, record.attempt, state="running",
                                               started_at=_iso(last.started))
        if last.state not in _FINAL_STATES:  # pending, running, requeued, suspended, ...
            return record
        return self._settle(record, last, folder)

    def _close_requeued_runs(self, record: JobRecord, runs: list[Run]) -> JobRecord:
        """Runs before the last one were requeued: each gets (or already has) its own attempt row."""
        nb = self.launcher.nb
        same = [a for a in self.attempts() if a.external_id == record.external_id]
        events = read_events(Path(record.folder or "") / f"{record.external_id}_events.jsonl")
        reasons = [e["reason"] for e in events if e["event"] == "checkpoint"]
        for i in range(len(same) - 1, len(runs) - 1):
            run, reason = runs[i], reasons[i] if i < len(reasons) else "preempted"
            nb.update_job(self.key, record.attempt, state="failed", failure_class=reason,
                          failure_detail=f"requeued in place after {reason} (run {i + 1})",
                          started_at=_iso(run.started), ended_at=_iso(run.ended),
                          gpu_hours=run.elapsed_s / 3600 * run.devices)
            spent = sum(a.gpu_hours or 0.0 for a in self.attempts())
            nb.start_job(self.key, session=self.launcher.session, kind=self.kind,
                         executor=self.launcher.backend.name, resources=record.resources,
                         forecast_gpuh=max(0.0, record.forecast_gpuh - spent), attempt=record.attempt + 1,
                         folder=record.folder)
            record = nb.update_job(self.key, record.attempt + 1, external_id=record.external_id,
                                   log_path=record.log_path)
        return record

    def _settle(self, record: JobRecord, run: Run, folder: Path) -> JobRecord:
        """The last run is over: settle its cost, store the result or classify the failure."""
        nb = self.launcher.nb
        cost = {"started_at": _iso(run.started), "ended_at": _iso(run.ended) or now(),
                "gpu_hours": run.elapsed_s / 3600 * run.devices}
        sub = self._submitit_job(record)
        outcome = _outcome(sub) if run.state == "COMPLETED" or sub.paths.result_pickle.exists() else None
        if isinstance(outcome, BaseModel):
            return nb.update_job(self.key, record.attempt, state="completed",
                                 result=outcome.model_dump(mode="json"), **cost)
        text = outcome if isinstance(outcome, str) else _tail(sub.paths.stderr)
        failure = classify(run.state, run.exit_code, text)
        if failure.failure_class == "preempted" and near_time_limit(
                run.elapsed_s, self.resources.time_limit_min * 60, self.resources.signal_delay_s):
            # A job that handles the signal itself (trainers/loop.py) reports any signal as a preemption.
            failure = failure.model_copy(update={"failure_class": "timeout"})
        record = nb.update_job(self.key, record.attempt, state="failed", failure_class=failure.failure_class,
                               failure_detail=failure.detail, **cost)
        self._apply_policy(record, failure)
        return self.record

    def _apply_policy(self, record: JobRecord, failure: Failure) -> None:
        earlier = self.attempts()
        action = decide(
            failure.failure_class,
            oom_retries=sum(1 for a in earlier[:-1] if a.failure_class == "oom"),
            requeues=sum(1 for a in earlier[:-1] if a.failure_class in _REQUEUED_CLASSES),
            max_requeues=self.resources.max_requeues,
            can_halve_batch=smaller_batch_config(self.args) is not None,
        )
        nb, session = self.launcher.nb, self.launcher.session
        if action == "record":
            nb.record_decision(session, "fail", f"{self.kind} failed: {failure.failure_class}",
                               {"key": self.key, "attempt": record.attempt, **failure.model_dump()})
            return
        reason = ("OOM: retry with half the micro-batch and twice the accumulation" if action == "retry_smaller_batch"
                  else f"{failure.failure_class}: requeue from the last checkpoint")
        try:
            self._launch(record.attempt + 1, reason)
        except BudgetRefused:
            nb.record_decision(session, "fail", f"{self.kind} failed ({failure.failure_class}); the retry did not fit "
                               "the budget", {"key": self.key, "attempt": record.attempt, **failure.model_dump()})

    def _submitit_job(self, record: JobRecord) -> submitit.Job[Any]:
        folder, job_id = Path(record.folder or ""), record.external_id or ""
        if isinstance(self.launcher.backend, SlurmBackend):
            return submitit.SlurmJob(folder=folder, job_id=job_id)
        return submitit.local.local.LocalJob(folder=folder, job_id=job_id)


def _outcome(sub: submitit.Job[Any]) -> BaseModel | str | None:
    """The job's pickled result, or the error text it pickled; None when it wrote neither."""
    try:
        return sub.result()
    except FailedJobError as err:
        return str(err)
    except UncompletedJobError:
        return None


def _tail(path: Path, chars: int = 4000) -> str:
    if not path.exists():
        return ""
    with open(path, "rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - chars))
        return f.read().decode(errors="replace")


def _iso(t: float | None) -> str | None:
    return None if t is None else datetime.fromtimestamp(t, UTC).isoformat(timespec="microseconds")
