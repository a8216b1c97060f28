"""Replay compares the decisions of a session's policy, not those of its circumstances (issue 43, item 7): a job
that waited in the Slurm queue past the lab's bound (a `wait` decision, timing) and a resume on changed [executor]
settings (a `reconfigure` decision) are not re-derived, and their absence from the replay is no difference."""

from __future__ import annotations

from pathlib import Path

from agent.replay import _compare
from memory.notebook import Notebook
from memory.records import ReconfigurePayload, WaitPayload


def _session(path: Path, circumstances: bool) -> Notebook:
    nb = Notebook.open(path)
    nb.open_session("s", lab=str(path.parent), budget_gpuh=1, reserve_gpuh=0, planner="playbook", executor="slurm",
                    config={})
    nb.record_decision("s", "ingest", "feedback split abc", {"split_id": 1, "sha256": "a" * 64, "counts": {"train": 3}})
    if circumstances:
        nb.record_decision("s", "wait", "ingest still pending after 10 min (Slurm: Resources)",
                           WaitPayload(key="k" * 64, kind="ingest", attempt=1, pending_s=600.0, reason="Resources"))
        nb.record_decision("s", "reconfigure", "resumed with changed [executor] settings: time_limit_min",
                           ReconfigurePayload(section="executor", before={"time_limit_min": 10},
                                              after={"time_limit_min": 20}))
    nb.end_session("s", "done", "planner stopped")
    return nb


def test_waits_and_reconfigurations_are_no_difference(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    original, scratch = _session(tmp_path / "a" / "notebook.db", True), _session(tmp_path / "b" / "notebook.db", False)
    result = _compare(original, scratch, "s")
    assert result.same and result.recorded == result.replayed == 2, result.lines
    original.close()
    scratch.close()
