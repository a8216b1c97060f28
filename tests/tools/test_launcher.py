"""The launcher end to end, the same tests on the local executor and on the loopback Slurm cluster:
cost settlement, cancel, timeout, preemption with resume, OOM retry, NaN loss, and an agent killed
mid-job that re-attaches on resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from memory.notebook import Notebook
from tools.jobs.executor import ExecutorSection
from tools.jobs.jobrun import HEARTBEAT_S
from tools.jobs.launcher import JobFailed, Launcher, Resources, _controller_alive
from tools.jobs.probe import CountConfig, count

SESSION = "s1"  # the session the conftest's notebook fixture opens

EXPECTED_TOTAL = {n: sum(i * i for i in range(n)) for n in (3, 10, 16)}


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.1)


def _sacct(job_id: str, fields: str) -> list[list[str]]:
    out = subprocess.run(["sacct", "-j", job_id, "-D", "-X", "-P", "-n", "-o", fields],
                         check=True, capture_output=True, text=True).stdout
    return [line.split("|") for line in out.splitlines() if line.strip()]


def _steps_done(out: Path) -> int:
    metrics = out / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


def test_success_settles_cost(launcher: Launcher, notebook: Notebook, tmp_path: Path) -> None:
    config = CountConfig(steps=3, step_seconds=0.4, output_dir=tmp_path / "out")
    t0 = time.time()
    job = launcher.submit("probe", count, config, Resources(time_limit_min=2, signal_delay_s=10))
    result = job.result(timeout_s=60)
    wall = time.time() - t0
    assert result.total == EXPECTED_TOTAL[3] and result.resumed_from == 0
    (attempt,) = job.attempts()
    assert attempt.state == "completed" and attempt.result == result.model_dump(mode="json")
    if launcher.backend.name == "slurm":
        ((elapsed, tres),) = _sacct(attempt.external_id, "ElapsedRaw,AllocTRES")
        assert "gres/gpu=1" in tres
        assert attempt.gpu_hours == pytest.approx(int(elapsed) * 1 / 3600)
    else:
        # Local: wall time of the worker on one device (CPU-only counts as one).
        assert 1.2 <= attempt.gpu_hours * 3600 <= wall
    # A real lab's charge is what was measured: device-seconds / 3600, both kept on the row.
    assert attempt.charge == "measured" and attempt.gpu_hours == pytest.approx(attempt.device_seconds / 3600)
    ledger = notebook.ledger(SESSION)
    assert ledger.spent_gpuh == pytest.approx(attempt.gpu_hours) and ledger.reserved_gpuh == 0


def test_resubmission_reads_back_and_never_submits_twice(launcher: Launcher, notebook: Notebook, tmp_path: Path) -> None:
    config = CountConfig(steps=3, step_seconds=0.0, output_dir=tmp_path / "out")
    resources = Resources(time_limit_min=2, signal_delay_s=10)
    first = launcher.submit("probe", count, config, resources).result(timeout_s=60)
    again = launcher.submit("probe", count, config, resources)
    assert again.result(timeout_s=5) == first
    assert len(notebook.jobs(session=SESSION)) == 1
    assert len(notebook.decisions(SESSION, kind="launch")) == 1
    assert len(list((tmp_path / "jobs").glob("*/*_submitted.pkl"))) == 1


def test_cancelled_job_is_recorded_cancelled(launcher: Launcher, tmp_path: Path) -> None:
    out = tmp_path / "out"
    job = launcher.submit("probe", count, CountConfig(steps=200, step_seconds=0.2, output_dir=out),
                          Resources(time_limit_min=2, signal_delay_s=10))
    # Run >= 1.6 s before cancelling: sacct counts whole seconds, and the cost must be positive.
    wait_until(lambda: _steps_done(out) >= 8, 30, "the job to run a few steps")
    job.cancel()
    with pytest.raises(JobFailed) as failed:
        job.result(timeout_s=60)
    assert failed.value.record.failure_class == "cancelled"
    assert failed.value.record.gpu_hours > 0
    assert len(job.attempts()) == 1  # a cancel is final: no retry


def test_local_cancel_when_the_agent_ignores_sigint(notebook: Notebook, tmp_path: Path) -> None:
    # An agent started in the background of a script ignores SIGINT; its local controllers inherit
    # that, so the cancel must not depend on SIGINT.
    launcher = Launcher.from_section(notebook, SESSION, ExecutorSection(kind="local"), tmp_path / "jobs", poll_s=0.2)
    out = tmp_path / "out"
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        job = launcher.submit("probe", count, CountConfig(steps=200, step_seconds=0.2, output_dir=out),
                              Resources(time_limit_min=2, signal_delay_s=10))
    finally:
        signal.signal(signal.SIGINT, previous)
    wait_until(lambda: _steps_done(out) >= 3, 30, "the job to run a few steps")
    job.cancel()
    with pytest.raises(JobFailed) as failed:
        job.result(timeout_s=30)
    assert failed.value.record.failure_class == "cancelled" and failed.value.record.gpu_hours > 0
    assert not _controller_alive(int(job.record.external_id), Path(job.record.folder))


def test_a_controller_read_in_the_middle_of_its_exec_is_alive(tmp_path: Path) -> None:
    # A resumed agent asks /proc whether a controller lives. Right after the Popen that started a process
    # returns, its cmdline can read empty for a moment (CI's resume test took a starting controller for dead
    # and ran the job again): a live process of the right command line must read alive every time.
    # Busy processes on every core make the moment long enough to be met often (one read in ten, here).
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    folder, dead = tmp_path / "jobs", []
    try:
        for _ in range(300):
            process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)", "submitit.local._local",
                                        str(folder)])
            try:
                if not _controller_alive(process.pid, folder):
                    dead.append(process.pid)
            finally:
                process.kill()
                process.wait()
    finally:
        for hog in busy:
            hog.kill()
            hog.wait()
    assert dead == []
    assert not _controller_alive(os.getpid(), folder)  # a live process of another command line is not a controller
    assert not _controller_alive(process.pid, folder)  # reaped


def test_job_over_its_time_limit_is_recorded_timeout(launcher: Launcher, tmp_path: Path) -> None:
    # The checkpoint signal comes `signal_delay_s` before the limit; with no requeue allowed the
    # run ends there, as a timeout. (Slurm's limit is whole minutes, so its signal comes earlier.)
    # The signal must come after the worker set its handler (imports take 10-15 s at a load of 12 on
    # 2 cores), else it dies of it. Locally it comes 6 s after the start. slurmctld checks limits
    # every 30 s and signals up to 30 s early (seen: 26 s early), so on Slurm it is asked for 60 s
    # after the start: 30-60 s. An 8-minute limit gives near_time_limit a slack (49 s) that still
    # reads a signal 30 s early, seen from a worker that started 15 s late, as the time limit.
    slurm = launcher.backend.name == "slurm"
    resources = Resources(time_limit_min=8 if slurm else 0.2, signal_delay_s=420 if slurm else 6, max_requeues=0)
    job = launcher.submit("probe", count, CountConfig(steps=600, step_seconds=0.2, output_dir=tmp_path / "out"),
                          resources)
    with pytest.raises(JobFailed) as failed:
        job.result(timeout_s=120)
    record = failed.value.record
    assert record.failure_class == "timeout", record.failure_detail
    assert len(job.attempts()) == 1 and record.gpu_hours > 0


def test_local_job_killed_at_its_time_limit_is_recorded_timeout(notebook: Notebook, tmp_path: Path) -> None:
    # The job takes the signal but keeps sleeping through it (a step longer than the limit): the
    # local controller kills it at the limit, with no result written. The signal comes 5 s after
    # the start, when the job's own handler is set even on a loaded machine.
    launcher = Launcher.from_section(notebook, SESSION, ExecutorSection(kind="local"), tmp_path / "jobs", poll_s=0.2)
    config = CountConfig(steps=2, step_seconds=30, output_dir=tmp_path / "out", on_signal="raise")
    job = launcher.submit("probe", count, config, Resources(time_limit_min=0.2, signal_delay_s=7, max_requeues=1))
    with pytest.raises(JobFailed) as failed:
        job.result(timeout_s=60)
    assert failed.value.record.failure_class == "timeout", failed.value.record.failure_detail
    # One requeue (a new submission, as nothing requeued it in place), then a recorded failure.
    first, second = job.attempts()
    assert (first.failure_class, second.failure_class) == ("timeout", "timeout")
    assert first.external_id != second.external_id
    for attempt in (first, second):
        # The worker process's wall time up to the kill: the controller never kills before the 12 s
        # limit (it counts sleeps); a loaded machine only makes it later. A worker too slow to log
        # its end before the SIGKILL 1 s later is dated by its last heartbeat (1 s apart).
        assert 12 - HEARTBEAT_S - 0.5 <= attempt.gpu_hours * 3600 <= 16
    (fail,) = notebook.decisions(SESSION, kind="fail")
    assert fail.payload.failure_class == "timeout"


def _preempt(launcher: Launcher, external_id: str, folder: Path) -> None:
    """Send the preemption signal the way the executor does: Slurm to the job, locally to the worker."""
    if launcher.backend.name == "slurm":
        subprocess.run(["scancel", "--signal", "USR2", external_id], check=True)
        return
    events = [json.loads(line) for line in (folder / f"{external_id}_events.jsonl").read_text().splitlines()]
    os.kill(events[-1]["pid"], signal.SIGUSR2)


@pytest.mark.parametrize("on_signal", ["requeue", "raise"])
def test_preempted_job_resumes_from_checkpoint(launcher: Launcher, tmp_path: Path, on_signal: str) -> None:
    # requeue: submitit's handler asks the job to checkpoint; the wrapper ends the run as preempted.
    # raise: the job saves and raises 'preempted:' like trainers/loop.py. Either way the launcher
    # admits the requeue against the budget and submits it again; the job resumes from its state.
    out = tmp_path / "out"
    config = CountConfig(steps=10, step_seconds=0.4, output_dir=out, on_signal=on_signal)
    job = launcher.submit("probe", count, config, Resources(time_limit_min=3, signal_delay_s=10))
    wait_until(lambda: _steps_done(out) >= 2, 60, "two steps before the preemption")
    record = job.record
    _preempt(launcher, record.external_id, Path(record.folder))
    result = job.result(timeout_s=120)

    uninterrupted = count(config.model_copy(update={"output_dir": tmp_path / "clean", "step_seconds": 0.0}))
    assert result.total == uninterrupted.total == EXPECTED_TOTAL[10]
    assert 2 <= result.resumed_from < 10  # resumed from the checkpoint, not from scratch
    first, second = job.attempts()
    assert (first.state, first.failure_class, second.state) == ("failed", "preempted", "completed")
    assert first.external_id != second.external_id  # a new submission, never an in-place requeue
    assert first.gpu_hours > 0 and second.gpu_hours > 0
    # The requeue was admitted: a launch decision for each attempt, the second on at least one run's bound.
    launches = [d.payload for d in launcher.nb.decisions(SESSION, kind="launch")]
    assert [(d.attempt, d.forecast_source) for d in launches] == [(1, "time_limit"), (2, "time_limit")]


def test_oom_retries_once_with_half_the_micro_batch(launcher: Launcher, tmp_path: Path) -> None:
    # 8 x 64 MiB does not fit in 300 MiB of headroom: a real MemoryError; 4 x 64 MiB does.
    config = CountConfig(steps=2, step_seconds=0.0, output_dir=tmp_path / "out", micro_batch_size=8,
                         grad_accum=2, item_mb=64, memory_limit_mb=300)
    job = launcher.submit("probe", count, config, Resources(time_limit_min=2, signal_delay_s=10))
    result = job.result(timeout_s=90)
    assert (result.micro_batch_size, result.grad_accum) == (4, 4)
    first, second = job.attempts()
    assert first.failure_class == "oom" and second.state == "completed"
    assert second.resources["args"]["micro_batch_size"] == 4
    assert first.external_id != second.external_id


def test_nan_loss_is_classified_and_not_retried(launcher: Launcher, notebook: Notebook, tmp_path: Path) -> None:
    config = CountConfig(steps=5, step_seconds=0.0, output_dir=tmp_path / "out", nan_at_step=2)
    job = launcher.submit("probe", count, config, Resources(time_limit_min=2, signal_delay_s=10))
    with pytest.raises(JobFailed) as failed:
        job.result(timeout_s=60)
    assert failed.value.record.failure_class == "nan_loss"
    assert failed.value.record.failure_detail.startswith("FloatingPointError: nan_loss: loss is nan at step 2")
    (fail,) = notebook.decisions(SESSION, kind="fail")
    assert fail.payload.failure_class == "nan_loss"


def _job_alive(kind: str, external_id: str, folder: Path) -> bool:
    if kind == "slurm":
        return _sacct(external_id, "State")[-1][0] in {"RUNNING", "PENDING"}
    return _controller_alive(int(external_id), folder)


def test_killed_agent_reattaches_on_resume(launcher: Launcher, notebook: Notebook, tmp_path: Path) -> None:
    kind = launcher.backend.name
    argv = [sys.executable, str(Path(__file__).with_name("agent_proc.py")), str(notebook.path),
            str(tmp_path / "jobs"), kind, "submit", str(tmp_path / "out"), "16"]
    agent = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        line = agent.stdout.readline().split()
        assert line[0] == "submitted", line
        wait_until(lambda: _steps_done(tmp_path / "out") >= 2, 60, "the job to run")
    finally:
        agent.kill()
        agent.wait()
    _, key, job_id = line
    record = notebook.jobs(session=SESSION)[0]
    assert record.external_id == job_id and _job_alive(kind, job_id, Path(record.folder))

    resumed = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    outputs = {ln.split(" ", 1)[0]: ln.split(" ", 2)[1:] for ln in resumed.stdout.splitlines()}
    assert outputs["submitted"] == [key, job_id]
    result = json.loads(outputs["result"][1])
    assert result["total"] == EXPECTED_TOTAL[16]
    assert result["resumed_from"] == 0  # the job itself was never interrupted
    (only,) = notebook.jobs(session=SESSION)
    assert only.state == "completed" and only.external_id == job_id
    assert len(notebook.decisions(SESSION, kind="launch")) == 1
    assert len(list((tmp_path / "jobs").glob("*/*_submitted.pkl"))) == 1
