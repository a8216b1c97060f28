"""Feedback and JSON everywhere (issue 10, item 4): the one JSON-lines reader (core/jsonl.py) refuses
deep nesting, huge integers, duplicate keys, lone surrogates and non-finite numbers with the line;
invisible-only answers are empty; a directory or FIFO is named for what it is; Parquet is found by
content or by any-case extension. At the CLI every refusal exits 2 and writes nothing."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from core.jsonl import MAX_DEPTH, JSONLError, parse_lines, read_values
from tools.data.feedback import FeedbackError, load_feedback, parse_feedback

sys.path.insert(0, str(Path(__file__).parent))
from hostile_kit import BATTLE, assert_refused, battles, files, make_lab, run_cli  # noqa: E402

GOOD = json.dumps(BATTLE | {"id": "g"})
HOSTILE_LINES = {
    "deep nesting": (json.dumps(BATTLE | {"id": "x"})[:-1] + ', "meta": {"m": ' + "[" * 100 + "]" * 100 + "}}",
                     "-", f"nested deeper than {MAX_DEPTH} levels"),
    "past Python's digit limit": (json.dumps(BATTLE | {"id": "x"})[:-1] + ', "meta": {"n": ' + "7" * 5000 + "}}",
                                  "-", "an integer of 5000 digits (at most 100 are accepted)"),
    "duplicate vote": (json.dumps(BATTLE | {"id": "x"})[:-1] + ', "vote": "other"}', "-", "key 'vote' appears twice in one object"),
    "lone surrogate": (json.dumps(BATTLE | {"id": "x", "own": "half \ud800 a pair"}), "-", "lone UTF-16 surrogate (U+D800)"),
    "lone surrogate key": ('{"id": "x", "\\udfff": 1}', "-", "lone UTF-16 surrogate (U+DFFF)"),
    "NaN": (json.dumps(BATTLE | {"id": "x", "meta": {"score": float("nan")}}), "-", "NaN is not a JSON number"),
    "overflowing float": (json.dumps(BATTLE | {"id": "x"})[:-1] + ', "meta": {"s": 1e400}}', "-", "number '1e400' is out of range"),
    "zero-width answer": (json.dumps(BATTLE | {"id": "x", "own": "\u200b\u200d\u2060"}), "own", "must be a non-empty string"),
    "BOM-only message": (json.dumps(BATTLE | {"id": "x", "messages": [{"role": "user", "content": "\ufeff \u3164"}]}),
                         "messages", "message 0: content must be a non-empty string"),
    "invisible id": (json.dumps(BATTLE | {"id": "\u200b"}), "id", "must be a non-empty string"),
    "not UTF-8": (b'{"id": "x\xc3\x28"}', "-", "not valid UTF-8 (byte 0xc3"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_LINES))
def test_hostile_line_is_refused_with_its_line_and_nothing_ingested(tmp_path: Path, case: str):
    line, field, words = HOSTILE_LINES[case]
    path = tmp_path / "fb.jsonl"
    path.write_bytes(b"\n".join([GOOD.encode(), b"", line if isinstance(line, bytes) else line.encode("utf-8", "surrogatepass")]) + b"\n")
    problems = parse_feedback(path).problems
    assert [(p.line, p.field) for p in problems] == [(3, field)], problems
    assert words in problems[0].message, problems[0].message
    with pytest.raises(FeedbackError, match=re.escape(f"{path}: 1 problem")):
        load_feedback(path)


def test_line_separators_inside_strings_survive_and_lines_split_on_newline_only():
    text = "one\u2028two\u2029three\u0085four\x0bfive\x1cend"
    data = ("\ufeff" + json.dumps({"t": text}, ensure_ascii=False) + "\r\n\n \t\n" + json.dumps({"t": 2}) + "\n").encode()
    assert [(line.number, line.value) for line in parse_lines(data)] == [(1, {"t": text}), (4, {"t": 2})]


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


@pytest.mark.parametrize(("make", "words"), [
    (lambda p: p.mkdir() or p, "is a directory, not a file"),
    (_fifo, "is a named pipe (FIFO), not a file"),
    (lambda p: p.symlink_to(p.parent / "gone") or p, "is a dangling symbolic link"),
    (lambda p: p, "does not exist"),
])
def test_what_is_not_a_file_is_named_and_never_opened(tmp_path: Path, make, words: str):
    path = make(tmp_path / "fb.jsonl")
    with pytest.raises(FeedbackError, match=re.escape(f"{path}: {words}")):
        parse_feedback(path)
    with pytest.raises(JSONLError, match=re.escape(f"{path}: {words}")):
        read_values(path)


def test_parquet_is_found_by_content_or_any_case_extension(tmp_path: Path):
    rows = battles(3)
    table = pa.Table.from_pylist(rows)
    for name in ("fb.jsonl", "fb.PARQUET", "FB.Parquet", "fb"):
        pq.write_table(table, tmp_path / name)
        parsed = parse_feedback(tmp_path / name)
        assert parsed.unit == "row" and [b.id for b in parsed.battles] == ["b0", "b1", "b2"], name
    (tmp_path / "text.parquet").write_text(json.dumps(rows[0]) + "\n")
    problems = parse_feedback(tmp_path / "text.parquet").problems
    assert problems[0].line == 1 and "not a readable Parquet file" in problems[0].message


def test_the_cli_refuses_hostile_feedback_with_exit_2(tmp_path: Path):
    """check-feedback on things that are not files, and `run` on a lab whose feedback holds hostile lines."""
    lab_lines = {"duplicate vote": HOSTILE_LINES["duplicate vote"][0], "lone surrogate": HOSTILE_LINES["lone surrogate"][0],
                 "past Python's digit limit": HOSTILE_LINES["past Python's digit limit"][0]}
    labs = []
    for i, (case, line) in enumerate(lab_lines.items()):
        lab = make_lab(tmp_path / f"lab{i}")
        (lab / "feedback.jsonl").write_bytes(b"\n".join([GOOD.encode(), line.encode("utf-8", "surrogatepass")]) + b"\n")
        labs.append((case, lab, files(lab)))
    (tmp_path / "adir").mkdir()
    fifo = _fifo(tmp_path / "pipe.jsonl")
    argvs = [["check-feedback", str(tmp_path / "adir")], ["check-feedback", str(fifo)],
             *(["--budget", "1gpuh", "--lab", str(lab)] for _, lab, _ in labs)]
    procs = run_cli(argvs)
    assert_refused(procs[0].returncode, procs[0].stderr, f"{tmp_path / 'adir'}: is a directory, not a file")
    assert_refused(procs[1].returncode, procs[1].stderr, f"{fifo}: is a named pipe (FIFO), not a file")
    for (case, lab, before), proc in zip(labs, procs[2:], strict=True):
        assert_refused(proc.returncode, proc.stderr, str(lab / "feedback.jsonl"), "line 2: -: ", HOSTILE_LINES[case][2])
        assert files(lab) == before and not (lab / "notebook.db").exists()
