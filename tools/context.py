"""What every tool is handed: the lab (typed, paths resolved), the notebook, the session, the job
submitter, and the one wrapper that records a tool call around its body.

A tool is a file in tools/ with an `Args` model (what the planner passes: artifact ids and intent,
never paths) and `run(ctx, args) -> ToolOutcome`. `invoke` records the tool call under its
idempotency key (tool name + canonical args) before the body runs and its outcome after; a call
already finished in the notebook returns its stored outcome without running again, which is what
makes a resumed session act exactly once per step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from core.util import canonical_json, sha256_text
from evals.decoding import Decoding
from evals.job import CallableJudgeSpec, OpenAIJudgeSpec
from memory.notebook import Notebook
from memory.records import PAYLOADS, BarsSpec, StepFailPayload, ToolOutcome
from tools.data.datasets import ReplaySource, VerifiedSource
from tools.jobs.executor import SINGLE_PROCESS_KINDS, KindResources, job_family
from tools.jobs.launcher import BudgetRefused, JobFailed, Resources
from tools.paths import LabPaths
from tools.session import ledger
from trainers.recipe import TrainRecipe

A = TypeVar("A", bound=BaseModel)
R = TypeVar("R", bound=BaseModel)


class LabSuite(BaseModel):
    """One eval suite of the lab: an items file, or (judge suites) the prompts of a holdout split."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = Field(description="Suite name, as bars and the notebook name it.")
    scorer: str = Field(description="Scorer (evals.job.ScorerName).")
    file: Path | None = Field(None, description="Items file; None for judge and battle suites, which read the dev "
                                                "(or, sealed, the sealed) battles of the session's split.")
    sealed: bool = Field(False, description="Scored once, for the nominee only.")
    constraint_mode: Literal["plain", "ifeval"] = Field(
        "plain", description="constraints suites: the instructions' plain meaning, or IFEval's exact semantics.")

    @property
    def judged(self) -> bool:
        return self.scorer == "judge"


class LabTruth(BaseModel):
    """The lab's ground-truth scorer ([truth] of lab.toml; tools/ground_truth.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["world"] = Field(description="Scorer kind.")
    n: int = Field(description="Prompts of the fresh sample.")
    seed: int = Field(description="Sample seed.")


class LabSpec(BaseModel):
    """The lab as the tools need it: resolved paths and flat settings (built from lab.toml by the agent)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    parent: Path = Field(description="Checkpoint the session starts from (the first incumbent).")
    tokenizer: Path = Field(description="Tokenizer directory (token counts of built datasets).")
    feedback: Path = Field(description="The battles file.")
    dev_fraction: float = Field(description="Share of battles held out for selection.")
    sealed_fraction: float = Field(description="Share of battles sealed for the nominee's confirmation.")
    stratify_by: str | None = Field(None, description="Meta tag the split stratifies by, on top of the vote.")
    reserve_fraction: float = Field(0.0, description="Share of battles held in reserve (0: none; tools/data/splits.py).")
    suites: list[LabSuite] = Field(min_length=1, description="Eval suites; sealed ones are scored once, for the nominee.")
    replicates: int = Field(3, ge=3, description="K replicates of an incumbent for its noise floor.")
    data: list[ReplaySource] = Field(default_factory=list, description="Local replay data sources.")
    verified: list[VerifiedSource] = Field(default_factory=list, description="The lab's verified item pools (RFT "
                                           "items apart from the eval suites; [[data]] kind = 'verified').")
    bars: Path | None = Field(description="Promotion bars file registered before any scoring.")
    recorded_bars: tuple[BarsSpec, ...] | None = Field(
        None, description="Typed bars registered instead of the file: every registration of a replayed session, in "
        "order (agent/replay.py); None in a live session.")
    served: Decoding = Field(description="The decoding and system prompt the parent is served with.")
    judge: OpenAIJudgeSpec | CallableJudgeSpec | None = Field(None, description="Judge for judge suites.")
    reward_model: Path | None = Field(None, description="Sequence-classification reward model of reward_proxy suites "
                                                        "([judge] kind = 'reward_model').")
    time_limit_min: float = Field(gt=0, description="Wall-clock limit of each job run, minutes.")
    eval_batch_size: int | None = Field(
        64, ge=1, description="Prompts generated together by eval jobs; None: chosen by the job from its GPU's free memory.")
    job_resources: dict[str, KindResources] = Field(
        default_factory=dict, description="Per resource kind (train, eval, reference, merge, data, bundle, truth) with "
        "defaults filled in (ExecutorSection.kind_resources); a kind absent: the executor's defaults.")
    gpu_dtype: Literal["bfloat16", "float16", "float32"] = Field(
        "bfloat16", description="Dtype of model jobs on GPUs; on the CPU they run in float32.")
    model_name: str = Field("model", description="Model label for throughput forecasts of the launcher.")
    truth: LabTruth | None = Field(None, description="Ground-truth scorer of the nominee; None: the lab declares none.")
    base_license: str | None = Field(None, description="The base model's license; None: not declared.")
    base_license_source: str = Field("not declared", description="Where the license was read (lab.toml, a README).")
    train: TrainRecipe | None = Field(None, description="The lab's [train], settled per trainer family "
                                      "(trainers/recipe.py); None: the rules over the parent model.")

    def replayed_bars(self, registered: int) -> BarsSpec | None:
        """The typed bars a replay registers at a default `register_bars` step taken after `registered`
        registrations: the session's own registration at that place (past its last one, the last, the bars it
        ended under). None in a live session, or when the session registered none: the file is read."""
        if not self.recorded_bars:
            return None
        return self.recorded_bars[min(registered, len(self.recorded_bars) - 1)]

    def suite(self, name: str) -> LabSuite:
        for s in self.suites:
            if s.name == name:
                return s
        raise KeyError(name)

    @property
    def open_suites(self) -> list[LabSuite]:
        return [s for s in self.suites if not s.sealed]

    @property
    def sealed_suites(self) -> list[LabSuite]:
        return [s for s in self.suites if s.sealed]


class JobHandle(Protocol[R]):
    key: str

    def result(self, timeout_s: float | None = None) -> R: ...


class Submitter(Protocol):
    """The launcher (tools/jobs/launcher.py), or replay's server of recorded results (agent/replay.py)."""

    def submit(self, kind: str, fn: Callable[[Any], R], args: BaseModel, resources: Resources) -> JobHandle[R]: ...


class WouldLaunch(Exception):
    """Replay met a job the recorded session never ran: nothing is launched, the step is marked."""

    def __init__(self, kind: str, key: str):
        super().__init__(f"would launch: {kind} {key[:12]}")
        self.kind, self.key = kind, key


@dataclass
class ToolContext:
    """Live objects of one session (never in graph state: the state holds JSON and ids only)."""

    nb: Notebook
    session: str
    paths: LabPaths
    lab: LabSpec
    jobs: Submitter
    job_timeout_s: float | None = None
    minute_gpuh: Callable[[Resources], float] | None = None
    """What one minute of a job with these resources can cost at most (the launcher's time-limit bound)."""

    def placement(self, kind: str) -> tuple[Literal["cuda", "cpu"], Literal["bfloat16", "float16", "float32"]]:
        """Device and dtype of a job of launcher kind `kind`'s model, from its resources: on its GPUs in the lab's
        dtype, else on the CPU in float32."""
        given = self.lab.job_resources.get(job_family(kind) or "")
        if given is not None and given.gpus:
            return "cuda", self.lab.gpu_dtype
        return "cpu", "float32"

    def kind_resources(self, kind: str) -> dict[str, Any]:
        """The Resources fields lab.toml's `[executor.resources.<kind>]` sets for a launcher kind."""
        family = job_family(kind)
        given = self.lab.job_resources.get(family or "")
        if given is None:
            return {}
        return {"gpus": given.gpus, "nodes": given.nodes, "cpus": given.cpus, "mem_gb": given.mem_gb,
                "time_limit_min": given.time_limit_min or self.lab.time_limit_min,
                "single_process": family in SINGLE_PROCESS_KINDS}

    def resources(self, nomination: bool = False, kind: str | None = None, own_gpuh: float = 0.0,
                  **extra: Any) -> Resources:
        """A job's resources. Its time limit is the lab's, or shorter when only that much of the budget
        is left above the reserve: a run never costs more than its limit, so a job admitted under that
        bound cannot overrun the budget (with less than a minute left the launcher refuses it). The
        nomination's jobs (bundle, sealed confirmation) are what the reserve is kept for: they are
        admitted on a declared 0 and their limit is what is left including the reserve. `own_gpuh`: what the
        step's own unsettled jobs still reserve (a resumed step gated again, tools/session.py own_reservation),
        left out of what is left, so the step is sized on the same budget as when it was first gated."""
        per_kind = self.kind_resources(kind) if kind is not None else {}
        fields = {"time_limit_min": self.lab.time_limit_min} | per_kind | {"model": self.lab.model_name} | extra
        if per_kind:  # a job of a lab kind runs where its GPUs are: checked on CUDA, GPUs hidden on the CPU
            fields.setdefault("device", "cuda" if fields.get("gpus") else "cpu")
        r = Resources(**fields)
        if self.minute_gpuh is None or (r.estimate_gpuh is not None and not nomination):
            return r
        left = ledger(self.nb, self.session).without(own_gpuh)
        minute = self.minute_gpuh(r)
        limit = left.time_limit_min(r.time_limit_min, minute, nomination)
        update: dict[str, Any] = {"estimate_gpuh": 0.0, "nomination": True} if nomination else {}
        if not nomination and 0 < minute and left.left_gpuh() < minute:
            # Not one minute of it can be paid: its forecast is its whole bound, which admission refuses (a
            # forecast from its size could fit what is left while no time limit could).
            update = {"estimate_gpuh": limit * minute}
        return r.model_copy(update=update | {"time_limit_min": limit})

    def wait(self, kind: str, fn: Callable[[Any], R], args: BaseModel, **extra: Any) -> tuple[R, str]:
        """Submit (or re-attach to) one keyed job and wait for its result."""
        job = self.jobs.submit(kind, fn, args, self.resources(kind=kind, **extra))
        return job.result(timeout_s=self.job_timeout_s), job.key


def content_name(prefix: str, spec: Any) -> str:
    """A stable name for an output: prefix plus the first 12 hex of the canonical spec's sha256."""
    return f"{prefix}-{sha256_text(canonical_json(spec))[:12]}"


def invoke(ctx: ToolContext, tool: str, args: A, body: Callable[[ToolContext, A], ToolOutcome],
           decision_seq: int | None = None) -> ToolOutcome:
    """Record the call, run the body once, record its outcome. Failures of jobs and budget are data."""
    call = ctx.nb.record_tool_call(ctx.session, tool, args.model_dump(mode="json"), decision_seq=decision_seq)
    if call.status != "open" and call.outcome is not None:
        return call.outcome
    job_failed = False
    try:
        outcome = body(ctx, args)
    except BudgetRefused as exc:
        outcome = ToolOutcome(tool=tool, status="refused", summary=str(exc))
    except JobFailed as exc:
        job_failed = True
        # The class and the ids the project minted: never the job's error text, which may carry input text.
        outcome = ToolOutcome(tool=tool, status="failed", summary=f"job failed: {exc.record.failure_class} "
                              f"({exc.record.kind} {exc.record.key[:12]}, attempt {exc.record.attempt})",
                              data={"job_key": exc.record.key}, detail=exc.record.failure_detail or "")
    except WouldLaunch as exc:
        outcome = ToolOutcome(tool=tool, status="unavailable", summary=str(exc),
                              data={"job_kind": exc.kind, "job_key": exc.key})
    status = {"done": "done", "refused": "refused"}.get(outcome.status, "failed")
    with ctx.nb.transaction():  # the step's failure and its outcome land together (a resumed step records neither twice)
        if outcome.status == "failed" and not job_failed:  # a failed job has its own `fail` decision (the launcher's)
            ctx.nb.record_decision(ctx.session, "fail", f"{tool} failed: {outcome.summary}"[:300],
                                   StepFailPayload(tool=tool, call=call.args_hash, reason=outcome.summary))
        ctx.nb.finish_tool_call(call.id, status, outcome.model_dump(mode="json"))
    return outcome


def served_of(ctx: ToolContext, artifact_id: int) -> Decoding:
    """An artifact's served decoding: the one its recipe ships with, else the lab's."""
    recipe = ctx.nb.artifact(artifact_id).recipe
    if "served_decoding" in recipe:
        return Decoding.model_validate(recipe["served_decoding"])
    return ctx.lab.served


def artifact_of_job(ctx: ToolContext, job_key: str) -> int | None:
    """The artifact a job already produced (a resumed tool must not record it twice)."""
    found = [a.id for a in ctx.nb.artifacts(session=ctx.session) if a.job_key == job_key]
    return found[0] if found else None


def record_once(ctx: ToolContext, kind: str, rationale: str, payload: dict[str, Any] | BaseModel) -> None:
    """Record a tool's decision unless a resumed run of the same call already did (same kind and payload, compared
    as the kind's typed payload: defaults filled in)."""
    typed = PAYLOADS[kind].validate_python(payload.model_dump(mode="json") if isinstance(payload, BaseModel) else payload)
    if any(d.payload == typed for d in ctx.nb.decisions(ctx.session, kind=kind)):
        return
    ctx.nb.record_decision(ctx.session, kind, rationale, payload)
