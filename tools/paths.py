"""The one lab paths object: every file and directory a session writes, derived from the lab root.

Tool arguments never carry paths (they speak in artifact ids and intent); a tool asks `LabPaths`
where its outputs go, and names them by content so that the same step always lands in the same
place (which is what makes a job's idempotency key stable across resume and replay).

    paths = LabPaths(root=Path("lab"))
    paths.run("sft-3f2a9c01")        # lab/runs/sft-3f2a9c01
    LabPaths(root=Path("lab"), session="s1").run("sft-3f2a9c01")   # lab/runs/s1/sft-3f2a9c01
    with paths.writer("run s1"):     # the lab's one writer (lab.lock); a second is refused
        ...
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import stat
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from core.display import shown
from memory.place import LAB_MARK, rewrite, root_pattern

LOCK_FILE = "lab.lock"
# The lab's own entries that sessions write into: each must be the lab's own (a regular file or a directory in the
# lab), never a symbolic link that leads a session's writes out of it (SQLite's write-ahead log and shared-memory
# files included: they are written beside the name opened). lab.lock is checked as it is opened.
OWN_ENTRIES = ("jobs", "runs", "data", "evals", "merges", "bundles", "splits", "notebook.db", "notebook.db-wal",
               "notebook.db-shm", "graph.sqlite", "graph.sqlite-wal", "graph.sqlite-shm")


class LabLockError(ValueError):
    """The lab cannot be locked for writing (another process holds it: the message names it); exit 2."""


class LabPaths(BaseModel):
    """Paths of one lab directory (submitit's JobPaths, for a whole lab)."""

    model_config = ConfigDict(frozen=True)
    root: Path = Field(description="The lab directory (holds lab.toml, the notebook and all outputs).")
    session: str | None = Field(None, description="The session whose outputs these are: a lab holds many sessions, "
                                "and each names its datasets, runs, evals and merges apart (lab/runs/<session>/...), so "
                                "that one session's content-named output never meets another's (a judgment file is "
                                "written once; a trainer would resume from another session's state). None: the lab's "
                                "own top-level directories.")

    @property
    def notebook(self) -> Path:
        return self.root / "notebook.db"

    @property
    def graph_checkpoints(self) -> Path:
        """LangGraph's SQLite checkpointer file: its own file, never the notebook."""
        return self.root / "graph.sqlite"

    @property
    def lock(self) -> Path:
        """The writer lock: flock'ed by the one process that writes the lab, with who it is inside."""
        return self.root / LOCK_FILE

    @property
    def jobs(self) -> Path:
        return self.root / "jobs"

    @property
    def splits(self) -> Path:
        return self.root / "splits"

    def _outputs(self, kind: str) -> Path:
        return self.root / kind if self.session is None else self.root / kind / self.session

    def dataset(self, name: str) -> Path:
        return self._outputs("data") / f"{name}.jsonl"

    def run(self, name: str) -> Path:
        return self._outputs("runs") / name

    def evaluation(self, name: str) -> Path:
        return self._outputs("evals") / name

    def merged(self, name: str) -> Path:
        return self._outputs("merges") / name

    def bundle(self, name: str) -> Path:
        return self.root / "bundles" / name

    def spellings(self, *recorded: str) -> tuple[str, ...]:
        """Every way this lab's root may be spelled in a recorded path: as given, absolute, resolved
        (through symbolic links), and the spellings a session recorded (`recorded`, e.g. its `lab`)."""
        names = {str(self.root), str(self.root.absolute()), str(self.root.resolve()), *recorded}
        return tuple(sorted((n for n in names if n), key=len, reverse=True))  # longest first: 'lab2' before 'lab'

    def writer_holding(self) -> str | None:
        """Who holds the lab's writer lock now ('pid 12 on host h (resume s1, since ...)'), None when nobody does.
        Writes nothing: the lock file is opened read-only, never created, and probed with a shared flock that is
        let go at once (a writer meeting the probe retries: `_acquire`)."""
        try:
            fd = os.open(self.lock, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:  # no lock file (nobody has written since a clean release), or not ours to open
            return None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return _holder(fd) or "another process"
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        finally:
            os.close(fd)

    def inside(self, path: str | Path) -> bool:
        """Whether `path` (absolute, or relative to the lab) resolves inside the lab directory."""
        p = Path(path)
        resolved = (p if p.is_absolute() else self.root / p).resolve()
        return resolved.is_relative_to(self.root.resolve())

    @contextmanager
    def writer(self, command: str) -> Iterator[None]:
        """Hold the lab's writer lock while the block runs; raise LabLockError naming the holder if another has it.

        An flock, not a pid file: the kernel drops it when its holder dies (SIGKILL included), so a lock
        left by a killed process never blocks anyone; the note it leaves behind (a clean release removes
        the file) is reported as stale. The descriptor is close-on-exec, so the jobs a session starts
        (which may outlive it) never hold the lab."""
        if os.path.lexists(self.root) and not self.root.is_dir():
            raise LabLockError(f"{shown(str(self.root))}: not a directory (a lab is a directory)")
        self.check_own_entries()
        self.root.mkdir(parents=True, exist_ok=True)
        fd = self._acquire()
        try:
            previous = _holder(fd)
            if previous is not None:
                print(f"note: {self.lock}: stale lock of {previous} (that process is gone); taking the lab over",
                      file=sys.stderr)
            note = {"pid": os.getpid(), "host": socket.gethostname(), "command": command,
                    "since": datetime.now(UTC).isoformat(timespec="seconds")}
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(note) + "\n").encode(), 0)
            try:
                yield
            finally:
                self.lock.unlink(missing_ok=True)  # still held: nobody can have locked the file being removed
        finally:
            os.close(fd)  # closing drops the flock

    def check_own_entries(self) -> None:
        """LabLockError naming the first of the lab's own entries (OWN_ENTRIES, and the session's directories under
        them) that is a symbolic link: a session writing through it would write outside the lab (another lab's runs,
        a file the link names overwritten)."""
        names = [*OWN_ENTRIES, *(f"{d}/{self.session}" for d in ("runs", "data", "evals", "merges") if self.session)]
        for name in names:
            entry = self.root / name
            if entry.is_symlink():
                raise LabLockError(f"{shown(str(entry))}: a symbolic link; the lab's own entries are never followed out "
                                   "of the lab: remove it (it is created fresh) or put the real directory there")

    def _acquire(self) -> int:
        """The locked descriptor of the lock file. A file a releasing holder removed between our open and
        our flock is not the lock any more: open the path again. The lock is truncated and written: it must be the
        lab's own regular file (no symbolic link, nothing else, no second name), never a file elsewhere."""
        while True:
            try:
                fd = os.open(self.lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
            except OSError as err:
                what = "a symbolic link" if self.lock.is_symlink() else f"cannot be opened ({err.strerror})"
                raise LabLockError(f"{shown(str(self.lock))}: {what}; the lab's lock must be a regular file of the lab: "
                                   "remove it (it is created fresh)") from None
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                os.close(fd)
                what = "not a regular file" if not stat.S_ISREG(st.st_mode) else f"a file with {st.st_nlink} names (a hard link)"
                raise LabLockError(f"{shown(str(self.lock))}: {what}; the lab's lock must be a regular file of the lab: "
                                   "remove it (it is created fresh)")
            try:
                _lock_or_wait_out_a_probe(fd)
            except BlockingIOError:
                holder = _holder(fd) or "another process"
                os.close(fd)
                raise LabLockError(f"{self.lock}: the lab is in use by {holder}; one writer at a time (wait for "
                                   "it to end, or use another --lab)") from None
            try:
                if os.fstat(fd).st_ino == os.stat(self.lock).st_ino:
                    return fd
            except FileNotFoundError:
                pass
            os.close(fd)


def portable(value: Any, roots: Sequence[str]) -> Any:
    """`value` (JSON) with every path inside one of `roots` rewritten relative to the lab ("<lab>/runs/x"): the
    notebook's own rule (memory/place.py), which stores records in this form.

    Job keys and the resume check compare this form, so neither depends on how the lab was spelled
    (relative or absolute, through a symbolic link) nor on where it lies (copied, moved)."""
    return rewrite(value, root_pattern(tuple(roots)), LAB_MARK)


def _lock_or_wait_out_a_probe(fd: int) -> None:
    """flock `fd` exclusively; BlockingIOError when another holds it. A reader's probe (`writer_holding`) holds a
    shared lock for microseconds: a few short retries tell it from a writer, which holds the lock for a session."""
    for _ in range(20):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            time.sleep(0.01)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


def _holder(fd: int) -> str | None:
    """Who the lock file's note names ('pid 12 on host h (run s1, since ...)'), None when it names nobody."""
    raw = os.pread(fd, 4096, 0)
    try:
        note = json.loads(raw)
        # Shown escaped and cut: the file is in the lab, and anyone who can write there can write it.
        said = f"{note['host']} ({note['command']}, since {note['since']})"
        return f"pid {int(note['pid'])} on {shown(said, limit=200)}"
    except (ValueError, KeyError, TypeError):
        return None
