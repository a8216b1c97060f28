"""Resume's and replay's errors are messages (issue 34, section 5): a damaged graph checkpoint or notebook, an
unknown session, a changed lab, and a `replay --bars FILE` that is not a bars file each exit 2 with one message
naming the file and what is wrong; nothing in the lab changes, no job starts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from agent.config import load_lab_config
from agent.planners.playbook import PlaybookSettings
from agent.runner import snapshot
from memory.notebook import Notebook

sys.path.insert(0, str(Path(__file__).parent))
from hostile_kit import assert_refused, files, make_lab, run_cli  # noqa: E402


@pytest.fixture
def lab(tmp_path) -> Path:
    """A lab whose notebook holds an open session, as a killed `run` leaves it."""
    lab = make_lab(tmp_path / "lab").resolve()
    config = load_lab_config(lab)
    settings = PlaybookSettings.named("test")
    with Notebook.open(lab / "notebook.db") as nb:
        nb.open_session("s1", lab=str(lab), budget_gpuh=1.0, reserve_gpuh=0.1, planner="playbook", executor="local",
                        config=snapshot(config, "test", settings))
    return lab


def _resume(lab: Path, session: str = "s1"):
    return run_cli([["resume", session, "--lab", str(lab)]])[0]


def test_a_garbage_graph_checkpoint_is_named(lab):
    (lab / "graph.sqlite").write_bytes(b"this is not a database, it is " * 100)
    before = files(lab)
    out = _resume(lab)
    assert_refused(out.returncode, out.stderr, str(lab / "graph.sqlite"), "not a readable SQLite database",
                   "remove it")
    assert files(lab) == before


def test_a_truncated_graph_checkpoint_is_named(lab):
    import sqlite3

    with sqlite3.connect(lab / "graph.sqlite") as conn:
        conn.execute("CREATE TABLE checkpoints (x)")
        conn.executemany("INSERT INTO checkpoints VALUES (?)", [(b"x" * 4000,)] * 50)
    conn.close()
    data = (lab / "graph.sqlite").read_bytes()
    (lab / "graph.sqlite").write_bytes(data[: len(data) // 3])
    before = files(lab)
    out = _resume(lab)
    assert_refused(out.returncode, out.stderr, str(lab / "graph.sqlite"))
    assert files(lab) == before


def test_a_garbage_notebook_is_named(lab):
    (lab / "notebook.db").write_bytes(b"\x00garbage" * 512)
    before = files(lab)
    out = _resume(lab)
    assert_refused(out.returncode, out.stderr, str(lab / "notebook.db"))
    assert files(lab) == before


def test_an_unknown_session_and_a_changed_lab_are_named(lab, tmp_path):
    other = make_lab(tmp_path / "other").resolve()
    config = load_lab_config(other)
    with Notebook.open(other / "notebook.db") as nb:
        nb.open_session("s1", lab=str(other), budget_gpuh=1.0, reserve_gpuh=0.1, planner="playbook",
                        executor="local", config=snapshot(config, "test", PlaybookSettings.named("test")))
    # A change beyond [executor] (those a resume accepts, recorded: tests/agent/test_resume_changes.py).
    (other / "lab.toml").write_text((other / "lab.toml").read_text().replace("dev_fraction = 0.2",
                                                                              "dev_fraction = 0.3"))
    before = files(lab), files(other)
    unknown, changed = run_cli([["resume", "s9", "--lab", str(lab)], ["resume", "s1", "--lab", str(other)]])
    assert_refused(unknown.returncode, unknown.stderr, "s9")
    assert_refused(changed.returncode, changed.stderr, str(other / "lab.toml"), "changed since session s1 started ([feedback])")
    assert (files(lab), files(other)) == before


def test_no_notebook_is_named_and_nothing_is_created(tmp_path):
    out = _resume(tmp_path / "nowhere")
    assert_refused(out.returncode, out.stderr, str(tmp_path / "nowhere" / "notebook.db"))
    assert not (tmp_path / "nowhere").exists()


# ---- replay --bars FILE ---------------------------------------------------------------------------


def _bars_cases(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    json_file = tmp_path / "bars.json"
    json_file.write_text(json.dumps({"bar": [{"suite": "math", "metric": "correct", "rule": "delta >= 0"}]}))
    no_bars = tmp_path / "empty.toml"
    no_bars.write_text('title = "not bars"\n')
    unknown = tmp_path / "unknown.toml"
    unknown.write_text('[[bar]]\nsuite = "gsm8k"\nmetric = "correct"\nrule = "delta >= 0"\n')
    (tmp_path / "a-dir").mkdir()
    return {"passwd": (Path("/etc/passwd"), "not valid TOML"), "json": (json_file, "not valid TOML"),
            "no bars": (no_bars, "unknown key"), "unknown suite": (unknown, "gsm8k"),
            "a directory": (tmp_path / "a-dir", "a-dir"), "missing": (tmp_path / "nope.toml", "nope.toml")}


def test_replay_bars_that_are_not_a_bars_file_are_named(lab, tmp_path):
    cases = _bars_cases(tmp_path)
    before = files(lab)
    outs = run_cli([["replay", "s1", "--lab", str(lab), "--bars", str(path)] for path, _ in cases.values()])
    for (name, (path, what)), out in zip(cases.items(), outs, strict=True):
        assert_refused(out.returncode, out.stderr, f"--bars {path}", what)
        assert "decisions differ" not in out.stdout, name
    assert files(lab) == before


def test_an_executor_edited_past_what_the_host_has_is_refused_at_resume_with_nothing_recorded(lab):
    """resume checks the lab as run does before a session opens: [executor] resources this host lacks (set after the
    session died) are refused, exit 2, before the change is recorded (issue 44, items 1 and 9)."""
    (lab / "lab.toml").write_text((lab / "lab.toml").read_text() + "\n[executor.resources.eval]\ngpus = 8\n")
    before = files(lab)
    out = _resume(lab)
    assert_refused(out.returncode, out.stderr, "[executor.resources.eval] gpus = 8")
    assert files(lab) == before
    with Notebook.open(lab / "notebook.db", readonly=True) as nb:
        assert not nb.decisions("s1", kind="reconfigure")
