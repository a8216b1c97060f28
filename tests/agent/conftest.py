"""One finished playbook session shared by the agent tests (session-scoped: a session runs real jobs).

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

from memory.notebook import Notebook

sys.path.insert(0, str(Path(__file__).parent))
from labkit import make_lab  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SESSION = "s1"
BUDGET = "5gpuh"
DEADLINE_S = 1800


@dataclass
class Finished:
    lab: Path
    session: str
    kills: list[str]
    logs: list[str]


def agent(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(REPO / "run_agent.py"), *args], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _job_started(lab: Path, kind: str) -> bool:
    if not (lab / "notebook.db").exists():
        return False
    with Notebook.open(lab / "notebook.db", readonly=True) as nb:
        return any(j.kind == kind and j.state in ("pending", "running") for j in nb.jobs(session=SESSION))


def kill_when(proc: subprocess.Popen, lab: Path, kind: str) -> str:
    """SIGKILL the agent (only the agent: its jobs live on) once a job of `kind` is in flight."""
    deadline = time.monotonic() + DEADLINE_S
    while not _job_started(lab, kind):
        if proc.poll() is not None:
            raise AssertionError(f"agent ended before a {kind} job started:\n{proc.stdout.read()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"no {kind} job after {DEADLINE_S} s")
        time.sleep(0.5)
    os.kill(proc.pid, signal.SIGKILL)
    out = proc.communicate(timeout=60)[0]
    return out


@pytest.fixture(scope="session")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Finished:
    lab = make_lab(tmp_path_factory.mktemp("agent") / "lab")
    logs = [kill_when(agent("--budget", BUDGET, "--lab", str(lab), "--session", SESSION, "--protocol", "test",
                            "--quiet"), lab, "eval")]
    logs.append(kill_when(agent("resume", SESSION, "--lab", str(lab), "--quiet"), lab, "sft"))
    (lab / "graph.sqlite").unlink()
    last = agent("resume", SESSION, "--lab", str(lab), "--quiet")
    out = last.communicate(timeout=DEADLINE_S)[0]
    logs.append(out)
    assert last.returncode == 0, out
    return Finished(lab=lab, session=SESSION, kills=["eval", "sft"], logs=logs)
