"""The lab notebook on real SQLite files: chain verification, tampering, SIGKILL durability, readers."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from memory.notebook import Notebook, NotebookError

REPO = Path(__file__).resolve().parents[2]


def _session(nb: Notebook, name: str = "s1") -> None:
    nb.open_session(name, lab="lab", budget_gpuh=10, reserve_gpuh=1, planner="playbook", executor="local",
                    config={"k": 1})


@pytest.fixture
def nb(tmp_path: Path):
    with Notebook.open(tmp_path / "notebook.db") as notebook:
        _session(notebook)
        for i in range(10):
            notebook.record_decision("s1", "plan", f"step {i}", {"i": i, "text": "é ✓"})
        yield notebook


def _raw(path: Path) -> sqlite3.Connection:
    """A tamperer's connection: plain sqlite3 with the append-only triggers dropped."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("DROP TRIGGER IF EXISTS decision_no_update")
    conn.execute("DROP TRIGGER IF EXISTS decision_no_delete")
    return conn


def test_chain_verifies_and_is_wal(nb: Notebook):
    report = nb.verify()
    assert report.ok and report.count == 11  # the session's opening decision + 10
    assert nb.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert [d.seq for d in nb.decisions("s1")] == list(range(1, 12))
    assert nb.decisions("s1", kind="plan")[3].payload.model_dump() == {"i": 3, "text": "é ✓"}


def test_decisions_are_append_only_through_sql(nb: Notebook):
    with pytest.raises(sqlite3.IntegrityError, match="append-only"):
        nb.db.execute("UPDATE decision SET rationale = 'x' WHERE seq = 2")
    with pytest.raises(sqlite3.IntegrityError, match="append-only"):
        nb.db.execute("DELETE FROM decision WHERE seq = 2")


def test_edited_payload_is_named(nb: Notebook):
    _raw(nb.path).execute("""UPDATE decision SET payload = '{"i":99,"text":"é ✓"}' WHERE seq = 5""")
    report = nb.verify()
    assert not report.ok and report.count == 4
    assert report.problem.startswith("decision seq 5:") and "edited" in report.problem


def test_deleted_row_is_named(nb: Notebook):
    _raw(nb.path).execute("DELETE FROM decision WHERE seq = 7")
    report = nb.verify()
    assert not report.ok and report.problem.startswith("decision seq 8: expected seq 7")


def test_swapped_rows_are_named(nb: Notebook):
    conn = _raw(nb.path)
    conn.execute("BEGIN")
    conn.execute("UPDATE decision SET seq = -1 WHERE seq = 3")
    conn.execute("UPDATE decision SET seq = 3 WHERE seq = 4")
    conn.execute("UPDATE decision SET seq = 4 WHERE seq = -1")
    conn.execute("COMMIT")
    report = nb.verify()
    assert not report.ok and report.problem.startswith("decision seq 3:")


def test_swapped_contents_are_named(nb: Notebook):
    conn = _raw(nb.path)
    rows = {r[0]: r[1:] for r in conn.execute("SELECT seq, at, rationale, payload, prev_hash, hash FROM decision")}
    for seq, other in ((6, 7), (7, 6)):
        conn.execute("UPDATE decision SET at=?, rationale=?, payload=?, prev_hash=?, hash=? WHERE seq=?",
                     [*rows[other], seq])
    report = nb.verify()
    assert not report.ok and report.problem.startswith("decision seq 6:")


def test_verify_cli_names_record_and_exits_nonzero(nb: Notebook):
    lab = nb.path.parent
    ok = subprocess.run([sys.executable, "run_agent.py", "verify", "--lab", str(lab)], cwd=REPO,
                        capture_output=True, text=True)
    assert ok.returncode == 0 and "11 decisions verified" in ok.stdout
    head = ok.stdout.strip().split("head ")[1]
    _raw(nb.path).execute("DELETE FROM decision WHERE seq = 11")
    truncated = subprocess.run([sys.executable, "run_agent.py", "verify", "--lab", str(lab), "--expect-head", head],
                               cwd=REPO, capture_output=True, text=True)
    assert truncated.returncode == 1 and "removed from the end" in truncated.stderr
    _raw(nb.path).execute("UPDATE decision SET kind = 'promote' WHERE seq = 2")
    bad = subprocess.run([sys.executable, "run_agent.py", "verify", "--lab", str(lab)], cwd=REPO,
                         capture_output=True, text=True)
    assert bad.returncode == 1 and "decision seq 2:" in bad.stderr


WRITER = textwrap.dedent("""
    import sys
    from memory.notebook import Notebook
    nb = Notebook.open(sys.argv[1])
    nb.open_session("w", lab="lab", budget_gpuh=1, reserve_gpuh=0, planner="playbook", executor="local", config={})
    i = 0
    while True:
        d = nb.record_decision("w", "plan", "loop", {"i": i, "pad": "x" * 2000})
        print(d.seq, flush=True)   # printed only after COMMIT returned
        i += 1
""")


def test_sigkill_mid_write_keeps_every_committed_record(tmp_path: Path):
    path = tmp_path / "notebook.db"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    committed = 0
    deadline = time.monotonic() + 60
    while committed < 300 and time.monotonic() < deadline:
        committed = int(proc.stdout.readline())
    os.kill(proc.pid, signal.SIGKILL)  # lands while the loop is writing its next decisions
    proc.wait()
    assert committed >= 300
    with Notebook.open(path) as nb:
        report = nb.verify()
        assert report.ok, report.problem
        assert report.count >= committed
        nb.end_session("w", "stopped", "after the kill")  # and it stays writable
        assert nb.verify().ok


READER = textwrap.dedent("""
    import sys, time
    from memory.notebook import Notebook
    nb = Notebook.open(sys.argv[1], readonly=True)
    counts = []
    t0 = time.monotonic()
    while time.monotonic() - t0 < 3:
        with nb.db.conn:                       # one read transaction: a consistent snapshot
            nb.db.execute("BEGIN")
            report = nb.verify()
            jobs = nb.db.execute("SELECT COUNT(*) FROM job").fetchone()[0]
            nb.db.execute("COMMIT")
        assert report.ok, report.problem
        assert report.count - 1 == jobs * 2, (report.count, jobs)   # writer adds 2 decisions per job
        counts.append(report.count)
    assert counts == sorted(counts) and counts[-1] > counts[0], counts[:3]
    print(len(counts))
""")


def test_concurrent_reader_sees_consistent_snapshots(tmp_path: Path):
    path = tmp_path / "notebook.db"
    nb = Notebook.open(path)
    _session(nb)
    reader = subprocess.Popen([sys.executable, "-c", READER, str(path)], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    i = 0
    while reader.poll() is None:
        with nb.transaction():  # a job and its two decisions land together or not at all
            nb._insert("job", {"key": f"k{i}", "attempt": 1, "session": "s1", "kind": "sft", "executor": "local",
                               "resources": {}, "forecast_gpuh": 0.1, "state": "pending", "submitted_at": "t"})
            nb._append_decision("s1", "plan", "x", {"i": i})
            nb._append_decision("s1", "plan", "y", {"i": i})
        i += 1
    out, err = reader.communicate()
    assert reader.returncode == 0, err
    assert int(out) > 3 and i > 10


def test_ledger_and_idempotent_tool_calls(tmp_path: Path):
    with Notebook.open(tmp_path / "nb.db") as nb:
        _session(nb)
        nb.start_job("k", session="s1", kind="sft", executor="local", resources={"gpus": 1}, forecast_gpuh=3)
        ledger = nb.ledger("s1")
        # One Ledger: left above the reserve (research jobs), or with it (the nomination's own checks).
        assert (ledger.spent_gpuh, ledger.reserved_gpuh, ledger.left_gpuh(nomination=True)) == (0, 3, 7)
        assert ledger.left_above_reserve_gpuh == ledger.left_gpuh() == 6
        nb.update_job("k", 1, state="completed", gpu_hours=2.5)
        assert nb.ledger("s1").left_gpuh(nomination=True) == 7.5
        with pytest.raises(NotebookError, match="unknown fields"):
            nb.update_job("k", 1, colour="red")
        with pytest.raises(NotebookError, match="not one of"):
            nb.update_job("k", 1, state="exploded")
        first = nb.record_tool_call("s1", "train", {"lr": 1e-4, "steps": 10})
        again = nb.record_tool_call("s1", "train", {"steps": 10, "lr": 1e-4})
        assert first.id == again.id


def test_readonly_refuses_writes_and_missing_files(tmp_path: Path):
    with pytest.raises(NotebookError, match="no notebook"):
        Notebook.open(tmp_path / "absent.db", readonly=True)
    Notebook.open(tmp_path / "nb.db").close()
    with Notebook.open(tmp_path / "nb.db", readonly=True) as ro, pytest.raises(NotebookError, match="read-only"):
        ro.record_decision("s1", "plan", "x", {})


def test_newer_schema_is_refused(tmp_path: Path):
    Notebook.open(tmp_path / "nb.db").close()
    sqlite3.connect(tmp_path / "nb.db").execute("PRAGMA user_version = 999")
    with pytest.raises(NotebookError, match="newer than this code"):
        Notebook.open(tmp_path / "nb.db")
