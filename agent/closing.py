"""Closing a stuck session by a person's decision (issue 43, item 7): a job pending forever on a partition that
cannot hold it, a session whose agent will not come back.

    python run_agent.py close SESSION --why "the partition is reserved all week" [--lab DIR]

Apart from agent/runner.py so that the command loads only the notebook, the lab config and the launcher, not the
graph, the planners and the model libraries.
"""

from __future__ import annotations

import time
from pathlib import Path

from agent.config import load_lab_config
from agent.errors import SessionError
from core.display import shown
from memory.notebook import Notebook, NotebookError
from memory.records import Session
from tools.jobs.launcher import Launcher
from tools.paths import LabPaths


def require_verified(nb: Notebook, verb: str) -> None:
    """The notebook must pass verify before `verb` (resume, close, replay) acts on what it records: a tool call's
    outcome, an artifact's path, an eval row or a session's status edited outside the agent would otherwise steer
    the planner or be trained from. Rows a killed session wrote after its last decision are pending, not edits."""
    report = nb.verify(pending=True)
    if not report.ok:
        raise SessionError(f"{nb.path}: the notebook fails verify: {report.problem}; {verb} refuses a notebook edited "
                           "outside the agent (nothing was written)")


def open_session(nb: Notebook, session: str, verb: str) -> Session:
    """The session's record, which must be open for `verb` (resume, close) to act on it, in a notebook that passes
    verify; SessionError otherwise."""
    require_verified(nb, verb)
    try:
        s = nb.session(session)
    except NotebookError as exc:
        raise SessionError(str(exc)) from None
    if s.status != "open":
        raise SessionError(f"session {session} already ended ({s.status}); nothing to {verb}")
    return s


def close(lab_dir: Path, session: str, why: str, wait_s: float = 120.0) -> int:
    """End a stuck session by a person's decision: its jobs still queued or running are cancelled at the executor
    and settled like any cancelled job (a `fail` decision each), then the session stops with `why` (a `stop`
    decision). The agent must not be running (the caller holds the lab's writer lock)."""
    lab_dir = lab_dir.resolve()
    paths = LabPaths(root=lab_dir)
    with Notebook.open(paths.notebook) as nb:
        s = open_session(nb, session, "close")
        open_jobs = [j for j in nb.jobs(session=session) if j.state in ("pending", "running") and j.external_id]
        cancelled = _cancel_jobs(nb, session, lab_dir, s.executor, [j.key for j in open_jobs], wait_s) if open_jobs else 0
        nb.end_session(session, "stopped", f"closed by a person: {why}")
        print(f"session {session}: stopped ({cancelled} of {len(open_jobs)} open job(s) cancelled and settled); "
              f"notebook {shown(str(nb.path))}")
    return 0


def _cancel_jobs(nb: Notebook, session: str, lab_dir: Path, executor: str, keys: list[str], wait_s: float) -> int:
    """Cancel the jobs at their executor and poll until each is settled (at most `wait_s`); how many were."""
    config = load_lab_config(lab_dir)
    paths = LabPaths(root=lab_dir, session=session)
    launcher = Launcher.from_section(nb, session, config.executor.model_copy(update={"kind": executor}), paths.jobs,
                                     lab_roots=paths.spellings(nb.session(session).lab))
    for key in keys:
        launcher.cancel(key)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and any(launcher.poll(k).state in ("pending", "running") for k in keys):
        time.sleep(launcher.poll_s)
    return sum(launcher.record(k).state not in ("pending", "running") for k in keys)
