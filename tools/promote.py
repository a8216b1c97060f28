"""Tool `promote`: make a candidate the incumbent, only on a comparison under the bars that
promoted it against the current incumbent at its served decoding.

The session's first incumbent is its parent checkpoint (`start_incumbent`, at session start); after
that the incumbent is the artifact of the latest `promote` decision whose payload says
`action: incumbent`. (A comparison that clears the bars is itself recorded as a `promote` verdict;
making the candidate the incumbent is this separate, explicit step.)
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from core.util import file_sha256
from memory.notebook import Comparison, Notebook
from tools.context import ToolContext, ToolOutcome, invoke, record_once
from trainers.common import weights_sha256

NAME = "promote"


class Args(BaseModel):
    """Promote a candidate whose latest comparison against the incumbent cleared every bar."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    candidate: int = Field(description="Artifact id of the candidate.")


def parent_of(nb: Notebook, session: str) -> int | None:
    found = [a.id for a in nb.artifacts(kind="checkpoint", session=session) if a.recipe.get("role") == "parent"]
    return found[0] if found else None


def incumbent_of(nb: Notebook, session: str) -> int | None:
    """The session's incumbent: the latest promoted artifact, else its parent."""
    promoted = [d for d in nb.decisions(session, kind="promote") if d.payload.get("action") == "incumbent"]
    return promoted[-1].payload.get("artifact_id") if promoted else parent_of(nb, session)


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


def promoting_comparison(nb: Notebook, session: str, candidate: int) -> Comparison | None:
    """The candidate's latest comparison against the current incumbent, when it promoted."""
    incumbent = incumbent_of(nb, session)
    mine = [c for c in nb.comparisons(session) if c.candidate == candidate and c.incumbent == incumbent]
    return mine[-1] if mine and mine[-1].promoted else None


def _body(ctx: ToolContext, args: Args) -> ToolOutcome:
    previous = incumbent_of(ctx.nb, ctx.session)
    comparison = promoting_comparison(ctx.nb, ctx.session, args.candidate)
    if comparison is None:
        return ToolOutcome(tool=NAME, status="failed", summary=f"artifact {args.candidate} has no comparison against "
                           f"incumbent {previous} that cleared the bars")
    name = ctx.nb.artifact(args.candidate).name
    summary = f"{name} becomes the incumbent (was {ctx.nb.artifact(previous).name}): comparison {comparison.id} cleared every bar"
    record_once(ctx, "promote", summary, {"action": "incumbent", "artifact_id": args.candidate,
                                          "comparison_id": comparison.id, "previous": previous})
    return ToolOutcome(tool=NAME, status="done", summary=summary, data={"artifact_id": args.candidate})


def run(ctx: ToolContext, args: Args, decision_seq: int | None = None) -> ToolOutcome:
    return invoke(ctx, NAME, args, _body, decision_seq)
