"""Tool `register_bars`: register the lab's promotion bars (hashed, time-stamped) before any scoring.

The bars file is the one lab.toml names (replay may substitute another with `--bars FILE`); the
planner can only name a file inside the lab, and the gates refuse anything else before this runs. Replay without
`--bars` registers, at each step, the typed bars its session recorded at that registration
(`LabSpec.replayed_bars`), never re-read from text.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from evals import bars
from tools.context import ToolContext, ToolOutcome, invoke
from tools.session import view

NAME = "register_bars"


class Args(BaseModel):
    """Register promotion bars for this session."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    file: str | None = Field(None, description="Bars file relative to the lab directory; default: the lab's bars file.")


def _body(ctx: ToolContext, args: Args) -> ToolOutcome:
    registered = view(ctx.nb, ctx.session).registrations
    # replay: the bars its session registered at this step (the i-th registration), typed
    spec = ctx.lab.replayed_bars(len(registered)) if args.file is None else None
    if spec is None:
        path = ctx.paths.root / args.file if args.file else ctx.lab.bars
        if path is None:
            return ToolOutcome(tool=NAME, status="failed", summary="the lab names no bars file ([bars] in lab.toml)")
        try:
            spec = bars.load(path).spec()
        except (ValueError, OSError) as exc:
            return ToolOutcome(tool=NAME, status="failed", summary=f"bars not registered: {exc}")
    # A resumed call whose registration committed before the crash: the same spec is already there.
    record = next((r for r in registered if r.spec == spec), None)
    if record is None:
        record = bars.register(ctx.nb, ctx.session, spec)
    rules = "; ".join(f"{r.target} {r.text()}" for r in spec.bars)
    return ToolOutcome(tool=NAME, status="done", summary=f"bars {record.sha256[:12]} registered: {rules}",
                       data={"bars_id": record.id, "sha256": record.sha256})


def run(ctx: ToolContext, args: Args, decision_seq: int | None = None) -> ToolOutcome:
    return invoke(ctx, NAME, args, _body, decision_seq)
