"""What a user sees while a session runs.

On a terminal: a live panel (rich) with the current step, a budget bar, running jobs with their last
logged step and loss, and the incumbent's key metrics, redrawn every second from the notebook (its
own read-only connection, in a background thread). Off a terminal, or with `--quiet`, plain log lines,
one per event: the same facts, greppable in CI logs.
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
from core.redact import redact
from memory.notebook import Notebook
from tools.jobs.progress import last_metrics, metrics_path


class Reporter(Protocol):
    def observe(self, summary: Summary) -> None: ...

    def event(self, text: str) -> None: ...

    def close(self) -> None: ...


class PlainLog:
    """One timestamped line per event (plan, act, outcome, refusal)."""

    def __init__(self, stream: TextIO | None = None, session: str = ""):
        self.stream, self.session = stream or sys.stdout, session

    def observe(self, summary: Summary) -> None:
        return None

    def event(self, text: str) -> None:
        stamp = datetime.now(UTC).strftime("%H:%M:%S")
        print(f"{stamp} [{self.session}] {redact(text)}", file=self.stream, flush=True)

    def close(self) -> None:
        return None


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
                running = [j for j in nb.jobs(session=self.session) if j.state in ("pending", "running")]
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
        return Group(*parts)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._live.stop()


def reporter(notebook: Path, session: str, quiet: bool) -> PlainLog | LivePanel:
    """The live panel on a terminal, plain lines otherwise (or when quiet)."""
    if quiet or not sys.stderr.isatty():
        return PlainLog(session=session)
    return LivePanel(notebook, session)
