"""Tool `compare`: judge a candidate against the incumbent under the session's registered bars, at the
candidate's served decoding (evals/compare.py records the verdict, or the refusal and its reasons).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from evals.compare import BarVerdict, compare
from tools.context import ToolContext, ToolOutcome, invoke, served_of
from tools.session import incumbent_of

NAME = "compare"


class Args(BaseModel):
    """Compare a candidate with the current incumbent under the registered bars."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    candidate: int = Field(description="Artifact id of the evaluated candidate.")


def latest_bars(ctx: ToolContext) -> int | None:
    registered = ctx.nb.decisions(ctx.session, kind="register_bars")
    return registered[-1].payload.get("bars_id") if registered else None


def _verdict_line(verdicts: list[BarVerdict]) -> str:
    return "; ".join(f"{v.bar.target} {v.bar.statistic}={v.value:.4g} {v.bar.op} {v.threshold:.4g} "
                     f"{'holds' if v.holds else 'fails'}" if isinstance(v.value, float) else f"{v.bar.target} {v.value}"
                     for v in verdicts)


def _body(ctx: ToolContext, args: Args) -> ToolOutcome:
    incumbent, bars_id = incumbent_of(ctx.nb, ctx.session), latest_bars(ctx)
    if bars_id is None:
        return ToolOutcome(tool=NAME, status="failed", summary="no bars registered in this session")
    name = ctx.nb.artifact(args.candidate).name
    done = [c for c in ctx.nb.comparisons(ctx.session)
            if (c.candidate, c.incumbent, c.bars_id) == (args.candidate, incumbent, bars_id)]
    if done:  # a resumed call whose comparison committed before the crash
        c = done[0]
        verdicts, promoted, cid = [BarVerdict.model_validate(v) for v in c.verdicts], c.promoted, c.id
    else:
        outcome = compare(ctx.nb, ctx.session, args.candidate, incumbent, bars_id, served_of(ctx, args.candidate))
        if outcome.refused:
            return ToolOutcome(tool=NAME, status="failed", summary=f"comparison of {name} refused: " + "; ".join(outcome.reasons),
                               data={"refused": True, "candidate": args.candidate})
        verdicts, promoted, cid = outcome.verdicts, outcome.promoted, outcome.comparison_id
    verdict = "clears every bar" if promoted else "fails the bars"
    draws = ctx.nb.bars(bars_id).spec.get("replicates", 1)
    means = f" (bars without a p-value on the mean of {draws} served draws a side)" if draws > 1 else ""
    summary = f"{name} vs incumbent {ctx.nb.artifact(incumbent).name} {verdict}{means}: {_verdict_line(verdicts)}"
    return ToolOutcome(tool=NAME, status="done", summary=summary,
                       data={"comparison_id": cid, "promoted": promoted, "candidate": args.candidate, "incumbent": incumbent})


def run(ctx: ToolContext, args: Args, decision_seq: int | None = None) -> ToolOutcome:
    return invoke(ctx, NAME, args, _body, decision_seq)
