"""The typed notebook: atomic transactions, typed decision payloads, Literal record fields, indexed
queries, migrations from version 1, and session rows vouched for by their open decision."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import get_args

import pytest

from core.util import canonical_json, sha256_text
from memory.chain import GENESIS, decision_hash
from memory.notebook import Notebook, NotebookError
from memory.records import (
    BarsSpec,
    BudgetRefusal,
    CalibrationRefusal,
    CompareRefusal,
    FailureClass,
    NotePayload,
    OpenDecision,
    RefuseDecision,
    RegisterBarsPayload,
    Rule,
    SealedRefusal,
)
from memory.schema import SCHEMA_VERSION, V1

ONE_BAR = BarsSpec(bars=(Rule(suite="d", metric="correct", statistic="delta", op=">=", value=0.0, unit="absolute",
                              test=None, confidence=None),), p_family=None)
TABLES = ["session", "decision", "tool_call", "job", "artifact", "eval", "noise_floor", "bars", "comparison",
          "feedback_split"]


def _counts(nb: Notebook) -> dict[str, int]:
    return {t: nb.db.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in TABLES}


@pytest.fixture
def nb(tmp_path: Path):
    with Notebook.open(tmp_path / "notebook.db") as notebook:
        notebook.open_session("s1", lab="lab", budget_gpuh=10, reserve_gpuh=1, planner="playbook",
                              executor="local", config={"lr": 1e-5, "steps": (1, 2)})
        yield notebook


def _write_everything(nb: Notebook, tag: str) -> None:
    """A tool call, a job launch, an artifact and its decision: what one step of the agent writes."""
    nb.record_tool_call("s1", "train", {"tag": tag})
    nb.start_job(f"k-{tag}", session="s1", kind="sft", executor="local", resources={}, forecast_gpuh=0.5)
    nb.add_artifact(kind="checkpoint", name=tag, path=f"/{tag}", sha256=tag * 64, session="s1")
    nb.record_decision("s1", "plan", "next", {"tag": tag})


def test_a_transaction_that_raises_half_way_leaves_no_rows(nb: Notebook):
    before = _counts(nb)
    with pytest.raises(RuntimeError, match="half way"), nb.transaction():
        _write_everything(nb, "a")
        nb.register_bars("s1", ONE_BAR)  # a write method with its own inner transaction
        raise RuntimeError("half way")
    assert _counts(nb) == before and nb.verify().ok
    with nb.transaction():
        _write_everything(nb, "b")
    after = _counts(nb)
    assert [after[t] - before[t] for t in ("tool_call", "job", "artifact", "decision")] == [1, 1, 1, 1]
    assert nb.verify().ok


def test_a_nested_block_joins_the_outer_transaction(nb: Notebook):
    before = _counts(nb)
    with nb.transaction():
        _write_everything(nb, "a")
        with pytest.raises(ValueError), nb.transaction():
            _write_everything(nb, "b")
            raise ValueError("inner only")
        # The inner block's writes are undone; the outer keeps its own and commits them.
        assert nb.artifacts(sha256="b" * 64) == [] and len(nb.artifacts(sha256="a" * 64)) == 1
    assert _counts(nb)["artifact"] == before["artifact"] + 1 and nb.verify().ok
    # Another connection sees nothing until the outer block commits.
    with nb.transaction():
        _write_everything(nb, "c")
        with Notebook.open(nb.path, readonly=True) as reader:
            assert reader.artifacts(sha256="c" * 64) == []
    with Notebook.open(nb.path, readonly=True) as reader:
        assert len(reader.artifacts(sha256="c" * 64)) == 1


def test_payloads_are_validated_on_write_and_nothing_is_written(nb: Notebook):
    before = _counts(nb)
    with pytest.raises(NotebookError, match="register_bars decision payload: bars_id: Field required"):
        nb.record_decision("s1", "register_bars", "x", {"sha256": "0" * 64})
    with pytest.raises(NotebookError, match="status"):
        nb.record_decision("s1", "stop", "x", {"status": "exploded"})
    with pytest.raises(NotebookError, match="not one of"):
        nb.record_decision("s1", "celebrate", "x", {})  # type: ignore[arg-type]
    with pytest.raises(NotebookError, match="launch decision payload"):
        nb.record_decision("s1", "launch", "x", {"key": "k", "kind": "sft", "attempt": 1, "forecast_gpuh": 1.0,
                                                 "forecast_source": "declared", "executor": "local", "extra": 1})
    assert _counts(nb) == before


def test_payloads_are_parsed_into_their_kind_on_read(nb: Notebook):
    nb.register_bars("s1", ONE_BAR.model_copy(update={"p_family": 2}))
    refusals = [
        {"key": "k", "kind": "sft", "attempt": 1, "forecast_gpuh": 9.0, "forecast_source": "declared",
         "executor": "local"},
        {"candidate": 1, "incumbent": 2, "bars_id": 1, "reasons": ["r"]},
        {"suite": "confirm", "artifact_id": 1, "sealed": True},  # as written before reasons were listed
        {"suite": "math", "eval_ids": [1, 1, 1], "reasons": ["r"]},
    ]
    for payload in refusals:
        nb.record_decision("s1", "refuse", "no", payload)
    opened, bars = nb.decisions("s1")[:2]
    assert isinstance(opened, OpenDecision) and opened.payload.budget_gpuh == 10.0
    assert isinstance(bars.payload, RegisterBarsPayload) and bars.payload.bars_id == 1
    refused = nb.decisions("s1", kind="refuse")
    assert all(isinstance(d, RefuseDecision) for d in refused)
    assert [type(d.payload) for d in refused] == [BudgetRefusal, CompareRefusal, SealedRefusal, CalibrationRefusal]
    nb.record_decision("s1", "plan", "free-form until the planner fixes it", {"next": "sft", "why": ["a"]})
    plan = nb.decisions("s1", kind="plan")[0]
    assert isinstance(plan.payload, NotePayload) and plan.payload.model_dump() == {"next": "sft", "why": ["a"]}
    assert plan.payload.next == "sft" and not hasattr(plan.payload, "get")  # typed reads only: no dict-style get


def test_literal_fields_refuse_bad_values_on_write_and_name_the_row_on_read(nb: Notebook):
    nb.start_job("k", session="s1", kind="sft", executor="local", resources={}, forecast_gpuh=1.0)
    with pytest.raises(NotebookError, match="failure_class 'gremlins' is not one of"):
        nb.update_job("k", 1, state="failed", failure_class="gremlins")
    assert nb.get_job("k").state == "pending"
    nb.db.execute("UPDATE job SET state = 'exploded' WHERE key = 'k'")  # written around the API
    with pytest.raises(NotebookError, match=r"job id 1: state: Input should be 'pending'"):
        nb.get_job("k")


def test_failure_classes_match_the_launchers():
    from tools.jobs.failures import FailureClass as LauncherFailureClass

    assert get_args(FailureClass) == get_args(LauncherFailureClass)


def _plans(nb: Notebook, call) -> list[str]:
    """Query plans of every SELECT that `call` runs."""
    statements: list[str] = []
    nb.db.conn.set_trace_callback(statements.append)
    try:
        call()
    finally:
        nb.db.conn.set_trace_callback(None)
    selects = [s for s in statements if s.lstrip().upper().startswith("SELECT")]
    return [" | ".join(r[3] for r in nb.db.execute(f"EXPLAIN QUERY PLAN {s}")) for s in selects]


def test_lookups_by_sha256_and_job_key_use_an_index(nb: Notebook):
    for i in range(20):
        nb.add_artifact(kind="checkpoint", name=str(i), path=f"/{i}", sha256=f"{i:064d}", session="s1")
        nb.start_job(f"k{i}", session="s1", kind="sft", executor="local", resources={}, forecast_gpuh=0.1)
    assert [a.name for a in nb.artifacts(sha256=f"{7:064d}")] == ["7"]
    nb.add_artifact(kind="dataset", name="made", path="/d", sha256="d" * 64, session="s1", job_key="k3")
    assert [a.name for a in nb.artifacts(job_key="k3")] == ["made"] and nb.artifacts(job_key="k4") == []
    assert [j.key for j in nb.jobs(key="k3")] == ["k3"]
    for call in (lambda: nb.artifacts(sha256="0" * 64), lambda: nb.jobs(key="k3"), lambda: nb.get_job("k3"),
                 lambda: nb.decisions("s1", kind="refuse"), lambda: nb.noise_floors("s1", "math", "correct")):
        plans = _plans(nb, call)
        assert plans and all("USING" in p and "SCAN" not in p for p in plans), plans


def _v1_notebook(path: Path) -> str:
    """A notebook as the version-1 code wrote it: V1 schema, an open decision without the row hash."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.executescript(V1)
    conn.execute("PRAGMA user_version = 1")
    conn.execute("PRAGMA journal_mode = wal")
    config = {"world": "toy"}
    conn.execute("INSERT INTO session VALUES ('old', 'lab', 5, 0.25, 'playbook', 'local', ?, 'open', "
                 "'2026-01-01T00:00:00.000000+00:00', NULL)", [canonical_json(config)])
    prev = GENESIS
    payloads = [("open", {"budget_gpuh": 5, "reserve_gpuh": 0.25, "planner": "playbook", "executor": "local",
                          "config_sha256": sha256_text(canonical_json(config))}),
                ("plan", {"next": "sft"}),
                ("refuse", {"suite": "confirm", "artifact_id": 3, "sealed": True})]
    for seq, (kind, payload) in enumerate(payloads, start=1):
        at, body = f"2026-01-01T00:00:0{seq}.000000+00:00", canonical_json(payload)
        digest = decision_hash(prev, seq, "old", at, kind, "v1", body)
        conn.execute("INSERT INTO decision VALUES (?, 'old', ?, ?, 'v1', ?, ?, ?)", [seq, at, kind, body, prev, digest])
        prev = digest
    conn.execute("INSERT INTO job (key, attempt, session, kind, executor, resources, forecast_gpuh, state, "
                 "submitted_at) VALUES ('k', 1, 'old', 'sft', 'local', '{}', 1.0, 'pending', 't')")
    conn.close()
    return prev


def test_a_version_1_notebook_verifies_read_only_then_migrates_and_verifies(tmp_path: Path):
    path = tmp_path / "notebook.db"
    head = _v1_notebook(path)
    with Notebook.open(path, readonly=True) as ro:  # read-only: not migrated, still verifiable
        assert ro.db.execute("PRAGMA user_version").fetchone()[0] == 1
        report = ro.verify()
        assert report.ok and report.count == 3 and report.head == head
        assert ro.get_job("k").fn is None
    with Notebook.open(path) as nb:
        assert nb.db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        report = nb.verify()
        assert report.ok and report.count == 3 and report.head == head
        assert nb.decisions("old", kind="refuse")[0].payload.reasons == []
        assert nb.get_job("k").fn is None and nb.session("old").budget_gpuh == 5.0
        nb.update_job("k", 1, state="completed", gpu_hours=0.5, device_seconds=1800.0, charge="measured")
        nb.end_session("old", "done", "finished after the upgrade")
        assert nb.verify().ok and nb.verify().count == 4


def _raw(nb: Notebook) -> sqlite3.Connection:
    return sqlite3.connect(nb.path, isolation_level=None)


@pytest.mark.parametrize(("edit", "named"), [
    ("UPDATE session SET budget_gpuh = 1000", "budget_gpuh is 1000.0 in its row but 10.0"),
    ("UPDATE session SET reserve_gpuh = 0", "reserve_gpuh is 0.0 in its row"),
    ("UPDATE session SET planner = 'openai'", "planner is 'openai' in its row"),
    ("UPDATE session SET config = '{\"lr\":1}'", "its config does not match"),
    ("UPDATE session SET lab = '/elsewhere'", "its row (lab or start time) does not match"),
    ("UPDATE session SET started_at = '2020-01-01'", "its row (lab or start time) does not match"),
    ("DELETE FROM session", "its row is gone"),
    ("INSERT INTO session VALUES ('ghost', 'lab', 1, 0, 'playbook', 'local', '{}', 'open', 't', NULL)",
     "session 'ghost': no open decision"),
])
def test_a_session_row_edited_after_it_opened_is_reported(nb: Notebook, edit: str, named: str):
    nb.end_session("s1", "done", "ended: status and ended_at change legitimately")
    assert nb.verify().ok
    _raw(nb).execute(edit)
    report = nb.verify()
    assert not report.ok and named in report.problem, report.problem
