"""Tool `tune_serving`: a serving alternative for fixed weights (decoding, system prompt), evaluated at
that decoding. The alternative is a new artifact with the same weights and its own served decoding;
it becomes what the nominee ships with only through `compare` under the bars and `promote`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from tools.context import ToolContext, ToolOutcome, content_name, invoke, record_once, served_of
from tools.evaluate import MissingReference, eval_job, metrics_line, references_of, run_and_record
from tools.session import incumbent_of

NAME = "tune_serving"


class Args(BaseModel):
    """Try one serving alternative of a checkpoint (weights unchanged)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    artifact: int = Field(description="Artifact id of the checkpoint (normally the incumbent).")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="Served temperature; unchanged when omitted.")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="Served nucleus mass; unchanged when omitted.")
    repetition_penalty: float | None = Field(None, ge=1.0, le=2.0, description="Served repetition penalty.")
    system_prompt: Literal["served", "none"] = Field("served", description="Keep the served system prompt, or serve none.")


def _decoding(ctx: ToolContext, args: Args):
    base = served_of(ctx, args.artifact)
    update = {k: v for k, v in (("temperature", args.temperature), ("top_p", args.top_p),
                                ("repetition_penalty", args.repetition_penalty)) if v is not None}
    if update.get("temperature", base.temperature) == 0.0:
        update["top_p"] = 1.0  # greedy decoding takes no nucleus
    if args.system_prompt == "none":
        update["system_prompt"] = ""
    return base.model_validate(base.model_dump() | update)


def _body(ctx: ToolContext, args: Args) -> ToolOutcome:
    source = ctx.nb.artifact(args.artifact)
    decoding = _decoding(ctx, args)
    if decoding == served_of(ctx, args.artifact):
        return ToolOutcome(tool=NAME, status="failed", summary="the alternative equals the served decoding")
    name = content_name("serve", {"weights": source.sha256, "decoding": decoding.fingerprint()})
    known = [a for a in ctx.nb.artifacts(kind="checkpoint", session=ctx.session) if a.name == name]
    variant = known[0] if known else ctx.nb.add_artifact(
        kind="checkpoint", name=name, path=source.path, sha256=source.sha256, parents=[args.artifact],
        recipe={"serving_of": args.artifact, "parent": args.artifact, "served_decoding": decoding.model_dump(mode="json")},
        session=ctx.session)
    names = [s.name for s in ctx.lab.open_suites]
    try:
        cfg = eval_job(ctx, variant.id, names, decoding, True, 1, references_of(ctx, incumbent_of(ctx.nb, ctx.session)))
    except MissingReference as exc:
        return ToolOutcome(tool=NAME, status="failed", summary=str(exc))
    evals, key = run_and_record(ctx, variant.id, cfg)
    settings = f"temperature {decoding.temperature:g}, top_p {decoding.top_p:g}, repetition penalty {decoding.repetition_penalty:g}, system prompt {'none' if not decoding.system_prompt else 'served'}"
    summary = f"{name} ({source.name} served at {settings}): {metrics_line(evals)}"
    record_once(ctx, "evaluate", summary, {"artifact_id": variant.id, "eval_ids": [e.id for e in evals], "job_key": key})
    return ToolOutcome(tool=NAME, status="done", summary=summary, data={"artifact_id": variant.id})


def run(ctx: ToolContext, args: Args, decision_seq: int | None = None) -> ToolOutcome:
    return invoke(ctx, NAME, args, _body, decision_seq)
