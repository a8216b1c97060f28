"""Settlement: a run that is over is charged what it held and its outcome read back, a result or a classified
failure (DESIGN.md invariants 5 and 6).

    cost(backend, run)          # its row's times, device-seconds and GPU-hours (as the backend charges them)
    outcome(backend, resources, folder, job_id, completed=True)     # rank 0's result, or the first error's text
    failure_of(run, text, RunPaths(folder, job_id), resources)      # the failure's class, detail and message

A run is charged its seconds times its devices: Slurm `sacct` elapsed times allocated GPUs (a CPU job holds none),
or local wall time times devices (a local CPU-only job counts one device per process); the lab's declared simulated
cost, if any, is the backend's to apply (`Backend.charge`).
"""

from __future__ import annotations

import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from submitit.core.utils import FailedJobError, UncompletedJobError

from core.display import shown
from core.redact import redact
from memory.notebook import now
from tools.jobs.failures import MESSAGE_LIMIT, Failure, classify, message_of
from tools.jobs.jobrun import RunPaths, near_time_limit, read_events
from tools.jobs.resources import Backend, Resources, Run

# States after which the last run will not change any more (sacct's State column, first word; the
# local backend reports the same names). REQUEUED is not among them: the job runs again.
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "PREEMPTED", "NODE_FAIL", "BOOT_FAIL",
                "OUT_OF_MEMORY", "DEADLINE", "REVOKED"}


def cost(backend: Backend, run: Run) -> dict[str, Any]:
    """A run's times and what it is charged, as its attempt row records them."""
    charge = backend.charge(run.elapsed_s * run.devices)
    return {"started_at": iso(run.started), "ended_at": iso(run.ended) or now(),
            "gpu_hours": charge.gpu_hours, "device_seconds": charge.device_seconds, "charge": charge.charge}


def outcome(backend: Backend, resources: Resources, folder: Path, job_id: str, completed: bool) -> BaseModel | str:
    """Rank 0's result, or the error text of the first task without one (its pickled trace, else
    its stderr tail): a job of several processes succeeds only when every rank returned."""
    results = []
    for task in range(backend.ranks(resources)):
        sub = backend.job(folder, job_id, task)
        # A completed run may still be writing its pickle on a slow file system: submitit waits for it.
        if not (completed or sub.paths.result_pickle.exists()):
            return _tail(sub.paths.stderr)
        try:
            results.append(sub.result())
        except FailedJobError as err:
            return str(err)
        except UncompletedJobError:
            return _tail(sub.paths.stderr)
    return results[0]


def failure_of(run: Run, text: str, paths: RunPaths, resources: Resources) -> Failure:
    """The failure of a run that ended without a result (`text`: what `outcome` read instead), classified
    (tools/jobs/failures.py) with the job's own words beside its class, for a person (the CLI, the notebook, the
    report): never the planner's."""
    failure = classify(run.state, run.exit_code, text, raised=_raised(paths))
    failure = failure.model_copy(update={"message": _raised_message(paths) or message_of(text)})
    if failure.failure_class == "preempted" and near_time_limit(
            run.elapsed_s, resources.time_limit_min * 60, resources.signal_delay_s):
        # A job that handles the signal itself (trainers/loop.py) reports any signal as a preemption.
        failure = failure.model_copy(update={"failure_class": "timeout"})
    return failure


def _raised(paths: RunPaths) -> tuple[str, Failure | None] | None:
    """What the job wrapper recorded of the last run's own exception (tools/jobs/jobrun.py): its type and
    class; None when the run ended without one (killed, or a rank other than 0 failed)."""
    events = read_events(paths.events)
    last = events[-1] if events else {}
    if last.get("event") != "end" or last.get("ok") is not False or not isinstance(last.get("error"), str):
        return None
    return last["error"], None if last.get("failure") is None else Failure.model_validate(last["failure"])


def _raised_message(paths: RunPaths) -> str:
    """The job's own error message as its wrapper recorded it (already safe there), made safe again here: this
    process holds the lab's keys, which a worker may not; '' when the run recorded none."""
    events = read_events(paths.events)
    message = events[-1].get("message") if events and events[-1].get("event") == "end" else None
    return shown(redact(message))[:2 * MESSAGE_LIMIT] if isinstance(message, str) else ""


def _tail(path: Path, chars: int = 4000) -> str:
    if not path.exists():
        return ""
    with open(path, "rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - chars))
        return f.read().decode(errors="replace")


def iso(t: float | None) -> str | None:
    return None if t is None else datetime.fromtimestamp(t, UTC).isoformat(timespec="microseconds")
