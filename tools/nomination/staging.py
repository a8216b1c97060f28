"""A candidate's bundle before it is published: where it is staged, what the jobs that write, check and publish it
return, and the refusal of one that fails (tools/nominate.py writes and checks it, tools/nomination/publish.py moves
it into place; both ask this module, so the tool below never imports the tool above it)."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from core.placement import Placement
from core.versions import Versions
from core.wall import Wall
from memory.records import BundleRefusal
from tools.context import ToolContext, ToolOutcome

STAGED_SUFFIX = ".candidate"


class CardJob(BaseModel):
    """What a job writing a bundle's card reads: the notebook and the card's three columns."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    notebook: Path = Field(description="The lab notebook (read-only in the job).")
    session: str = Field(description="Session of the nominee.")
    nominee: int = Field(description="Artifact id of the nominee.")
    parent: int | None = Field(description="The session's parent (the card's baseline column).")
    runner_up: int | None = Field(None, description="The runner-up (the card's third column).")


class BundleOutcome(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    path: str = Field(description="Bundle directory ('' when none was written or it was removed).")
    sha256: str = Field(description="Bundle hash ('' when none was written).")
    passed: bool = Field(description="Every check passed.")
    problems: list[str] = Field(description="What failed: the writer's refusal or each failed check.")
    files: dict[str, str] = Field(default_factory=dict, description="sha256 of every file of the bundle as checked.")
    versions: Versions | None = Field(None, description="The versions of torch, transformers, peft, trl and mamba-ssm "
                                      "the bundle job ran with (stamped by the job wrapper, tools/jobs/jobrun.py).")
    placement: Placement | None = Field(None, description="The device the job held: where check-bundle's reload "
                                        "served the bundle (its GPU in bfloat16, else the CPU in float32).")
    wall: Wall | None = Field(None, description="Start-up, work and write-out seconds (completed by the job wrapper).")


def staged_dir(ctx: ToolContext, artifact_id: int) -> Path:
    """Where a candidate's bundle is written and checked before it is nominated."""
    return ctx.paths.bundle(f"{ctx.session}-{ctx.nb.artifact(artifact_id).name}{STAGED_SUFFIX}")


def refuse(ctx: ToolContext, tool: str, artifact_id: int, job_key: str | None, problems: list[str]) -> ToolOutcome:
    """Record a refused bundle (every failure listed) and report it as failed."""
    name = ctx.nb.artifact(artifact_id).name
    reason = f"bundle of {name} refused ({len(problems)} failure(s)): " + " | ".join(problems)
    ctx.nb.record_decision(ctx.session, "refuse", reason,
                           BundleRefusal(artifact_id=artifact_id, bundle_job=job_key, reasons=problems))
    return ToolOutcome(tool=tool, status="failed", summary=reason[:1000], data={"job_key": job_key} if job_key else {})
