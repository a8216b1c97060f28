"""Jobs outlive the agent: `Launcher.attach(key)` rebuilds a handle from the notebook alone, in a
process that never saw the job function, and waits on, reads back or cancels the job; the same
tests on the local executor and on the loopback Slurm cluster."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from memory.notebook import Notebook
from tools.jobs.executor import ExecutorSection
from tools.jobs.launcher import JobFailed, Launcher, Resources, _controller_alive
from tools.jobs.probe import CountConfig, EmptyConfig, count

SESSION = "s1"  # the session the conftest's notebook fixture opens
AGENT = str(Path(__file__).with_name("agent_proc.py"))


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.1)


def _over(kind: str, external_id: str, folder: Path) -> bool:
    """Whether the executor ran the job to its end (asked of the executor, never of the notebook)."""
    if kind == "slurm":
        out = subprocess.run(["sacct", "-j", external_id, "-X", "-P", "-n", "-o", "State"],
                             check=True, capture_output=True, text=True).stdout.split()
        return bool(out) and out[-1] == "COMPLETED"
    return not _controller_alive(int(external_id), folder)


def test_attach_after_the_agent_was_sigkilled(launcher: Launcher, notebook: Notebook, tmp_path: Path) -> None:
    kind = launcher.backend.name
    base = [sys.executable, AGENT, str(notebook.path), str(tmp_path / "jobs"), kind]
    short, long = tmp_path / "short", tmp_path / "long"
    # 2 steps and 30 steps of 0.5 s: the short job ends ~14 s before the long one.
    agent = subprocess.Popen([*base, "submit", str(short), "2", str(long), "30"], stdout=subprocess.PIPE, text=True)
    try:
        submitted = [agent.stdout.readline().split() for _ in range(2)]
    finally:
        agent.send_signal(signal.SIGKILL)
        agent.wait()
    assert [line[0] for line in submitted] == ["submitted", "submitted"], submitted
    (_, short_key, short_id), (_, long_key, long_id) = submitted
    short_folder = Path(notebook.get_job(short_key).folder)
    wait_until(lambda: _over(kind, short_id, short_folder), 90, "the short job to finish with no agent watching")
    # Nothing settled it: the notebook still says what the killed agent last wrote.
    assert {notebook.get_job(k).state for k in (short_key, long_key)} <= {"pending", "running"}
    assert not _over(kind, long_id, Path(notebook.get_job(long_key).folder))

    resumed = subprocess.run([*base, "attach", short_key, long_key], capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    lines = [line.split(" ", 2) for line in resumed.stdout.splitlines()]
    assert lines[:2] == [["attached", short_key, short_id], ["attached", long_key, long_id]]
    results = {key: json.loads(text) for word, key, text in lines[2:] if word == "result"}
    assert results[short_key]["total"] == 0 + 1
    assert results[long_key]["total"] == sum(i * i for i in range(30)) and results[long_key]["resumed_from"] == 0

    # No second submission: one attempt, one launch decision and one submitit job per key.
    for key, job_id in ((short_key, short_id), (long_key, long_id)):
        (only,) = notebook.jobs(key=key)
        assert (only.state, only.external_id) == ("completed", job_id) and only.gpu_hours > 0
        assert len(list(Path(only.folder).glob("*_submitted.pkl"))) == 1
    assert len(notebook.decisions(SESSION, kind="launch")) == 2


def test_a_fresh_launcher_cancels_by_key(launcher: Launcher, notebook: Notebook, executor: ExecutorSection,
                                         tmp_path: Path) -> None:
    out = tmp_path / "out"
    key = launcher.submit("probe", count, CountConfig(steps=200, step_seconds=0.2, output_dir=out),
                          Resources(time_limit_min=2, signal_delay_s=10)).key
    wait_until(lambda: (out / "metrics.jsonl").exists(), 60, "the job to start stepping")
    # Another launcher object, as in a resumed agent: nothing but the notebook and the key.
    job = Launcher.from_section(notebook, SESSION, executor, tmp_path / "jobs", poll_s=0.2).attach(key)
    assert job.result_type.__name__ == "CountResult" and job.kind == "probe"
    job.cancel()
    with pytest.raises(JobFailed) as failed:
        job.result(timeout_s=60)
    assert failed.value.record.failure_class == "cancelled" and len(job.attempts()) == 1


def test_attach_refuses_what_it_cannot_rebuild(tmp_path: Path) -> None:
    nb = Notebook.open(tmp_path / "notebook.db")
    nb.open_session("s1", lab=str(tmp_path), budget_gpuh=1.0, reserve_gpuh=0.0, planner="playbook",
                    executor="local", config={})
    launcher = Launcher.from_section(nb, "s1", ExecutorSection(kind="local"), tmp_path / "jobs")
    with pytest.raises(LookupError, match="no job 000000000000 in session 's1'"):
        launcher.attach("0" * 64)
    nb.start_job("k" * 64, session="s1", kind="probe", executor="slurm", resources={}, forecast_gpuh=0.1,
                 fn="tools.jobs.probe:count", result_type="tools.jobs.probe:CountResult")
    with pytest.raises(LookupError, match="ran on the slurm executor; this launcher is local"):
        launcher.attach("k" * 64)
    nb.start_job("m" * 64, session="s1", kind="probe", executor="local", resources={}, forecast_gpuh=0.1,
                 fn="tools.jobs.probe:renamed_since", result_type="tools.jobs.probe:CountResult")
    with pytest.raises(LookupError, match="its function tools.jobs.probe:renamed_since .* no longer imports"):
        launcher.attach("m" * 64)

    def nested(config: CountConfig) -> CountConfig:  # no import path a resumed agent could follow
        return config

    config = CountConfig(steps=1, step_seconds=0, output_dir=tmp_path / "o")
    with pytest.raises(TypeError, match="must be a module-level function of an importable module"):
        launcher.submit("probe", nested, config, Resources(time_limit_min=1, signal_delay_s=10))
    with pytest.raises(TypeError, match="must take one argument annotated with the config's type EmptyConfig"):
        launcher.submit("probe", count, EmptyConfig(tag="wrong config"), Resources(time_limit_min=1, signal_delay_s=10))
    assert nb.jobs(key="0" * 64) == [] and len(nb.jobs()) == 2
