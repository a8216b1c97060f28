"""Tool `calibrate`: evaluate the incumbent K >= 3 times on every open suite at its served decoding
and store each suite's noise floor (invariant 3: noise before deltas). Replicate 0 is also the
incumbent's baseline, the look every comparison against it reads.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from evals import noise
from tools.context import ToolContext, ToolOutcome, invoke, served_of
from tools.evaluate import MissingReference, eval_job, metrics_line, reference_completions, run_and_record
from tools.session import view

NAME = "calibrate"


class Args(BaseModel):
    """Calibrate the noise floor of a checkpoint (the incumbent) on the open suites."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    artifact: int = Field(description="Artifact id of the checkpoint, normally the incumbent.")
    k: int = Field(3, ge=3, le=16, description="Replicates (K >= 3).")


def _body(ctx: ToolContext, args: Args) -> ToolOutcome:
    names = [s.name for s in ctx.lab.open_suites]
    served = served_of(ctx, args.artifact)
    try:
        # Judge suites score the incumbent against its own first answers: the noise of self-play.
        reference = reference_completions(ctx, args.artifact, names)
        cfg = eval_job(ctx, args.artifact, names, served, True, args.k, reference)
    except MissingReference as exc:
        return ToolOutcome(tool=NAME, status="failed", summary=str(exc))
    evals, key = run_and_record(ctx, args.artifact, cfg)
    floors, state = [], view(ctx.nb, ctx.session)
    for suite in names:
        reps = [e for e in evals if e.suite == suite]
        known = [f.record for name in reps[0].metrics for f in state.floors
                 if (f.record.suite, f.record.metric) == (suite, name)
                 and sorted(f.record.source_evals) == sorted(e.id for e in reps)]
        floors += known or noise.calibrate(ctx.nb, ctx.session, reps)
    name = ctx.nb.artifact(args.artifact).name
    widths = ", ".join(f"{f.suite}/{f.metric}={f.mean_abs_delta:.3f}" for f in floors if not f.metric.startswith("n_"))
    summary = f"{name}: K={args.k} baseline {metrics_line(evals)}; noise floors {widths}"
    return ToolOutcome(tool=NAME, status="done", summary=summary,
                       data={"artifact_id": args.artifact, "noise_floor_ids": [f.id for f in floors], "job_key": key,
                             "reference": reference})


def run(ctx: ToolContext, args: Args, decision_seq: int | None = None) -> ToolOutcome:
    return invoke(ctx, NAME, args, _body, decision_seq)
