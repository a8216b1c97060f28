"""The lab is a place (issue 34, section 4), the cheap cases: one writer at a time (a second `run`, `resume` or
`world build` is refused naming the holder; a lock left by a killed process is stale and taken over), `world
build` never destroys a user's files, `report -o` writes regular files only, and job keys do not depend on how
the lab path is spelled. The whole-session cases (a copied lab replays, a resume from another directory, two
`run`s racing) are in test_lab_sessions.py."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import sqlite3
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from pydantic import BaseModel

from core.util import file_sha256
from memory.notebook import Notebook
from memory.place import Place
from tools.jobs.executor import ExecutorSection
from tools.jobs.launcher import Launcher
from tools.paths import LabLockError, LabPaths, portable
from tools.world.build import MANIFEST, WORLD_DIR, Manifest, WorldError, build

sys.path.insert(0, str(Path(__file__).parent))
from hostile_kit import REPO, assert_refused, files, make_lab, run_cli  # noqa: E402

HOLD = """
import sys, time
from pathlib import Path
from tools.paths import LabPaths
with LabPaths(root=Path(sys.argv[1])).writer("run held-by-test"):
    print("held", flush=True)
    time.sleep(600)
"""


def _holder(lab: Path) -> subprocess.Popen:
    """A real process holding the lab's lock (as a running session does) until it is killed."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(lab)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


@pytest.fixture
def held(tmp_path):
    lab = make_lab(tmp_path / "lab")
    proc = _holder(lab)
    yield lab, proc
    proc.kill()
    proc.wait()


# ---- one writer at a time ------------------------------------------------------------------------


def test_a_second_run_or_resume_is_refused_naming_the_holder(held, tmp_path, monkeypatch):
    lab, proc = held
    monkeypatch.setenv("OPENAI_API_KEY", "test-key")  # the lab's planner key is set: only the lock stands in the way
    with Notebook.open(lab / "notebook.db"):  # resume looks for a notebook before the lock
        pass
    (tmp_path / "link").symlink_to(lab)  # the same lab reached through a link is the same lock
    before = files(lab)
    outs = run_cli([["--budget", "1gpuh", "--lab", str(lab), "--session", "s2"],
                    ["resume", "s1", "--lab", str(tmp_path / "link")]])
    for out in outs:
        assert_refused(out.returncode, out.stderr, "lab.lock", f"pid {proc.pid}", "run held-by-test")
    assert files(lab) == before


def test_a_world_build_is_refused_while_a_session_holds_the_lab(tmp_path):
    lab = _world_lab(tmp_path / "lab")
    proc = _holder(lab)
    try:
        before = files(lab)
        out = run_cli([["world", "build", "--lab", str(lab), "--size", "test"]])[0]
        assert_refused(out.returncode, out.stderr, str(lab / "lab.lock"), f"pid {proc.pid}")
        assert files(lab) == before
    finally:
        proc.kill()
        proc.wait()


def test_a_lock_left_by_a_killed_process_is_stale_and_taken_over(tmp_path, capfd):
    lab = tmp_path / "lab"
    proc = _holder(lab)
    with pytest.raises(LabLockError, match=f"pid {proc.pid}"):
        with LabPaths(root=lab).writer("second"):
            pass
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    with LabPaths(root=lab).writer("after the kill"):
        assert "after the kill" in (lab / "lab.lock").read_text()
    err = capfd.readouterr().err
    assert f"stale lock of pid {proc.pid}" in err and "run held-by-test" in err
    with LabPaths(root=lab).writer("third"):  # a clean release leaves no stale note
        pass
    assert "stale" not in capfd.readouterr().err


def test_a_hostile_lock_note_is_shown_escaped(tmp_path, capfd):
    lab = tmp_path / "lab"
    lab.mkdir()
    (lab / "lab.lock").write_text(json.dumps({"pid": 1, "host": "h\x1b]0;owned\x07", "command": "run x\nforged line",
                                              "since": "\u202etoday"}))
    with LabPaths(root=lab).writer("run s1"):
        pass
    err = capfd.readouterr().err
    assert "stale lock of pid 1" in err and "\\x1b]0;owned" in err and "\\n" in err and "\\u202e" in err
    assert "\x1b" not in err and "\u202e" not in err and len(err.strip().splitlines()) == 1
    assert not (lab / "lab.lock").exists()


def test_the_lock_is_not_inherited_by_the_jobs_a_session_starts(tmp_path):
    """A job outlives a killed agent; it must not keep the lab locked against the resume."""
    lab = tmp_path / "lab"
    with LabPaths(root=lab).writer("run s1"):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        with LabPaths(root=lab).writer("resume s1"):
            pass
    finally:
        child.kill()
        child.wait()


def test_a_lab_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "lab").write_text("not a lab")
    with pytest.raises(LabLockError, match="not a directory"):
        with LabPaths(root=tmp_path / "lab").writer("run"):
            pass
    assert (tmp_path / "lab").read_text() == "not a lab"


# ---- world build never destroys a user's files -------------------------------------------------------


def _world_lab(lab: Path, *, notebook: bool = False) -> Path:
    """A lab as a build leaves it (lab.toml vouched for by world/manifest.json), without the models."""
    (lab / WORLD_DIR).mkdir(parents=True)
    (lab / "lab.toml").write_text('bars = "world/bars.toml"\n')
    manifest = Manifest(version=0, seed=0, size="test", files={"lab.toml": file_sha256(lab / "lab.toml")})
    (lab / WORLD_DIR / MANIFEST).write_text(manifest.model_dump_json())
    if notebook:
        with Notebook.open(lab / "notebook.db"):
            pass
    return lab


def test_build_refuses_a_directory_of_other_files(tmp_path):
    lab = tmp_path / "mine"
    (lab / "world").mkdir(parents=True)
    (lab / "world" / "thesis.tex").write_text("years of work")
    before = files(lab)
    out = run_cli([["world", "build", "--lab", str(lab), "--size", "test"]])[0]
    assert_refused(out.returncode, out.stderr, str(lab), "no lab.toml", "world")
    assert files(lab) == before  # not even a lock file


def test_build_refuses_an_edited_lab_toml(tmp_path):
    lab = _world_lab(tmp_path / "lab")
    (lab / "lab.toml").write_text('bars = "world/bars.toml"\n# my own note\n')
    before = files(lab)
    out = run_cli([["world", "build", "--lab", str(lab), "--size", "test"]])[0]
    assert_refused(out.returncode, out.stderr, str(lab / "lab.toml"), "edited")
    assert files(lab) == before


def test_build_refuses_a_lab_holding_a_notebook(tmp_path):
    lab = _world_lab(tmp_path / "lab", notebook=True)
    before = files(lab)
    out = run_cli([["world", "build", "--lab", str(lab), "--size", "test"]])
    assert_refused(out[0].returncode, out[0].stderr, str(lab / "notebook.db"), "sessions")
    assert files(lab) == before


def test_run_on_a_directory_of_other_files_builds_nothing(tmp_path):
    lab = tmp_path / "mine"
    (lab / "world").mkdir(parents=True)
    (lab / "world" / "data.csv").write_text("1,2\n")
    before = files(lab)
    out = run_cli([["--budget", "1gpuh", "--lab", str(lab)]])[0]
    assert_refused(out.returncode, out.stderr, str(lab), "no lab.toml")
    assert files(lab) == before


def test_a_killed_builds_staging_directory_is_removed_by_the_next_build(tmp_path):
    lab = _world_lab(tmp_path / "lab", notebook=True)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = lab / f".world-build-{dead.pid}-x1"
    live = lab / f".world-build-{os.getpid()}-x2"  # a build still running (this process) keeps its own
    for d in (stale, live):
        (d / "world").mkdir(parents=True)
    with pytest.raises(WorldError, match="notebook"):
        build(lab, seed=0, size="test")
    assert not stale.exists() and live.exists()


# ---- report -o ------------------------------------------------------------------------------------


@pytest.fixture
def notebook(tmp_path) -> Path:
    lab = tmp_path / "lab"
    lab.mkdir()
    with Notebook.open(lab / "notebook.db") as nb:
        nb.open_session("s1", lab=str(lab), budget_gpuh=1.0, reserve_gpuh=0.1, planner="playbook", executor="local",
                        config={})
    return lab


def test_report_refuses_a_device(notebook):
    if not os.path.exists("/dev/null"):
        pytest.skip("no /dev/null")
    before = os.stat("/dev/null")
    out = run_cli([["report", "--lab", str(notebook), "-o", "/dev/null"]])[0]
    assert_refused(out.returncode, out.stderr, "/dev/null", "not a regular file")
    after = os.stat("/dev/null")
    assert stat.S_ISCHR(after.st_mode) and after.st_ino == before.st_ino


def test_report_refuses_a_fifo_and_a_symbolic_link(notebook, tmp_path):
    fifo, target, link = tmp_path / "pipe", tmp_path / "mine.html", tmp_path / "link.html"
    os.mkfifo(fifo)
    target.write_text("kept")
    link.symlink_to(target)
    outs = run_cli([["report", "--lab", str(notebook), "-o", str(fifo)],
                    ["report", "--lab", str(notebook), "-o", str(link)],
                    ["report", "--lab", str(notebook), "-o", str(tmp_path / "no-such-dir" / "r.html")]])
    assert_refused(outs[0].returncode, outs[0].stderr, str(fifo), "not a regular file")
    assert_refused(outs[1].returncode, outs[1].stderr, str(link), "symbolic link")
    assert_refused(outs[2].returncode, outs[2].stderr, "no-such-dir", "not a directory")
    assert stat.S_ISFIFO(fifo.lstat().st_mode) and link.is_symlink() and target.read_text() == "kept"
    assert not (tmp_path / "no-such-dir").exists()


# ---- job keys and the lab's spelling --------------------------------------------------------------


class _Job(BaseModel):
    model_path: Path
    output_dir: Path
    steps: int


def _job(cfg: _Job) -> _Job:
    return cfg


def _key(nb: Notebook, lab: Path, roots: tuple[str, ...]) -> str:
    launcher = Launcher.from_section(nb, "s1", ExecutorSection(kind="local"), lab / "jobs", lab_roots=roots)
    return launcher.key("sft", _job, _Job(model_path=lab / "models/parent", output_dir=lab / "runs/sft-1", steps=1))


def test_job_keys_do_not_depend_on_how_the_lab_is_spelled(tmp_path, monkeypatch):
    original, copy = tmp_path / "lab", tmp_path / "elsewhere" / "copy-of-lab"
    original.mkdir()
    copy.parent.mkdir()
    (tmp_path / "link").symlink_to(original)
    monkeypatch.chdir(tmp_path)
    with Notebook.open(tmp_path / "nb.db") as nb:
        keys = {_key(nb, Path("lab"), LabPaths(root=Path("lab")).spellings()),
                _key(nb, original, LabPaths(root=original).spellings()),
                _key(nb, tmp_path / "link", LabPaths(root=tmp_path / "link").spellings()),
                # a copy, with the recorded root of the session that ran in the original
                _key(nb, copy, LabPaths(root=copy).spellings(str(original)))}
        assert len(keys) == 1
        # Another lab is another lab: a path outside the roots stays as it is.
        assert _key(nb, tmp_path / "other", LabPaths(root=copy).spellings()) not in keys


def test_portable_rewrites_only_paths_inside_the_lab():
    roots = LabPaths(root=Path("/data/lab")).spellings()
    value = {"a": "/data/lab/runs/x", "b": "/data/lab2/runs/x", "c": ["/data/lab", "/data/labx"], "d": 3,
             "e": "lab/runs"}
    assert portable(value, roots) == {"a": "<lab>/runs/x", "b": "/data/lab2/runs/x", "c": ["<lab>", "/data/labx"],
                                      "d": 3, "e": "lab/runs"}


# ---- the notebook's paths are lab-relative (issue 43 item 6, issue 44 item 3) ------------------------


def _recorded(lab: Path) -> None:
    """A notebook in `lab` with a session whose config, artifact, job and decision name paths inside and outside the
    lab (a team's base model elsewhere; another lab beside it)."""
    with Notebook.open(lab / "notebook.db") as nb:
        base = "/models/team-base"  # kept outside the lab, named by lab.toml: stays as written
        nb.open_session("s1", lab=str(lab), budget_gpuh=1.0, reserve_gpuh=0.1, planner="playbook",
                        executor="local", config={"lab": {"feedback": str(lab / "feedback.jsonl"), "base": base}})
        nb.add_artifact(kind="checkpoint", name="sft-1", path=str(lab / "runs/s1/sft-1"), sha256="a" * 64, session="s1")
        nb.add_artifact(kind="checkpoint", name="base", path=base, sha256="b" * 64, session="s1")
        nb.add_artifact(kind="dataset", name="other", path=f"{lab}2/data/x.jsonl", sha256="c" * 64, session="s1")
        nb.start_job("k1", session="s1", kind="sft", executor="local", forecast_gpuh=0.1, folder=str(lab / "jobs/k1-1"),
                     resources={"args": {"output_dir": str(lab / "runs/s1/sft-1"), "model_path": base}})
        nb.update_job("k1", 1, state="completed", log_path=str(lab / "jobs/k1-1/1_0_log.err"),
                      result={"model_dir": str(lab / "runs/s1/sft-1/model")})
        nb.record_decision("s1", "plan", f"bundle at {lab}/bundles/b1 checked", {"text": "x"})


def _read(lab: Path) -> dict:
    with Notebook.open(lab / "notebook.db", readonly=True) as nb:
        assert nb.verify().ok, nb.verify().problem
        job = nb.jobs()[0]
        return {"config": nb.session("s1").config["lab"], "paths": [a.path for a in nb.artifacts()],
                "folder": job.folder, "log": job.log_path, "args": job.resources["args"], "result": job.result,
                "rationale": nb.decisions(kind="plan")[0].rationale}


def _expected(lab: Path, old: Path) -> dict:
    return {"config": {"feedback": str(lab / "feedback.jsonl"), "base": "/models/team-base"},
            "paths": [str(lab / "runs/s1/sft-1"), "/models/team-base", f"{old}2/data/x.jsonl"],
            "folder": str(lab / "jobs/k1-1"), "log": str(lab / "jobs/k1-1/1_0_log.err"),
            "args": {"output_dir": str(lab / "runs/s1/sft-1"), "model_path": "/models/team-base"},
            "result": {"model_dir": str(lab / "runs/s1/sft-1/model")}, "rationale": f"bundle at {lab}/bundles/b1 checked"}


def _stored(db: Path, sql: str) -> list:
    conn = sqlite3.connect(db)
    try:
        return [r[0] for r in conn.execute(sql)]
    finally:
        conn.close()


def test_the_notebook_stores_paths_into_the_lab_relative_and_reads_them_where_the_lab_is(tmp_path):
    old, new = tmp_path / "lab", tmp_path / "elsewhere" / "moved"
    old.mkdir()
    _recorded(old)
    db = old / "notebook.db"
    assert _stored(db, "SELECT path FROM artifact ORDER BY id") == ["<lab>/runs/s1/sft-1", "/models/team-base",
                                                                   f"{old}2/data/x.jsonl"]
    assert _stored(db, "SELECT folder FROM job") == ["<lab>/jobs/k1-1"]
    assert not any(str(old) + "/" in text for text in _stored(db, "SELECT payload || rationale FROM decision")
                   + _stored(db, "SELECT config FROM session") + _stored(db, "SELECT resources || result FROM job"))
    assert _read(old) == _expected(old, old)
    new.parent.mkdir()
    shutil.move(old, new)  # the chain holds (it hashed the stored form), and every path is read at the new place
    assert _read(new) == _expected(new, old)


def test_an_old_notebook_of_absolute_paths_reads_them_at_the_labs_new_place(tmp_path, monkeypatch):
    """Written before the rule: its paths point into the lab's recorded location. They are read at the lab's current
    place even while the old one still exists (a copy must never read its original's files)."""
    old, copy, moved = tmp_path / "lab", tmp_path / "copy", tmp_path / "moved"
    old.mkdir()
    with monkeypatch.context() as m:
        m.setattr(Place, "stored", lambda self, value: value)  # written as before the rule: every path as given
        _recorded(old)
    assert _stored(old / "notebook.db", "SELECT folder FROM job") == [str(old / "jobs/k1-1")]
    assert _read(old) == _expected(old, old)
    shutil.copytree(old, copy)
    assert _read(copy) == _expected(copy, old)
    shutil.move(old, moved)
    assert _read(moved) == _expected(moved, old)


def test_a_snapshot_reads_one_state_of_a_notebook_being_written(tmp_path):
    lab = tmp_path / "lab"
    lab.mkdir()
    _recorded(lab)
    with Notebook.open(lab / "notebook.db") as writer, \
            Notebook.open(lab / "notebook.db", readonly=True, snapshot=True) as snap, \
            Notebook.open(lab / "notebook.db", readonly=True) as live:
        writer.record_decision("s1", "plan", "later", {"text": "y"})
        assert len(snap.decisions(kind="plan")) == 1 and snap.verify().ok
        assert len(live.decisions(kind="plan")) == 2  # a plain reader sees the writer's commits as they land


def test_replay_of_a_session_being_written_is_refused_naming_the_writer(held):
    lab, proc = held
    with Notebook.open(lab / "notebook.db") as nb:
        nb.open_session("s1", lab=str(lab), budget_gpuh=1.0, reserve_gpuh=0.1, planner="playbook", executor="local",
                        config={})
    before = files(lab)
    out = run_cli([["replay", "s1", "--lab", str(lab)]])[0]
    assert_refused(out.returncode, out.stderr, "lab.lock", f"pid {proc.pid}", "run held-by-test", "being written")
    assert files(lab) == before


def test_probing_the_lock_writes_nothing_and_never_refuses_a_writer(tmp_path):
    lab = tmp_path / "lab"
    lab.mkdir()
    paths = LabPaths(root=lab)
    assert paths.writer_holding() is None and not paths.lock.exists()  # no lock file is created by asking
    proc = _holder(lab)
    try:
        assert f"pid {proc.pid}" in paths.writer_holding()
    finally:
        proc.kill()
        proc.wait()
    assert paths.writer_holding() is None  # a killed holder's stale note holds nothing
    # A probe's shared lock, held for a moment, is waited out by a writer, not taken for a session holding the lab.
    fd = os.open(paths.lock, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)
    threading.Timer(0.05, os.close, [fd]).start()
    with paths.writer("run s2"):
        pass
