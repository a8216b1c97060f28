"""Tool `compare`: judge a candidate against the incumbent under the session's registered bars, at the
candidate's served decoding (evals/compare.py records the verdict, or the refusal and its reasons).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from evals.compare import compare
from memory.records import BarVerdict, LookPayload
from tools.context import ToolContext, ToolOutcome, invoke, served_of
from tools.session import view

NAME = "compare"


class Args(BaseModel):
    """Compare a candidate with the current incumbent under the registered bars."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    candidate: int = Field(description="Artifact id of the evaluated candidate.")
    look: int | None = Field(None, ge=1, le=8, description="Under bars with sequential looks: this look at the p bars "
                             "(it reads the candidate's served draws 0 .. look-1 of their suite) and may end unresolved, "
                             "nothing spent, so that more evidence can be bought. None: one look, decided.")
    reserve: bool = Field(False, description="This look is the reserve look: the last registered look, reading the "
                          "candidate's draws of the dev holdout with its first look at the reserve split's prompts "
                          "(evaluate it and the incumbent with `reserve` first). Only where the split holds a reserve.")

    @model_serializer(mode="wrap")
    def _without_no_look(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Recorded without `look` when there is none and without `reserve` when false: a call is keyed by its
        canonical args, and calls recorded before the keys existed must keep their key (replay and resume match
        them)."""
        data = handler(self)
        return {k: v for k, v in data.items() if (k != "look" or v is not None) and (k != "reserve" or v)}


def _verdict_line(verdicts: list[BarVerdict]) -> str:
    return "; ".join(f"{v.bar.target} {v.bar.statistic}={v.value:.4g} {v.bar.op} {v.threshold:.4g} "
                     f"{'holds' if v.holds else 'fails'}" if isinstance(v.value, float) else f"{v.bar.target} {v.value}"
                     for v in verdicts)


def _body(ctx: ToolContext, args: Args) -> ToolOutcome:
    state = view(ctx.nb, ctx.session)
    incumbent, bars = state.incumbent, state.bars
    if bars is None:
        return ToolOutcome(tool=NAME, status="failed", summary="no bars registered in this session")
    name = ctx.nb.artifact(args.candidate).name
    done = [v for v in state.verdicts if (v.candidate, v.incumbent, v.bars_id) == (args.candidate, incumbent, bars.id)]
    looked = [x.payload for x in state.looks if (x.payload.candidate, x.payload.incumbent, x.payload.bars_id,
                                                 x.payload.look) == (args.candidate, incumbent, bars.id, args.look)]
    if looked and looked[-1].outcome == "continue":  # a resumed call whose unresolved look committed
        return _unresolved(ctx, name, args, incumbent, looked)
    if done:  # a resumed call whose comparison committed before the crash
        verdicts, cleared, cid = done[0].bars, done[0].cleared, done[0].comparison_id
    else:
        outcome = compare(ctx.nb, ctx.session, args.candidate, incumbent, bars.id, served_of(ctx, args.candidate),
                          look=args.look, reserve=args.reserve)
        if outcome.refused:
            return ToolOutcome(tool=NAME, status="failed", summary=f"comparison of {name} refused: " + "; ".join(outcome.reasons),
                               data={"refused": True, "candidate": args.candidate})
        if outcome.unresolved:
            return _unresolved(ctx, name, args, incumbent, outcome.looks)
        verdicts, cleared, cid = outcome.verdicts, outcome.cleared, outcome.comparison_id
    verdict = "clears every bar" if cleared else "fails the bars"
    draws = bars.replicates
    means = f" (bars without a p-value on the mean of {draws} served draws a side)" if draws > 1 else ""
    summary = f"{name} vs incumbent {ctx.nb.artifact(incumbent).name} {verdict}{means}: {_verdict_line(verdicts)}"
    return ToolOutcome(tool=NAME, status="done", summary=summary,
                       data={"comparison_id": cid, "cleared": cleared, "candidate": args.candidate, "incumbent": incumbent})


def _unresolved(ctx: ToolContext, name: str, args: Args, incumbent: int, looks: list[LookPayload]) -> ToolOutcome:
    lines = "; ".join(f"{x.target} look {x.look} of {x.looks}: {x.reason}" for x in looks)
    return ToolOutcome(tool=NAME, status="done", summary=f"{name} vs incumbent {ctx.nb.artifact(incumbent).name} "
                       f"unresolved, nothing spent: {lines}",
                       data={"unresolved": True, "look": args.look, "candidate": args.candidate, "incumbent": incumbent})


def run(ctx: ToolContext, args: Args, decision_seq: int | None = None) -> ToolOutcome:
    return invoke(ctx, NAME, args, _body, decision_seq)
