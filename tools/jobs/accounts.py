"""A session's jobs accounted by kind: forecast against actual device-seconds, and where their wall went.

    accounts = session_accounts(nb, "s1")
    accounts.kinds["eval"].ratio          # actual / forecast device-seconds over the session's eval attempts
    accounts.wall.startup_s               # start-up seconds summed over every job that split its wall

The forecast is what the launcher recorded on each attempt's row before it ran (resources["forecast"], the
admission forecast or, for a job admitted on a declared cost, the launcher's own); the actual is the settled run's
device-seconds. The wall is each result's split (core/wall.py); a job whose result has none (data jobs) is counted
whole under `unsplit_s`.
"""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field

from core.wall import wall_of
from memory.notebook import JobRecord, Notebook


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class KindAccount(_Frozen):
    """The settled attempts of one job kind."""

    jobs: int = Field(description="Settled attempts.")
    forecast_device_s: float = Field(description="Device-seconds forecast before they ran, summed.")
    actual_device_s: float = Field(description="Device-seconds they were settled at, summed.")
    gpu_hours: float = Field(description="GPU-hours charged, summed.")

    @property
    def ratio(self) -> float | None:
        """actual / forecast; None when nothing was forecast (a job that holds no device, forecast and charged 0)."""
        return self.actual_device_s / self.forecast_device_s if self.forecast_device_s > 0 else None


class WallSums(_Frozen):
    """Where the session's jobs' wall went, summed over its settled attempts."""

    startup_s: float = Field(0.0, description="Process, imports, CUDA initialisation, model loads, compilation.")
    work_s: float = Field(0.0, description="Training steps, generation and scoring, merging.")
    write_s: float = Field(0.0, description="Checkpoints, records and results written after the work.")
    unsplit_s: float = Field(0.0, description="Whole wall of the jobs whose results do not split it (data jobs).")
    parts: dict[str, float] = Field(default_factory=dict, description="Start-up's parts, summed where timed.")


class SessionAccounts(_Frozen):
    kinds: dict[str, KindAccount] = Field(description="By launcher kind (sft, eval, reference, merge, ...).")
    wall: WallSums = Field(description="The jobs' wall, summed.")

    def ratios(self) -> dict[str, float]:
        """actual / forecast by kind, for the kinds that were forecast a cost."""
        return {k: round(r, 3) for k, a in self.kinds.items() if (r := a.ratio) is not None}


def forecast_device_s(job: JobRecord) -> float | None:
    """The device-seconds recorded as the attempt's forecast (None on rows from before forecasts were recorded)."""
    found = job.resources.get("forecast")
    return float(found["device_s"]) if found else None


def elapsed_s(job: JobRecord) -> float:
    if not (job.started_at and job.ended_at):
        return 0.0
    return max(0.0, datetime.fromisoformat(job.ended_at).timestamp()
               - datetime.fromisoformat(job.started_at).timestamp())


def session_accounts(nb: Notebook, session: str) -> SessionAccounts:
    """Every settled attempt of the session, by kind; attempts without a recorded forecast are left out of the
    ratios (and counted in the wall sums all the same)."""
    sums: dict[str, list[float]] = {}
    wall = {"startup_s": 0.0, "work_s": 0.0, "write_s": 0.0, "unsplit_s": 0.0}
    parts: dict[str, float] = {}
    for job in nb.jobs(session=session):
        if job.device_seconds is None:
            continue
        forecast = forecast_device_s(job)
        if forecast is not None:
            row = sums.setdefault(job.kind, [0, 0.0, 0.0, 0.0])
            row[0] += 1
            row[1] += forecast
            row[2] += job.device_seconds
            row[3] += job.gpu_hours or 0.0
        split = wall_of(job.result)
        if split is None:
            wall["unsplit_s"] += elapsed_s(job)
            continue
        wall["startup_s"] += split.startup_s
        wall["work_s"] += split.work_s
        wall["write_s"] += split.write_s
        for name, seconds in split.parts.items():
            parts[name] = parts.get(name, 0.0) + seconds
    kinds = {k: KindAccount(jobs=int(n), forecast_device_s=round(f, 3), actual_device_s=round(a, 3),
                            gpu_hours=round(g, 6)) for k, (n, f, a, g) in sorted(sums.items())}
    return SessionAccounts(kinds=kinds, wall=WallSums(**{k: round(v, 3) for k, v in wall.items()},
                                                      parts={k: round(v, 3) for k, v in sorted(parts.items())}))


def accounts_line(accounts: SessionAccounts) -> str:
    """One line for a person: actual/forecast by kind, and the wall's split."""
    ratios = ", ".join(f"{k} {r:.2f}" for k, r in accounts.ratios().items()) or "none forecast"
    w = accounts.wall
    return (f"jobs: actual/forecast device-seconds by kind: {ratios}; wall: start-up {w.startup_s:.0f} s, work "
            f"{w.work_s:.0f} s, write-out {w.write_s:.0f} s, unsplit {w.unsplit_s:.0f} s")
