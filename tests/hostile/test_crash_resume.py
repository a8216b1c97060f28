"""Crash and resume (issue 34, section 5). A job killed with the agent is lost, not failed: when the agent's
whole process group is SIGKILLed mid-job (a closed terminal, a double Ctrl-C), its local jobs die with it;
resume classifies the dead attempt as `lost`, runs a new attempt admitted against the budget, gates the
interrupted step again before acting on it, and the session completes with a nomination, no job attempt
launched twice. The classification itself is checked on its own first (cheap); the whole session is slow."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
from labkit import make_lab

from evals import synthetic
from memory.notebook import Notebook, NotebookError
from tools.jobs.failures import classify, decide

REPO = Path(__file__).resolve().parents[2]
BUDGET = "5gpuh"
DEADLINE_S = 1800
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


# ---- the whole session ------------------------------------------------------------------------------


@dataclass
class Crash:
    lab: Path
    killed_key: str
    first_log: str
    resume_rc: int
    resume_log: str


def _eval_in_flight(lab: Path) -> str | None:
    try:
        with Notebook.open(lab / "notebook.db", readonly=True) as nb:
            live = [j for j in nb.jobs(session="s1") if j.kind == "eval" and j.state == "running"]
    except NotebookError:
        return None
    return live[0].key if live else None


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _slow_evals(lab: Path) -> Path:
    """The open suite made long enough (300 items) that a calibration eval runs for seconds, not the fraction of
    a second 8 items take: the kill lands while it runs."""
    taken = {json.loads(line)["messages"][-1]["content"]
             for name in ("feedback.jsonl", "confirm.jsonl") for line in (lab / name).read_text().splitlines()}
    items = [t.item for t in synthetic.generate("digit_sum", 300, seed=12,
                                                exclude=lambda it: it.messages[-1].content in taken)]
    (lab / "digits.jsonl").write_text("".join(i.model_dump_json() + "\n" for i in items))
    return lab


@pytest.fixture(scope="module")
def crash(tmp_path_factory: pytest.TempPathFactory) -> Crash:
    root = tmp_path_factory.mktemp("crash")
    lab = _slow_evals(make_lab(root / "lab"))
    with open(root / "run.log", "w") as out:  # its own process group, as a terminal gives one
        agent = subprocess.Popen([sys.executable, str(REPO / "run_agent.py"), "--budget", BUDGET, "--lab", str(lab),
                                  "--session", "s1", "--protocol", "test", "--quiet"], cwd=REPO, stdout=out,
                                 stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + DEADLINE_S
    while (key := _eval_in_flight(lab)) is None:
        assert agent.poll() is None, (root / "run.log").read_text()
        assert time.monotonic() < deadline
        time.sleep(0.1)
    os.killpg(agent.pid, signal.SIGKILL)  # the whole group: the agent, its job controllers and their clients
    agent.wait()
    while _group_alive(agent.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(2)  # the zygote kills a job whose client ended; let it
    resumed = subprocess.run([sys.executable, str(REPO / "run_agent.py"), "resume", "s1", "--lab", str(lab), "--quiet"],
                             cwd=REPO, capture_output=True, text=True, timeout=DEADLINE_S)
    return Crash(lab=lab, killed_key=key, first_log=(root / "run.log").read_text(), resume_rc=resumed.returncode,
                 resume_log=resumed.stdout + resumed.stderr)


@pytest.mark.slow
def test_the_killed_job_is_lost_and_run_again(crash):
    assert crash.resume_rc == 0, crash.resume_log
    with Notebook.open(crash.lab / "notebook.db", readonly=True) as nb:
        attempts = nb.jobs(session="s1", key=crash.killed_key)
        assert [a.state for a in attempts] == ["failed", "completed"], [(a.state, a.failure_class) for a in attempts]
        assert attempts[0].failure_class == "lost" and attempts[0].gpu_hours is not None  # settled, not reserved
        launches = [d.payload for d in nb.decisions("s1", kind="launch") if d.payload.get("key") == crash.killed_key]
        assert [p.attempt for p in launches] == [1, 2]
        assert not [d for d in nb.decisions("s1", kind="fail") if d.payload.get("key") == crash.killed_key]


@pytest.mark.slow
def test_the_session_completes_with_a_nomination_no_attempt_launched_twice(crash):
    assert "session s1: done" in crash.resume_log and "nominee: " in crash.resume_log
    with Notebook.open(crash.lab / "notebook.db", readonly=True) as nb:
        assert nb.session("s1").status == "done" and len(nb.decisions("s1", kind="nominate")) == 1
        assert nb.verify().ok
        jobs = nb.jobs(session="s1")
        assert Counter((j.key, j.attempt) for j in jobs).most_common(1)[0][1] == 1
        launches = [(d.payload.key, d.payload.attempt) for d in nb.decisions("s1", kind="launch")]
        assert len(launches) == len(set(launches)) == len(jobs)
        ledger = nb.ledger("s1")
        assert ledger.spent_gpuh <= ledger.budget_gpuh and ledger.reserved_gpuh == 0
        assert not [d for d in nb.decisions("s1", kind="refuse") if "budget" in d.rationale]


@pytest.mark.slow
def test_the_interrupted_step_was_gated_again_before_acting(crash):
    assert "act: calibrate" in crash.first_log
    assert "resume: gating plan" in crash.resume_log and "(calibrate) again before acting" in crash.resume_log
