"""Feedback format: validation of every kind of bad line, the summary, Parquet, all-or-nothing ingestion,
and `run_agent.py check-feedback` as a real subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from memory.notebook import Notebook
from tools.data.feedback import FeedbackError, load_feedback, parse_feedback, summarize
from tools.data.splits import SplitConfig, ingest_feedback

REPO = Path(__file__).resolve().parents[2]
GOOD = {"id": "g", "messages": [{"role": "user", "content": "q"}], "own": "a", "other": "b", "vote": "own"}


def test_valid_file_summary_matches_hand_counts(tmp_path, battle, jsonl):
    path = jsonl(tmp_path / "fb.jsonl", [
        battle("b1", "How many r in strawberry?", "own", own="3", other="two", meta={"lang": "en", "tags": ["web", "math"]}),
        battle("b2", "  how many R in STRAWBERRY ", "other", own="12345", other="x", meta={"lang": "de"}),
        battle("b3", "", "tie", own="abcdefg", other="xyz", messages=[
            {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "2+2?"}]),
        battle("b4", "Name a color", "both_bad", own="ab", other="abcd", meta={"lang": "en"}),
    ])
    parsed = parse_feedback(path)
    assert parsed.problems == [] and [b.id for b in parsed.battles] == ["b1", "b2", "b3", "b4"]
    s = summarize(parsed)
    assert s.by_vote == {"own": 1, "other": 1, "tie": 1, "both_bad": 1}
    assert s.by_meta == {"lang": {"de": 1, "en": 2}, "tags": {"math": 1, "web": 1}}
    assert (s.multi_turn, s.multi_turn_share) == (1, 0.25)
    # own lengths 1, 5, 7, 2 -> sorted 1 2 5 7; inclusive quartiles: 1.75, 3.5, 5.5
    assert (s.own_chars.min, s.own_chars.q1, s.own_chars.median, s.own_chars.q3, s.own_chars.max) == (1, 1.75, 3.5, 5.5, 7)
    assert s.duplicate_prompts == 1  # b2 is b1's prompt with case and spacing changed
    assert s.duplicate_ids == 0


BAD_LINES = {
    "invalid JSON": ('{"id": "x", "messages": [', "-", "invalid JSON"),
    "missing field": (json.dumps({k: v for k, v in GOOD.items() if k != "other"} | {"id": "x"}), "other", "missing"),
    "empty field": (json.dumps(GOOD | {"id": "x", "own": "  "}), "own", "non-empty"),
    "empty message": (json.dumps(GOOD | {"id": "x", "messages": [{"role": "user", "content": ""}]}), "messages", "message 0: content must be a non-empty string"),
    "unknown vote": (json.dumps(GOOD | {"id": "x", "vote": "draw"}), "vote", "unknown vote 'draw'"),
    "unknown role": (json.dumps(GOOD | {"id": "x", "messages": [{"role": "bot", "content": "q"}]}), "messages.0.role", "unknown role 'bot'"),
    "last not user": (json.dumps(GOOD | {"id": "x", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}),
                      "messages", "last message must be from the user"),
    "duplicate id": (json.dumps(GOOD | {"id": "b1"}), "id", "duplicate id 'b1' (first on line 1)"),
    "unknown field": (json.dumps(GOOD | {"id": "x", "votes": "own"}), "votes", "unknown field"),
    "not an object": ("[1, 2]", "-", "expected a JSON object"),
}


@pytest.mark.parametrize("kind", sorted(BAD_LINES))
def test_each_bad_line_is_reported_and_nothing_is_ingested(kind, tmp_path, battle, jsonl):
    bad, field, words = BAD_LINES[kind]
    path = jsonl(tmp_path / "fb.jsonl", [battle("b1"), battle("b2"), bad, battle("b4")])
    problems = parse_feedback(path).problems
    assert [(p.line, p.field) for p in problems] == [(3, field)]
    assert words in problems[0].message
    _assert_ingests_nothing(tmp_path, path, "line 3")


def test_non_utf8_line_is_reported(tmp_path, battle, jsonl):
    path = jsonl(tmp_path / "fb.jsonl", [battle("b1"), battle("b2")])
    path.write_bytes(path.read_bytes() + json.dumps(battle("b3")).encode().replace(b'"q"', b'"q\xff"') + b"\n")
    problems = parse_feedback(path).problems
    assert [(p.line, p.field) for p in problems] == [(3, "-")]
    assert "not valid UTF-8 (byte 0xff" in problems[0].message
    _assert_ingests_nothing(tmp_path, path, "line 3")


def _assert_ingests_nothing(tmp_path: Path, path: Path, where: str) -> None:
    """A lab that already holds a split is left exactly as it was: same record, same split files."""
    split_dir, cfg = tmp_path / "splits", SplitConfig(dev_fraction=0.25, sealed_fraction=0.25)
    earlier = tmp_path / "earlier.jsonl"
    earlier.write_text("".join(json.dumps(GOOD | {"id": f"e{i}", "vote": v}) + "\n" for i, v in enumerate(["own", "tie"] * 4)))
    with Notebook.open(tmp_path / "notebook.db") as nb:
        _, before = ingest_feedback(nb, earlier, cfg, split_dir)
        files = sorted(split_dir.iterdir())
        with pytest.raises(FeedbackError, match=where):
            ingest_feedback(nb, path, cfg, split_dir)
        assert nb.latest_split() == before
    assert sorted(split_dir.iterdir()) == files


def test_every_problem_is_collected_and_the_first_20_listed(tmp_path, battle, jsonl):
    rows = [battle(f"b{i}", vote="draw") for i in range(25)] + [battle("ok")]
    path = jsonl(tmp_path / "fb.jsonl", rows)
    with pytest.raises(FeedbackError) as err:
        load_feedback(path)
    assert len(err.value.problems) == 25
    msg = str(err.value)
    assert "line 20: vote" in msg and "line 21: vote" not in msg and "... and 5 more" in msg


def test_parquet_with_the_same_columns_reads_like_jsonl(tmp_path, battle, jsonl):
    rows = [battle("b1", "p1", meta={"lang": "en"}), battle("b2", "p2", "tie", meta={"web": True}), battle("b3", "p3", "other")]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "fb.parquet")
    from_parquet = load_feedback(tmp_path / "fb.parquet").battles
    assert from_parquet == load_feedback(jsonl(tmp_path / "fb.jsonl", rows)).battles
    assert from_parquet[1].meta == {"web": True}


def test_parquet_bad_row_is_reported_by_row_number(tmp_path, battle):
    rows = [battle("b1"), battle("b2", vote="meh"), battle("b1")]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "fb.parquet")
    with pytest.raises(FeedbackError) as err:
        load_feedback(tmp_path / "fb.parquet")
    assert "row 2: vote: unknown vote 'meh'" in str(err.value)
    assert "row 3: id: duplicate id 'b1' (first on row 1)" in str(err.value)


def test_ingest_records_the_split_once(tmp_path, battle, jsonl):
    path = jsonl(tmp_path / "fb.jsonl", [battle(f"b{i}", f"prompt number {i}", ("own", "other")[i % 2]) for i in range(20)])
    cfg = SplitConfig(dev_fraction=0.2, sealed_fraction=0.1)
    with Notebook.open(tmp_path / "nb.db") as nb:
        split_path, record = ingest_feedback(nb, path, cfg, tmp_path / "splits")
        again_path, again = ingest_feedback(nb, path, cfg, tmp_path / "splits")
    assert (again_path, again.id) == (split_path, record.id)
    saved = json.loads(split_path.read_text())
    assert saved["assignment"] == record.assignment
    assert sum(s == "dev" for s in record.assignment.values()) == 4
    assert sum(s == "sealed" for s in record.assignment.values()) == 2


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "run_agent.py"), "check-feedback", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=120)


def test_check_feedback_cli(tmp_path, battle, jsonl):
    good = jsonl(tmp_path / "good.jsonl", [battle("b1", meta={"lang": "en"}), battle("b2", "p", "tie")])
    res = _cli(str(good))
    assert res.returncode == 0, res.stderr
    assert "2 valid battles" in res.stdout and "votes: own 1, other 0, tie 1, both_bad 0" in res.stdout
    assert "meta.lang: en 1" in res.stdout

    bad = jsonl(tmp_path / "bad.jsonl", [battle("b1"), battle("b2", vote="x"), "{oops", battle("b1")])
    res = _cli(str(bad))
    assert res.returncode == 1
    assert "3 problem(s)" in res.stderr
    for where in ("line 2: vote", "line 3: -: invalid JSON", "line 4: id: duplicate id"):
        assert where in res.stderr

    res = _cli(str(tmp_path / "missing.jsonl"))
    assert res.returncode == 2 and "missing.jsonl: does not exist" in res.stderr
