"""The notebook's browsing views (memory/views.py): each answers a reviewer's question with one query,
on a notebook written through the Notebook API, and an old notebook gains them by migrating."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from memory.chain import GENESIS, decision_hash
from memory.notebook import Notebook
from memory.records import Adjustment, BarsSpec, GateRefusal, IncumbentPayload, Rule
from memory.schema import SCHEMA_VERSION

VIEWS = ["budget_by_kind", "decisions_readable", "leaderboard", "lineage"]


def _eval(nb: Notebook, artifact_id: int, values: list[float], replicate: int = 0, served: bool = True) -> None:
    items = [{"item_id": f"i{k}", "label": "x", "values": {"correct": v}} for k, v in enumerate(values)]
    nb.add_eval(session="s1", artifact_id=artifact_id, suite="digits", replicate=replicate, decoding={},
                decoding_sha256="d", served=served, metrics={"correct": sum(values) / len(values), "mode": "plain"},
                items=items)


@pytest.fixture
def nb(tmp_path: Path):
    with Notebook.open(tmp_path / "notebook.db") as notebook:
        notebook.open_session("s1", lab="lab", budget_gpuh=10, reserve_gpuh=1, planner="playbook",
                              executor="local", config={})
        parent = notebook.add_artifact(kind="checkpoint", name="parent", path="/p", sha256="a" * 64,
                                       recipe={"role": "parent"}, session="s1")
        data = notebook.add_artifact(kind="dataset", name="pairs", path="/d", sha256="b" * 64, session="s1")
        notebook.start_job("k-sft", session="s1", kind="sft", executor="slurm", resources={}, forecast_gpuh=2)
        notebook.update_job("k-sft", 1, state="failed", gpu_hours=0.5, failure_class="oom", charge="measured",
                            device_seconds=1800.0, external_id="41")
        notebook.start_job("k-sft", session="s1", kind="sft", executor="slurm", resources={}, forecast_gpuh=2, attempt=2)
        notebook.update_job("k-sft", 2, state="completed", gpu_hours=1.5, charge="simulated", device_seconds=60.0,
                            external_id="42")
        notebook.start_job("k-eval", session="s1", kind="eval", executor="slurm", resources={}, forecast_gpuh=0.25)
        sft = notebook.add_artifact(kind="checkpoint", name="sft-1", path="/s", sha256="c" * 64,
                                    parents=[parent.id, data.id], recipe={"hparams": {"trainer": "sft"}},
                                    job_key="k-sft", session="s1")
        dose = notebook.add_artifact(kind="checkpoint", name="dose-1", path="/m", sha256="e" * 64,
                                     parents=[parent.id, sft.id], recipe={"merge": "dose", "alpha": 0.5,
                                                                          "models": [parent.id, sft.id]}, session="s1")
        _eval(notebook, parent.id, [0, 0, 1, 0])
        _eval(notebook, parent.id, [0, 1, 1, 0], replicate=1)
        _eval(notebook, sft.id, [1, 1, 1, 0])
        _eval(notebook, sft.id, [0, 0, 0, 0], served=False)  # a diagnostic decoding: never on the leaderboard
        _eval(notebook, dose.id, [1, 0, 1, 0])
        notebook.record_decision("s1", "refuse", "gate refused", GateRefusal(
            tool="train", args={"steps": 9}, reason="forecast 12 GPU-h exceeds the 7.5 left"))
        bars = notebook.register_bars("s1", BarsSpec(bars=(Rule(suite="d", metric="correct", statistic="delta", op=">=", value=0.0, unit="absolute", test=None, confidence=None),), p_family=None))
        cmp, _ = notebook.add_comparison(session="s1", candidate=sft.id, incumbent=parent.id, bars_id=bars.id,
                                         verdicts=[], promoted=True, adjustment=Adjustment(), rationale="all bars hold")
        notebook.record_decision("s1", "promote", "sft-1 becomes the incumbent", IncumbentPayload(
            action="incumbent", artifact_id=sft.id, comparison_id=cmp.id, previous=parent.id))
        yield notebook


def _query(nb: Notebook, sql: str) -> list[dict]:
    return list(nb.db.query(sql))


def test_a_new_notebook_has_the_views_at_the_current_version(nb: Notebook):
    names = [r["name"] for r in _query(nb, "SELECT name FROM sqlite_master WHERE type = 'view' ORDER BY name")]
    assert names == VIEWS
    assert nb.db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


def test_decisions_readable_names_each_refusals_reason(nb: Notebook):
    rows = _query(nb, "SELECT seq, refusal_reason FROM decisions_readable WHERE kind = 'refuse'")
    assert [r["refusal_reason"] for r in rows] == ["forecast 12 GPU-h exceeds the 7.5 left"]
    promoted = _query(nb, "SELECT artifact_name, comparison_id FROM decisions_readable WHERE kind = 'promote'")
    assert [(r["artifact_name"], r["comparison_id"]) for r in promoted] == [("sft-1", 1), ("sft-1", 1)]


def test_leaderboard_ranks_served_first_looks(nb: Notebook):
    rows = _query(nb, "SELECT artifact_name, method, first_look, mean, evals, cleared_bars FROM leaderboard "
                      "WHERE suite = 'digits' AND metric = 'correct'")
    assert [(r["artifact_name"], r["method"], r["first_look"], r["evals"], r["cleared_bars"]) for r in rows] == [
        ("sft-1", "sft", 0.75, 1, 1), ("dose-1", "dose alpha 0.5", 0.5, 1, 0), ("parent", "parent", 0.25, 2, 0)]
    assert rows[2]["mean"] == pytest.approx(0.375)
    # labels such as a scoring mode are no metric
    assert not _query(nb, "SELECT 1 FROM leaderboard WHERE metric = 'mode'")


def test_budget_by_kind_splits_failed_and_simulated_hours(nb: Notebook):
    rows = {(r["kind"], r["state"], r["charge"]): r for r in _query(nb, "SELECT * FROM budget_by_kind")}
    assert set(rows) == {("sft", "failed", "measured"), ("sft", "completed", "simulated"),
                         ("eval", "pending", "unsettled")}
    assert rows[("sft", "failed", "measured")]["gpu_hours"] == 0.5
    assert rows[("sft", "failed", "measured")]["failure_classes"] == "oom"
    assert rows[("sft", "failed", "measured")]["device_hours"] == 0.5
    assert rows[("eval", "pending", "unsettled")]["reserved_gpuh"] == 0.25


def test_lineage_has_one_row_per_edge_with_the_latest_job_attempt(nb: Notebook):
    rows = _query(nb, "SELECT name, parent_name, method, job_external_id, became_incumbent FROM lineage")
    assert [(r["name"], r["parent_name"]) for r in rows] == [
        ("parent", None), ("sft-1", "parent"), ("sft-1", "pairs"), ("dose-1", "parent"), ("dose-1", "sft-1")]
    sft = [r for r in rows if r["name"] == "sft-1"]
    assert {(r["method"], r["job_external_id"], r["became_incumbent"]) for r in sft} == {("sft", "42", 1)}
    assert {r["became_incumbent"] for r in rows if r["name"] != "sft-1"} == {0}


def test_the_views_are_read_only(nb: Notebook):
    with pytest.raises(sqlite3.OperationalError, match="cannot modify"):
        nb.db.execute("DELETE FROM decisions_readable")


def _unchain_evals(conn: sqlite3.Connection) -> None:
    """The chain as a release before V5 wrote it: no eval, tool-call, artifact or job chain columns, every decision hashed
    without them."""
    for table in ("tool_call", "artifact", "noise_floor", "bars", "comparison", "feedback_split", "job"):
        conn.execute(f"DROP INDEX {table}_chain")
        conn.execute(f"ALTER TABLE {table} DROP COLUMN chain_seq")
        conn.execute(f"ALTER TABLE {table} DROP COLUMN chain_sha256")
    conn.execute("DROP INDEX eval_decision")
    conn.execute("ALTER TABLE eval DROP COLUMN decision_seq")
    conn.execute("ALTER TABLE eval DROP COLUMN sha256")
    conn.execute("DROP TRIGGER decision_no_update")
    prev = GENESIS
    for row in conn.execute("SELECT seq, session, at, kind, rationale, payload FROM decision ORDER BY seq").fetchall():
        digest = decision_hash(prev, *row)
        conn.execute("UPDATE decision SET prev_hash = ?, hash = ? WHERE seq = ?", [prev, digest, row[0]])
        prev = digest
    conn.execute("CREATE TRIGGER decision_no_update BEFORE UPDATE ON decision "
                 "BEGIN SELECT RAISE(ABORT, 'decisions are append-only'); END")


def test_a_version_3_notebook_gains_the_views_and_still_verifies(tmp_path: Path, nb: Notebook):
    # The fixture's notebook, rolled back to version 3 as the previous release wrote it (views dropped, evals not
    # chained).
    old = tmp_path / "old.db"
    conn = sqlite3.connect(old)
    nb.db.conn.backup(conn)
    for view in VIEWS:
        conn.execute(f"DROP VIEW {view}")
    _unchain_evals(conn)
    conn.execute("PRAGMA user_version = 3")
    conn.commit()
    conn.close()
    with Notebook.open(old, readonly=True) as ro:
        assert ro.verify().ok
        assert not _query(ro, "SELECT name FROM sqlite_master WHERE type = 'view'")
    with Notebook.open(old) as upgraded:
        assert upgraded.verify().ok and upgraded.verify().count == nb.verify().count
        assert len(_query(upgraded, "SELECT * FROM lineage")) == 5
