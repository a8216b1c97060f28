"""Tool `promote`: make a candidate the incumbent, only on its verdict that cleared every bar against the current
incumbent at its served decoding (the session state's one eligibility rule, memory/state.py `promotion`).

The session's first incumbent is its parent checkpoint (`start_incumbent`, at session start); after that the
incumbent is the artifact of the latest `incumbent` decision, which this tool records. A comparison's verdict
(`promote`: every bar held; `reject`) moves no incumbent: making the candidate the incumbent is this separate,
explicit step, its own event.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from core.util import file_sha256
from core.weights import weights_sha256
from memory.records import IncumbentPayload
from tools.context import ToolContext, ToolOutcome, invoke, record_once
from tools.session import parent_of, view

NAME = "promote"


class Args(BaseModel):
    """Promote a candidate whose latest comparison against the incumbent cleared every bar."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    candidate: int = Field(description="Artifact id of the candidate.")


def start_incumbent(ctx: ToolContext) -> int:
    """Record the lab's parent checkpoint as the session's first incumbent (once)."""
    known = parent_of(ctx.nb, ctx.session)
    if known is not None:
        return known
    path = ctx.lab.parent
    sha = weights_sha256(path) if any(path.glob("*.safetensors")) else file_sha256(path / "config.json")
    return ctx.nb.add_artifact(kind="checkpoint", name="parent", path=str(path), sha256=sha, session=ctx.session,
                               recipe={"role": "parent", "served_decoding": ctx.lab.served.model_dump(mode="json"),
                                       "license": ctx.lab.base_license, "license_source": ctx.lab.base_license_source}).id


def _body(ctx: ToolContext, args: Args) -> ToolOutcome:
    v = view(ctx.nb, ctx.session)
    previous, eligibility = v.incumbent, v.promotion(args.candidate)
    if not eligibility.promotable:
        return ToolOutcome(tool=NAME, status="failed", summary="; ".join(eligibility.reasons))
    name = ctx.nb.artifact(args.candidate).name
    summary = (f"{name} becomes the incumbent (was {ctx.nb.artifact(previous).name}): comparison "
               f"{eligibility.comparison_id} cleared every bar")
    record_once(ctx, "incumbent", summary, IncumbentPayload(action="incumbent", artifact_id=args.candidate,
                                                            comparison_id=eligibility.comparison_id, previous=previous))
    return ToolOutcome(tool=NAME, status="done", summary=summary, data={"artifact_id": args.candidate})


def run(ctx: ToolContext, args: Args, decision_seq: int | None = None) -> ToolOutcome:
    return invoke(ctx, NAME, args, _body, decision_seq)
