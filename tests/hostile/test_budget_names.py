"""--budget and names (issue 10, item 6): ASCII digits only, between a stated minimum and maximum;
session names and --lab paths that cannot be used are refused; nothing is created when refused."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import run_agent

sys.path.insert(0, str(Path(__file__).parent))
from hostile_kit import assert_refused, files, run_cli  # noqa: E402

RANGE = "at least 1gpum (0.0167 GPU-hours), at most 1000000gpuh"
FORMS = "accepted forms: GPU-hours like 60gpuh"
BUDGETS = {
    "arabic-indic digits": ("٦٠gpuh", FORMS),
    "fullwidth digits": ("６０gpuh", FORMS),
    "superscript": ("6²gpuh", FORMS),
    "trailing newline": ("60gpuh\n", FORMS),
    "empty": ("", FORMS),
    "negative": ("-1gpuh", FORMS),
    "exponent": ("1e3gpuh", FORMS),
    "hundreds of digits": ("9" * 400 + "gpuh", FORMS),
    "zero": ("0gpuh", RANGE),
    "below a minute": ("0.5gpum", RANGE),
    "above the maximum": ("1000001gpuh", RANGE),
}
SESSIONS = {
    "newline": "good\nbad",
    "path": "../../etc/x",
    "unicode letters": "séance",
    "leading underscore": "_x",
    "too long": "s" * 65,
}


def _assert_nothing_created(root: Path, before: dict) -> None:
    assert files(root) == before and not (root / "lab").exists()


@pytest.mark.parametrize("case", sorted(BUDGETS))
def test_hostile_budget_is_refused_with_forms_and_range(tmp_path: Path, capsys, case: str):
    budget, words = BUDGETS[case]
    before = files(tmp_path)
    assert run_agent.main(["--budget", budget, "--lab", str(tmp_path / "lab")]) == 2
    err = capsys.readouterr().err
    assert_refused(2, err, "--budget", words)
    _assert_nothing_created(tmp_path, before)


@pytest.mark.parametrize("case", sorted(SESSIONS))
def test_hostile_session_name_is_refused(tmp_path: Path, capsys, case: str):
    before = files(tmp_path)
    assert run_agent.main(["--budget", "1gpuh", "--lab", str(tmp_path / "lab"), "--session", SESSIONS[case]]) == 2
    assert_refused(2, capsys.readouterr().err, "--session", "use 1-64 letters, digits")
    _assert_nothing_created(tmp_path, before)


def test_lab_that_is_a_file_or_a_broken_link_is_refused(tmp_path: Path, capsys):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    before = files(tmp_path)
    for name, words in (("afile", "not a directory"), ("dangling", "a symbolic link to nothing"), ("loop", "a symbolic link to nothing")):
        assert run_agent.main(["--budget", "1gpuh", "--lab", str(tmp_path / name)]) == 2
        assert_refused(2, capsys.readouterr().err, f"--lab {tmp_path / name}", words)
    assert files(tmp_path) == before and not (tmp_path / "nowhere").exists()


def test_the_cli_refuses_budgets_and_names_and_creates_nothing(tmp_path: Path):
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    before = files(tmp_path)
    lab = str(tmp_path / "lab")
    argvs = [["--budget", "٦٠gpuh", "--lab", lab], ["--budget", "0gpuh", "--lab", lab],
             ["--budget", "2000000gpuh", "--lab", lab], ["--budget", "1gpuh", "--lab", lab, "--session", "a\nb"],
             ["--budget", "1gpuh", "--lab", str(tmp_path / "dangling")]]
    expected = [FORMS, RANGE, RANGE, "--session", "a symbolic link to nothing"]
    for proc, words in zip(run_cli(argvs), expected, strict=True):
        assert_refused(proc.returncode, proc.stderr, words)
    _assert_nothing_created(tmp_path, before)
    assert not (tmp_path / "nowhere").exists()
