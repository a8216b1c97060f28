"""Crash and resume (issue 34, section 5; issue 44, item 2). A job killed with the agent is lost, not failed: when
the agent's whole process group is SIGKILLed mid-job (a closed terminal, a double Ctrl-C), its local jobs die with it;
resume settles the dead attempt as `lost` (so the ledger holds no reservation of a process that is gone), gates the
interrupted step again on the same budget its first run was gated on, runs a new attempt admitted against the budget,
and the session completes with a nomination, no job attempt launched twice. The classification itself is checked on
its own first (cheap); then one session on the test world is killed at every kill point in turn (calibration's
reference and eval jobs, a training job, the nomination's bundle job), each time resumed, to its nomination."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

from memory.notebook import Notebook, NotebookError
from tools.jobs.failures import classify, decide
from tools.world.testing import session_world

sys.path.insert(0, str(Path(__file__).parent))
from hostile_kit import group_alive  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
BUDGET = "5gpuh"
DEADLINE_S = 1800
# Where the agent's group is killed, in the order a session reaches them: calibration's first (reference) job, its
# eval job, the first training arm, the nomination's bundle job.
KILLS = ("reference", "eval", "sft", "bundle")
WARNING = "Some weights of the model checkpoint were not used when initializing LlamaForCausalLM\n"


# ---- the class --------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["", WARNING, "[rank0]: loading shards 3/4\n" * 40])
def test_a_silent_death_is_lost_and_requeued(text):
    """No result, no exception of its own, no exit code: whatever the log's last lines, it is lost."""
    failure = classify("FAILED", None, text)
    assert failure.failure_class == "lost"
    assert WARNING.strip() not in failure.detail  # the log's words are never the detail
    assert decide("lost", oom_retries=0, requeues=0, max_requeues=3, can_halve_batch=True) == "requeue"
    assert decide("lost", oom_retries=0, requeues=3, max_requeues=3, can_halve_batch=True) == "record"


def test_a_death_with_its_own_word_is_not_lost():
    trace = "Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\nValueError: bad row\n"
    assert classify("FAILED", None, trace).failure_class == "error"  # the job raised: a failure of its own
    assert classify("FAILED", 1, WARNING).failure_class == "error"  # it exited with a code of its own
    assert classify("CANCELLED", None, "").failure_class == "cancelled"
    assert classify("TIMEOUT", None, "").failure_class == "timeout"


# ---- one session, killed at each point ---------------------------------------------------------------


@dataclass
class Crashes:
    lab: Path
    killed: dict[str, str]  # kind -> the key of the job in flight when the agent's group was killed
    logs: list[str]  # the first run's, then each resume's
    last_rc: int


def _in_flight(lab: Path, kind: str, killed: dict[str, str]) -> str | None:
    """A job of `kind` running now, not one killed before."""
    try:
        with Notebook.open(lab / "notebook.db", readonly=True) as nb:
            live = [j.key for j in nb.jobs(session="s1") if j.kind == kind and j.state == "running"
                    and j.key not in killed.values()]
    except NotebookError:
        return None
    return live[0] if live else None


def _agent(log: Path, *args: str) -> subprocess.Popen:
    with open(log, "w") as out:  # its own process group, as a terminal gives one
        return subprocess.Popen([sys.executable, str(REPO / "run_agent.py"), *args, "--quiet"], cwd=REPO, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


@pytest.fixture(scope="module")
def crashes(tmp_path_factory: pytest.TempPathFactory) -> Crashes:
    root = tmp_path_factory.mktemp("crash")
    lab = Path(shutil.copytree(session_world(tmp_path_factory), root / "lab"))
    logs, killed = [root / "run.log"], {}
    agent = _agent(logs[0], "--budget", BUDGET, "--lab", str(lab), "--session", "s1", "--protocol", "test")
    deadline = time.monotonic() + DEADLINE_S
    for kind in KILLS:
        while (key := _in_flight(lab, kind, killed)) is None:
            assert agent.poll() is None, f"the agent ended before a {kind} job ran:\n{logs[-1].read_text()}"
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.killpg(agent.pid, signal.SIGKILL)  # the whole group: the agent, its job controllers and their clients
        agent.wait()
        while group_alive(agent.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        killed[kind] = key
        logs.append(root / f"resume-{len(logs)}.log")
        agent = _agent(logs[-1], "resume", "s1", "--lab", str(lab))
    agent.wait(timeout=DEADLINE_S)
    return Crashes(lab=lab, killed=killed, logs=[p.read_text() for p in logs], last_rc=agent.returncode)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KILLS)
def test_the_job_killed_with_its_agent_is_lost_and_run_again(crashes, kind):
    """Whatever the point: the dead attempt is settled lost (its run charged, nothing left reserved), and one new
    attempt is launched, admitted against the budget, and completes; nothing is recorded as a failure."""
    key = crashes.killed[kind]
    with Notebook.open(crashes.lab / "notebook.db", readonly=True) as nb:
        attempts = nb.jobs(session="s1", key=key)
        assert [(a.state, a.failure_class) for a in attempts] == [("failed", "lost"), ("completed", None)]
        assert attempts[0].gpu_hours is not None  # settled, not reserved
        launches = [d.payload for d in nb.decisions("s1", kind="launch") if d.payload.key == key]
        assert [p.attempt for p in launches] == [1, 2]
        assert not [d for d in nb.decisions("s1", kind="fail") if d.payload.key == key]
        assert not [d for d in nb.decisions("s1", kind="refuse") if "budget" in d.rationale]
    resumed = crashes.logs[KILLS.index(kind) + 1]
    assert f"resume: job {kind} {key[:12]} attempt 1 ended while the agent was gone: failed (lost)" in resumed


@pytest.mark.slow
def test_the_session_completes_with_a_checked_nomination_no_attempt_launched_twice(crashes):
    assert crashes.last_rc == 0, crashes.logs[-1]
    assert "session s1: done" in crashes.logs[-1] and "nominee: " in crashes.logs[-1]
    with Notebook.open(crashes.lab / "notebook.db", readonly=True) as nb:
        assert nb.session("s1").status == "done" and len(nb.decisions("s1", kind="nominate")) == 1
        assert nb.verify().ok
        jobs = nb.jobs(session="s1")
        assert Counter((j.key, j.attempt) for j in jobs).most_common(1)[0][1] == 1
        assert all(j.state in ("completed", "failed") for j in jobs)  # nothing left running
        launches = [(d.payload.key, d.payload.attempt) for d in nb.decisions("s1", kind="launch")]
        assert len(launches) == len(set(launches)) == len(jobs)
        ledger = nb.ledger("s1")
        assert ledger.spent_gpuh <= ledger.budget_gpuh and ledger.reserved_gpuh == 0
        # The bundle killed mid-build was built again and passed check-bundle (the nominate step runs it), and the
        # nominee's bundle was published.
        assert [c.status for c in nb.tool_calls("s1") if c.tool in ("nominate", "publish")] == ["done", "done"]


@pytest.mark.slow
def test_each_interrupted_step_was_gated_again_before_acting(crashes):
    """The calibration step killed at its reference job is gated again on the budget it was first admitted on (its
    forecast is not the lab's whole time limit), and so on at each kill inside the research loop."""
    assert "act: calibrate" in crashes.logs[0]
    for resumed, step in zip(crashes.logs[1:3], ("calibrate", "calibrate"), strict=True):
        assert "resume: gating plan" in resumed and f"({step}) again before acting" in resumed
    assert "(train) again before acting" in crashes.logs[3]
