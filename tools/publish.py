"""Tool `publish`: the nominee's checked bundle, with its card rewritten after the sealed confirmation,
checked again and moved to its final place (`bundles/<session>-<name>`); recorded as a `bundle` artifact.

The order of the nomination step (agent/graph.py): `nominate` writes and checks a candidate's bundle
and records the `nominate` decision; `sealed_open` scores the sealed suites once, for that nominee;
`publish` (this tool) rewrites `README.md` and `training_evidence.json` from the notebook as it now
stands (the sealed result and its records in the card, the evidence's last decision after it), runs
check-bundle on the whole bundle again, and renames it into place. Weights, tokenizer, template and
configs are the files the nomination check passed; only the two notebook-derived files change.

A bundle that fails here is a recorded `refuse` and stays at its candidate path; the session then
ends failed (the sealed suites were opened for this nominee and cannot be opened for another).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from evals.sealed import nominee as nominee_of
from memory.notebook import Notebook
from tools.bundle import BundleError, TrainingEvidence, write_records
from tools.context import ToolContext, ToolOutcome, invoke
from tools.nominate import STAGED_SUFFIX, BundleOutcome, checked, refuse, staged_dir
from tools.promote import parent_of

NAME = "publish"


class Args(BaseModel):
    """Publish the nominee's bundle with its final model card."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    artifact: int = Field(description="Artifact id of the nominee (the latest `nominate` decision's).")
    runner_up: int | None = Field(None, description="The best candidate not nominated (the card's third column).")


class PublishJob(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    notebook: Path = Field(description="The lab notebook (read-only in the job).")
    session: str = Field(description="Session of the nominee.")
    nominee: int = Field(description="Artifact id of the nominee.")
    parent: int | None = Field(description="The session's parent (the card's baseline column).")
    runner_up: int | None = Field(description="The runner-up (the card's third column).")
    staged: Path = Field(description="The nominee's checked candidate bundle.")
    out_dir: Path = Field(description="Final bundle directory (must not exist).")


def _same_nominee(nb: Notebook, staged: Path, nominee: int) -> str | None:
    """Why the candidate bundle is not this nominee's, or None."""
    evidence = TrainingEvidence.model_validate_json((staged / "training_evidence.json").read_text(encoding="utf-8"))
    if evidence.nominee != nominee or evidence.nominee_sha256 != nb.artifact(nominee).sha256:
        return (f"writer: {staged} holds artifact {evidence.nominee} ({evidence.nominee_sha256[:16]}...); "
                f"expected the nominee {nominee}")
    return None


def publish_job(cfg: PublishJob) -> BundleOutcome:
    if cfg.out_dir.exists():  # a requeued job that renamed it already: check it again
        return checked(cfg.out_dir, cfg.notebook)
    with Notebook.open(cfg.notebook, readonly=True) as nb:
        wrong = _same_nominee(nb, cfg.staged, cfg.nominee)
        if wrong:
            return BundleOutcome(path=str(cfg.staged), sha256="", passed=False, problems=[wrong])
        try:
            write_records(nb, cfg.session, cfg.nominee, cfg.staged, cfg.parent, cfg.runner_up)
        except BundleError as exc:
            return BundleOutcome(path=str(cfg.staged), sha256="", passed=False, problems=[f"writer: {exc}"])
    outcome = checked(cfg.staged, cfg.notebook)
    if not outcome.passed:
        return outcome
    cfg.staged.rename(cfg.out_dir)  # atomic: the final path holds a checked bundle or nothing
    return outcome.model_copy(update={"path": str(cfg.out_dir)})


def _body(ctx: ToolContext, args: Args) -> ToolOutcome:
    if nominee_of(ctx.nb, ctx.session) != args.artifact:
        return ToolOutcome(tool=NAME, status="failed",
                           summary=f"artifact {args.artifact} is not the session's nominee: nothing to publish")
    staged = staged_dir(ctx, args.artifact)
    out = staged.with_name(staged.name.removesuffix(STAGED_SUFFIX))
    if not staged.is_dir() and not out.is_dir():
        return refuse(ctx, NAME, args.artifact, None, [f"writer: {staged}: the nominee's checked bundle is gone"])
    cfg = PublishJob(notebook=ctx.paths.notebook, session=ctx.session, nominee=args.artifact,
                     parent=parent_of(ctx.nb, ctx.session), runner_up=args.runner_up, staged=staged, out_dir=out)
    bundle, key = ctx.wait("bundle", publish_job, cfg, gpus=0, nomination=True)
    if not bundle.passed:
        return refuse(ctx, NAME, args.artifact, key, bundle.problems)
    if not [a for a in ctx.nb.artifacts(kind="bundle", session=ctx.session) if a.job_key == key]:
        ctx.nb.add_artifact(kind="bundle", name=out.name, path=bundle.path, sha256=bundle.sha256,
                            parents=[args.artifact], job_key=key, session=ctx.session,
                            recipe={"runner_up": args.runner_up, "parent": cfg.parent})
    summary = f"bundle of {ctx.nb.artifact(args.artifact).name} published at {bundle.path} (sha256 {bundle.sha256[:12]})"
    return ToolOutcome(tool=NAME, status="done", summary=summary,
                       data={"artifact_id": args.artifact, "bundle": bundle.path, "job_key": key})


def run(ctx: ToolContext, args: Args, decision_seq: int | None = None) -> ToolOutcome:
    return invoke(ctx, NAME, args, _body, decision_seq)
