"""`run_agent.py clear-suite` (issue 41): a person clears a suite the suite audit flagged, run as a real subprocess on
a real notebook whose audit flagged `math`. It records one clear_suite decision and the guard reads its registered
margin again; it refuses (exit 2, one message, nothing written) a suite with no finding in force, an unknown session
or suite, empty names and a lab another writer holds."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from evals import compare as compare_mod
from memory.notebook import Notebook
from memory.state import fold
from tests.evals.test_bars_compare import BASE, SERVED
from tests.evals.test_sequential_audit import SEQUENTIAL, _candidate, _win, calibrated_incumbent
from tools.paths import LabPaths

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def lab(tmp_path: Path) -> Path:
    """A lab whose notebook holds session s1 with sequential bars, and a candidate the judge prefers whose `math`
    guard failed: the audit flagged `math`."""
    (tmp_path / "bars.toml").write_text(SEQUENTIAL)
    with Notebook.open(tmp_path / "notebook.db") as nb:
        nb.open_session("s1", lab=str(tmp_path), budget_gpuh=10, reserve_gpuh=1, planner="playbook",
                        executor="local", config={})
        inc, bars = calibrated_incumbent(nb, tmp_path / "bars.toml")
        worse = [0 if k in (0, 2) else v for k, v in enumerate(BASE)]
        cand = _candidate(nb, "first", [_win(30, 0)], math=worse)
        assert compare_mod.compare(nb, "s1", cand, inc, bars.id, SERVED, look=1).cleared
        assert fold(nb, "s1").flagged("math") is not None
    return tmp_path


def _cli(lab: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "run_agent.py"), "clear-suite", *args, "--lab", str(lab)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)


def _chain(lab: Path) -> tuple[int, str]:
    with Notebook.open(lab / "notebook.db", readonly=True) as nb:
        report = nb.verify()
        assert report.ok, report.problem
        return report.count, report.head


def _refused(lab: Path, out: subprocess.CompletedProcess, before: tuple[int, str], says: str) -> str:
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stdout == "" and out.stderr.count("\n") == 1 and out.stderr.startswith("error: "), out.stderr
    assert says in out.stderr, out.stderr
    assert _chain(lab) == before  # nothing written
    return out.stderr


def test_clear_suite_records_the_person_and_the_guard_reads_its_margin_again(lab: Path):
    before = _chain(lab)
    out = _cli(lab, "s1", "math", "--by", "Ada  Reviewer", "--reason", "labels re-checked\nby hand")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "suite math cleared by Ada Reviewer" in out.stdout
    assert _chain(lab)[0] == before[0] + 1
    with Notebook.open(lab / "notebook.db", readonly=True) as nb:
        (decision,) = nb.decisions("s1", kind="clear_suite")
        assert (decision.payload.suite, decision.payload.by, decision.payload.note) == (
            "math", "Ada Reviewer", "labels re-checked by hand")
        state = fold(nb, "s1")
    assert state.flagged("math") is None
    assert [(f.cleared_seq, f.cleared_by) for f in state.findings] == [(decision.seq, "Ada Reviewer")]
    # cleared once: a second clearing is refused, and says by whom it was cleared
    _refused(lab, _cli(lab, "s1", "math", "--by", "Bob", "--reason", "again"), _chain(lab), "cleared by 'Ada Reviewer'")


def test_what_cannot_be_cleared_is_refused_with_nothing_written(lab: Path):
    before = _chain(lab)
    _refused(lab, _cli(lab, "s1", "hold", "--by", "Ada", "--reason", "r"), before, "no suite-audit finding")
    _refused(lab, _cli(lab, "s1", "nope", "--by", "Ada", "--reason", "r"), before, "its bars' suites: hold, math")
    _refused(lab, _cli(lab, "s9", "math", "--by", "Ada", "--reason", "r"), before, "no session 's9'")
    _refused(lab, _cli(lab, "s1", "math", "--by", "  ", "--reason", "r"), before, "--by: name who clears")
    _refused(lab, _cli(lab, "s1", "math", "--by", "Ada", "--reason", ""), before, "--reason: say why")
    # a name from the command line is printed escaped, never raw
    said = _refused(lab, _cli(lab, "s1", "ma\x1b[2Jth\u202e", "--by", "Ada", "--reason", "r"), before,
                    "no bars of session s1")
    assert "\x1b" not in said and "\u202e" not in said and "\\x1b" in said, said
    with LabPaths(root=lab).writer("resume s1"):  # the session's agent holds the lab
        _refused(lab, _cli(lab, "s1", "math", "--by", "Ada", "--reason", "r"), before, "resume s1")
    with Notebook.open(lab / "notebook.db", readonly=True) as nb:
        assert fold(nb, "s1").flagged("math") is not None

