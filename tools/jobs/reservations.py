"""Reservations: what a job is forecast to cost and whether it is admitted, before anything is submitted
(DESIGN.md invariant 5).

    reservations = Reservations(nb, "s1", backend, gpu_memory_gib=80)
    reservations.forecast("sft", resources)          # Forecast(gpuh=..., source="throughput", device_s=...)
    payload = reservations.admit(key, "sft", resources)   # the launch payload, or a `refuse` decision and BudgetRefused

The forecast is the declared estimate, else one run's seconds measured on this lab's earlier runs (their start-up and
write-out apart from their work: tools/jobs/forecast.py), else the throughput of earlier jobs of the same kind and
model, else the job's tokens on its model, else its time limit on its devices; never above one run's bound. It plus
what is spent and reserved plus the session's reserve must fit the budget (the ledger's `admission`: memory/records.py).
A training job is also admitted by its memory estimate per GPU (trainers/memory.py), and a Slurm job by what its
partition's nodes can hold. The checkpoint signal's lead time is derived from the saves earlier jobs measured.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, Field

from core.wall import wall_of
from memory.notebook import Notebook
from memory.records import BudgetRefusal, LaunchPayload, MemoryRefusal, PartitionRefusal
from tools.jobs import forecast
from tools.jobs.forecast import fitting_alternatives
from tools.jobs.resources import Backend, Resources
from tools.session import ledger as session_ledger

# The signal lead time: the longest measured save times this factor, never under the floor (Slurm's
# own signal timing is only good to about a minute, and a step must end before the save begins).
SIGNAL_LEAD_FACTOR = 2.0
SIGNAL_LEAD_FLOOR_S = 30
GIB = 1024**3


class BudgetRefused(Exception):
    """The job's forecast does not fit the session budget; the refusal is a recorded decision."""


class MemoryRefused(BudgetRefused):
    """A training job's memory estimate exceeds the GPUs it asks for; the refusal is a recorded decision.

    A kind of BudgetRefused (GPU memory is a budget too), so every caller that turns an admission
    refusal into data (tools.context.invoke) handles it the same way."""


class PartitionRefused(BudgetRefused):
    """No node of the job's Slurm partition has what the job asks for; the refusal is a recorded decision (a kind of
    BudgetRefused: the partition's nodes are a budget too, and callers turn refusals into data alike)."""


def signal_lead_s(measured_save_s: float | None, time_limit_s: float) -> int:
    """Seconds of warning before the time limit for a job whose longest measured save took `measured_save_s`.

    SIGNAL_LEAD_FACTOR times the save, at least SIGNAL_LEAD_FLOOR_S; capped at half the time limit (a job
    whose save needs more than that needs a longer limit: each run would spend half of it saving)."""
    lead = SIGNAL_LEAD_FLOOR_S
    if measured_save_s:
        lead = max(lead, math.ceil(SIGNAL_LEAD_FACTOR * measured_save_s))
    return max(1, min(lead, int(time_limit_s // 2)))


def _max_save_s(result: dict[str, Any] | None) -> float:
    """The longest resume save a completed trainer job measured (TrainResult.metrics, or an RFT run's train)."""
    train = (result or {}).get("train", result) or {}
    return float(train.get("metrics", {}).get("max_save_s", 0.0))


class Forecast(BaseModel):
    gpuh: float = Field(description="Forecast GPU-hours of the job, in the units the ledger charges.")
    source: Literal["declared", "throughput", "model", "time_limit"] = Field(description="Where the forecast came from.")
    device_s: float = Field(0.0, description="The same forecast in device-seconds (seconds held x devices), the unit "
                            "a settled run records (JobRecord.device_seconds).")



class Reservations:
    """The forecasts and admission checks of one session's jobs; the launcher asks it before every attempt."""

    def __init__(self, notebook: Notebook, session: str, backend: Backend, gpu_memory_gib: float | None = None):
        self.nb, self.session, self.backend = notebook, session, backend
        self.gpu_memory_gib = gpu_memory_gib  # one GPU's memory; None: training jobs are not admitted by memory

    def forecast(self, kind: str, resources: Resources) -> Forecast:
        """The job's cost: as declared; else one run's seconds from this lab's earlier runs, their start-up and
        write-out apart from their work (forecast.run_seconds); else its work units at the throughput of earlier jobs
        of its kind and model; else from its tokens and model; else its time limit on its devices. Never above one
        run's bound."""
        if resources.estimate_gpuh is not None:
            return self._forecast(resources.estimate_gpuh, "declared")
        bound = self.run_bound(resources)
        devices = self.backend.devices(resources)
        size = forecast.RunSize(kind=kind, model_job=resources.device is not None, units=resources.work_units,
                                tokens=resources.tokens, active_params=resources.active_params,
                                job_class=resources.job_class)
        seconds = forecast.run_seconds(size, self.measured_runs())
        if seconds is not None:
            made = self._forecast(self.backend.charge(seconds * devices).gpu_hours, "throughput")
            return min(made, bound, key=lambda f: f.gpuh)
        rate = self._throughput(kind, resources.model)
        if rate is not None and resources.work_units is not None:
            return self._forecast(resources.work_units / rate, "throughput")
        if resources.tokens is not None and resources.active_params is not None and resources.job_class is not None:
            # Nothing measured yet: the model's work at a declared MFU after a declared start-up (a first job's
            # forecast was its work alone, near zero, while its start-up alone took seconds).
            startup = self.backend.charge(forecast.DEFAULT_HARDWARE.startup_s(kind) * devices).gpu_hours
            work = self._model_forecast(resources)
            return min(self._forecast(startup + work.gpuh, "model"), bound, key=lambda f: f.gpuh)
        return bound

    def _forecast(self, gpuh: float, source: Literal["declared", "throughput", "model", "time_limit"]) -> Forecast:
        per_device_s = self.backend.charge(1.0).gpu_hours
        return Forecast(gpuh=gpuh, source=source, device_s=gpuh / per_device_s if per_device_s else 0.0)

    def measured_runs(self) -> list[forecast.MeasuredRun]:
        """This notebook's completed jobs whose results split their wall (core/wall.py), for run_seconds."""
        runs = []
        for j in self.nb.jobs():
            wall = wall_of(j.result) if j.state == "completed" else None
            if wall is None:
                continue
            r = j.resources
            runs.append(forecast.MeasuredRun(
                kind=j.kind, model_job=r.get("device") is not None, fixed_s=wall.startup_s + wall.write_s,
                work_s=wall.work_s, units=r.get("work_units"), tokens=r.get("tokens"),
                active_params=r.get("active_params")))
        return runs

    def _model_forecast(self, resources: Resources) -> Forecast:
        """From the job's tokens and its model's active parameters, at the speed this lab's earlier jobs of the same
        class achieved (in the ledger's own GPU-hours), else a declared MFU; never above one run's bound."""
        measured = [forecast.MeasuredJob(kind=resources.job_class, tokens=j.resources["tokens"],
                                         gpu_seconds=j.gpu_hours * 3600, active_params=j.resources["active_params"])
                    for j in self.nb.jobs() if j.state == "completed" and j.gpu_hours
                    and j.resources.get("job_class") == resources.job_class and j.resources.get("tokens")
                    and j.resources.get("active_params")]
        model = forecast.ModelCompute(total_params=resources.active_params, active_params=resources.active_params)
        size = forecast.train_forecast if resources.job_class == "train" else forecast.eval_forecast
        gpus = max(1, self.backend.devices(resources))
        bound = self.run_bound(resources)
        return min(self._forecast(size(resources.tokens, model, gpus, measured).gpu_hours, "model"), bound,
                   key=lambda f: f.gpuh)

    def run_bound(self, resources: Resources) -> Forecast:
        """The most one run can cost: its whole time limit on all its devices, charged as runs are."""
        device_seconds = resources.time_limit_min * 60 * self.backend.devices(resources)
        return Forecast(gpuh=self.backend.charge(device_seconds).gpu_hours, source="time_limit",
                        device_s=device_seconds)

    def predicted(self, kind: str, resources: Resources, payload: LaunchPayload) -> Forecast:
        """What the attempt is expected to cost, recorded on its row beside what it then cost: its admission
        forecast, or for a job admitted on a declared cost (the nomination's jobs on the reserve, data jobs declared
        free) the launcher's own forecast of it."""
        if resources.estimate_gpuh is None:
            return self._forecast(payload.forecast_gpuh, payload.forecast_source)
        return self.forecast(kind, resources.model_copy(update={"estimate_gpuh": None}))

    def admission_forecast(self, kind: str, resources: Resources, attempt: int) -> Forecast:
        """What an attempt is admitted on: the job's forecast; for a requeue or retry at least one run's
        bound, since the run before it already outlived any smaller estimate."""
        forecast = self.forecast(kind, resources)
        if attempt == 1:
            return forecast
        bound = self.run_bound(resources)
        return bound if bound.gpuh > forecast.gpuh else forecast

    def with_signal_lead(self, kind: str, resources: Resources) -> Resources:
        """The resources with their signal lead time set: as given, else derived from measured saves."""
        if resources.signal_delay_s is not None:
            return resources
        lead = signal_lead_s(self.measured_save_s(kind, resources.model), resources.time_limit_min * 60)
        return resources.model_copy(update={"signal_delay_s": lead})

    def measured_save_s(self, kind: str, model: str | None) -> float | None:
        """The longest save earlier completed jobs of this kind and model measured (None: none saved)."""
        saves = [_max_save_s(j.result) for j in self.nb.jobs(kind=kind)
                 if j.state == "completed" and j.resources.get("model") == model]
        return max(saves, default=0.0) or None

    def check_memory(self, key: str, kind: str, args: BaseModel, resources: Resources, attempt: int = 1
                     ) -> dict[str, Any] | None:
        """A training job's memory estimate per GPU (GiB, by part) for its attempt row; a job on GPUs whose
        estimate exceeds one GPU is a recorded refusal (MemoryRefused). None for jobs that do not train."""
        # Imported here: the launcher serves data and eval jobs without loading torch and transformers.
        from trainers.common import TrainConfig
        from trainers.memory import estimate_job

        if not isinstance(args, TrainConfig):
            return None
        gpus, world = self.backend.gpus(resources), self.backend.ranks(resources)
        est = estimate_job(args, world)
        parts = {k: round(v / GIB, 3) for k, v in est.model_dump().items() if k != "world_size"}
        memory = {"world_size": world, "per_gpu_gib": round(est.total / GIB, 3), "parts_gib": parts}
        if gpus == 0 or self.gpu_memory_gib is None or est.total <= self.gpu_memory_gib * GIB:
            return memory
        top = ", ".join(f"{k} {v:.1f}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1])[:3])
        options = fitting_alternatives(args, world, self.gpu_memory_gib)
        would_fit = [f"{o.change} ({o.per_gpu_gib:.1f} GiB)" for o in options]
        fit = "; would fit: " + ", ".join(would_fit) if would_fit else \
            "; neither micro-batch 1, LoRA nor more GPUs would fit"
        self.nb.record_decision(
            self.session, "refuse", f"{kind} cannot fit its GPUs: estimated {est.total / GIB:.1f} GiB per GPU on "
            f"{gpus} GPU(s) > {self.gpu_memory_gib:g} GiB ({top} GiB){fit}",
            MemoryRefusal(key=key, kind=kind, attempt=attempt, gpus=gpus, estimate_gib=memory["per_gpu_gib"],
                          gpu_memory_gib=self.gpu_memory_gib, parts_gib=parts, would_fit=would_fit))
        raise MemoryRefused(f"{kind}: estimated {est.total / GIB:.1f} GiB per GPU exceeds {self.gpu_memory_gib:g} GiB "
                            f"on {gpus} GPU(s){fit}")

    def check_partition(self, key: str, kind: str, resources: Resources, attempt: int = 1) -> None:
        """A job no node of its partition can hold is a recorded refusal (PartitionRefused), before submission."""
        problem = self.backend.unfit(resources)
        if problem is None:
            return
        self.nb.record_decision(self.session, "refuse", f"{kind} cannot run on its partition: {problem}",
                                PartitionRefusal(key=key, kind=kind, attempt=attempt, reason=problem))
        raise PartitionRefused(f"{kind}: {problem}")

    def _throughput(self, kind: str, model: str | None) -> float | None:
        """Work units per GPU-hour over completed earlier jobs of this kind and model (all attempts count)."""
        attempts = [j for j in self.nb.jobs(kind=kind) if j.resources.get("model") == model]
        done = {j.key: j.resources.get("work_units") or 0.0 for j in attempts if j.state == "completed"}
        units = sum(done.values())
        hours = sum(j.gpu_hours or 0.0 for j in attempts if j.key in done)
        return units / hours if units and hours else None

    def admit(self, key: str, kind: str, resources: Resources, attempt: int = 1) -> LaunchPayload:
        """The launch payload of an attempt whose forecast fits what is left of the budget (above the
        reserve, unless it is a nomination check); otherwise a recorded refusal and BudgetRefused."""
        forecast = self.admission_forecast(kind, resources, attempt)
        payload = LaunchPayload(key=key, kind=kind, attempt=attempt, forecast_gpuh=forecast.gpuh,
                                forecast_source=forecast.source, executor=self.backend.name)
        admission = session_ledger(self.nb, self.session).admission(forecast.gpuh, resources.nomination)
        if admission.admitted:
            return payload
        what = kind if attempt == 1 else f"{kind} attempt {attempt}"
        self.nb.record_decision(self.session, "refuse", f"{what} would overrun the budget: {admission.reason} GPU-h",
                                BudgetRefusal(**payload.model_dump()))
        raise BudgetRefused(f"{what}: forecast {forecast.gpuh:.3f} GPU-h does not fit; "
                            f"{admission.left_gpuh:.3f} GPU-h left above the reserve")

    def requeue_limit(self, resources: Resources) -> float:
        """A later attempt's time limit in minutes: like a new job's (tools/session.py time_limit_min), what the
        budget has left now that the runs before it are spent, at most the job's own limit."""
        minute_gpuh = self.run_bound(resources.model_copy(update={"time_limit_min": 1.0})).gpuh
        return session_ledger(self.nb, self.session).time_limit_min(resources.time_limit_min, minute_gpuh, resources.nomination)
