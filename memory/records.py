"""The notebook's records: one frozen pydantic model per table row, and one payload model per decision kind.

Rows become records when they are read (`memory.notebook` decodes the JSON columns first); decision
payloads are validated against their kind's model before they are hashed and written, and parsed
back into it on read, so a consumer reads `decision.payload.bars_id`, never a guessed dict key.

`Decision` is the base of one subclass per payload shape; `AnyDecision` is their union,
discriminated by `kind` (pydantic picks the subclass from the kind column).
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    TypeAdapter,
    model_serializer,
)

DecisionKind = Literal[
    "open", "plan", "launch", "refuse", "compare", "promote", "reject", "incumbent", "calibrate",
    "register_bars", "ingest", "build", "evaluate", "confirm", "fail", "nominate", "truth", "stop",
    "wait", "reconfigure", "look", "audit", "clear_suite",
]
JobState = Literal["pending", "running", "completed", "failed"]
# The launcher's failure classes (tools/jobs/failures.py keeps the same list; a test holds them equal:
# memory sits below tools and cannot import it).
FailureClass = Literal["oom", "preempted", "timeout", "nccl_timeout", "nan_loss", "node_failure", "cancelled", "no_gpu",
                       "lost", "config", "error"]
SessionStatus = Literal["open", "done", "failed", "stopped"]
ToolCallStatus = Literal["open", "done", "failed", "refused"]
_EPS = 1e-12  # float slack of sums of settled costs


class _Record(BaseModel):
    model_config = ConfigDict(frozen=True)


# ---- table rows ----------------------------------------------------------------------------------


class Session(_Record):
    """One research session: its budget, planner, executor and lab-config snapshot."""

    name: str = Field(description="Session name, unique in the notebook.")
    lab: str = Field(description="Lab directory the session ran in.")
    budget_gpuh: float = Field(description="GPU-hour budget (a hard limit).")
    reserve_gpuh: float = Field(description="GPU-hours kept back for the final nomination checks.")
    planner: str = Field(description="Planner kind: playbook or openai.")
    executor: str = Field(description="Executor kind: local or slurm.")
    config: dict[str, Any] = Field(description="Snapshot of the lab config the session ran with.")
    status: SessionStatus = Field(description="open while running; done, failed or stopped once ended.")
    started_at: str = Field(description="ISO-8601 UTC time the session opened.")
    ended_at: str | None = Field(description="ISO-8601 UTC time the session ended; None while open.")


class _Payload(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PolicyRef(_Payload):
    """The named, versioned planner policy a session runs with (agent/planners/playbook.py)."""

    name: str = Field(description="Policy name (the recipe it follows).")
    protocol: str = Field(description="The sizes it runs at (full, short, test).")
    version: int = Field(description="Rules version.")


class ChatTemplateRef(_Payload):
    """The chat format a session trains, evaluates and ships with (core.chat.chat_format of the lab's tokenizer)."""

    source: Literal["model", "chatml-default"] = Field(
        description="'model': the tokenizer's own chat template; 'chatml-default': it had none, so ChatML is used.")
    sha256: str = Field(description="sha256 of the template text rows are rendered with.")
    system_turns: Literal["native", "folded"] = Field(
        description="'native': the template renders system turns; 'folded': it has no system role, so the system "
        "prompt is folded into the first user turn.")
    masking: Literal["generation-markers", "prefix"] = Field(
        description="How assistant tokens are found: the template's {% generation %} markers, or prefix differences.")
    eot_token: str = Field(description="The end-of-turn token derived from the template.")
    stop_token_ids: list[int] = Field(description="The serving stop ids derived from the template and the tokenizer.")


class OpenPayload(_Payload):
    """What the `open` decision vouches for about its session row."""

    budget_gpuh: float = Field(description="Budget at opening.")
    reserve_gpuh: float = Field(description="Nomination reserve at opening.")
    planner: str = Field(description="Planner at opening.")
    executor: str = Field(description="Executor at opening.")
    config_sha256: str = Field(description="sha256 of the canonical config snapshot.")
    session_sha256: str | None = Field(None, description="sha256 of the canonical session row (see session_sha256); "
                                                         "None in notebooks written before schema version 2.")
    policy: PolicyRef | None = Field(None, description="The playbook policy the session runs with (its whole settings are "
                                                       "in the config snapshot); None before policies were named.")
    chat_template: ChatTemplateRef | None = Field(
        None, description="The chat format of the lab's tokenizer (own template or the ChatML default); None in "
        "sessions opened before it was recorded, or opened without a tokenizer.")


class StopPayload(_Payload):
    """How a session ended."""

    status: Literal["done", "failed", "stopped"] = Field(description="The session's final status.")


class RegisterBarsPayload(_Payload):
    """Promotion bars registered before scoring."""

    bars_id: int = Field(description="bars row id.")
    sha256: str = Field(description="sha256 of the canonical bars spec.")


class VerdictPayload(_Payload):
    """A comparison's verdict: `promote` when every bar held (the candidate cleared the bars), `reject` otherwise.
    A verdict changes no incumbent; the promote tool's `incumbent` decision does."""

    comparison_id: int = Field(description="comparison row id.")
    candidate: int = Field(description="Candidate artifact id.")
    incumbent: int = Field(description="Incumbent artifact id.")
    bars_id: int = Field(description="bars row the candidate was judged by.")


class IncumbentPayload(_Payload):
    """A candidate whose verdict cleared every bar made the incumbent (the agent's promote tool): the `incumbent`
    decision. Notebooks written before that kind existed recorded it as a `promote` decision with this payload."""

    action: Literal["incumbent"] = Field(description="Marks the change of incumbent.")
    artifact_id: int = Field(description="The new incumbent.")
    comparison_id: int = Field(description="The comparison that promoted it.")
    previous: int = Field(description="The incumbent it replaces.")


class CalibratePayload(_Payload):
    """Noise floors calibrated on one artifact and suite."""

    suite: str = Field(description="Suite calibrated.")
    artifact_id: int = Field(description="Artifact evaluated K times.")
    noise_floor_ids: list[int] = Field(description="noise_floor rows written, one per metric.")


class IngestPayload(_Payload):
    """The session's feedback split (tools/ingest.py)."""

    split_id: int = Field(description="feedback_split row.")
    sha256: str = Field(description="sha256 of its canonical assignment.")
    counts: dict[str, int] = Field(description="Battles per split (train, dev, sealed; reserve when the lab holds one).")
    job_key: str | None = Field(None, description="The split job.")
    reserve_suites: list[str] | None = Field(None, description="With a reserve: the open suites that read the dev "
                                             "holdout's prompts, which a reserve look extends with the reserve's; None: "
                                             "no reserve.")

    @model_serializer(mode="wrap")
    def _as_recorded(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Stored without `reserve_suites` when there is no reserve (as every split before the key was)."""
        return {k: v for k, v in handler(self).items() if k != "reserve_suites" or v is not None}


class EvaluatePayload(_Payload):
    """Evals recorded for one artifact (tools/evaluate.py, tools/tune_serving.py, the sealed confirmation)."""

    artifact_id: int = Field(description="Artifact evaluated.")
    eval_ids: list[int] = Field(description="eval rows it added (or found recorded).")
    job_key: str | None = Field(None, description="The eval job; None when nothing had to run.")
    sealed: bool = Field(False, description="The sealed confirmation of the nominee.")
    undecided: list[str] = Field(default_factory=list, description="Sealed battle suites with no decisive vote.")


class ConfirmPayload(_Payload):
    """The one permitted opening of a sealed suite."""

    suite: str = Field(description="Sealed suite opened.")
    artifact_id: int = Field(description="The nominee it was opened for.")


class NominatePayload(_Payload):
    """The session's nominee."""

    artifact_id: int = Field(description="Nominated artifact id.")


class TruthFamily(_Payload):
    """The ground truth on one task family of the sample."""

    n: int = Field(description="Prompts of this family.")
    accuracy: float = Field(description="Share the measured side answered correctly.")
    other_accuracy: float = Field(description="Share the other side answered correctly.")
    win_rate: float = Field(description="The measured side's win rate on this family.")


# The size of a ground-truth sample, one bound for lab.toml's `[truth] n` and `world truth --n`: enough prompts for a
# confidence interval worth printing, and no more than the oracle judges in a reasonable time.
TRUTH_N_MIN = 20
TRUTH_N_MAX = 100_000


class TruthFigures(_Payload):
    """A ground-truth measurement on a fresh sample by a noise-free scorer: what `world truth` reports and what
    the `truth` decision keeps."""

    n: int = Field(description="Prompts in the fresh sample.")
    seed: int = Field(description="Sample seed.")
    win_rate: float = Field(description="Mean points per prompt (win 1, tie or both bad 0.5, loss 0).")
    ci_low: float = Field(description="Lower bound of the 95% CI of win_rate.")
    ci_high: float = Field(description="Upper bound of the 95% CI of win_rate.")
    outcomes: dict[str, int] = Field(description="Prompts per outcome: win, tie, both_bad, loss.")
    accuracy: float = Field(description="The measured side's accuracy over the sample.")
    other_accuracy: float = Field(description="The other side's accuracy over the sample.")
    per_family: dict[str, TruthFamily] = Field(description="Per task family.")
    audit_passed: bool = Field(description="The sample shares no prompt with any split, suite or data source.")
    audit_sha256: str = Field(description="sha256 of the sample's leak audit.")
    audit_references: dict[str, int] = Field(description="Reference prompts per source it was audited against.")


class TruthPayload(TruthFigures):
    """The nominee's ground truth against the parent, by the lab's declared noise-free scorer ([truth] of
    lab.toml): measured after the sealed confirmation, for the card and the report; never shown to a planner."""

    artifact_id: int = Field(description="The nominee measured.")
    parent: int = Field(description="The artifact it was measured against (the session's parent).")
    scorer: str = Field(description="The [truth] kind that scored it.")
    job_key: str = Field(description="The ground-truth job.")


class _JobAttempt(_Payload):
    """The attempt of a keyed job a launch or admission decision is about."""

    key: str = Field(description="Job idempotency key.")
    kind: str = Field(description="Job kind (sft, dpo, eval, ...).")
    attempt: int = Field(description="Attempt number, from 1.")


class LaunchPayload(_JobAttempt):
    """A job attempt admitted by the budget and submitted."""

    forecast_gpuh: float = Field(description="GPU-hours reserved for it.")
    forecast_source: Literal["declared", "throughput", "model", "time_limit"] = Field(
        description="Where the forecast came from.")
    executor: str = Field(description="Executor it was submitted to.")


class FailPayload(_Payload):
    """A job attempt that failed and was not retried."""

    key: str = Field(description="Job idempotency key.")
    attempt: int = Field(description="Attempt that failed.")
    failure_class: FailureClass = Field(description="Classified failure.")
    detail: str = Field(description="The line of evidence.")
    message: str = Field("", description="The job's own error message for a person (redacted, escaped, bounded: "
                         "tools/jobs/failures.py safe_message); never read by the planner. '' when none.")


class StepFailPayload(_Payload):
    """A tool step that failed without a failed job of its own (data refused, nothing to compare, ...): a failure
    of the session like a job's, counted with them (issue 43, item 3)."""

    tool: str = Field(description="The tool that failed.")
    call: str = Field(description="Its tool call's idempotency key (args_hash; the call's result holds the outcome).")
    reason: str = Field(description="The tool's outcome line.")


class NotePayload(_Payload):
    """Kinds whose shape no reader relies on (plan, compare, build): any JSON object, until a reader needs a field
    (then the kind gets its own model, as ingest and evaluate did)."""

    model_config = ConfigDict(extra="allow", frozen=True)


# Refusals: one shape per gate that refuses; each forbids extra fields, so exactly one fits a payload.
class BudgetRefusal(LaunchPayload):
    """A job refused because its forecast does not fit the budget (the launch fields it would have had)."""


class MemoryRefusal(_JobAttempt):
    """A training job refused because its estimated peak memory per GPU exceeds one GPU (trainers/memory.py)."""

    gpus: int = Field(description="GPUs the job asked for, one rank each.")
    estimate_gib: float = Field(description="Estimated peak GiB per GPU.")
    gpu_memory_gib: float = Field(description="GiB of one GPU, as the lab's executor section declares it.")
    parts_gib: dict[str, float] = Field(description="The estimate by part (weights, activations, ...), GiB.")
    would_fit: list[str] = Field(default_factory=list, description="Changes whose estimate would fit one GPU, each "
                                 "with its GiB per GPU: micro-batch 1, LoRA, more GPUs (tools/jobs/forecast.py).")


class PartitionRefusal(_JobAttempt):
    """A job refused before submission: no node of its Slurm partition has the CPUs, memory or GPUs it asks for
    (read from `sinfo`), so it would pend forever."""

    reason: str = Field(description="The partition, what the job asks for and what its largest node has.")


class WaitPayload(_JobAttempt):
    """A job attempt still pending at the executor past the lab's bound (executor.slurm.pending_report_min)."""

    pending_s: float = Field(description="Seconds since the attempt was submitted.")
    reason: str = Field(description="The executor's reason it waits (Slurm's squeue %r: Resources, Priority, ...), "
                        "'' when it gives none.")


class ReconfigurePayload(_Payload):
    """A resumed session runs on changed [executor] settings (the only section a resume may change)."""

    section: str = Field(description="The lab.toml section that changed (executor).")
    before: dict[str, Any] = Field(description="Its settings as the session last ran with them.")
    after: dict[str, Any] = Field(description="Its settings from now on.")


class LookPayload(_Payload):
    """One look of a comparison's p bar under the bars' sequential rule (evals/compare.py): a look that leaves the
    comparison unresolved (`continue`: more evidence may be bought) or the look its verdict is read at (`decided`)."""

    candidate: int = Field(description="Candidate artifact id.")
    incumbent: int = Field(description="Incumbent artifact id.")
    bars_id: int = Field(description="bars row judged by.")
    target: str = Field(description="The p bar's suite/metric.")
    look: int = Field(description="This look, from 1: it reads the candidate's served draws 0 .. look-1.")
    looks: int = Field(description="Most looks the bars registered.")
    n: int = Field(description="Items paired.")
    raw_p: float = Field(description="This look's one-sided p-value.")
    weight: float = Field(description="This look's share of the bar's alpha (the registered spending).")
    sequential_p: float = Field(description="min over looks so far of p / weight: the comparison's p-value.")
    adjusted_p: float = Field(description="sequential_p Holm-adjusted in the session's family.")
    threshold: float = Field(description="The bar's threshold on the adjusted p.")
    outcome: Literal["continue", "decided"] = Field(description="continue: unresolved, a later look may follow; "
                                                    "decided: the verdict is read at this look.")
    reason: str = Field(description="Why, in one line.")
    reserve: int | None = Field(None, description="A reserve look (the last registered look of a session whose split "
                                "holds a reserve): how many of its `n` items are reserve prompts, drawn for it; the "
                                "rest are the dev holdout's, on the candidate's draws 0 .. look-2. None: dev only.")

    @model_serializer(mode="wrap")
    def _as_recorded(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Stored without `reserve` on a look of the dev holdout alone (as every look before the key was)."""
        return {k: v for k, v in handler(self).items() if k != "reserve" or v is not None}


class AuditPayload(_Payload):
    """A suite-audit finding: a guard's suite and the judged holdout disagree beyond chance on the same candidate
    (the judge's p bar holds at its family-wise level while the guard's delta is past its noise-floor margin)."""

    suite: str = Field(description="The guard's suite flagged.")
    metric: str = Field(description="The guard's metric.")
    candidate: int = Field(description="The candidate they disagree on.")
    incumbent: int = Field(description="The incumbent it was compared with.")
    bars_id: int = Field(description="bars row judged by.")
    judge_target: str = Field(description="The p bar's suite/metric (the judge).")
    judge_adjusted_p: float = Field(description="The p bar's adjusted p-value (it held).")
    guard_value: float = Field(description="The guard's statistic.")
    guard_threshold: float = Field(description="The guard's threshold at its registered margin (it failed).")
    widened_threshold: float = Field(description="Its threshold at the bars' audit_margin times the margin: what the "
                                     "guard reads until a person clears the suite.")


class ClearSuitePayload(_Payload):
    """A person cleared a flagged suite: its guards read their registered margin again."""

    suite: str = Field(description="The suite cleared.")
    by: str = Field(description="Who cleared it.")
    note: str = Field(description="Why, in their words.")


class CompareRefusal(_Payload):
    """A comparison refused before any verdict."""

    candidate: int = Field(description="Candidate artifact id.")
    incumbent: int = Field(description="Incumbent artifact id.")
    bars_id: int = Field(description="bars row asked for.")
    reasons: list[str] = Field(description="Every reason it was refused.")


class SealedRefusal(_Payload):
    """A sealed suite that may not be opened or scored now."""

    suite: str = Field(description="Sealed suite.")
    artifact_id: int = Field(description="Artifact it was asked for.")
    sealed: Literal[True] = Field(description="Marks the sealed-suite gate.")
    reasons: list[str] = Field(default_factory=list, description="Every reason (empty in notebooks before v2, "
                                                                 "where the rationale holds the one reason).")


class CalibrationRefusal(_Payload):
    """A noise-floor calibration refused (replicates that cannot measure noise)."""

    suite: str | None = Field(description="Suite of the evals offered (None when they span several).")
    eval_ids: list[int] = Field(description="Evals offered as replicates.")
    reasons: list[str] = Field(description="Every reason it was refused.")


class GateRefusal(_Payload):
    """A planned tool call refused by the agent's gates (agent/gates.py) before it ran."""

    tool: str = Field(description="Tool proposed.")
    args: dict[str, Any] = Field(description="Its canonical arguments.")
    reason: str = Field(description="The first gate's reason.")
    plan_seq: int | None = Field(None, description="The plan decision it came from (None in the nomination step).")
    forecast_gpuh: float | None = Field(None, description="Forecast of its job, when it would have launched one.")


class PlannerRefusal(_Payload):
    """An LLM planner reply that could not be acted on (bad JSON, unknown tool, invalid arguments)."""

    planner: str = Field(description="Planner that replied.")
    reason: str = Field(description="What was wrong, as fed back to the planner.")
    raw: str = Field(description="The reply's tool call as received, truncated.")
    in_row: int = Field(description="Unusable replies in a row, this one included.")


class BundleRefusal(_Payload):
    """A nomination refused because the candidate's bundle could not be written or failed check-bundle."""

    artifact_id: int = Field(description="Artifact id of the candidate whose bundle was refused.")
    bundle_job: str | None = Field(description="Key of the job that wrote and checked it (None when no job ran).")
    reasons: list[str] = Field(description="Every failure: the writer's refusal, or each failed check with what it expected.")


RefusePayload = (BudgetRefusal | MemoryRefusal | CompareRefusal | SealedRefusal | CalibrationRefusal | GateRefusal
                 | PlannerRefusal | BundleRefusal | PartitionRefusal)


class Decision(_Record):
    """One entry of the append-only, hash-chained decision log (see memory/chain.py)."""

    seq: int = Field(description="Position in the chain, from 1, gapless.")
    session: str = Field(description="Session it belongs to.")
    at: str = Field(description="ISO-8601 UTC time it was written.")
    kind: DecisionKind = Field(description="What was decided.")
    rationale: str = Field(description="Why, in one line a reviewer reads.")
    payload: BaseModel = Field(description="The kind's typed payload.")
    prev_hash: str = Field(description="Hash of the previous decision (GENESIS for the first).")
    hash: str = Field(description="sha256 over prev_hash and this canonical record.")


class OpenDecision(Decision):
    kind: Literal["open"] = Field(description="A session opened.")
    payload: OpenPayload = Field(description="What the session row held at opening.")


class StopDecision(Decision):
    kind: Literal["stop"] = Field(description="A session ended.")
    payload: StopPayload = Field(description="Its final status.")


class RegisterBarsDecision(Decision):
    kind: Literal["register_bars"] = Field(description="Bars registered.")
    payload: RegisterBarsPayload = Field(description="Which bars.")


class VerdictDecision(Decision):
    kind: Literal["promote", "reject"] = Field(description="A comparison's verdict: every bar held, or not.")
    payload: VerdictPayload | IncumbentPayload = Field(
        description="The comparison judged; IncumbentPayload only in notebooks from before the `incumbent` kind.")


class IncumbentDecision(Decision):
    kind: Literal["incumbent"] = Field(description="A candidate that cleared the bars made the incumbent.")
    payload: IncumbentPayload = Field(description="The new incumbent, the one it replaces and the comparison.")


class IngestDecision(Decision):
    kind: Literal["ingest"] = Field(description="The feedback split.")
    payload: IngestPayload = Field(description="Which split, and its sizes.")


class EvaluateDecision(Decision):
    kind: Literal["evaluate"] = Field(description="Evals recorded.")
    payload: EvaluatePayload = Field(description="The artifact and its eval rows.")


class CalibrateDecision(Decision):
    kind: Literal["calibrate"] = Field(description="Noise floors calibrated.")
    payload: CalibratePayload = Field(description="The floors.")


class ConfirmDecision(Decision):
    kind: Literal["confirm"] = Field(description="A sealed suite opened for the nominee.")
    payload: ConfirmPayload = Field(description="Suite and nominee.")


class NominateDecision(Decision):
    kind: Literal["nominate"] = Field(description="The nominee chosen.")
    payload: NominatePayload = Field(description="Which artifact.")


class TruthDecision(Decision):
    kind: Literal["truth"] = Field(description="The nominee's ground truth measured.")
    payload: TruthPayload = Field(description="The result.")


class LaunchDecision(Decision):
    kind: Literal["launch"] = Field(description="A job attempt launched.")
    payload: LaunchPayload = Field(description="The attempt and its forecast.")


class FailDecision(Decision):
    kind: Literal["fail"] = Field(description="A job attempt failed for good, or a tool step failed.")
    payload: FailPayload | StepFailPayload = Field(description="The job's failure, or the step's.")


class WaitDecision(Decision):
    kind: Literal["wait"] = Field(description="A job attempt pends past the lab's bound.")
    payload: WaitPayload = Field(description="The attempt, how long and why.")


class ReconfigureDecision(Decision):
    kind: Literal["reconfigure"] = Field(description="A resume changed the session's executor settings.")
    payload: ReconfigurePayload = Field(description="The section, before and after.")


class RefuseDecision(Decision):
    kind: Literal["refuse"] = Field(description="A gate refused an action.")
    payload: RefusePayload = Field(description="The refusal, in its gate's shape.")


class LookDecision(Decision):
    kind: Literal["look"] = Field(description="A look of a comparison's p bar under the sequential rule.")
    payload: LookPayload = Field(description="The look's statistics and outcome.")


class AuditDecision(Decision):
    kind: Literal["audit"] = Field(description="A guard's suite disagreed with the judge beyond chance.")
    payload: AuditPayload = Field(description="The finding.")


class ClearSuiteDecision(Decision):
    kind: Literal["clear_suite"] = Field(description="A person cleared a flagged suite.")
    payload: ClearSuitePayload = Field(description="Suite, who and why.")


class NoteDecision(Decision):
    kind: Literal["plan", "compare", "build"] = Field(description="Kinds with an open payload.")
    payload: NotePayload = Field(description="Any JSON object.")


AnyDecision = Annotated[
    OpenDecision | StopDecision | RegisterBarsDecision | VerdictDecision | IncumbentDecision | CalibrateDecision
    | ConfirmDecision | IngestDecision | EvaluateDecision | NominateDecision | TruthDecision | LaunchDecision | FailDecision | RefuseDecision | NoteDecision | WaitDecision
    | ReconfigureDecision | LookDecision | AuditDecision | ClearSuiteDecision,
    Field(discriminator="kind"),
]
DECISION = TypeAdapter(AnyDecision)
# kind -> adapter of its payload type, read off the union members (one source of truth).
PAYLOADS: dict[str, TypeAdapter[Any]] = {
    kind: TypeAdapter(member.model_fields["payload"].annotation)
    for member in get_args(get_args(AnyDecision)[0])
    for kind in get_args(member.model_fields["kind"].annotation)
}
assert set(PAYLOADS) == set(get_args(DecisionKind)), "every decision kind needs a payload model"


class ToolOutcome(BaseModel):
    """What a tool reports back (tools/context.py `invoke` records it); stored as the tool call's result in the
    notebook and read back typed (`ToolCall.outcome`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    tool: str = Field(description="Tool name.")
    status: Literal["done", "failed", "refused", "unavailable"] = Field(
        description="done; failed (job failed, data refused); refused (budget); unavailable (replay: needs a new job).")
    summary: str = Field(description="One line citing the numbers the outcome rests on.")
    data: dict[str, Any] = Field(default_factory=dict, description="Ids the outcome produced (artifact_id, ...).")
    detail: str = Field("", description="For a person only (the CLI line, the report): a failed job's own error "
                        "message, made safe (tools/jobs/failures.py safe_message). The planner never reads it "
                        "(agent/summary.py Call has no such field): it may quote input text.",
                        exclude_if=lambda v: v == "")

    @property
    def artifact_id(self) -> int | None:
        """The artifact the call made (a trained, merged or served checkpoint, a dataset), or None."""
        return self.data.get("artifact_id")

    @property
    def unresolved(self) -> bool:
        """A compare look that left the comparison unresolved: nothing judged, more evidence may be bought."""
        return bool(self.data.get("unresolved"))


class ToolCall(_Record):
    """One tool call of the agent, keyed for idempotency by (tool, canonical args)."""

    id: int = Field(description="Row id.")
    session: str = Field(description="Session it belongs to.")
    tool: str = Field(description="Tool name.")
    args: dict[str, Any] = Field(description="Canonical arguments.")
    args_hash: str = Field(description="Idempotency key: sha256 of tool and canonical args.")
    decision_seq: int | None = Field(description="Decision recorded with its outcome, once finished.")
    job_key: str | None = Field(description="Job it launched, if any.")
    status: ToolCallStatus = Field(description="open while running; done, failed or refused once finished.")
    result: dict[str, Any] | None = Field(description="The tool's result (JSON), once finished.")
    started_at: str = Field(description="ISO-8601 UTC time it was recorded.")
    ended_at: str | None = Field(description="ISO-8601 UTC time it finished.")

    @property
    def outcome(self) -> ToolOutcome | None:
        """The result as its tool reported it, typed; None while the call is open. A result of another shape (a
        judgment that closed the call with its own model, evals/judgment.py) reads as the row's tool and status with
        no summary or data."""
        if self.result is None:
            return None
        row = {"tool": self.tool, "status": self.status, "summary": "", "data": {}}
        return ToolOutcome.model_validate(row | self.result, extra="ignore")


class JobRecord(_Record):
    """One attempt of a job: retries and requeues keep their own row and cost."""

    id: int = Field(description="Row id.")
    key: str = Field(description="Idempotency key of the job (all attempts share it).")
    attempt: int = Field(description="Attempt number, from 1.")
    session: str = Field(description="Session that launched it.")
    kind: str = Field(description="Job kind: sft, dpo, klce, rft, merge, eval, ...")
    executor: str = Field(description="local or slurm.")
    external_id: str | None = Field(description="Executor's job id once submitted.")
    folder: str | None = Field(description="submitit folder of the attempt.")
    resources: dict[str, Any] = Field(description="Requested resources and the attempt's arguments.")
    forecast_gpuh: float = Field(description="GPU-hours reserved before launch.")
    gpu_hours: float | None = Field(description="Settled cost; None while reserved.")
    state: JobState = Field(description="pending, running, completed or failed.")
    failure_class: FailureClass | None = Field(description="Why it failed, when it did.")
    failure_detail: str | None = Field(description="The line of evidence for the failure.")
    log_path: str | None = Field(description="stderr log of the attempt.")
    result: dict[str, Any] | None = Field(description="The job's result (JSON) once completed.")
    submitted_at: str = Field(description="ISO-8601 UTC time the attempt was recorded.")
    started_at: str | None = Field(description="When its run started.")
    ended_at: str | None = Field(description="When its run ended.")
    fn: str | None = Field(None, description="The job function, 'module:qualname' (None on rows before schema 2).")
    result_type: str | None = Field(None, description="Its pydantic result model, 'module:qualname'.")
    device_seconds: float | None = Field(None, description="Measured seconds held x devices of the settled run.")
    charge: Literal["measured", "simulated"] | None = Field(
        None, description="How gpu_hours was settled from device_seconds.")


class Admission(_Record):
    """Whether a job of this forecast is admitted, and the arithmetic when it is not."""

    admitted: bool = Field(description="Whether the forecast fits what is left.")
    forecast_gpuh: float = Field(description="The job's forecast.")
    left_gpuh: float = Field(description="What is left for it: above the reserve, or including it (nomination).")
    reason: str | None = Field(None, description="Why it was refused; None when admitted.")


class Ledger(_Record):
    """The session's GPU-hours: budget, settled spend, reservations of unsettled jobs, the nomination reserve. The one
    budget arithmetic: launcher admission, the tools' time limits, the stop rule, the report and the progress line
    ask it (`Notebook.ledger` sums it from the job rows)."""

    budget_gpuh: float = Field(description="Session budget.")
    spent_gpuh: float = Field(description="Settled GPU-hours.")
    reserved_gpuh: float = Field(description="Forecasts of jobs not yet settled.")
    reserve_gpuh: float = Field(description="Kept back for the nomination checks.")

    @property
    def left_above_reserve_gpuh(self) -> float:
        """What new research jobs may still use."""
        return self.left_gpuh(nomination=False)

    def left_gpuh(self, nomination: bool = False) -> float:
        """What is left for a job: above the reserve, or including it for the nomination's own checks (bundle,
        sealed confirmation), which the reserve is kept for."""
        reserve = 0.0 if nomination else self.reserve_gpuh
        return self.budget_gpuh - self.spent_gpuh - self.reserved_gpuh - reserve

    def without(self, reservation_gpuh: float) -> Ledger:
        """The ledger without one pending reservation (a job's own, when its attempt is admitted again)."""
        return self.model_copy(update={"reserved_gpuh": max(0.0, self.reserved_gpuh - reservation_gpuh)})

    def admission(self, forecast_gpuh: float, nomination: bool = False) -> Admission:
        left = self.left_gpuh(nomination)
        if forecast_gpuh <= left + _EPS:
            return Admission(admitted=True, forecast_gpuh=forecast_gpuh, left_gpuh=left)
        reserve = 0.0 if nomination else self.reserve_gpuh
        return Admission(admitted=False, forecast_gpuh=forecast_gpuh, left_gpuh=left, reason=(
            f"forecast {forecast_gpuh:.3f} GPU-h + spent {self.spent_gpuh:.3f} + reserved {self.reserved_gpuh:.3f} "
            f"+ reserve {reserve:.3f} > budget {self.budget_gpuh:.3f}"))

    def time_limit_min(self, limit_min: float, minute_gpuh: float, nomination: bool = False) -> float:
        """A job's time limit: the lab's, or shorter (in tenths of a minute) when only that much of what is left
        pays for it. A run never costs more than its limit, so a job admitted under this bound cannot overrun the
        budget; with less than one minute left the limit stays the lab's and admission refuses the job. A job that
        costs nothing per minute (a Slurm CPU job: no GPU charged) keeps the lab's limit."""
        if minute_gpuh <= 0:
            return limit_min
        fit = math.floor(self.left_gpuh(nomination) / minute_gpuh * 10) / 10
        return fit if 1.0 <= fit < limit_min else limit_min

    @property
    def exhausted(self) -> bool:
        return self.left_above_reserve_gpuh <= 0


class Artifact(_Record):
    """A checkpoint, dataset, split or bundle, identified by its content hash."""

    id: int = Field(description="Row id.")
    session: str | None = Field(description="Session that produced it (None for lab-level inputs).")
    kind: str = Field(description="checkpoint, dataset, bundle, split, ...")
    name: str = Field(description="Human name.")
    path: str = Field(description="Where it lives.")
    sha256: str = Field(description="Content hash (weights hash for checkpoints).")
    parents: list[int] = Field(description="Artifact ids it was made from.")
    recipe: dict[str, Any] = Field(description="Config or manifest that made it.")
    job_key: str | None = Field(description="Producing job.")
    created_at: str = Field(description="ISO-8601 UTC time recorded.")


class EvalRecord(_Record):
    """One suite, one replicate, one decoding of one artifact, with every per-item outcome."""

    id: int = Field(description="Row id.")
    session: str = Field(description="Session it belongs to.")
    artifact_id: int = Field(description="Artifact evaluated.")
    suite: str = Field(description="Suite name.")
    replicate: int = Field(description="Replicate index (0 is the full first look).")
    decoding: dict[str, Any] = Field(description="The decoding used (evals.decoding.Decoding as JSON).")
    decoding_sha256: str = Field(description="Fingerprint of that decoding.")
    served: bool = Field(description="Evaluated at the candidate's served decoding.")
    metrics: dict[str, Any] = Field(description="Suite metrics: numbers, plus labels such as a scoring mode.")
    items: list[dict[str, Any]] = Field(description="Per-item outcomes (evals.types.Outcome as JSON).")
    job_key: str | None = Field(description="Eval job that produced it.")
    created_at: str = Field(description="ISO-8601 UTC time recorded.")

    def values(self, metric: str) -> dict[str, float]:
        """item id -> value of `metric` for the items that have it (resampled duplicates collapse): what the paired
        statistics and the noise floor's resolution read."""
        return {o["item_id"]: o["values"][metric] for o in self.items if metric in o["values"]}


class NoiseFloor(_Record):
    """How much one metric of one suite moves under evaluation noise alone."""

    id: int = Field(description="Row id.")
    session: str = Field(description="Session it belongs to.")
    suite: str = Field(description="Suite.")
    metric: str = Field(description="Metric.")
    k: int = Field(description="Replicates used.")
    spread: float = Field(description="Max minus min of replicate means.")
    mean_abs_delta: float = Field(description="Mean |difference| of means over replicate pairs (the bar unit).")
    max_abs_t: float = Field(description="Largest |t| between two replicates.")
    source_evals: list[int] = Field(description="Eval ids of the replicates.")
    created_at: str = Field(description="ISO-8601 UTC time recorded.")


Statistic = Literal["delta", "t", "p", "ci_low", "ci_high"]
Op = Literal[">=", "<=", ">", "<"]
FloorRule = Literal["replicates", "resolvable"]


class Rule(_Record):
    """A bar in its parsed, canonical form (evals/bars.py parses the bars file into it): what is registered (hashed),
    recorded in each verdict, and read back typed by everyone, never as a rule string parsed again."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    suite: str = Field(description="Suite the bar reads.")
    metric: str = Field(description="Per-item metric of that suite.")
    statistic: Statistic = Field(description="delta, t, p, ci_low or ci_high (candidate minus incumbent).")
    op: Op = Field(description="Comparison of the statistic with the threshold.")
    value: float = Field(description="The threshold as written (in noise floors when unit is noise_floor).")
    unit: Literal["absolute", "noise_floor"] = Field(description="Unit of value.")
    test: Literal["mcnemar_exact", "paired_t", "wilcoxon"] | None = Field(description="Paired test of a p bar.")
    confidence: float | None = Field(description="Bootstrap CI level of a ci bar.")

    @property
    def higher_is_better(self) -> bool:
        """Whether the bar asks the statistic to be large (a lower bound); a p bar bounds p from above, yet
        still asks the candidate to beat the incumbent."""
        return self.statistic == "p" or self.op in (">", ">=")

    @property
    def target(self) -> str:
        return f"{self.suite}/{self.metric}"

    @property
    def in_noise_units(self) -> bool:
        return self.unit == "noise_floor"

    def text(self) -> str:
        """The rule as a person reads it (`delta >= -1 * noise_floor`): rendered for a person or the LLM planner,
        never parsed back."""
        return f"{self.statistic} {self.op} {self.value:g}" + (" * noise_floor" if self.in_noise_units else "")


class BarsSpec(_Record):
    """A bars row's canonical spec, typed: the rules in the bars file's order and the keys that say how they read."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    bars: tuple[Rule, ...] = Field(min_length=1, description="The rules; the first is the primary.")
    p_family: int | None = Field(description="Pre-registered p-value family size (None: no p bars).")
    replicates: int = Field(1, description="Served draws a side that every bar without a p-value averages.")
    floor_unit: FloorRule = Field("replicates", description="What one noise floor is (evals/bars.py); a spec "
                                  "registered before the key reads as `replicates`, what it was judged by.")
    looks: int = Field(1, description="Most looks at a p bar under the sequential rule (1: one look).")
    look_spending: float = Field(1.0, description="rho of the spending t**rho that shares a p bar's alpha over "
                                 "its looks (evals/bars.py).")
    continue_p: float = Field(0.5, description="A look may continue only while its raw p is at most this.")
    audit_margin: float | None = Field(None, description="A guard whose suite the judge contradicted holds at this "
                                       "many times its margin until a person clears the suite; None: no audit rule.")

    def look_weights(self) -> list[float]:
        """Each look's share of a p bar's alpha: f(i/L) - f((i-1)/L) with f(t) = t**rho (Kim & DeMets 1987)."""
        f = [(i / self.looks) ** self.look_spending for i in range(self.looks + 1)]
        return [f[i] - f[i - 1] for i in range(1, self.looks + 1)]

    def canonical(self) -> dict[str, Any]:
        """The stored form, hashed at registration: keys at their defaults left out, so that bars registered before
        `replicates` and `floor_unit` existed keep their sha256."""
        return self.model_dump(mode="json", exclude_defaults=True)


class BarsRecord(_Record):
    """Promotion bars, registered (hashed, time-stamped) before the scores they judge."""

    id: int = Field(description="Row id.")
    session: str = Field(description="Session it belongs to.")
    spec: BarsSpec = Field(description="Canonical bars spec (evals.bars.Bars.spec()).")
    sha256: str = Field(description="sha256 of the canonical spec.")
    registered_at: str = Field(description="ISO-8601 UTC time registered.")


class BarVerdict(_Record):
    """One bar's statistic, threshold and verdict in a comparison."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    bar: Rule = Field(description="The bar, canonical form.")
    n: int = Field(description="Items paired.")
    value: float | str = Field(description="The statistic (Holm-adjusted for p bars); 'inf'/'-inf' when infinite.")
    raw_p: float | None = Field(None, description="Unadjusted p-value for p bars.")
    threshold: float = Field(description="Threshold after converting noise-floor units.")
    holds: bool = Field(description="Whether the bar is cleared.")
    floor: float | None = Field(None, description="A noise-floor bar's floor in the unit its threshold used "
                                "(threshold = value x floor); None for other bars and in comparisons recorded "
                                "before it was kept (the session state derives it then).")
    floor_id: int | None = Field(None, description="The noise_floor row that floor came from.")


class Adjustment(_Record):
    """How a comparison's p-values were adjusted (evals/compare.py): Holm over the session's pre-registered family,
    and under sequential bars every look taken. Read from rows of every age: `tested` came with the pre-registered
    family, the look keys with rules version 6 (issue 41); a key a row was recorded without stays out of its stored
    form."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    method: Literal["holm"] = Field("holm", description="The multiple-comparison method (Holm 1979).")
    family_size: int | None = Field(None, description="The p-value family adjusted over: the pre-registered "
                                    "p_family (before it was registered, the p-values seen so far); None when the "
                                    "bars have no p bar.")
    tested: int | None = Field(None, description="P-values of the family tested with this comparison's included; "
                               "None in rows from before the family was pre-registered.")
    raw_p: list[float] = Field(default_factory=list, description="This comparison's p-values as tested, in bar order "
                               "(under sequential bars each is p* = min p/w over the looks taken).")
    adjusted_p: list[float] = Field(default_factory=list, description="Their Holm-adjusted values.")
    prior_comparisons: list[int] = Field(default_factory=list, description="Comparisons whose p-values were tested "
                                         "before this one.")
    looks: dict[int, list[tuple[int, float, float]]] | None = Field(None, description="Sequential bars: per p bar (its "
                                                                    "index among the bars), (items, raw p, weight) "
                                                                    "of each look taken; None: one look.")
    look: int | None = Field(None, description="The look the verdict was read at (sequential bars).")
    max_looks: int | None = Field(None, description="The looks the bars registered (sequential bars).")
    reserve: int | None = Field(None, description="Reserve prompts the deciding look read besides the dev holdout's "
                                "(a reserve look); None: none.")

    @model_serializer(mode="wrap")
    def _as_recorded(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Stored without the keys a row of its kind never had (tested, the look keys of a single look, the reserve
        of a look without one)."""
        optional = ("tested", "looks", "look", "max_looks", "reserve")
        return {k: v for k, v in handler(self).items() if k not in optional or v is not None}


class Comparison(_Record):
    """A candidate judged against the incumbent by registered bars."""

    id: int = Field(description="Row id.")
    session: str = Field(description="Session it belongs to.")
    candidate: int = Field(description="Candidate artifact id.")
    incumbent: int = Field(description="Incumbent artifact id.")
    bars_id: int = Field(description="bars row used.")
    verdicts: list[BarVerdict] = Field(description="One verdict per bar: statistic, value, threshold, holds.")
    promoted: bool = Field(description="Whether every bar held (the candidate cleared the bars; a verdict, not a "
                           "change of incumbent).")
    adjustment: Adjustment = Field(description="Multiple-comparison method, family and adjusted p-values, and the "
                                   "sequential looks taken.")
    created_at: str = Field(description="ISO-8601 UTC time recorded.")


class FeedbackSplit(_Record):
    """A deterministic train/dev/sealed assignment of a feedback file's battles."""

    id: int = Field(description="Row id.")
    session: str | None = Field(description="Session that made it (None for lab-level ingestion).")
    source_path: str = Field(description="Feedback file.")
    source_sha256: str = Field(description="Its content hash.")
    config: dict[str, Any] = Field(description="Fractions, stratification and salt.")
    sha256: str = Field(description="sha256 of the canonical assignment.")
    counts: dict[str, Any] = Field(description="{split: {vote: n}}.")
    assignment: dict[str, str] = Field(description="{battle id: split}.")
    created_at: str = Field(description="ISO-8601 UTC time recorded.")


class VerifyReport(_Record):
    """Outcome of re-walking the decision chain and the session rows; `problem` names the first bad record."""

    ok: bool = Field(description="Whether everything checked.")
    count: int = Field(description="Decisions that verified before the first problem.")
    head: str = Field(description="Hash of the last good decision.")
    problem: str | None = Field(None, description="The first problem found, naming the record.")
