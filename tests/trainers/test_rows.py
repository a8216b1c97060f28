"""Training row formats: good rows parse, bad rows name file, line and field."""

import json

import pytest

from trainers.rows import KLCERow, PreferenceRow, RowsError, SFTRow, read_rows, write_rows

U = {"role": "user", "content": "2+2?"}
A = {"role": "assistant", "content": "4"}


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_round_trip(tmp_path):
    rows = [SFTRow(messages=[U, A]), SFTRow(id="x", messages=[U, A, U, A])]
    assert read_rows(write_rows(tmp_path / "d.jsonl", rows), SFTRow) == rows
    kl = read_rows(_jsonl(tmp_path / "k.jsonl", [{"messages": [U, A], "kl_only": True}]), KLCERow)
    assert kl[0].kl_only


@pytest.mark.parametrize(
    ("row", "row_type", "message"),
    [
        ({"messages": [U]}, SFTRow, "messages: no assistant turn"),
        ({"messages": [U, {"role": "bot", "content": "4"}]}, SFTRow, "field messages.1.role"),
        ({"messages": [U, A], "extra": 1}, SFTRow, "field extra: Extra inputs"),
        ({"prompt": [U], "chosen": "4", "rejected": "4"}, PreferenceRow, "chosen and rejected are the same"),
        ({"prompt": [U, A], "chosen": "4", "rejected": "5"}, PreferenceRow, "prompt: the last turn must be the user's"),
    ],
)
def test_bad_row_names_line_and_field(tmp_path, row, row_type, message):
    path = tmp_path / "d.jsonl"
    good = {"messages": [U, A]} if row_type is SFTRow else {"prompt": [U], "chosen": "a", "rejected": "b"}
    _jsonl(path, [good, row])
    with pytest.raises(RowsError, match=f"d.jsonl:2: {message}"):
        read_rows(path, row_type)


def test_missing_empty_and_broken_files(tmp_path):
    with pytest.raises(RowsError, match="data file does not exist"):
        read_rows(tmp_path / "nope.jsonl", SFTRow)
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(RowsError, match="no rows"):
        read_rows(tmp_path / "e.jsonl", SFTRow)
    (tmp_path / "b.jsonl").write_text('{"messages": [\n')
    with pytest.raises(RowsError, match="b.jsonl:1: not valid JSON"):
        read_rows(tmp_path / "b.jsonl", SFTRow)
