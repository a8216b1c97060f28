"""Evals are covered by verify (issue 34, section 7): each eval row is hashed into the decision that records it.

A lab notebook written through the Notebook API (a session, two evals recorded by an `evaluate` decision, a third
by a later one), then edited with sqlite3 the way a hostile reader of the file would; `run_agent.py verify` runs as
a real subprocess. Each case asserts the exit status, no traceback, the message naming the eval row or decision,
and that verify wrote nothing.
"""

from __future__ import annotations

import json
import sqlite3
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from hostile_kit import files, run_cli  # noqa: E402

from memory.chain import EVAL_COLUMNS, eval_digest  # noqa: E402
from memory.notebook import Notebook  # noqa: E402


def _eval(nb: Notebook, artifact: int, suite: str, win: float) -> int:
    return nb.add_eval(session="s1", artifact_id=artifact, suite=suite, replicate=0, decoding={}, decoding_sha256="d",
                       served=True, metrics={"win_score": win}, items=[{"item_id": "i0", "values": {"win": win}}]).id


def _lab(root: Path) -> Path:
    """A lab whose notebook verifies: evals 1-2 recorded by decision 3, eval 3 by decision 4."""
    lab = root / "lab"
    with Notebook.open(lab / "notebook.db") as nb:
        nb.open_session("s1", lab=str(lab), budget_gpuh=1, reserve_gpuh=0.1, planner="playbook", executor="local",
                        config={})
        art = nb.add_artifact(kind="checkpoint", name="parent", path="/p", sha256="a" * 64, session="s1").id
        ids = [_eval(nb, art, "judge", 0.5), _eval(nb, art, "math", 0.25)]
        nb.record_decision("s1", "evaluate", "parent scored", {"artifact_id": art, "eval_ids": ids})
        third = _eval(nb, art, "judge", 0.5)
        nb.record_decision("s1", "evaluate", "parent scored again", {"artifact_id": art, "eval_ids": [third]})
    return lab


def _sql(lab: Path, *statements: str) -> None:
    conn = sqlite3.connect(lab / "notebook.db")
    for s in statements:
        conn.execute(s)
    conn.commit()
    conn.close()


def _verify(lab: Path) -> tuple[int, str, str]:
    before = files(lab)
    [done] = run_cli([["verify", "--lab", str(lab)]])
    assert "Traceback" not in done.stderr, done.stderr
    assert files(lab) == before  # verify writes nothing (no -wal, no migration)
    return done.returncode, done.stdout, done.stderr


def test_an_untouched_notebook_verifies_with_its_evals(tmp_path):
    lab = _lab(tmp_path)
    code, out, err = _verify(lab)
    assert code == 0, err
    assert "3 decisions verified" in out
    with Notebook.open(lab / "notebook.db", readonly=True) as nb:
        chained = [seq for (seq,) in nb.db.execute("SELECT decision_seq FROM eval ORDER BY id")]
        recorded = [d.seq for d in nb.decisions("s1", kind="evaluate")]
    assert chained == [recorded[0], recorded[0], recorded[1]]  # each eval in the decision that records it


def test_an_eval_metric_edited_with_sqlite3_fails_verify_naming_the_row(tmp_path):
    lab = _lab(tmp_path)
    metrics = json.dumps({"win_score": 0.999}, separators=(",", ":"))
    _sql(lab, f"UPDATE eval SET metrics = '{metrics}' WHERE id = 1")
    code, _, err = _verify(lab)
    assert code == 1
    assert "eval 1: its row does not match the hash decision seq" in err and "edited after it was recorded" in err


def test_an_edit_that_also_rewrites_the_stored_digest_or_unchains_the_row_still_fails(tmp_path):
    lab = _lab(tmp_path)
    _sql(lab, "UPDATE eval SET items = '[]' WHERE id = 3")
    conn = sqlite3.connect(lab / "notebook.db")  # the forger re-records the row's digest too
    row = conn.execute(f"SELECT {', '.join(EVAL_COLUMNS)} FROM eval WHERE id = 3").fetchone()
    conn.execute("UPDATE eval SET sha256 = ? WHERE id = 3", [eval_digest(row)])
    conn.commit()
    conn.close()
    code, _, err = _verify(lab)
    assert code == 1 and "content does not match its hash" in err and "decision seq" in err
    lab2 = _lab(tmp_path / "2")
    _sql(lab2, "UPDATE eval SET decision_seq = NULL WHERE id = 2")
    code, _, err = _verify(lab2)
    assert code == 1 and "decision seq" in err and "does not match its hash" in err


def test_a_forged_or_deleted_eval_row_fails_verify(tmp_path):
    forged = _lab(tmp_path / "forged")
    _sql(forged, "INSERT INTO eval (session, artifact_id, suite, replicate, decoding, decoding_sha256, served, metrics, "
                 "items, created_at) SELECT session, artifact_id, suite, 1, decoding, decoding_sha256, served, "
                 "'{\"win_score\":0.99}', items, created_at FROM eval WHERE id = 1")
    code, _, err = _verify(forged)
    assert code == 1 and "eval 4 (session 's1'): in no decision's hash" in err
    pointed = _lab(tmp_path / "pointed")
    _sql(pointed, "UPDATE eval SET decision_seq = 99 WHERE id = 3")
    code, _, err = _verify(pointed)
    assert code == 1 and "decision seq" in err
    deleted = _lab(tmp_path / "deleted")
    _sql(deleted, "DELETE FROM eval WHERE id = 2")
    code, _, err = _verify(deleted)
    assert code == 1 and "content does not match its hash" in err
