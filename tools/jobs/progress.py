"""Live progress while the agent waits on jobs: one line per job (kind, state, elapsed, settled cost
with its measured device-seconds and whether the charge is simulated, the last logged step/loss from
the run's metrics.jsonl) and the session budget spent/left, drawn with rich.
Off a terminal (CI, logs piped to a file) it draws nothing; the notebook has the record anyway.

    wait_all([job_a, job_b], notebook, "s1")        # console defaults to stderr; then job_a.result()
"""

from __future__ import annotations

import json
import os
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from memory.notebook import JobRecord, Notebook
from tools.jobs.launcher import Job


def metrics_path(record: JobRecord) -> Path | None:
    """A job's metrics.jsonl: declared in its resources, else `<output_dir>/metrics.jsonl` of its config."""
    if record.resources.get("metrics_file"):
        return Path(record.resources["metrics_file"])
    output_dir = record.resources.get("args", {}).get("output_dir")
    return Path(output_dir) / "metrics.jsonl" if output_dir else None


def last_metrics(path: Path | None) -> str:
    """'step 3/10 loss 0.3333' from the last line of a metrics.jsonl, or '' when there is none."""
    if path is None or not path.exists() or path.stat().st_size == 0:
        return ""
    with open(path, "rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
        tail = f.read().decode(errors="replace")
    # Only complete lines: the job may be halfway through appending the next one.
    lines = tail[: tail.rfind("\n") + 1].strip().splitlines()
    if not lines:
        return ""
    record: dict[str, Any] = json.loads(lines[-1])
    step = f"step {record['step']}" + (f"/{record['of']}" if "of" in record else "") if "step" in record else ""
    loss = f"loss {record['loss']:.4g}" if isinstance(record.get("loss"), int | float) else ""
    return " ".join(part for part in (step, loss) if part)


def _elapsed(started_at: str | None, ended_at: str | None) -> str:
    if started_at is None:
        return "-"
    end = datetime.fromisoformat(ended_at) if ended_at else datetime.now(UTC)
    seconds = int((end - datetime.fromisoformat(started_at)).total_seconds())
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def render(jobs: list[Job[Any]], notebook: Notebook, session: str) -> Table:
    """The table drawn on each refresh (reads the notebook, never polls the executor)."""
    ledger = notebook.ledger(session)
    table = Table(title=f"budget: {ledger.spent_gpuh:.3f} GPU-h spent, {ledger.reserved_gpuh:.3f} reserved, "
                        f"{ledger.left_gpuh(nomination=True):.3f} left of {ledger.budget_gpuh:g}", title_justify="left")
    for column in ("job", "attempt", "state", "elapsed", "cost", "progress"):
        table.add_column(column)
    for job in jobs:
        record = job.record
        state = record.state if record.failure_class is None else f"{record.state} ({record.failure_class})"
        table.add_row(f"{record.kind} {job.key[:8]}", str(record.attempt), state,
                      _elapsed(record.started_at, record.ended_at), _cost(record), last_metrics(metrics_path(record)))
    return table


def _cost(record: JobRecord) -> str:
    """'0.0042 GPU-h (15.1 device-s, simulated)' once the attempt is settled, else '-'."""
    if record.gpu_hours is None:
        return "-"
    if record.device_seconds is None:  # settled before rows kept device-seconds
        return f"{record.gpu_hours:.4g} GPU-h"
    label = ", simulated" if record.charge == "simulated" else ""
    return f"{record.gpu_hours:.4g} GPU-h ({record.device_seconds:.1f} device-s{label})"


def wait_all(jobs: list[Job[Any]], notebook: Notebook, session: str, console: Console | None = None,
             refresh_s: float = 0.5) -> None:
    """Poll every job until all are done, drawing the live table when `console` is a terminal."""
    console = console or Console(stderr=True)
    if not console.is_terminal:
        while not all([job.done() for job in jobs]):
            time.sleep(refresh_s)
        return
    with Live(render(jobs, notebook, session), console=console, auto_refresh=False) as live:
        while not all([job.done() for job in jobs]):
            live.update(render(jobs, notebook, session), refresh=True)
            time.sleep(refresh_s)
        live.update(render(jobs, notebook, session), refresh=True)
