"""The lab is a place, whole sessions (issue 34, section 4). One story on one small lab:

1. `run s1` starts from the lab's parent directory with a relative `--lab lab`;
2. while it holds the lab, `run s2` is refused, naming it;
3. s1's agent is stopped (SIGSTOP) while an eval runs, then SIGKILLed mid-job (its jobs live on); `run s2` now
   proceeds past the stale lock, in the same lab, to a nomination (a second session names its outputs apart: no
   content-named directory is met twice);
4. the lab is moved (shutil.move: its old parent is gone), and s1 is resumed from another working directory, through
   a symbolic link to the lab's new place, to its nomination; while the resume holds the lab (stopped mid-job), a
   replay of s1 is refused naming the writer (not "decisions differ" against a record still being written);
5. the notebook holds no path of the old place but the sessions' own record of where they ran;
6. the lab is copied, and both sessions replay exactly on the copy with the moved lab out of reach (renamed away).

Runs real jobs: marked slow."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
from labkit import make_lab

from memory.notebook import Notebook, NotebookError

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
BUDGET = "5gpuh"
DEADLINE_S = 1800


def _agent(log: Path, cwd: Path, *args: str) -> subprocess.Popen:
    with open(log, "w") as out:  # a file, not a pipe: the jobs inherit it and outlive a SIGKILL
        return subprocess.Popen([sys.executable, str(REPO / "run_agent.py"), *args], cwd=cwd, stdout=out,
                                stderr=subprocess.STDOUT)


def _finish(proc: subprocess.Popen, log: Path) -> tuple[int, str]:
    proc.wait(timeout=DEADLINE_S)
    return proc.returncode, log.read_text()


def _in_flight(lab: Path, session: str, kind: str) -> bool:
    try:
        with Notebook.open(lab / "notebook.db", readonly=True) as nb:
            return any(j.kind == kind and j.state in ("pending", "running") for j in nb.jobs(session=session))
    except NotebookError:  # not there yet
        return False


def _wait_for_job(proc: subprocess.Popen, log: Path, lab: Path, session: str, kind: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not _in_flight(lab, session, kind):
        assert proc.poll() is None, f"agent ended before a {kind} job started:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"no {kind} job after {DEADLINE_S} s"
        time.sleep(0.5)


def _jobs(lab: Path, session: str) -> list:
    try:
        with Notebook.open(lab / "notebook.db", readonly=True) as nb:
            return nb.jobs(session=session)
    except NotebookError:  # not there yet
        return []


def _tree(lab: Path) -> dict[str, str]:
    return {str(p.relative_to(lab)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(lab.rglob("*")) if p.is_file() and not p.name.endswith(("-shm", "-wal"))}


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


def _replay(session: str, lab: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "run_agent.py"), "replay", session, "--lab", lab], cwd=cwd,
                          capture_output=True, text=True, timeout=900)


@dataclass
class Story:
    root: Path
    old: Path  # where the lab was made, and s1 and s2 ran
    lab: Path  # where it was moved to, and s1 resumed
    copy: Path
    first_pid: int
    refused: subprocess.CompletedProcess
    second: tuple[int, str]
    resumed: tuple[int, str]
    resume_pid: int
    during: subprocess.CompletedProcess
    replays: dict[str, subprocess.CompletedProcess]
    copy_before: dict[str, str]
    copy_after: dict[str, str]


@pytest.fixture(scope="module")
def story(tmp_path_factory: pytest.TempPathFactory) -> Story:
    root = tmp_path_factory.mktemp("place")
    lab = make_lab(root / "lab")
    first = _agent(root / "s1.log", root, "--budget", BUDGET, "--lab", "lab", "--session", "s1", "--protocol", "test",
                   "--quiet")
    try:
        _wait_for_job(first, root / "s1.log", lab, "s1", "eval")
        # Stopped, the agent still holds the lab and its jobs run on; it cannot finish its session while the
        # refused run starts (on a loaded CI machine that took longer than the rest of s1 once).
        os.kill(first.pid, signal.SIGSTOP)
        refused = subprocess.run([sys.executable, str(REPO / "run_agent.py"), "--budget", BUDGET, "--lab", str(lab),
                                  "--session", "s2", "--protocol", "test", "--quiet"], cwd=REPO, capture_output=True,
                                 text=True, timeout=600)
    finally:
        os.kill(first.pid, signal.SIGKILL)  # the agent only: its jobs live on, as after a crash
        first.wait()
    second = _finish(_agent(root / "s2.log", REPO, "--budget", BUDGET, "--lab", str(lab), "--session", "s2",
                            "--protocol", "test", "--quiet"), root / "s2.log")
    with Notebook.open(lab / "notebook.db", readonly=True) as nb:  # s1's jobs ran on after its kill
        orphans = [Path(j.folder) for j in nb.jobs(session="s1")]
    deadline = time.monotonic() + DEADLINE_S
    while not all(any(folder.glob("*_result.pkl")) for folder in orphans):
        assert time.monotonic() < deadline, f"s1's jobs left no result after {DEADLINE_S} s"
        time.sleep(0.5)
    moved = root / "second" / "moved"
    moved.parent.mkdir()
    shutil.move(lab, moved)
    (root / "elsewhere").mkdir()
    (root / "link").symlink_to(moved)
    known = len(_jobs(moved, "s1"))
    resume = _agent(root / "resume.log", root / "elsewhere", "resume", "s1", "--lab", "../link", "--quiet")
    try:
        deadline = time.monotonic() + DEADLINE_S
        while not (len(jobs := _jobs(moved, "s1")) > known and any(j.state in ("pending", "running") for j in jobs)):
            assert resume.poll() is None, f"the resume ended before a job of its own:\n{(root / 'resume.log').read_text()}"
            assert time.monotonic() < deadline, f"no job of the resume after {DEADLINE_S} s"
            time.sleep(0.5)
        # Stopped, the resume still holds the lab and its session stays open while the replay starts.
        os.kill(resume.pid, signal.SIGSTOP)
        try:
            during = _replay("s1", str(moved), REPO)
        finally:
            os.kill(resume.pid, signal.SIGCONT)
    finally:
        resume.wait(timeout=DEADLINE_S)
    resumed = (resume.returncode, (root / "resume.log").read_text())
    copy = root / "third" / "copy-of-lab"
    shutil.copytree(moved, copy, symlinks=True)
    before = _tree(copy)
    aside = moved.with_name("moved-aside")
    moved.rename(aside)  # out of reach while the copy replays: nothing may read it
    try:
        replays = {s: _replay(s, "../third/copy-of-lab", root / "elsewhere") for s in ("s1", "s2")}
    finally:
        aside.rename(moved)
    return Story(root=root, old=lab, lab=moved, copy=copy, first_pid=first.pid, refused=refused, second=second,
                 resumed=resumed, resume_pid=resume.pid, during=during, replays=replays, copy_before=before,
                 copy_after=_tree(copy))


def test_a_second_run_is_refused_while_the_first_holds_the_lab(story):
    out = story.refused
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    assert str(story.old / "lab.lock") in out.stderr and f"pid {story.first_pid}" in out.stderr
    assert "run s1" in out.stderr


def test_the_second_run_proceeds_past_a_stale_lock_to_a_nomination(story):
    rc, log = story.second
    assert rc == 0, log
    assert f"stale lock of pid {story.first_pid}" in log
    assert "session s2: done" in log and "nominee: " in log


def test_two_sessions_in_one_lab_name_their_outputs_apart(story):
    with Notebook.open(story.lab / "notebook.db", readonly=True) as nb:
        paths = {s: {a.path for a in nb.artifacts(session=s) if a.kind != "checkpoint" or "/runs/" in a.path
                     or "/merges/" in a.path} for s in ("s1", "s2")}
        assert nb.verify().ok
    assert paths["s1"] and paths["s2"] and not paths["s1"] & paths["s2"]
    assert "FileExistsError" not in story.second[1] + story.resumed[1]


def test_resume_from_another_directory_through_a_link_completes(story):
    rc, log = story.resumed
    assert rc == 0, log
    assert "changed since session" not in log and "session s1: done" in log and "nominee: " in log
    assert str(story.old) not in log and "Traceback" not in log
    with Notebook.open(story.lab / "notebook.db", readonly=True) as nb:
        assert nb.session("s1").lab == str(story.old.resolve())  # where it ran first: its own record
        jobs = nb.jobs(session="s1")
        assert Counter((j.key, j.attempt) for j in jobs).most_common(1)[0][1] == 1
        launches = [(d.payload.key, d.payload.attempt) for d in nb.decisions("s1", kind="launch")]
        assert len(launches) == len(set(launches)) == len(jobs)


def test_a_replay_while_the_resume_writes_is_refused_naming_the_writer(story):
    out = story.during
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr and "decisions differ" not in out.stdout
    assert "lab.lock" in out.stderr and f"pid {story.resume_pid}" in out.stderr and "resume s1" in out.stderr


def test_the_notebook_holds_lab_relative_paths_read_where_the_lab_is(story):
    # Only the sessions' own records of where they ran name the old place; every path into the lab is `<lab>/...`.
    assert not story.old.exists()
    db = story.copy / "notebook.db"
    assert _holding(db, str(story.old)) == {"session.lab"} and not _holding(db, str(story.lab))
    assert {"artifact.path", "job.folder", "job.result", "job.resources"} <= _holding(db, "<lab>/")
    with Notebook.open(db, readonly=True) as nb:
        assert nb.verify().ok
        made = [a for a in nb.artifacts() if a.kind != "checkpoint" or a.job_key]
        assert made and all(Path(a.path).is_relative_to(story.copy) and Path(a.path).exists() for a in made)


def test_both_sessions_replay_exactly_on_a_copied_lab_without_the_original(story):
    for session, out in story.replays.items():
        assert out.returncode == 0, (session, out.stdout + out.stderr)
        assert "reproduced exactly" in out.stdout, session
    assert story.copy_after == story.copy_before
