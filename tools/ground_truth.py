"""Tool `ground_truth`: the nominee's true win rate against the session's parent, by the noise-free scorer the
lab declares in lab.toml (`[truth]`), as a job; its result is recorded as a `truth` decision.

    [truth]
    kind = "world"     # the toy world's oracle on a fresh sample (tools/world/truth.py)
    n = 300

The nomination step (agent/graph.py) runs it after the sealed confirmation and before `publish`, on the
nomination reserve like the sealed confirmation, so that the card (tools/nomination/card.py) and the session report
(memory/report.py) show it. It measures the agent; it is not evidence the agent may use: the planner's
summary (agent/summary.py) leaves out its call, its job and its decision, no planner tool can ask for it,
and nothing after it decides anything but publishing the bundle. A lab without `[truth]` gets no job and
no record.

Scorers (one so far): `world` draws a fresh sample apart from every prompt of the lab's world (feedback of
all splits, suite files, replay data), leak-audits it against them, and has the oracle judge the nominee's
answers against the parent's, both at the world's served decoding.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from evals.sealed import nominee as nominee_of
from memory.records import TruthPayload
from tools.context import ToolContext, ToolOutcome, invoke, record_once
from tools.session import parent_of
from tools.world.truth import TruthResult, truth

NAME = "ground_truth"
JOB_KIND = "truth"
WORLD_SPEC = Path("world") / "world.json"  # what a world build leaves in its lab (tools/world/build.py)


class Args(BaseModel):
    """Measure the nominee's ground truth against the parent (the nomination step only)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    artifact: int = Field(description="Artifact id of the nominee.")


class TruthJob(BaseModel):
    """What the ground-truth job scores: two checkpoints, by one scorer, on one fresh sample."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["world"] = Field(description="The scorer ([truth] kind).")
    lab: Path = Field(description="Lab directory (the world the scorer samples from).")
    checkpoint: Path = Field(description="The nominee's weights.")
    other: Path = Field(description="The parent's weights.")
    n: int = Field(description="Prompts of the sample.")
    seed: int = Field(description="Sample seed.")
    device: str = Field("cpu", description="torch device, as the eval jobs use.")
    # Left out of the dump at its default, so truth jobs recorded before it keep their keys.
    dtype: str = Field("float32", exclude_if=lambda v: v == "float32",
                       description="Weights dtype: the lab's gpu_dtype on a GPU, float32 on the CPU.")


def truth_job(cfg: TruthJob) -> TruthResult:
    return truth(cfg.lab, cfg.checkpoint, str(cfg.other), n=cfg.n, seed=cfg.seed, device=cfg.device, dtype=cfg.dtype)


def truth_sizing(cfg: TruthJob) -> dict[str, Any]:
    """What the launcher forecasts the truth job from: both sides' answers to the sample at the served cap (the
    tokens it generates at most) with the nominee's active parameters."""
    from tools.world.build import TOKENIZER, load_spec, served_decoding
    from trainers.recipe import model_shape

    cap = served_decoding(cfg.lab / TOKENIZER, load_spec(cfg.lab).sizes).max_new_tokens
    try:
        return {"job_class": "eval", "tokens": float(2 * cfg.n * cap),
                "active_params": model_shape(cfg.checkpoint).params_active}
    except (OSError, ValueError, KeyError):  # no readable config.json: the forecast falls back to its bound
        return {"job_class": "eval", "tokens": float(2 * cfg.n * cap)}


def scorer_problem(kind: str, lab_dir: Path) -> str | None:
    """Why a declared scorer cannot score in this lab (None when it can): lab.toml's loader asks."""
    if kind == "world" and not (lab_dir / WORLD_SPEC).is_file():
        return (f"kind = 'world' scores in the toy world built in this lab directory, and {lab_dir / WORLD_SPEC} "
                "is not there (build it with `python run_agent.py world build --lab DIR`, or remove [truth])")
    return None


def payload(result: TruthResult, artifact_id: int, parent_id: int, kind: str, job_key: str) -> TruthPayload:
    """The `truth` decision of a result (the checkpoint paths are in the two artifacts' rows)."""
    kept = result.model_dump(exclude={"checkpoint", "other", "placement", "versions", "wall"})
    return TruthPayload(artifact_id=artifact_id, parent=parent_id, scorer=kind, job_key=job_key, **kept)


def _body(ctx: ToolContext, args: Args) -> ToolOutcome:
    spec, parent = ctx.lab.truth, parent_of(ctx.nb, ctx.session)
    if spec is None or parent is None or nominee_of(ctx.nb, ctx.session) != args.artifact:
        return ToolOutcome(tool=NAME, status="failed", summary=f"no ground truth for artifact {args.artifact}: it is "
                           "measured for the session's nominee against its parent, when the lab declares [truth]")
    cfg = TruthJob(kind=spec.kind, lab=ctx.paths.root, checkpoint=Path(ctx.nb.artifact(args.artifact).path),
                   other=Path(ctx.nb.artifact(parent).path), n=spec.n, seed=spec.seed,
                   device=ctx.placement(JOB_KIND)[0], dtype=ctx.placement(JOB_KIND)[1])
    result, key = ctx.wait(JOB_KIND, truth_job, cfg, nomination=True, **truth_sizing(cfg))
    found = payload(result, args.artifact, parent, spec.kind, key)
    summary = (f"ground truth of {ctx.nb.artifact(args.artifact).name} vs the parent ({spec.kind}, n = {found.n}): "
               f"win rate {found.win_rate:.3f} [{found.ci_low:.3f}, {found.ci_high:.3f}]")
    record_once(ctx, "truth", summary, found.model_dump(mode="json"))
    return ToolOutcome(tool=NAME, status="done", summary=summary, data={"artifact_id": args.artifact, "job_key": key})


def run(ctx: ToolContext, args: Args, decision_seq: int | None = None) -> ToolOutcome:
    return invoke(ctx, NAME, args, _body, decision_seq)
