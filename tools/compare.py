"""Tool `compare`: judge a candidate against the incumbent under the session's registered bars, at the
candidate's served decoding (evals/compare.py records the verdict, or the refusal and its reasons).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from evals.compare import compare
from memory.records import BarVerdict
from tools.context import ToolContext, ToolOutcome, invoke, served_of
from tools.session import view

NAME = "compare"


class Args(BaseModel):
    """Compare a candidate with the current incumbent under the registered bars."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    candidate: int = Field(description="Artifact id of the evaluated candidate.")


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
    if done:  # a resumed call whose comparison committed before the crash
        verdicts, cleared, cid = done[0].bars, done[0].cleared, done[0].comparison_id
    else:
        outcome = compare(ctx.nb, ctx.session, args.candidate, incumbent, bars.id, served_of(ctx, args.candidate))
        if outcome.refused:
            return ToolOutcome(tool=NAME, status="failed", summary=f"comparison of {name} refused: " + "; ".join(outcome.reasons),
                               data={"refused": True, "candidate": args.candidate})
        verdicts, cleared, cid = outcome.verdicts, outcome.cleared, outcome.comparison_id
    verdict = "clears every bar" if cleared else "fails the bars"
    draws = bars.replicates
    means = f" (bars without a p-value on the mean of {draws} served draws a side)" if draws > 1 else ""
    summary = f"{name} vs incumbent {ctx.nb.artifact(incumbent).name} {verdict}{means}: {_verdict_line(verdicts)}"
    return ToolOutcome(tool=NAME, status="done", summary=summary,
                       data={"comparison_id": cid, "cleared": cleared, "candidate": args.candidate, "incumbent": incumbent})


def run(ctx: ToolContext, args: Args, decision_seq: int | None = None) -> ToolOutcome:
    return invoke(ctx, NAME, args, _body, decision_seq)
