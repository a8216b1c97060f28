"""Tool `merge`: weight soups, dose interpolation and LoRA merge-back, as a job; the merged weights
become a candidate artifact served like its first input.

    soup:  models [a, b, ...] with weights summing to 1 (equal when not given)
    dose:  models [a, b] and alpha: a + alpha * (b - a) (alpha outside [0, 1] extrapolates)
    lora:  models [base, adapter]: the adapter merged into its base, a full checkpoint in the base's dtypes
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tools.context import (
    ToolContext,
    ToolOutcome,
    artifact_of_job,
    content_name,
    invoke,
    record_once,
    served_of,
)

NAME = "merge"


class Args(BaseModel):
    """Combine checkpoints by their artifact ids."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    method: Literal["soup", "dose", "lora"] = Field(description="soup (weighted average), dose (interpolate a -> b), lora (merge an adapter).")
    models: list[int] = Field(min_length=2, description="Artifact ids: soup members; dose [a, b]; lora [base, adapter].")
    weights: list[float] | None = Field(None, description="soup: one weight per model, summing to 1; equal when omitted.")
    alpha: float | None = Field(None, ge=-1.0, le=2.0, description="dose: position along a -> b.")

    @model_validator(mode="after")
    def _method_fields(self) -> Args:
        if self.method in ("dose", "lora") and len(self.models) != 2:
            raise ValueError(f"{self.method} takes exactly two models")
        if (self.method == "dose") != (self.alpha is not None):
            raise ValueError("alpha is required for dose and only for dose")
        if self.weights is not None and (self.method != "soup" or len(self.weights) != len(self.models)):
            raise ValueError("weights are for soup, one per model")
        return self


def _make(cls, out: Path, **fields):
    """The merge config; once its output exists (a resumed or replayed step re-attaching to the job
    that wrote it) the must-not-exist check would refuse the same config, so it is built unchecked."""
    if out.exists():
        return cls.model_construct(**fields, output_dir=out)
    return cls(**fields, output_dir=out)


def _job(args: Args, paths: list[Path], out: Path):
    from trainers import merge  # torch: loaded with the first merge, not with the agent

    match args.method:
        case "soup":
            weights = args.weights or [1.0 / len(paths)] * len(paths)
            return merge.soup, _make(merge.SoupConfig, out, models=paths, weights=weights)
        case "dose":
            return merge.dose, _make(merge.DoseConfig, out, a=paths[0], b=paths[1], alpha=args.alpha)
        case "lora":
            # Streamed shard by shard in the base's stored dtypes (trainers.merge.merge_lora), so the merged
            # checkpoint has its base's layout and can be souped with its siblings.
            return merge.merge_lora, _make(merge.LoRAMergeConfig, out, base=paths[0], adapter=paths[1])


def _body(ctx: ToolContext, args: Args) -> ToolOutcome:
    inputs = [ctx.nb.artifact(i) for i in args.models]
    # lora merges an adapter (a LoRA arm's own artifact, tools/train.py) into a checkpoint; the rest take checkpoints.
    kinds = ["checkpoint", "adapter"] if args.method == "lora" else ["checkpoint"] * len(inputs)
    if [a.kind for a in inputs] != kinds:
        return ToolOutcome(tool=NAME, status="failed", summary=f"{args.method} takes {', '.join(kinds)} artifacts "
                           f"(got {', '.join(a.kind for a in inputs)})")
    # The inputs by their sha256, never by notebook row ids (which another session or a replay numbers differently).
    name = content_name(args.method, {"args": args.model_dump(mode="json", exclude={"models"}),
                                      "inputs": [a.sha256 for a in inputs]})
    out = ctx.paths.merged(name)
    fn, cfg = _job(args, [Path(a.path) for a in inputs], out)
    result, key = ctx.wait("merge", fn, cfg)
    artifact_id = artifact_of_job(ctx, key)
    if artifact_id is None:
        recipe = {"merge": args.method, "models": args.models, "weights": args.weights, "alpha": args.alpha,
                  "parent": args.models[0], "served_decoding": served_of(ctx, args.models[0]).model_dump(mode="json")}
        artifact_id = ctx.nb.add_artifact(kind="checkpoint", name=name, path=str(result.output_dir),
                                          sha256=result.weights_sha256, parents=args.models, recipe=recipe,
                                          job_key=key, session=ctx.session).id
    detail = f"alpha {args.alpha:g}" if args.alpha is not None else f"weights {args.weights or 'equal'}"
    summary = f"{name}: {args.method} of {', '.join(a.name for a in inputs)} ({detail}), {result.tensors} tensors"
    record_once(ctx, "build", summary, {"artifact_id": artifact_id, "merge": args.method, "job_key": key})
    return ToolOutcome(tool=NAME, status="done", summary=summary, data={"artifact_id": artifact_id, "job_key": key})


def run(ctx: ToolContext, args: Args, decision_seq: int | None = None) -> ToolOutcome:
    return invoke(ctx, NAME, args, _body, decision_seq)
