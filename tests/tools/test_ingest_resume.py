"""An ingest interrupted after it recorded its split and before its tool call closed (a crash, then a resume or a
restored graph checkpoint) runs again as the same job (issue 43, item 7): its job's arguments pin the lab's split
from before the session, never the one this session just recorded, so its key is the same and no second ingest
job is submitted."""

from __future__ import annotations

import sqlite3
import sys
from pathlib import Path

from agent.config import load_lab_config
from agent.runner import lab_spec
from memory.notebook import Notebook
from tools import ingest
from tools.context import ToolContext
from tools.jobs.executor import ExecutorSection
from tools.jobs.launcher import Launcher
from tools.paths import LabPaths

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agent"))
from labkit import make_lab  # noqa: E402

SESSION = "s1"


def _context(nb: Notebook, lab: Path) -> ToolContext:
    paths = LabPaths(root=lab, session=SESSION)
    launcher = Launcher.from_section(nb, SESSION, ExecutorSection(kind="local", time_limit_min=5, zygote=False),
                                     paths.jobs, poll_s=0.1)
    return ToolContext(nb=nb, session=SESSION, paths=paths, lab=lab_spec(load_lab_config(lab)), jobs=launcher)


def test_an_interrupted_ingest_resumed_submits_no_second_job(tmp_path: Path) -> None:
    lab = make_lab(tmp_path / "lab").resolve()
    with Notebook.open(lab / "notebook.db") as nb:
        nb.open_session(SESSION, lab=str(lab), budget_gpuh=1.0, reserve_gpuh=0.1, planner="playbook",
                        executor="local", config={})
        first = ingest.run(_context(nb, lab), ingest.Args())
        assert first.status == "done"
    # The crash: the split was recorded, the tool call not closed (its row as it was before the outcome).
    con = sqlite3.connect(lab / "notebook.db")
    con.execute("UPDATE tool_call SET status = 'open', result = NULL WHERE tool = 'ingest'")
    con.commit()
    con.close()
    with Notebook.open(lab / "notebook.db") as nb:
        again = ingest.run(_context(nb, lab), ingest.Args())
        assert again.status == "done" and again.data == first.data
        jobs = nb.jobs(session=SESSION, kind="ingest")
        assert len({j.key for j in jobs}) == 1 and len(jobs) == 1, [j.key[:12] for j in jobs]
        assert len(nb.decisions(SESSION, kind="ingest")) == 1
