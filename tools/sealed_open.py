"""Tool `sealed_open`: score the sealed confirmation suites once, for the nominee only.

Each suite is opened (a `confirm` decision) before its job runs, so a crash cannot buy a second
look (evals/sealed.py); a refused opening is recorded and reported as refused.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from evals.sealed import SealedRefused, open_sealed
from tools.context import ToolContext, ToolOutcome, invoke, record_once, served_of
from tools.evaluate import eval_job, metrics_line, reference_completions, run_and_record
from tools.session import parent_of

NAME = "sealed_open"


class Args(BaseModel):
    """Open the sealed confirmation suites for the nominee."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    artifact: int = Field(description="Artifact id of the nominee.")


def _body(ctx: ToolContext, args: Args) -> ToolOutcome:
    names = [s.name for s in ctx.lab.sealed_suites]
    if not names:
        return ToolOutcome(tool=NAME, status="failed", summary="the lab has no sealed suite")
    opened = {d.payload.get("suite") for d in ctx.nb.decisions(ctx.session, kind="confirm")
              if d.payload.get("artifact_id") == args.artifact}
    try:
        for suite in names:
            if suite not in opened:
                open_sealed(ctx.nb, ctx.session, suite, args.artifact)
    except SealedRefused as exc:
        return ToolOutcome(tool=NAME, status="refused", summary=str(exc))
    # Judge suites confirm the nominee against the session's parent on the sealed prompts.
    reference = reference_completions(ctx, parent_of(ctx.nb, ctx.session), names, nomination=True)
    cfg = eval_job(ctx, args.artifact, names, served_of(ctx, args.artifact), True, 1, reference)
    evals, key = run_and_record(ctx, args.artifact, cfg, nomination=True)
    summary = f"sealed confirmation of {ctx.nb.artifact(args.artifact).name}: {metrics_line(evals)}"
    record_once(ctx, "evaluate", summary, {"artifact_id": args.artifact, "eval_ids": [e.id for e in evals],
                                           "sealed": True, "job_key": key})
    return ToolOutcome(tool=NAME, status="done", summary=summary, data={"artifact_id": args.artifact,
                                                                        "eval_ids": [e.id for e in evals]})


def run(ctx: ToolContext, args: Args, decision_seq: int | None = None) -> ToolOutcome:
    return invoke(ctx, NAME, args, _body, decision_seq)
