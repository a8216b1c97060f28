"""Failure classification from state, exit code and log text; the policy; admission and forecasts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError, model_validator
from submitit.local.local import start_controller

from memory.notebook import Notebook
from tools.jobs import local
from tools.jobs.executor import ExecutorSection, SlurmSection
from tools.jobs.failures import classify, decide, smaller_batch_config
from tools.jobs.launcher import BudgetRefused, JobFailed, Launcher, Resources, _sbatch_lines
from tools.jobs.probe import CountConfig, EmptyConfig, count, empty

TRACE = "Traceback (most recent call last):\n  File \"x.py\", line 3, in step\n{}\n"


@pytest.mark.parametrize(("state", "code", "text", "expected", "detail"), [
    ("FAILED", 1, TRACE.format("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"),
     "oom", "torch.OutOfMemoryError"),
    ("OUT_OF_MEMORY", 0, "", "oom", "OUT_OF_MEMORY"),
    ("FAILED", 1, TRACE.format("MemoryError"), "oom", "MemoryError"),
    ("FAILED", 1, "[rank3]:[E ProcessGroupNCCL.cpp:616] Watchdog caught collective operation timeout: "
     "WorkNCCL(SeqNum=77, OpType=ALLREDUCE) ran for 600012 milliseconds before timing out.",
     "nccl_timeout", None),
    # Messages of torch 2.x on CPU (gloo): a rank that skipped the collective, a rank that never joined.
    ("FAILED", 1, "[rank0]: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/"
     "unbound_buffer.cc:78] Timed out waiting 5000ms for recv operation to complete", "nccl_timeout", None),
    ("FAILED", 1, TRACE.format("torch.distributed.DistStoreError: Timed out after 6 seconds waiting for clients. "
                               "1/2 clients joined."), "nccl_timeout", None),
    ("FAILED", 1, TRACE.format("FloatingPointError: nan_loss: loss is nan at step 40"), "nan_loss",
     "FloatingPointError: nan_loss: loss is nan at step 40"),
    ("FAILED", 1, TRACE.format("tools.jobs.jobrun.RunInterrupted: timeout: after 170 s of a 180 s limit"),
     "timeout", None),
    ("TIMEOUT", 0, "slurmstepd: error: *** JOB 12 ON n1 CANCELLED AT 2026-01-01T00:00:00 DUE TO TIME LIMIT ***",
     "timeout", "TIMEOUT"),
    ("PREEMPTED", 0, "", "preempted", "PREEMPTED"),
    ("NODE_FAIL", 1, "", "node_failure", "NODE_FAIL"),
    ("CANCELLED by 0", 0, TRACE.format("KeyboardInterrupt"), "cancelled", "CANCELLED BY 0"),
    ("FAILED", 2, TRACE.format("ValueError: dataset row 7 has no messages"), "error",
     "ValueError (exit code 2)"),
    ("FAILED", 137, "", "error", "FAILED: no exception (exit code 137)"),
])
def test_classify(state: str, code: int, text: str, expected: str, detail: str | None) -> None:
    failure = classify(state, code, text)
    assert failure.failure_class == expected
    if detail is not None:
        assert failure.detail == detail


def test_a_loss_that_mentions_nan_elsewhere_is_not_nan_loss() -> None:
    assert classify("FAILED", 1, TRACE.format("KeyError: 'nan_loss_weight'")).failure_class == "error"


def test_policy() -> None:
    kw = {"oom_retries": 0, "requeues": 0, "max_requeues": 2, "can_halve_batch": True}
    assert decide("preempted", **kw) == "requeue"
    assert decide("timeout", **{**kw, "requeues": 2}) == "record"
    assert decide("oom", **kw) == "retry_smaller_batch"
    assert decide("oom", **{**kw, "oom_retries": 1}) == "record"
    assert decide("oom", **{**kw, "can_halve_batch": False}) == "record"
    for klass in ("nan_loss", "nccl_timeout", "node_failure", "cancelled", "error"):
        assert decide(klass, **kw) == "record"


def test_smaller_batch_config_keeps_rows_per_step(tmp_path: Path) -> None:
    config = CountConfig(steps=1, step_seconds=0, output_dir=tmp_path / "run", micro_batch_size=6, grad_accum=3)
    smaller = smaller_batch_config(config)
    assert (smaller.micro_batch_size, smaller.grad_accum) == (3, 6)
    assert smaller.output_dir == tmp_path / "run-mb3"  # a fresh run directory for the changed config
    assert smaller_batch_config(config.model_copy(update={"micro_batch_size": 1})) is None
    assert smaller_batch_config(EmptyConfig(tag="no batch")) is None


class _Trainer(BaseModel):
    batch_size: int
    micro_batch_size: int

    @model_validator(mode="after")
    def _divides(self) -> _Trainer:
        if self.batch_size % self.micro_batch_size:
            raise ValueError("batch_size must be a multiple of micro_batch_size")
        return self


def test_smaller_batch_config_with_implied_accumulation() -> None:
    # batch_size stays: accumulation (batch_size / micro_batch_size) doubles by itself.
    assert smaller_batch_config(_Trainer(batch_size=8, micro_batch_size=4)) == _Trainer(batch_size=8, micro_batch_size=2)
    # 15 rows per step cannot be cut into micro-batches of 2: no valid smaller config.
    assert smaller_batch_config(_Trainer(batch_size=15, micro_batch_size=5)) is None


def _launcher(tmp_path: Path, budget: float, reserve: float) -> tuple[Notebook, Launcher]:
    nb = Notebook.open(tmp_path / "notebook.db")
    nb.open_session("s1", lab=str(tmp_path), budget_gpuh=budget, reserve_gpuh=reserve, planner="playbook",
                    executor="local", config={})
    return nb, Launcher.from_section(nb, "s1", ExecutorSection(kind="local"), tmp_path / "jobs")


def test_refusal_is_recorded_and_nothing_runs(tmp_path: Path) -> None:
    nb, launcher = _launcher(tmp_path, budget=1.0, reserve=0.25)
    with pytest.raises(BudgetRefused, match="does not fit"):
        launcher.submit("probe", empty, EmptyConfig(tag="big"), Resources(time_limit_min=1, estimate_gpuh=0.8))
    (refusal,) = nb.decisions("s1", kind="refuse")
    assert refusal.payload.forecast_gpuh == 0.8 and refusal.payload.forecast_source == "declared"
    assert nb.jobs() == [] and not (tmp_path / "jobs").exists()
    # 0.75 fits exactly: forecast + spent + reserved + reserve == budget.
    job = launcher.submit("probe", empty, EmptyConfig(tag="fits"), Resources(time_limit_min=1, estimate_gpuh=0.75))
    assert nb.ledger("s1").reserved_gpuh == 0.75
    job.result(timeout_s=60)
    ledger = nb.ledger("s1")
    assert ledger.reserved_gpuh == 0 and 0 < ledger.spent_gpuh < 0.01


def test_forecast_sources(tmp_path: Path) -> None:
    nb, launcher = _launcher(tmp_path, budget=100.0, reserve=0.0)
    bound = launcher.forecast("sft", Resources(time_limit_min=30, gpus=4, model="m", work_units=1000))
    assert (bound.source, bound.gpuh) == ("time_limit", 2.0)
    # An earlier completed sft on model m: 2000 units in 0.5 + 0.5 GPU-h over two attempts.
    for attempt, hours, state in ((1, 0.5, "failed"), (2, 0.5, "completed")):
        nb.start_job("k1", session="s1", kind="sft", executor="local", attempt=attempt, forecast_gpuh=1.0,
                     resources={"model": "m", "work_units": 2000})
        nb.update_job("k1", attempt, gpu_hours=hours, state=state)
    measured = launcher.forecast("sft", Resources(time_limit_min=30, gpus=4, model="m", work_units=1000))
    assert (measured.source, measured.gpuh) == ("throughput", 0.5)
    other_model = launcher.forecast("sft", Resources(time_limit_min=30, model="other", work_units=1000))
    assert other_model.source == "time_limit"
    declared = launcher.forecast("sft", Resources(time_limit_min=30, estimate_gpuh=3.0, model="m", work_units=1))
    assert (declared.source, declared.gpuh) == ("declared", 3.0)


def test_bad_inputs_are_refused_with_the_field_named(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="signal_delay_s must be shorter"):
        Resources(time_limit_min=0.5, signal_delay_s=30)
    with pytest.raises(ValidationError, match="time_limit_min"):
        Resources(time_limit_min=0)
    with pytest.raises(ValueError, match="extra_sbatch: 'constraint=h100' is not a long option"):
        _sbatch_lines(["constraint=h100"])
    assert _sbatch_lines(["#SBATCH --constraint=h100", "--exclusive"]) == {"constraint": "h100", "exclusive": True}
    _, launcher = _launcher(tmp_path, budget=1.0, reserve=0.0)
    with pytest.raises(TypeError, match="must be annotated to return a pydantic model"):
        launcher.submit("probe", lambda c: c, EmptyConfig(tag="x"), Resources(time_limit_min=1))


def test_count_probe_resumes_in_process(tmp_path: Path) -> None:
    config = CountConfig(steps=4, step_seconds=0, output_dir=tmp_path)
    (tmp_path / "state.json").write_text('{"step": 2, "total": 1}')
    result = count(config)
    assert (result.resumed_from, result.total) == (2, 1 + 4 + 9)


def test_recorded_but_never_submitted_is_submitted_once_on_resume(tmp_path: Path) -> None:
    # The agent died between writing the attempt row and calling the executor.
    nb, launcher = _launcher(tmp_path, budget=1.0, reserve=0.0)
    config = EmptyConfig(tag="crash window")
    key = launcher.key("probe", empty, config)
    nb.start_job(key, session="s1", kind="probe", executor="local", resources={}, forecast_gpuh=0.01,
                 folder=str(tmp_path / "jobs" / "attempt-1"))
    job = launcher.submit("probe", empty, config, Resources(time_limit_min=1, signal_delay_s=10))
    assert job.result(timeout_s=60).pid > 0
    assert len(list((tmp_path / "jobs" / "attempt-1").glob("*_submitted.pkl"))) == 1
    again = launcher.submit("probe", empty, config, Resources(time_limit_min=1, signal_delay_s=10))
    assert again.record.external_id == job.record.external_id and len(nb.jobs()) == 1


@pytest.mark.parametrize("through", ["python", "zygote"])
def test_a_controller_started_but_never_given_its_pickle_is_stopped_before_the_attempt_runs_again(
        tmp_path: Path, through: str) -> None:
    # The agent died after submitit started the controller and before it wrote the job's pickle: the controller's
    # task waits 60 s for that pickle and then fails into the folder, after the resumed agent ran the attempt there.
    nb, launcher = _launcher(tmp_path, budget=1.0, reserve=0.0)
    config, folder = EmptyConfig(tag="started, no pickle"), tmp_path / "jobs" / "attempt-1"
    key = launcher.key("probe", empty, config)
    nb.start_job(key, session="s1", kind="probe", executor="local", resources={}, forecast_gpuh=0.01,
                 folder=str(folder))
    folder.mkdir(parents=True)
    # The task as the launcher starts it: a plain python, or the zygote's client (its job forked by the zygote).
    python = launcher.backend.zygote.prepare(os.environ) if through == "zygote" else sys.executable
    assert python is not None
    stray = start_controller(folder, f"{python} -u -m submitit.core._submit {folder}", timeout_min=2)
    deadline = time.monotonic() + 30
    while not list(folder.glob(f"{stray.pid}_0_log.err")):  # its task started and opened its log
        assert time.monotonic() < deadline and stray.poll() is None, "the stray controller's task never started"
        time.sleep(0.05)
    bystander = subprocess.Popen(["tail", "-f", str(folder / f"{stray.pid}_0_log.err")], stdout=subprocess.DEVNULL)
    job = launcher.submit("probe", empty, config, Resources(time_limit_min=1, signal_delay_s=10))
    assert stray.wait(timeout=5) == -signal.SIGKILL  # stopped before the attempt was submitted again
    assert bystander.poll() is None  # a user's `tail -f` on the job's log is no job process: left running
    bystander.kill()
    bystander.wait()
    assert job.result(timeout_s=60).pid > 0 and job.record.external_id != str(stray.pid)
    assert not local._using(folder)  # nothing is left to write into the folder
    assert len(list(folder.glob("*_submitted.pkl"))) == 1 and len(nb.jobs()) == 1


def test_failure_settled_but_not_followed_up_is_requeued_on_resume(tmp_path: Path) -> None:
    # The agent died after settling attempt 1 as preempted and before the policy requeued it.
    nb, launcher = _launcher(tmp_path, budget=1.0, reserve=0.0)
    config = CountConfig(steps=3, step_seconds=0, output_dir=tmp_path / "out")
    resources = Resources(time_limit_min=1, signal_delay_s=10)
    key = launcher.key("probe", count, config)
    nb.start_job(key, session="s1", kind="probe", executor="local", resources={}, forecast_gpuh=0.01,
                 folder=str(tmp_path / "jobs" / "attempt-1"))
    nb.update_job(key, 1, external_id="1", state="failed", failure_class="preempted", failure_detail="PREEMPTED",
                  gpu_hours=0.001)
    job = launcher.submit("probe", count, config, resources)
    assert job.result(timeout_s=60).total == 0 + 1 + 4
    first, second = job.attempts()
    assert (first.state, second.attempt, second.state) == ("failed", 2, "completed")
    (launch,) = nb.decisions("s1", kind="launch")
    assert launch.payload.attempt == 2 and "requeue" in launch.rationale


def test_recorded_failure_is_not_retried_on_resume(tmp_path: Path) -> None:
    # A failure the policy already recorded (a `fail` decision) is read back, never resubmitted.
    nb, launcher = _launcher(tmp_path, budget=1.0, reserve=0.0)
    config = CountConfig(steps=3, step_seconds=0, output_dir=tmp_path / "out", nan_at_step=1)
    resources = Resources(time_limit_min=1, signal_delay_s=10)
    with pytest.raises(JobFailed):
        launcher.submit("probe", count, config, resources).result(timeout_s=60)
    resumed = Launcher.from_section(nb, "s1", ExecutorSection(kind="local"), tmp_path / "jobs")
    again = resumed.submit("probe", count, config, resources)
    with pytest.raises(JobFailed, match="nan_loss"):
        again.result(timeout_s=5)
    assert len(nb.jobs()) == 1 and len(nb.decisions("s1", kind="launch")) == 1
    assert len(nb.decisions("s1", kind="fail")) == 1


def test_submitted_but_not_recorded_is_adopted_on_resume(tmp_path: Path) -> None:
    nb, launcher = _launcher(tmp_path, budget=1.0, reserve=0.0)
    config, resources = EmptyConfig(tag="adopt"), Resources(time_limit_min=1, signal_delay_s=10)
    job_id = launcher.submit("probe", empty, config, resources).record.external_id
    # The agent died after the executor took the job and before the notebook stored its id.
    assert nb.update_job(launcher.key("probe", empty, config), 1, external_id=None).external_id is None
    resumed = Launcher.from_section(nb, "s1", ExecutorSection(kind="local"), tmp_path / "jobs")
    again = resumed.submit("probe", empty, config, resources)
    assert again.record.external_id == job_id
    assert again.result(timeout_s=60).pid > 0
    assert len(list((tmp_path / "jobs").glob("*/*_submitted.pkl"))) == 1 and len(nb.jobs()) == 1


def test_a_requeue_that_would_overrun_the_budget_is_refused(tmp_path: Path) -> None:
    # The bug of a 10 GPU-h test session: an eval timed out and was requeued in place twice after the
    # ledger had passed the budget. Here a real job times out at a 12 s limit (signal at 8 s), charged
    # 0.5 GPU-h per device-second: one run's bound is 6 GPU-h, admitted on 10 - 0.5 reserve; after the
    # first run (>= 4 GPU-h) a second run's 6 GPU-h does not fit and must not run.
    nb = Notebook.open(tmp_path / "notebook.db")
    nb.open_session("s1", lab=str(tmp_path), budget_gpuh=10.0, reserve_gpuh=0.5, planner="playbook",
                    executor="local", config={})
    section = ExecutorSection(kind="local", simulated_gpuh_per_device_s=0.5)
    launcher = Launcher.from_section(nb, "s1", section, tmp_path / "jobs", poll_s=0.2)
    config = CountConfig(steps=600, step_seconds=0.2, output_dir=tmp_path / "out")
    job = launcher.submit("eval", count, config, Resources(time_limit_min=0.2, signal_delay_s=4, max_requeues=3))
    with pytest.raises(JobFailed, match="requeue refused") as failed:
        job.result(timeout_s=90)
    record = failed.value.record
    assert record.failure_class == "timeout" and record.attempt == 1, record.failure_detail
    ledger = nb.ledger("s1")
    assert 4.0 <= ledger.spent_gpuh <= ledger.budget_gpuh and ledger.reserved_gpuh == 0
    (refusal,) = nb.decisions("s1", kind="refuse")
    assert (refusal.payload.attempt, refusal.payload.forecast_gpuh) == (2, pytest.approx(6.0))
    assert "attempt 2 would overrun the budget" in refusal.rationale
    (fail,) = nb.decisions("s1", kind="fail")
    assert (fail.payload.attempt, fail.payload.failure_class) == (1, "timeout")
    assert "did not fit the budget" in fail.rationale
    assert len(nb.decisions("s1", kind="launch")) == len(nb.jobs()) == 1


@pytest.mark.parametrize("nomination", [False, True])
def test_a_requeue_is_admitted_on_one_runs_bound_and_nomination_checks_may_use_the_reserve(
        tmp_path: Path, nomination: bool) -> None:
    # Attempt 1 (declared 0 GPU-h, as nomination checks are) was preempted. Its requeue is admitted on
    # one run's bound (60 s on one device: 1/60 GPU-h), not on the estimate the first run outlived:
    # that does not fit above a 0.99 reserve, and fits inside it for a nomination check only.
    nb, launcher = _launcher(tmp_path, budget=1.0, reserve=0.99)
    config = CountConfig(steps=3, step_seconds=0, output_dir=tmp_path / "out")
    resources = Resources(time_limit_min=1, signal_delay_s=10, estimate_gpuh=0.0, nomination=nomination)
    key = launcher.key("probe", count, config)
    nb.start_job(key, session="s1", kind="probe", executor="local", resources={}, forecast_gpuh=0.0,
                 folder=str(tmp_path / "jobs" / "attempt-1"))
    nb.update_job(key, 1, external_id="1", state="failed", failure_class="preempted", failure_detail="PREEMPTED",
                  gpu_hours=0.001)
    assert launcher.admission_forecast("probe", resources, 1).gpuh == 0.0
    assert launcher.admission_forecast("probe", resources, 2).gpuh == pytest.approx(1 / 60)
    job = launcher.submit("probe", count, config, resources)
    if nomination:
        assert job.result(timeout_s=60).total == 0 + 1 + 4
        (launch,) = nb.decisions("s1", kind="launch")
        assert (launch.payload.attempt, launch.payload.forecast_source) == (2, "time_limit")
    else:
        with pytest.raises(JobFailed, match="requeue refused"):
            job.result(timeout_s=5)
        assert len(nb.jobs()) == 1 and nb.decisions("s1", kind="launch") == []
    assert nb.ledger("s1").spent_gpuh <= 1.0


@pytest.mark.slurm
def test_a_slurm_requeue_in_place_is_admitted_or_cancelled(slurm_cluster: None, tmp_path: Path) -> None:
    # Jobs go out --no-requeue; a lab that passes --requeue lets Slurm requeue in place (here
    # `scontrol requeue`, as a preemption would). The launcher admits that new run like any requeue:
    # one run's bound (60 s on 1 GPU) no longer fits after the first run's seconds, so it is cancelled.
    nb = Notebook.open(tmp_path / "notebook.db")
    nb.open_session("s1", lab=str(tmp_path), budget_gpuh=0.0175, reserve_gpuh=0.0, planner="playbook",
                    executor="slurm", config={})
    section = ExecutorSection(kind="slurm", slurm=SlurmSection(partition="debug", cpus_per_task=1, mem_gb=1,
                                                               extra_sbatch=["--requeue"]))
    launcher = Launcher.from_section(nb, "s1", section, tmp_path / "jobs", poll_s=0.5)
    out = tmp_path / "out"
    job = launcher.submit("probe", count, CountConfig(steps=100, step_seconds=1.0, output_dir=out),
                          Resources(time_limit_min=1, signal_delay_s=10))
    deadline = time.monotonic() + 120
    while not (out / "metrics.jsonl").exists() or len((out / "metrics.jsonl").read_text().splitlines()) < 6:
        assert time.monotonic() < deadline, "the Slurm job never ran six steps"
        job.done()
        time.sleep(0.5)
    subprocess.run(["scontrol", "requeue", job.record.external_id], check=True, timeout=60)
    with pytest.raises(JobFailed, match="requeue refused") as failed:
        job.result(timeout_s=120)
    record = failed.value.record
    assert (record.attempt, record.failure_class) == (1, "preempted") and record.gpu_hours > 0
    (refusal,) = nb.decisions("s1", kind="refuse")
    assert refusal.payload.attempt == 2 and refusal.payload.forecast_gpuh == pytest.approx(1 / 60)
    assert nb.ledger("s1").spent_gpuh <= 0.0175 and len(nb.jobs()) == 1
    deadline = time.monotonic() + 60  # slurmdbd records the cancel a moment after scancel returns
    while True:
        states = subprocess.run(["sacct", "-j", record.external_id, "-D", "-X", "-n", "-P", "-o", "State"],
                                capture_output=True, text=True, check=True).stdout.splitlines()
        if states[-1].startswith("CANCELLED") or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert states[0] == "REQUEUED" and states[-1].startswith("CANCELLED"), states
