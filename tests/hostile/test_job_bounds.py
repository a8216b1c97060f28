"""Local jobs are bounded (issue 44, item 1): a job past its memory bound is ended and recorded with the reason, a
job that ignores SIGTERM is killed after the grace period, and a job whose agent is gone ends at its time limit
(tools/jobs/warden.py beside each task, started by tools/jobs/jobrun.py). Real subprocesses: the local executor's
controller, its task and the warden; the orphan case adds an agent process that is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import submitit

from memory.notebook import Notebook
from tools.jobs.executor import ExecutorSection
from tools.jobs.jobrun import Resumable, RunPaths, read_events
from tools.jobs.launcher import JobFailed, Launcher, Resources
from tools.jobs.probe import HogConfig, hog

REPO = Path(__file__).resolve().parents[2]


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")


def _wait(predicate, timeout_s: float) -> float:
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout_s, "timed out"
        time.sleep(0.05)
    return time.monotonic() - start


def _kill(pid: int) -> None:
    """A test that failed leaves no job of its own running."""
    if not _gone(pid):
        os.kill(pid, signal.SIGKILL)


def _pid(pid_file: Path) -> int:
    _wait(lambda: pid_file.exists() and pid_file.read_text().strip(), 60)
    return int(pid_file.read_text())


def test_a_job_past_its_memory_bound_is_ended_and_recorded_with_the_reason(tmp_path: Path):
    nb = Notebook.open(tmp_path / "notebook.db")
    nb.open_session("s1", lab=str(tmp_path), budget_gpuh=1.0, reserve_gpuh=0.0, planner="playbook",
                    executor="local", config={})
    launcher = Launcher.from_section(nb, "s1", ExecutorSection(kind="local", zygote=False), tmp_path / "jobs",
                                     poll_s=0.2)
    config = HogConfig(tag="hog", grow_mb=100, steps=40, step_seconds=0.05)  # 4 GB if nothing ends it
    with pytest.raises(JobFailed):
        launcher.submit("probe", hog, config, Resources(time_limit_min=2, mem_gb=1)).result(timeout_s=120)
    (record,) = nb.jobs()
    assert record.failure_class == "oom", record.failure_detail
    assert "past its bound of 1.00 GiB" in record.failure_detail and "ended by its warden" in record.failure_detail
    assert len(nb.decisions("s1", kind="fail")) == 1
    nb.close()


def _submit(tmp_path: Path, config: HogConfig, time_limit_s: float) -> submitit.Job:
    executor = submitit.LocalExecutor(folder=tmp_path / "jobs")
    executor.update_parameters(timeout_min=5)
    return executor.submit(Resumable(hog, time_limit_s, 1, term_grace_s=1.0), config)


@pytest.mark.parametrize("ignore", [True, False])
def test_a_sigterm_ends_the_job_within_the_grace_period(tmp_path: Path, ignore: bool):
    """submitit's own handler ignores SIGTERM; the job here ignores it too (a handler that does nothing): its
    warden, told at once through the wakeup pipe, kills it 1 s later. A job that does not ignore it ends at once."""
    pid_file = tmp_path / "pid"
    job = _submit(tmp_path, HogConfig(tag="t", steps=600, step_seconds=0.1, ignore_sigterm=ignore,
                                      pid_file=pid_file), 300)
    pid = _pid(pid_file)
    os.kill(pid, signal.SIGTERM)
    try:
        took = _wait(lambda: _gone(pid), 20)
    finally:
        _kill(pid)
    assert took < 6, took
    end = read_events(RunPaths(job.paths.folder, job.job_id).events)[-1]
    assert end["event"] == "end" and end["ok"] is False
    if ignore:
        assert end["failure"]["failure_class"] == "preempted" and "killed by its warden" in end["message"], end
    else:
        assert end["error"] == "tools.jobs.jobrun.RunInterrupted" and "SIGTERM from outside" in end["message"], end


AGENT = """
import sys, time
from pathlib import Path
import submitit
from tools.jobs.jobrun import Resumable
from tools.jobs.probe import HogConfig, hog
folder, pid_file = Path(sys.argv[1]), Path(sys.argv[2])
executor = submitit.LocalExecutor(folder=folder)
executor.update_parameters(timeout_min=30)
job = executor.submit(Resumable(hog, 3.0, 1, term_grace_s=1.0),
                      HogConfig(tag="o", steps=6000, step_seconds=0.1, ignore_sigterm=True, pid_file=pid_file))
print(job.job_id, flush=True)
time.sleep(600)
"""


def test_a_job_whose_agent_is_gone_ends_at_its_time_limit(tmp_path: Path):
    """The agent and the job's controller are killed (SIGKILL, as a time limit or a person would); the job, which
    ignores SIGTERM, is ended by its warden once its 3 s limit has passed, and the end is recorded as a timeout."""
    pid_file = tmp_path / "pid"
    agent = subprocess.Popen([sys.executable, "-c", AGENT, str(tmp_path / "jobs"), str(pid_file)], cwd=REPO,
                             stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    controller = int(agent.stdout.readline())
    pid = _pid(pid_file)
    agent.kill()
    agent.wait()
    os.kill(controller, signal.SIGKILL)
    try:
        _wait(lambda: _gone(pid), 30)
    finally:
        _kill(pid)
    events = read_events(RunPaths(tmp_path / "jobs", str(controller)).events)
    assert events[-1]["failure"]["failure_class"] == "timeout", events
    assert "the agent that started it is gone" in events[-1]["message"]
    assert events[-1]["t"] - events[0]["t"] >= 3.0
