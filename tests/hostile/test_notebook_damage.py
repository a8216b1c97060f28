"""Damaged notebooks (issue 10, item 1): not SQLite, truncated, empty, a directory, a table dropped,
a zero or negative schema version with tables, a session config that is not JSON, a damaged page.

`verify`, `run`, `resume` and `replay` answer each with one line naming the file, exit 2 (bad input; exit 1 stays "a
check failed"), no traceback, and leave every file as it was (no -wal/-shm appears). A session row
edited after its `open` decision is a failed check: exit 1, naming the session and the field.
"""

from __future__ import annotations

import os
import re
import sqlite3
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

import run_agent
from memory.notebook import Notebook, NotebookError

sys.path.insert(0, str(Path(__file__).parent))
from hostile_kit import assert_refused, files, make_lab, run_cli  # noqa: E402

PAGE = 4096


def _good(path: Path, decisions: int = 200) -> bytes:
    """A valid notebook (closed, fully checkpointed); returns its bytes."""
    with Notebook.open(path) as nb:
        nb.open_session("s1", lab=str(path.parent), budget_gpuh=10, reserve_gpuh=1, planner="playbook",
                        executor="local", config={"world": "toy"})
        for i in range(decisions):
            nb.record_decision("s1", "plan", "step", {"i": i, "pad": "p" * 200})
    return path.read_bytes()


def _sql(path: Path, *statements: str) -> None:
    conn = sqlite3.connect(path, isolation_level=None)
    for statement in statements:
        conn.execute(statement)
    conn.close()


def _edited(*statements: str) -> Callable[[Path], None]:
    def build(path: Path) -> None:
        _good(path)
        _sql(path, *statements)
    return build


def _cut(keep: Callable[[int], int]) -> Callable[[Path], None]:
    def build(path: Path) -> None:
        data = _good(path)
        path.write_bytes(data[:keep(len(data))])
    return build


def _page_overwritten(page: int) -> Callable[[Path], None]:
    def build(path: Path) -> None:
        data = bytearray(_good(path))
        data[page * PAGE:(page + 1) * PAGE] = bytes(range(256)) * (PAGE // 256)
        path.write_bytes(bytes(data))
    return build


def _symlink_to_dir(path: Path) -> None:
    (path.parent.parent / "elsewhere").mkdir()
    path.symlink_to(path.parent.parent / "elsewhere")


DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    # not SQLite
    "text": (lambda p: p.write_text("hello, I am a notebook\n"), "is not an SQLite database"),
    "json": (lambda p: p.write_text('{"decisions": []}'), "is not an SQLite database"),
    "png": (lambda p: p.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(200)), "is not an SQLite database"),
    "zeros": (lambda p: p.write_bytes(bytes(PAGE)), "is not an SQLite database"),
    # truncated
    "inside the header": (_cut(lambda n: 50), "shorter than the 100-byte SQLite header"),
    "half the file": (_cut(lambda n: n // 2), "is truncated"),
    "a partial page": (_cut(lambda n: 3 * PAGE + 17), "is truncated"),
    "the last page": (_cut(lambda n: n - PAGE), "is truncated"),
    # empty
    "zero bytes": (lambda p: p.write_bytes(b""), "is an empty file (0 bytes)"),
    "no tables": (lambda p: _sql(p, "CREATE TABLE t (x)", "DROP TABLE t", "VACUUM"), "an empty SQLite database"),
    "a version but no tables": (lambda p: _sql(p, "PRAGMA user_version = 3"), "table artifact is missing"),
    # a directory
    "empty directory": (lambda p: p.mkdir(), "is a directory"),
    "directory with files": (lambda p: (p.mkdir(), (p / "x").write_text("x")), "is a directory"),
    "symlink to a directory": (_symlink_to_dir, "is a directory"),
    # a table or column dropped
    "decision dropped": (_edited("DROP TABLE decision"), "table decision is missing"),
    "session dropped": (_edited("DROP TABLE session"), "table session is missing"),
    "eval dropped": (_edited("DROP TABLE eval"), "table eval is missing"),
    "column dropped": (_edited("ALTER TABLE job DROP COLUMN fn"), "table job lacks column(s) fn"),
    # zero or negative schema version with tables
    "version 0": (_edited("PRAGMA user_version = 0"), "but schema version 0"),
    "version -1": (_edited("PRAGMA user_version = -1"), "schema version -1"),
    "version -2^31": (_edited("PRAGMA user_version = -2147483648"), "schema version -2147483648"),
    # a session config that is not JSON
    "config cut short": (_edited("UPDATE session SET config = '{\"world\": '"), "column config is not JSON"),
    "config empty": (_edited("UPDATE session SET config = ''"), "column config is not JSON"),
    "config not UTF-8": (_edited("UPDATE session SET config = X'FFFE7B7D'"), "column config is not JSON"),
    "config a list": (_edited("UPDATE session SET config = '[1, 2]'"), "config: Input should be a valid dictionary"),
    # a damaged page in the middle (what the chain walk alone might never read)
    "page 3 overwritten": (_page_overwritten(2), "the file is damaged"),
    "page 10 overwritten": (_page_overwritten(9), "the file is damaged"),
    "page 30 overwritten": (_page_overwritten(29), "the file is damaged"),
}


def _refused(capsys, argv: list[str], *where: str) -> None:
    code = run_agent.main(argv)
    err = capsys.readouterr().err
    assert_refused(code, err, *where)
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_a_damaged_notebook_is_refused_with_one_line_and_left_as_it_was(tmp_path: Path, capsys, case: str):
    build, message = DAMAGE[case]
    lab = make_lab(tmp_path / "lab")  # every other input valid: only the notebook is wrong
    path = lab / "notebook.db"
    build(path)
    before = files(tmp_path)
    for argv in (["verify"], ["--budget", "1gpuh", "--session", "again"], ["resume", "s1"], ["replay", "s1"]):
        _refused(capsys, [*argv, "--lab", str(lab)], str(path), message)
    with pytest.raises(NotebookError, match=re.escape(message)) as err:
        Notebook.open(path)  # a writer (run, resume) refuses it the same way, and does not repair it
    assert "\n" not in str(err.value)
    assert files(tmp_path) == before  # nothing appeared (no -wal/-shm, no new notebook) and nothing changed


def test_through_the_real_command_line(tmp_path: Path):
    labs = []
    for case in ("half the file", "version 0", "config cut short"):  # the in-process test above covers the rest
        lab = tmp_path / case.replace(" ", "-")
        lab.mkdir()
        DAMAGE[case][0](lab / "notebook.db")
        labs.append((lab, DAMAGE[case][1]))
    for (lab, message), proc in zip(labs, run_cli([["verify", "--lab", str(lab)] for lab, _ in labs]), strict=True):
        assert_refused(proc.returncode, proc.stderr, str(lab / "notebook.db"), message)
        assert proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1


EDITS = {
    "budget raised": ("UPDATE session SET budget_gpuh = 1000", "budget_gpuh is 1000.0 in its row but 10.0"),
    "reserve cut": ("UPDATE session SET reserve_gpuh = 0", "reserve_gpuh is 0.0 in its row but 1.0"),
    "executor changed": ("UPDATE session SET executor = 'slurm'", "executor is 'slurm' in its row"),
    "config edited": ("UPDATE session SET config = '{\"world\":\"real\"}'", "its config does not match the hash"),
    "lab moved": ("UPDATE session SET lab = '/somewhere/else'", "its row (lab or start time) does not match"),
}


@pytest.mark.parametrize("case", sorted(EDITS))
def test_a_session_row_edited_after_it_opened_fails_verify(tmp_path: Path, capsys, case: str):
    edit, message = EDITS[case]
    path = tmp_path / "notebook.db"
    _good(path, decisions=3)
    _sql(path, edit)
    before = files(tmp_path)
    code = run_agent.main(["verify", "--lab", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err, err
    assert "verify FAILED" in err and "session 's1'" in err and message in err, err
    assert files(tmp_path) == before


def test_a_read_only_verify_leaves_no_wal_or_shm_and_sees_a_live_writer(tmp_path: Path, capsys):
    path = tmp_path / "notebook.db"
    _good(path, decisions=3)
    assert run_agent.main(["verify", "--lab", str(tmp_path)]) == 0
    assert "4 decisions verified" in capsys.readouterr().out
    assert sorted(os.listdir(tmp_path)) == ["notebook.db"]
    with Notebook.open(path) as writer:  # a running agent: its WAL holds commits not yet checkpointed
        writer.record_decision("s1", "plan", "live", {"i": -1})
        assert run_agent.main(["verify", "--lab", str(tmp_path)]) == 0
        assert "5 decisions verified" in capsys.readouterr().out
    assert sorted(os.listdir(tmp_path)) == ["notebook.db"]
