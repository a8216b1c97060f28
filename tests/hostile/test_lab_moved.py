"""A lab is a place of its own (issue 43 item 6, issue 44 item 3), one session on a small lab:

1. `run s1` in `first/lab`; its agent is SIGKILLed while the first training job runs; that job finishes on its own;
2. the lab is moved (shutil.move: `first/` is gone) and s1 is resumed at the new place; while the resume holds the
   lab (stopped mid-job), a replay of s1 is refused naming the writer (not "decisions differ" against a record
   still being written);
3. the resume completes; the notebook holds no path of the old place (only the session's recorded `lab`);
4. the moved lab replays exactly; so does a copy of it, with the moved one deleted (the tests run as root, whom
   chmod 000 does not stop).

Runs real jobs: marked slow."""

from __future__ import annotations

import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from labkit import make_lab

from memory.notebook import Notebook, NotebookError

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
DEADLINE_S = 1800


def _agent(log: Path, *args: str) -> subprocess.Popen:
    with open(log, "w") as out:  # a file, not a pipe: the jobs inherit it and outlive a SIGKILL
        return subprocess.Popen([sys.executable, str(REPO / "run_agent.py"), *args], cwd=REPO, stdout=out,
                                stderr=subprocess.STDOUT)


def _jobs(lab: Path) -> list:
    try:
        with Notebook.open(lab / "notebook.db", readonly=True) as nb:
            return nb.jobs(session="s1")
    except NotebookError:  # not there yet
        return []


def _wait(what: str, proc: subprocess.Popen | None, log: Path | None, ready) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not ready():
        assert proc is None or proc.poll() is None, f"agent ended before {what}:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"no {what} after {DEADLINE_S} s"
        time.sleep(0.5)


def _replay(lab: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "run_agent.py"), "replay", "s1", "--lab", str(lab)], cwd=REPO,
                          capture_output=True, text=True, timeout=900)


def _holding(db: Path, text: str) -> set[str]:
    """table.column of every stored value holding `text`."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        found = set()
        for (table,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'"):
            for column in [r[1] for r in conn.execute(f"PRAGMA table_info({table})")]:
                if conn.execute(f"SELECT 1 FROM {table} WHERE instr(CAST({column} AS TEXT), ?) > 0 LIMIT 1",
                                [text]).fetchone():
                    found.add(f"{table}.{column}")
        return found
    finally:
        conn.close()


@dataclass
class Moved:
    old: Path
    lab: Path
    copy: Path
    resumed: tuple[int, str]
    during: subprocess.CompletedProcess
    resume_pid: int
    replay_moved: subprocess.CompletedProcess
    replay_copy: subprocess.CompletedProcess


@pytest.fixture(scope="module")
def moved(tmp_path_factory: pytest.TempPathFactory) -> Moved:
    root = tmp_path_factory.mktemp("moved")
    old = make_lab(root / "first" / "lab")
    first = _agent(root / "run.log", "--budget", "5gpuh", "--lab", str(old), "--session", "s1", "--protocol", "test",
                   "--quiet")
    try:
        _wait("a training job", first, root / "run.log",
              lambda: any(j.kind == "sft" and j.state in ("pending", "running") for j in _jobs(old)))
    finally:
        os.kill(first.pid, signal.SIGKILL)  # the agent only: its job runs on, as after a crash
        first.wait()
    train = next(j for j in _jobs(old) if j.kind == "sft")
    _wait("the training job's result", None, None, lambda: any(Path(train.folder).glob("*_result.pkl")))
    lab = root / "second" / "moved"
    lab.parent.mkdir()
    shutil.move(old, lab)
    shutil.rmtree(root / "first")
    known = len(_jobs(lab))
    resume = _agent(root / "resume.log", "resume", "s1", "--lab", str(lab), "--quiet")
    try:
        _wait("a job of the resume", resume, root / "resume.log",
              lambda: len(_jobs(lab)) > known and any(j.state in ("pending", "running") for j in _jobs(lab)))
        # Stopped, the resume still holds the lab and its session stays open while the replay starts (on a loaded
        # machine it could otherwise finish the session first).
        os.kill(resume.pid, signal.SIGSTOP)
        try:
            during = _replay(lab)
        finally:
            os.kill(resume.pid, signal.SIGCONT)
    finally:
        resume.wait(timeout=DEADLINE_S)
    resumed = (resume.returncode, (root / "resume.log").read_text())
    replay_moved = _replay(lab)
    copy = root / "third" / "copy"
    shutil.copytree(lab, copy, symlinks=True)
    shutil.rmtree(lab.parent)
    replay_copy = _replay(copy)
    return Moved(old=old, lab=lab, copy=copy, resumed=resumed, during=during, resume_pid=resume.pid, replay_moved=replay_moved,
                 replay_copy=replay_copy)


def test_a_moved_lab_resumes_after_a_kill_to_its_nomination(moved):
    rc, log = moved.resumed
    assert rc == 0, log
    assert "session s1: done" in log and "nominee: " in log and "Traceback" not in log
    assert str(moved.old) not in log


def test_the_notebook_holds_lab_relative_paths_read_where_the_lab_is(moved):
    # Only the session's own record of where it ran names the old place; every path into the lab is `<lab>/...`.
    assert not moved.old.exists() and not moved.lab.exists()
    db = moved.copy / "notebook.db"
    assert _holding(db, str(moved.old)) == {"session.lab"} and not _holding(db, str(moved.lab))
    assert {"artifact.path", "job.folder", "job.result", "job.resources"} <= _holding(db, "<lab>/")
    with Notebook.open(db, readonly=True) as nb:
        assert nb.verify().ok
        made = [a for a in nb.artifacts(session="s1") if a.kind != "checkpoint" or a.job_key]
        assert made and all(Path(a.path).is_relative_to(moved.copy) and Path(a.path).exists() for a in made)


def test_a_replay_while_the_resume_writes_is_refused_naming_the_writer(moved):
    out = moved.during
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr and "decisions differ" not in out.stdout
    assert "lab.lock" in out.stderr and f"pid {moved.resume_pid}" in out.stderr and "resume s1" in out.stderr


def test_the_moved_lab_and_a_copy_replay_exactly_without_the_original(moved):
    for out in (moved.replay_moved, moved.replay_copy):
        assert out.returncode == 0, out.stdout + out.stderr
        assert "reproduced exactly" in out.stdout and "Traceback" not in out.stderr
