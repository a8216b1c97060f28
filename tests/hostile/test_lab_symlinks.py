"""The lab's own entries are not followed out of it, and its name is printed escaped (issue 44, item 4b).

`lab.lock` as a symbolic link (or a hard link) to a file outside the lab, and `jobs/`, `runs/`, `graph.sqlite`,
`notebook.db` and their SQLite side files as symbolic links: a writer (resume here, through the command line's own entry) refuses with one line naming the entry,
exit 2, and the file outside is left as it was. A lab directory whose name carries terminal escapes (ESC ] ... BEL sets
the title, ESC [2J clears the screen) is printed escaped by run, verify and report.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import run_agent
from memory.notebook import Notebook
from tools.paths import LabLockError, LabPaths

ESCAPES = "lab\x1b]0;owned\x07\x1b[2J"


def _lab(root: Path, name: str = "lab") -> Path:
    lab = root / name
    with Notebook.open(lab / "notebook.db") as nb:
        nb.open_session("s1", lab=str(lab), budget_gpuh=1, reserve_gpuh=0.1, planner="playbook", executor="local",
                        config={})
    return lab


def _outside(root: Path) -> Path:
    precious = root / "elsewhere" / "precious.txt"
    precious.parent.mkdir(exist_ok=True)
    precious.write_text("someone else's file\n")
    return precious


def test_a_lock_file_linked_outside_the_lab_is_refused_and_its_target_left_alone(tmp_path: Path, capsys):
    lab, precious = _lab(tmp_path), _outside(tmp_path)
    (lab / "lab.lock").symlink_to(precious)
    assert run_agent.main(["resume", "s1", "--lab", str(lab)]) == 2
    err = capsys.readouterr().err
    assert "lab.lock: a symbolic link" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert precious.read_text() == "someone else's file\n"
    (lab / "lab.lock").unlink()
    os.link(precious, lab / "lab.lock")  # a hard link: the same file under a second name
    with pytest.raises(LabLockError, match="a file with 2 names"), LabPaths(root=lab).writer("resume s1"):
        pass
    assert precious.read_text() == "someone else's file\n"


@pytest.mark.parametrize("entry", ["jobs", "runs", "graph.sqlite", "runs/s1", "notebook.db", "notebook.db-wal",
                                   "graph.sqlite-shm"])
def test_the_labs_own_entries_as_symbolic_links_are_refused_naming_the_entry(tmp_path: Path, entry: str):
    lab, precious = _lab(tmp_path), _outside(tmp_path)
    target = precious if "." in entry else precious.parent
    (lab / entry).parent.mkdir(parents=True, exist_ok=True)
    (lab / entry).unlink(missing_ok=True)  # the notebook's own file: another lab's notebook linked in its place
    (lab / entry).symlink_to(target)
    before = sorted(os.listdir(precious.parent))
    with pytest.raises(LabLockError, match=f"{entry}: a symbolic link"), \
            LabPaths(root=lab, session="s1").writer("resume s1"):
        pass
    assert sorted(os.listdir(precious.parent)) == before and precious.read_text() == "someone else's file\n"
    assert not (lab / "lab.lock").exists()  # refused before the lock was taken: nothing written


def test_a_lab_named_with_terminal_escapes_is_printed_escaped(tmp_path: Path, capsys):
    lab = _lab(tmp_path, ESCAPES)
    with Notebook.open(lab / "notebook.db") as nb:
        nb.end_session("s1", "done", "ended")
    outputs = []
    for argv in (["verify", "--lab", str(lab)], ["report", "--lab", str(lab)],
                 ["--budget", "1gpuh", "--lab", str(lab / "missing")]):
        run_agent.main(argv)
        outputs.append(capsys.readouterr())
    for out in outputs:
        text = out.out + out.err
        assert "\x1b" not in text and "\x07" not in text, text
        assert "lab\\x1b]0;owned\\x07\\x1b[2J" in text, text


def test_resume_refuses_a_sessions_run_directory_linked_to_another_labs(tmp_path: Path, capsys):
    lab, precious = _lab(tmp_path), _outside(tmp_path)
    (lab / "runs").mkdir()
    (lab / "runs" / "s1").symlink_to(precious.parent)  # another lab's runs: a trainer would resume from its state
    assert run_agent.main(["resume", "s1", "--lab", str(lab)]) == 2
    err = capsys.readouterr().err
    assert "runs/s1: a symbolic link" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert sorted(os.listdir(precious.parent)) == ["precious.txt"] and not (lab / "lab.lock").exists()


def test_replay_prints_the_differing_decisions_escaped(monkeypatch, capsys):
    """A replay that differs prints recorded and replayed rationales and would-launch summaries, which carry the lab's
    paths: escaped, as every other command prints them (issue 44, item 4b)."""
    from agent import replay

    differing = replay.ReplayResult(same=False, recorded=3, replayed=3, first_difference=1,
                                    lines=[f"  2 recorded: train on {ESCAPES}/data/x.jsonl"],
                                    would_launch=[f"sft on {ESCAPES}/runs/s1"])
    monkeypatch.setattr(replay, "replay", lambda *args, **kwargs: differing)
    assert replay.replay_command(Path("lab"), "s1", bars=None, planner=None, protocol=None) == 1
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out, out
    assert out.count("lab\\x1b]0;owned\\x07\\x1b[2J") == 2, out
