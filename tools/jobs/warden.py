"""The warden of one local job process: its memory bound, its end after SIGTERM, and its end once orphaned past
its time limit (issue 44, item 1). Started by the job wrapper (tools/jobs/jobrun.py) beside each local task, as a
separate interpreter running this file alone (standard library only, no project imports: it starts in
milliseconds and holds no lock of the job's).

Why a process of its own: a bound the job enforces on itself runs on the job's own Python threads, which a long C
call holds off (a `b"x" * 10**11` holds the GIL until it returns or the machine swaps). Why a watch on the
resident set and not a resource limit: RLIMIT_AS counts address space, which CUDA reserves by the hundreds of GiB
for unified addressing, so any GPU job fails under a limit near the host's memory; RLIMIT_DATA counts private
writable mappings, which CUDA's driver and pinned buffers also grow, and a limit failing one malloc inside a
library surfaces as an arbitrary error, not as a reason. The resident set of the job and its children is what the
host loses; its bound is [executor.resources.<kind>] mem_gb, else a share of the host's memory (jobrun.py).

What it does, every POLL_S, until the job is gone:

- the resident memory of the job and its descendants over the bound: the job is stopped, its end recorded in the
  events file (class oom, with the bound and what was reached), then killed with its descendants;
- a SIGTERM reached the job (its signal handler writes the signal's number to the warden's pipe, from C, at once,
  even while the job's main thread is busy): after GRACE_S the job is killed if it has not ended;
- the job's controller or the agent above it is gone (killed with its time limit, or by a person) and the run has
  passed its time limit: it is ended (SIGTERM, GRACE_S, SIGKILL) and its end recorded as a timeout.

    python tools/jobs/warden.py PID BOUND_BYTES STARTED_EPOCH TIME_LIMIT_S GRACE_S EVENTS_FILE WAKE_FD WATCHED...
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import time
from pathlib import Path

POLL_S = 0.2
PAGE = os.sysconf("SC_PAGE_SIZE")
GIB = 1024**3


def _stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat's fields after the command name (state first), or None when the process is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else fields


def alive(pid: int, started: str | None = None) -> bool:
    """Whether `pid` runs (not a zombie), and, with `started` (its /proc start time), is still that process."""
    fields = _stat(pid)
    return fields is not None and (started is None or fields[19] == started)


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it, from /proc's children lists; the warden itself (the job's child) left out."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        if current == os.getpid():
            continue
        found.append(current)
        try:
            tasks = list(Path(f"/proc/{current}/task").iterdir())
            todo += [int(c) for t in tasks for c in (t / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError, NotADirectoryError):
            continue
    return found


def resident_bytes(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            continue
    return total


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            continue


def _record_end(events: Path, failure_class: str, detail: str) -> None:
    """The run's end event, as the job wrapper writes it, unless the run has already ended itself."""
    try:
        lines = [json.loads(x) for x in events.read_text().splitlines() if x.strip()]
    except (OSError, ValueError):
        lines = []
    if not lines or lines[-1].get("event") != "start":
        return
    with open(events, "a") as f:
        f.write(json.dumps({"event": "end", "t": time.time(), "ok": False, "error": "JobBound",
                            "failure": {"failure_class": failure_class, "detail": detail, "message": ""},
                            "message": detail}) + "\n")


def _end(pid: int, grace_s: float) -> None:
    """SIGTERM to the job and its descendants, SIGKILL to what is left after `grace_s`."""
    _signal_all(descendants(pid), signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(POLL_S / 4)
    _signal_all(descendants(pid), signal.SIGKILL)


def watch(pid: int, bound: int, started: float, time_limit_s: float, grace_s: float, events: Path, wake_fd: int,
          watched: list[tuple[int, str]]) -> str:
    """Watches job `pid` until it is gone; returns what ended it ('gone', 'memory', 'sigterm', 'orphaned')."""
    term_at = None
    while alive(pid):
        if wake_fd >= 0:
            ready = select.select([wake_fd], [], [], POLL_S)[0]
        else:
            ready = []
            time.sleep(POLL_S)
        if ready:
            data = os.read(wake_fd, 64)
            if not data:  # the job closed its end: it is exiting
                wake_fd = -1
            elif signal.SIGTERM in data and term_at is None:
                term_at = time.monotonic()
        tree = descendants(pid)
        used = resident_bytes(tree)
        if used > bound:
            _signal_all(tree, signal.SIGSTOP)  # no more writes of its own while its end is recorded
            _record_end(events, "oom", f"host memory: the job's resident memory reached {used / GIB:.2f} GiB, past "
                                       f"its bound of {bound / GIB:.2f} GiB ([executor.resources.<kind>] mem_gb, else "
                                       "a share of the host's memory); ended by its warden")
            _signal_all(descendants(pid), signal.SIGKILL)
            return "memory"
        if term_at is not None and time.monotonic() - term_at > grace_s:
            _record_end(events, "preempted", f"preempted: SIGTERM from outside; the job had not ended {grace_s:g} s "
                                             "later and was killed by its warden")
            _signal_all(descendants(pid), signal.SIGKILL)
            return "sigterm"
        orphaned = not all(alive(p, s) for p, s in watched)
        if orphaned and time.time() - started > time_limit_s:
            _record_end(events, "timeout", f"timeout: the agent that started it is gone and the run passed its time "
                                           f"limit of {time_limit_s:.0f} s; ended by its warden")
            _end(pid, grace_s)
            return "orphaned"
    return "gone"


def main(argv: list[str]) -> int:
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # the job's group signalled: outlive the job, briefly
        signal.signal(sig, signal.SIG_IGN)
    pid, bound, started, limit, grace, events, wake = argv[:7]
    watched = [(int(p), s) for p, _, s in (w.partition(":") for w in argv[7:])]
    watch(int(pid), int(bound), float(started), float(limit), float(grace), Path(events), int(wake), watched)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
