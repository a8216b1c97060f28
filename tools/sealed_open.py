"""Tool `sealed_open`: score the sealed confirmation suites once, for the nominee only.

Each suite is opened (a `confirm` decision) before its job runs, so a crash cannot buy a second
look (evals/sealed.py); a refused opening is recorded and reported as refused. A battle suite (a
reward proxy or battle margin over the sealed battles) whose sealed battles hold no decisive vote has
nothing to score: its confirmation is recorded as undecided (in the outcome and the `evaluate`
decision), not run on no items.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from core.jsonl import read_values
from evals.sealed import SealedRefused, open_sealed
from tools.context import ToolContext, ToolOutcome, invoke, record_once, served_of
from tools.evaluate import eval_job, metrics_line, reference_completions, run_and_record
from tools.ingest import holdout_battles
from tools.session import parent_of, view

NAME = "sealed_open"


class Args(BaseModel):
    """Open the sealed confirmation suites for the nominee."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    artifact: int = Field(description="Artifact id of the nominee.")


def _body(ctx: ToolContext, args: Args) -> ToolOutcome:
    names = [s.name for s in ctx.lab.sealed_suites]
    if not names:
        return ToolOutcome(tool=NAME, status="failed", summary="the lab has no sealed suite")
    opened = {c.suite for c in view(ctx.nb, ctx.session).confirmed(args.artifact)}
    try:
        for suite in names:
            if suite not in opened:
                open_sealed(ctx.nb, ctx.session, suite, args.artifact)
    except SealedRefused as exc:
        return ToolOutcome(tool=NAME, status="refused", summary=str(exc))
    undecided = [n for n in names if _no_decisive_battle(ctx, n)]
    scored = [n for n in names if n not in undecided]
    evals, key = [], None
    if scored:
        # Judge suites confirm the nominee against the session's parent on the sealed prompts.
        reference = reference_completions(ctx, parent_of(ctx.nb, ctx.session), scored, nomination=True)
        cfg = eval_job(ctx, args.artifact, scored, served_of(ctx, args.artifact), True, 1, reference)
        evals, key = run_and_record(ctx, args.artifact, cfg, nomination=True)
    summary = f"sealed confirmation of {ctx.nb.artifact(args.artifact).name}: " + "; ".join(
        ([metrics_line(evals)] if scored else []) + [f"{n} undecided (its sealed battles hold no decisive vote)"
                                                     for n in undecided])
    record_once(ctx, "evaluate", summary, {"artifact_id": args.artifact, "eval_ids": [e.id for e in evals],
                                           "sealed": True, "job_key": key, "undecided": undecided})
    return ToolOutcome(tool=NAME, status="done", summary=summary, data={"artifact_id": args.artifact,
                                                                        "eval_ids": [e.id for e in evals],
                                                                        "undecided": undecided})


def _no_decisive_battle(ctx: ToolContext, name: str) -> bool:
    """Whether a sealed battle suite (no items file, not a judge suite) reads sealed battles of which none is
    decisive: ties and both-bad votes name no preferred answer, so there is nothing to score."""
    suite = ctx.lab.suite(name)
    if suite.file is not None or suite.judged:
        return False
    battles = holdout_battles(ctx, sealed=True)
    return battles is not None and battles.is_file() and not read_values(battles)


def run(ctx: ToolContext, args: Args, decision_seq: int | None = None) -> ToolOutcome:
    return invoke(ctx, NAME, args, _body, decision_seq)
