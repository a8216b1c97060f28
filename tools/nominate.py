"""Tool `nominate`: write the nominee's serving bundle and check it, as a job; only a bundle that
passes every check makes the `nominate` decision (and a bundle artifact). A failing bundle is a
recorded refusal, and the graph falls back to the next candidate (then the parent).

The bundle job (`bundle_job`) reads the notebook read-only, writes the bundle (tools/bundle.py:
weights, the one renderer's chat template, served decoding, evidence, model card) and runs
check-bundle on it (tools/check_bundle.py: template compiles and renders like the trainer's
renderer, the bundle reloads as a server loads it and answers cleanly).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from memory.notebook import Notebook
from tools.bundle import BundleError, write_bundle
from tools.check_bundle import check_bundle
from tools.context import ToolContext, ToolOutcome, invoke, record_once, served_of
from tools.evaluate import metrics_line
from tools.promote import parent_of

NAME = "nominate"


class Args(BaseModel):
    """Nominate one checkpoint as the session's result (its bundle must pass check-bundle)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    artifact: int = Field(description="Artifact id of the nominee (normally the incumbent).")


class BundleJob(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    notebook: Path = Field(description="The lab notebook (read-only in the job).")
    session: str = Field(description="Session of the nominee.")
    nominee: int = Field(description="Artifact id of the nominee.")
    parent: int | None = Field(description="The session's parent (the card's baseline column).")
    out_dir: Path = Field(description="Bundle directory (must not exist).")


class BundleOutcome(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    path: str = Field(description="Bundle directory ('' when none was written).")
    sha256: str = Field(description="Bundle hash ('' when none was written).")
    passed: bool = Field(description="Every check passed.")
    problems: list[str] = Field(description="What failed: the writer's refusal or each failed check.")


def bundle_job(cfg: BundleJob) -> BundleOutcome:
    if cfg.out_dir.exists():  # a requeued job whose bundle was written: check it again
        return _checked(cfg.out_dir, "", cfg.notebook)
    with Notebook.open(cfg.notebook, readonly=True) as nb:
        try:
            result = write_bundle(nb, cfg.session, cfg.nominee, cfg.out_dir, parent_id=cfg.parent)
        except BundleError as exc:
            return BundleOutcome(path="", sha256="", passed=False, problems=[str(exc)])
    return _checked(result.path, result.sha256, cfg.notebook)


def _checked(path: Path, sha256: str, notebook: Path) -> BundleOutcome:
    report = check_bundle(path, notebook)
    problems = [f"{name}: {'; '.join(msgs)}" for name, msgs in report.failures().items()]
    return BundleOutcome(path=str(path), sha256=sha256, passed=report.ok, problems=problems)


def _body(ctx: ToolContext, args: Args) -> ToolOutcome:
    artifact = ctx.nb.artifact(args.artifact)
    served = served_of(ctx, args.artifact)
    evals = [e for e in ctx.nb.evals(artifact_id=args.artifact, session=ctx.session)
             if e.served and e.decoding_sha256 == served.fingerprint()]
    if not evals:  # a bundle ships the decoding its evaluations used: nothing to bundle, no job
        reason = f"{artifact.name} has no eval at its served decoding: a bundle ships what was measured"
        ctx.nb.record_decision(ctx.session, "refuse", reason, {"tool": NAME, "args": args.model_dump(mode="json"),
                                                               "reason": reason})
        return ToolOutcome(tool=NAME, status="failed", summary=reason)
    cfg = BundleJob(notebook=ctx.paths.notebook, session=ctx.session, nominee=args.artifact,
                    parent=parent_of(ctx.nb, ctx.session), out_dir=ctx.paths.bundle(f"{ctx.session}-{artifact.name}"))
    bundle, key = ctx.wait("bundle", bundle_job, cfg, gpus=0, nomination=True)
    if not bundle.passed:
        reason = f"bundle of {artifact.name} failed its checks: " + " | ".join(bundle.problems)[:800]
        ctx.nb.record_decision(ctx.session, "refuse", reason, {"tool": NAME, "args": args.model_dump(mode="json"),
                                                               "reason": reason})
        return ToolOutcome(tool=NAME, status="failed", summary=reason, data={"job_key": key})
    known = [a for a in ctx.nb.artifacts(kind="bundle", session=ctx.session) if a.job_key == key]
    if not known:
        ctx.nb.add_artifact(kind="bundle", name=Path(bundle.path).name, path=bundle.path, sha256=bundle.sha256,
                            parents=[args.artifact], job_key=key, session=ctx.session)
    firsts = {e.suite: e for e in reversed(evals) if e.replicate == 0}
    summary = (f"nominee {artifact.name} served at decoding {served.fingerprint()[:12]}: "
               f"{metrics_line(list(firsts.values()))}; bundle {bundle.path} passed check-bundle")
    record_once(ctx, "nominate", summary, {"artifact_id": args.artifact})
    return ToolOutcome(tool=NAME, status="done", summary=summary, data={"artifact_id": args.artifact,
                                                                        "bundle": bundle.path})


def run(ctx: ToolContext, args: Args, decision_seq: int | None = None) -> ToolOutcome:
    return invoke(ctx, NAME, args, _body, decision_seq)
