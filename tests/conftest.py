"""One finished playbook session shared by the agent and report tests (session-scoped: a session runs real
jobs, so the whole suite runs it once).

It is also the resume test's session: the agent is SIGKILLed while the incumbent's calibration job
runs, resumed from its graph checkpoint, SIGKILLed again while the SFT arm trains, its checkpoint
file deleted, and resumed from the notebook alone to its nomination.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from memory.notebook import Notebook, NotebookError

sys.path.insert(0, str(Path(__file__).parent / "agent"))
from labkit import make_lab  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SESSION = "s1"
BUDGET = "5gpuh"
DEADLINE_S = 1800


@pytest.fixture(scope="session", autouse=True)
def _one_thread_per_process():
    """One intra-op thread in this process and in every process the tests start (agents, their jobs,
    on Slurm too: sbatch passes the environment on). The models are tiny, and on the shared 2-core
    machine two OpenMP threads per process mostly spin: the labkit parent's 40 SFT steps took 52 s of
    CPU with two threads and 4.8 s with one, at load 15."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        yield
        torch.set_num_threads(before)


@dataclass
class Finished:
    lab: Path
    session: str
    kills: list[str]
    logs: list[str]


def agent(log: Path, *args: str) -> subprocess.Popen:
    # A log file, not a pipe: the jobs the agent started inherit its stdout and outlive a SIGKILL.
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, str(REPO / "run_agent.py"), *args], cwd=REPO, stdout=out,
                                stderr=subprocess.STDOUT)


def _job_started(lab: Path, kind: str) -> bool:
    try:
        with Notebook.open(lab / "notebook.db", readonly=True) as nb:
            return any(j.kind == kind and j.state in ("pending", "running") for j in nb.jobs(session=SESSION))
    except NotebookError:  # not there yet, or still being created by the agent
        return False


def kill_when(proc: subprocess.Popen, log: Path, lab: Path, kind: str) -> str:
    """SIGKILL the agent (only the agent: its jobs live on) once a job of `kind` is in flight."""
    deadline = time.monotonic() + DEADLINE_S
    while not _job_started(lab, kind):
        if proc.poll() is not None:
            raise AssertionError(f"agent ended before a {kind} job started:\n{log.read_text()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"no {kind} job after {DEADLINE_S} s")
        time.sleep(0.5)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    return log.read_text()


@pytest.fixture(scope="session")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Finished:
    root = tmp_path_factory.mktemp("agent")
    lab, logs = make_lab(root / "lab"), []
    first = root / "run.log"
    logs.append(kill_when(agent(first, "--budget", BUDGET, "--lab", str(lab), "--session", SESSION, "--protocol",
                                "test", "--quiet"), first, lab, "eval"))
    second = root / "resume1.log"
    logs.append(kill_when(agent(second, "resume", SESSION, "--lab", str(lab), "--quiet"), second, lab, "sft"))
    (lab / "graph.sqlite").unlink()
    third = root / "resume2.log"
    last = agent(third, "resume", SESSION, "--lab", str(lab), "--quiet")
    last.wait(timeout=DEADLINE_S)
    logs.append(third.read_text())
    assert last.returncode == 0, logs[-1]
    return Finished(lab=lab, session=SESSION, kills=["eval", "sft"], logs=logs)
