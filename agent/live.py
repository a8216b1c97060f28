"""What a user sees while a session runs.

On a terminal: a live panel (rich) with the current step, a budget bar, running jobs with their last
logged step and loss, and the incumbent's key metrics, redrawn every second from the notebook (its
own read-only connection, in a background thread). Off a terminal, or with `--quiet`, plain log lines,
one per event, and one when a job attempt starts running and one when it ends (a failure with its class and the
job's own message, made safe): the same facts, greppable in CI logs.
"""

from __future__ import annotations

import sys
import threading
from datetime import UTC, datetime
from pathlib import Path
from typing import Protocol, TextIO

from rich.console import Console, Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from agent.summary import Summary
from core.display import shown
from core.redact import redact
from memory.notebook import JobRecord, Notebook
from tools.jobs.progress import last_metrics, metrics_path


class Reporter(Protocol):
    def observe(self, summary: Summary) -> None: ...

    def event(self, text: str) -> None: ...

    def close(self) -> None: ...


def job_line(job: JobRecord) -> str | None:
    """One line for a job attempt that started or ended (None while it waits in the queue): the ids the project
    minted, and a failure's class with its detail (the job's own message, stored made safe, shown escaped)."""
    name = f"job {job.kind} {job.key[:12]} attempt {job.attempt}"
    if job.state == "running":
        return f"{name}: running"
    if job.state == "completed":
        return f"{name}: completed ({job.gpu_hours or 0:.4g} GPU-h)"
    if job.state == "failed":
        return f"{name}: failed: {job.failure_class}: {shown(job.failure_detail or '')}"
    return None


class PlainLog:
    """One timestamped line per event (plan, act, outcome, refusal); given the notebook, also one line when a
    job attempt starts and one when it ends (a background thread reads the job rows): a long job is never
    silence, and a failed job says why."""

    def __init__(self, stream: TextIO | None = None, session: str = "", notebook: Path | None = None,
                 poll_s: float = 1.0):
        self.stream, self.session = stream or sys.stdout, session
        self._lock, self._stop, self._thread = threading.Lock(), threading.Event(), None
        if notebook is not None and notebook.exists():  # a session's notebook (none yet: events only)
            ready = threading.Event()
            self._thread = threading.Thread(target=self._watch, args=(notebook, poll_s, ready), daemon=True)
            self._thread.start()
            ready.wait(timeout=30)

    def observe(self, summary: Summary) -> None:
        return None

    def event(self, text: str) -> None:
        stamp = datetime.now(UTC).strftime("%H:%M:%S")
        with self._lock:
            print(f"{stamp} [{self.session}] {shown(redact(text))}", file=self.stream, flush=True)

    def _watch(self, notebook: Path, poll_s: float, ready: threading.Event) -> None:
        # Its own read-only connection, opened and used in this thread only (SQLite connections stay in theirs).
        nb = Notebook.open(notebook, readonly=True)
        try:
            shown_before = {(j.key, j.attempt): job_line(j) for j in nb.jobs(session=self.session)}  # not again
            shown_before |= {("wait", d.seq): d.rationale for d in nb.decisions(self.session, kind="wait")}
            ready.set()
            while not self._stop.wait(poll_s):
                self._poll_jobs(nb, shown_before)
            self._poll_jobs(nb, shown_before)  # the last jobs' ends, before the session's closing lines
        finally:
            ready.set()
            nb.close()

    def _poll_jobs(self, nb: Notebook, shown_before: dict[tuple[str, int], str | None]) -> None:
        for job in nb.jobs(session=self.session):
            line = job_line(job)
            if line is not None and shown_before.get((job.key, job.attempt)) != line:
                shown_before[(job.key, job.attempt)] = line
                self.event(line)
        for d in nb.decisions(self.session, kind="wait"):  # a job pending past the lab's bound (the launcher's)
            if ("wait", d.seq) not in shown_before:
                shown_before[("wait", d.seq)] = d.rationale
                self.event(f"job {d.payload.kind} {d.payload.key[:12]} attempt {d.payload.attempt}: {d.rationale}")

    def close(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=10)
            self._thread = None


class Silent:
    """Reports nothing (replay prints its own comparison)."""

    def observe(self, summary: Summary) -> None:
        return None

    def event(self, text: str) -> None:
        return None

    def close(self) -> None:
        return None


def _incumbent_line(s: Summary) -> str:
    cp = s.checkpoint(s.incumbent) if s.incumbent is not None else None
    if cp is None:
        return "incumbent: none yet"
    metrics = ", ".join(f"{suite}/{m}={v:.3f}" for suite, ms in cp.metrics.items() for m, v in ms.items()
                        if not m.startswith("n_"))
    return f"incumbent {cp.name}: {metrics or 'not evaluated yet'}"


class LivePanel:
    """The rich live view; `close()` stops its refresh thread and leaves the last frame on screen."""

    def __init__(self, notebook: Path, session: str, console: Console | None = None):
        self.notebook, self.session = notebook, session
        self.console = console or Console(stderr=True)
        self.step, self.summary = "starting", None
        self.last_failure, self.opened_at = "", datetime.now(UTC).isoformat(timespec="microseconds")
        self._stop = threading.Event()
        self._live = Live(self._frame([]), console=self.console, refresh_per_second=2, transient=False)
        self._live.start()
        self._thread = threading.Thread(target=self._refresh, daemon=True)
        self._thread.start()

    def observe(self, summary: Summary) -> None:
        self.summary = summary

    def event(self, text: str) -> None:
        self.step = redact(text)

    def _refresh(self) -> None:
        nb = Notebook.open(self.notebook, readonly=True)
        try:
            while not self._stop.wait(1.0):
                jobs = nb.jobs(session=self.session)
                running = [j for j in jobs if j.state in ("pending", "running")]
                failed = [j for j in jobs if j.state == "failed" and j.ended_at and j.ended_at >= self.opened_at]
                if failed:
                    self.last_failure = f"last failure: {job_line(max(failed, key=lambda j: j.ended_at or ''))}"
                self._live.update(self._frame(running))
        finally:
            nb.close()

    def _frame(self, running) -> Group:
        parts = [Text(f"session {self.session}: {self.step}", overflow="ellipsis", no_wrap=True)]
        s = self.summary
        if s is not None:
            b = s.budget
            used = b.spent_gpuh + b.reserved_gpuh
            parts += [Text(f"budget {used:.3f} / {b.budget_gpuh:.3f} GPU-h (reserve {b.reserve_gpuh:.3f})"),
                      ProgressBar(total=max(b.budget_gpuh, 1e-9), completed=min(used, b.budget_gpuh), width=50),
                      Text(_incumbent_line(s))]
        table = Table("job", "state", "last step", box=None)
        for j in running:
            table.add_row(f"{j.kind} {j.key[:10]}", j.state, last_metrics(metrics_path(j)))
        parts.append(table)
        if self.last_failure:
            parts.append(Text(self.last_failure, overflow="ellipsis", no_wrap=True))
        return Group(*parts)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._live.stop()


def reporter(notebook: Path, session: str, quiet: bool) -> PlainLog | LivePanel:
    """The live panel on a terminal, plain lines otherwise (or when quiet)."""
    if quiet or not sys.stderr.isatty():
        return PlainLog(session=session, notebook=notebook)
    return LivePanel(notebook, session)
