"""Tool `nominate`: name the session's nominee (normally the incumbent) with the decoding it is served
with and its served metrics; the sealed confirmation is opened for it afterwards (`sealed_open`).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from tools.context import ToolContext, ToolOutcome, invoke, record_once, served_of
from tools.evaluate import metrics_line

NAME = "nominate"


class Args(BaseModel):
    """Nominate one checkpoint as the session's result."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    artifact: int = Field(description="Artifact id of the nominee (normally the incumbent).")


def _body(ctx: ToolContext, args: Args) -> ToolOutcome:
    artifact = ctx.nb.artifact(args.artifact)
    served = served_of(ctx, args.artifact)
    evals = [e for e in ctx.nb.evals(artifact_id=args.artifact, session=ctx.session)
             if e.served and e.decoding_sha256 == served.fingerprint()]
    firsts = {e.suite: e for e in reversed(evals) if e.replicate == 0}
    summary = f"nominee {artifact.name} served at decoding {served.fingerprint()[:12]}: {metrics_line(list(firsts.values()))}"
    record_once(ctx, "nominate", summary, {"artifact_id": args.artifact})
    return ToolOutcome(tool=NAME, status="done", summary=summary, data={"artifact_id": args.artifact})


def run(ctx: ToolContext, args: Args, decision_seq: int | None = None) -> ToolOutcome:
    return invoke(ctx, NAME, args, _body, decision_seq)
