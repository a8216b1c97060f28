"""The job launcher: submit a job function through submitit (local subprocesses or Slurm), with
idempotency keys, budget admission, GPU-hour settlement and failure handling, all in the notebook.

    launcher = Launcher.from_section(notebook, "s1", ExecutorSection(kind="local"), Path("lab/jobs"))
    job = launcher.submit("sft", trainers.sft.train, SFTConfig(...), Resources(time_limit_min=60, gpus=1))
    result = job.result()          # a TrainResult, or raises JobFailed with the failure class
    key = job.key                  # all a resumed agent needs to keep: launcher.attach(key) is the same job

The launcher orchestrates; its parts live beside it in tools/jobs/: resources.py (what a job asks for, what an
executor reports, the Backend protocol), local.py and slurm.py (the backends), submission.py (the backend of a lab's
[executor], one attempt handed to it), keys.py (idempotency keys, what the notebook keeps to rebuild a job),
reservations.py (forecasts and admission), settlement.py (a run's cost and outcome) and retries.py (what follows a
failed attempt).

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

import time
import typing
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Generic, TypeVar

from pydantic import BaseModel
from submitit.core.utils import JobPaths

from memory.notebook import JobRecord, Notebook
from memory.records import FailPayload, LaunchPayload, WaitPayload
from tools.jobs import forecast, retries
from tools.jobs.executor import ExecutorSection
from tools.jobs.failures import Failure
from tools.jobs.jobrun import RunPaths
from tools.jobs.keys import MOVED, JobSpec, import_path, job_key, resolve, spec_of_call, spec_of_record
from tools.jobs.local import LocalBackend, _controller_alive
from tools.jobs.reservations import (
    SIGNAL_LEAD_FACTOR,
    SIGNAL_LEAD_FLOOR_S,
    BudgetRefused,
    Forecast,
    MemoryRefused,
    PartitionRefused,
    Reservations,
    signal_lead_s,
)
from tools.jobs.resources import Backend, Charge, Resources, Run, measured
from tools.jobs.settlement import FINAL_STATES, cost, failure_of, iso, outcome
from tools.jobs.slurm import (
    SACCT_RETRY_S,
    NodeNeed,
    PartitionNode,
    SlurmBackend,
    _sbatch_lines,
    partition_nodes,
    partition_problem,
    sinfo_minutes,
    sinfo_nodes,
    slurm_problems,
)
from tools.jobs.submission import env_allows_zygote, local_zygote, make_backend, submit_attempt

# The launcher's public names, and those of its parts that callers have always imported from here.
__all__ = ["MOVED", "SACCT_RETRY_S", "SIGNAL_LEAD_FACTOR", "SIGNAL_LEAD_FLOOR_S", "Backend", "BudgetRefused", "Charge",
           "Forecast", "Job", "JobFailed", "Launcher", "LocalBackend", "MemoryRefused", "NodeNeed", "PartitionNode",
           "PartitionRefused", "Resources", "Run", "SlurmBackend", "_controller_alive", "_sbatch_lines",
           "env_allows_zygote", "import_path", "local_zygote", "make_backend", "measured", "partition_nodes",
           "partition_problem", "resolve", "signal_lead_s", "sinfo_minutes", "sinfo_nodes", "slurm_problems"]

R = TypeVar("R", bound=BaseModel)
C = TypeVar("C", bound=BaseModel)


class JobFailed(Exception):
    """The job ended without a result after the failure policy ran out of options."""

    def __init__(self, record: JobRecord):
        super().__init__(f"job {record.kind} {record.key[:12]} attempt {record.attempt}: "
                         f"{record.failure_class}: {record.failure_detail}")
        self.record = record


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
        self.reservations = Reservations(notebook, session, backend, gpu_memory_gib)
        # Each Slurm poll is one sacct call through slurmdbd: keep it gentle on a shared cluster.
        self.poll_s = poll_s if poll_s is not None else (2.0 if backend.name == "slurm" else 0.25)
        self._specs: dict[str, JobSpec] = {}

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
        spec = spec_of_call(kind, fn, args, self.with_signal_lead(kind, resources))
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
            self._specs.setdefault(key, spec_of_record(first, spec.args, self.nb.get_job(key)))
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
        """Idempotency key: the tool (kind and function) and the canonical args, within this session (keys.job_key)."""
        return job_key(self.session, kind, fn, args, self.lab_roots)

    def attempts(self, key: str) -> list[JobRecord]:
        return self.nb.jobs(session=self.session, key=key)

    def _spec(self, key: str) -> JobSpec:
        if key not in self._specs:
            first = self.nb.get_job(key, 1)
            assert first is not None, "specs are looked up for recorded keys only"
            self._specs[key] = spec_of_record(first, latest=self.nb.get_job(key))
        return self._specs[key]

    # -- admission (tools/jobs/reservations.py) ------------------------------------------------------

    def forecast(self, kind: str, resources: Resources) -> Forecast:
        return self.reservations.forecast(kind, resources)

    def run_bound(self, resources: Resources) -> Forecast:
        return self.reservations.run_bound(resources)

    def admission_forecast(self, kind: str, resources: Resources, attempt: int) -> Forecast:
        return self.reservations.admission_forecast(kind, resources, attempt)

    def measured_runs(self) -> list[forecast.MeasuredRun]:
        return self.reservations.measured_runs()

    def measured_save_s(self, kind: str, model: str | None) -> float | None:
        return self.reservations.measured_save_s(kind, model)

    def with_signal_lead(self, kind: str, resources: Resources) -> Resources:
        return self.reservations.with_signal_lead(kind, resources)

    def check_memory(self, key: str, kind: str, args: BaseModel, resources: Resources, attempt: int = 1
                     ) -> dict[str, Any] | None:
        return self.reservations.check_memory(key, kind, args, resources, attempt)

    def admit(self, key: str, kind: str, resources: Resources, attempt: int = 1) -> LaunchPayload:
        return self.reservations.admit(key, kind, resources, attempt)

    # -- attempts --------------------------------------------------------------------------------

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

    def _launch(self, key: str, spec: JobSpec, attempt: int, reason: str) -> None:
        """Admission, then the attempt row and the launch decision, then the submission."""
        if attempt > 1:  # shortened to what the budget has left: the key's spec from here on
            spec = self._specs[key] = retries.shortened(spec, self.reservations.requeue_limit(spec.resources))
        args = retries.attempt_args(self.attempts(key), spec)
        self.reservations.check_partition(key, spec.kind, spec.resources, attempt)
        memory = self.reservations.check_memory(key, spec.kind, args, spec.resources, attempt)
        payload = self.reservations.admit(key, spec.kind, spec.resources, attempt)
        folder = self.root / f"{key[:16]}-{attempt}"
        resources = {**spec.resources.model_dump(mode="json"), "args": args.model_dump(mode="json"),
                     "forecast": self.reservations.predicted(spec.kind, spec.resources, payload).model_dump(mode="json")}
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

    def _submit(self, key: str, spec: JobSpec, folder: Path, attempt: int, args: BaseModel) -> None:
        sub = submit_attempt(self.backend, spec, folder, args)
        self.nb.update_job(key, attempt, external_id=sub.job_id, log_path=str(sub.paths.stderr))

    def _recover(self, key: str, spec: JobSpec) -> None:
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
        else:  # a controller started before the crash but never given its pickle is stopped first (local.py)
            self.backend.stop_strays(folder)
            self._submit(key, spec, folder, record.attempt, retries.attempt_args(self.attempts(key), spec))

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
            return self.nb.update_job(key, record.attempt, state="running", started_at=iso(last.started))
        if last.state not in FINAL_STATES:  # pending, running, requeued, suspended, ...
            if last.state == "PENDING":
                self._report_pending(key, record)
            return record
        return self._settle(key, spec, record, last, folder, follow_up)

    def cancel(self, key: str) -> None:
        record = self.record(key)
        if record.external_id and record.state in {"pending", "running"}:
            self.backend.cancel(record.external_id, Path(record.folder or ""))

    def _close_requeued_runs(self, key: str, spec: JobSpec, record: JobRecord, runs: list[Run]) -> JobRecord:
        """Runs before the last one were requeued in place by Slurm itself (jobs are submitted
        `--no-requeue`; a lab's extra_sbatch `--requeue` overrides that): each closes its attempt as
        preempted, and the next run is admitted like any requeue, or refused and the job cancelled."""
        same = [a for a in self.attempts(key) if a.external_id == record.external_id]
        for i in range(len(same) - 1, len(runs) - 1):
            detail = f"requeued in place by the executor (run {i + 1}: {runs[i].state})"
            with self.nb.transaction():
                record = self.nb.update_job(key, record.attempt, state="failed", failure_class="preempted",
                                            failure_detail=detail, **cost(self.backend, runs[i]))
                try:
                    payload = self.reservations.admit(key, spec.kind, spec.resources, record.attempt + 1)
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

    def _refuse_requeue(self, key: str, spec: JobSpec, record: JobRecord, failure: Failure, refused: BudgetRefused,
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

    def _settle(self, key: str, spec: JobSpec, record: JobRecord, run: Run, folder: Path,
                follow_up: bool = True) -> JobRecord:
        """The last run is over: settle its cost, store the result or classify the failure (tools/jobs/settlement.py)."""
        job_id = record.external_id or ""
        got = outcome(self.backend, spec.resources, folder, job_id, completed=run.state == "COMPLETED")
        if isinstance(got, BaseModel):
            return self.nb.update_job(key, record.attempt, state="completed",
                                      result=got.model_dump(mode="json"), **cost(self.backend, run))
        failure = failure_of(run, got, RunPaths(folder, job_id), spec.resources)
        record = self.nb.update_job(key, record.attempt, state="failed", failure_class=failure.failure_class,
                                    failure_detail=failure.line(), **cost(self.backend, run))
        if follow_up:
            self._apply_policy(key, spec, record, failure)
        return self.record(key)

    def _apply_policy(self, key: str, spec: JobSpec, record: JobRecord, failure: Failure) -> None:
        """Record the failure, or launch the retry or requeue that follows it (tools/jobs/retries.py), admitted
        again; a refused one ends the job with the run's failure."""
        action = retries.next_action(self.attempts(key), failure, spec)
        payload = FailPayload(key=key, attempt=record.attempt, **failure.model_dump())
        if action == "record":
            self.nb.record_decision(self.session, "fail", f"{spec.kind} failed: {failure.failure_class}", payload)
            return
        try:
            self._launch(key, spec, record.attempt + 1, retries.reason(action, failure))
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
