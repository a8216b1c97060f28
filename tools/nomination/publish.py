"""Tool `publish`: the nominee's checked bundle, its card rewritten after the sealed confirmation, moved to
its final place (`bundles/<session>-<name>`) and recorded as a `bundle` artifact.

The order of the nomination step (agent/graph.py): `nominate` writes a candidate's bundle, runs
check-bundle on it and records the `nominate` decision; `sealed_open` scores the sealed suites once,
for that nominee; `ground_truth` (when the lab declares [truth]) records its ground truth; `publish`
(this tool) rewrites the two files read from the notebook, `README.md` and `training_evidence.json`,
as the notebook now stands (the sealed result and the ground truth in the card, with their records;
the evidence's last decision after them), and renames the bundle into place.

What it checks, in a job (replay serves it, so replay writes no bundle): every other file has the
sha256 it had when check-bundle passed (the weights, tokenizer, template and configs are the ones
checked, so the reload and template checks still hold without loading the model again), the bundle
is the nominee's, and the evidence's last decision is in the notebook's chain. A failure is a
recorded `refuse` and the bundle stays at its candidate path; the session then ends failed (the
sealed suites were opened for this nominee and cannot be opened for another).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from evals.sealed import nominee as nominee_of
from memory.notebook import Notebook
from tools.context import ToolContext, ToolOutcome, invoke
from tools.nomination.bundle import BundleError, TrainingEvidence, bundle_files, bundle_sha256, write_records
from tools.nomination.staging import STAGED_SUFFIX, BundleOutcome, CardJob, refuse, staged_dir

NAME = "publish"
REWRITTEN = ("README.md", "training_evidence.json")


class Args(BaseModel):
    """Publish the nominee's bundle with its final model card."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    artifact: int = Field(description="Artifact id of the nominee (the latest `nominate` decision's).")
    runner_up: int | None = Field(None, description="The best candidate not nominated (the card's third column).")


class PublishJob(CardJob):
    staged: Path = Field(description="The nominee's checked candidate bundle.")
    out_dir: Path = Field(description="Final bundle directory.")
    checked: dict[str, str] = Field(description="sha256 of every file when check-bundle passed on it.")


def changed_files(path: Path, checked: dict[str, str]) -> list[str]:
    """Every file, but the two rewritten from the notebook, whose bytes differ from the checked ones."""
    now = {name: d.sha256 for name, d in bundle_files(path).items()}
    problems = []
    for name in sorted((set(checked) | set(now)) - set(REWRITTEN)):
        if name not in now:
            problems.append(f"files: {name} was checked but is gone; expected the checked bundle unchanged")
        elif name not in checked:
            problems.append(f"files: {name} appeared after the check; expected the checked bundle unchanged")
        elif now[name] != checked[name]:
            problems.append(f"files: {name} has sha256 {now[name][:16]}..., checked as {checked[name][:16]}...; "
                            "expected the checked bytes")
    return problems


def _nominee_problems(nb: Notebook, path: Path, nominee: int) -> list[str]:
    """Why the bundle at `path` is not the nominee's checked bundle (empty when it is)."""
    if not (path / "training_evidence.json").is_file():
        return [f"writer: {path}: the nominee's checked bundle is not there"]
    evidence = TrainingEvidence.model_validate_json((path / "training_evidence.json").read_text(encoding="utf-8"))
    if evidence.nominee != nominee or evidence.nominee_sha256 != nb.artifact(nominee).sha256:
        return [f"writer: {path} holds artifact {evidence.nominee} ({evidence.nominee_sha256[:16]}...); "
                f"expected the nominee {nominee}"]
    return []


def _chain_problems(nb: Notebook, path: Path, session: str) -> list[str]:
    """The evidence's last decision is in the notebook's chain with the hash it records."""
    last = TrainingEvidence.model_validate_json((path / "training_evidence.json").read_text(encoding="utf-8")).last_decision
    if nb.recorded_hash(session, last.seq) != last.hash:
        return [f"decision_hash: decision {last.seq} of session {session} is not in the notebook's chain with hash "
                f"{last.hash}; expected the evidence's last decision in the chain"]
    return []


def publish_job(cfg: PublishJob) -> BundleOutcome:
    done = cfg.out_dir.exists()  # a requeued job that renamed it already: verify it again
    path = cfg.out_dir if done else cfg.staged
    with Notebook.open(cfg.notebook, readonly=True) as nb:
        problems = _nominee_problems(nb, path, cfg.nominee)
        if not problems and not done:
            try:
                write_records(nb, cfg.session, cfg.nominee, path, cfg.parent, cfg.runner_up)
            except BundleError as exc:
                problems = [f"writer: {exc}"]
        if not problems:
            problems = _chain_problems(nb, path, cfg.session) + changed_files(path, cfg.checked)
    if problems:
        return BundleOutcome(path=str(path), sha256="", passed=False, problems=problems)
    if not done:
        path = path.rename(cfg.out_dir)  # atomic: the final path holds a checked bundle or nothing
    files = bundle_files(path)
    return BundleOutcome(path=str(path), sha256=bundle_sha256(files), passed=True, problems=[],
                         files={name: d.sha256 for name, d in files.items()})


def _checked_files(ctx: ToolContext, artifact_id: int) -> dict[str, str] | None:
    """What check-bundle saw of the nominee's bundle (its nominate call's outcome)."""
    for c in ctx.nb.tool_calls(ctx.session):
        if c.tool == "nominate" and c.status == "done" and c.args.get("artifact") == artifact_id:
            return c.outcome.data.get("files") if c.outcome is not None else None
    return None


def _body(ctx: ToolContext, args: Args) -> ToolOutcome:
    from tools.session import parent_of  # here: the job's interpreter loads this module without torch

    checked = _checked_files(ctx, args.artifact)
    if nominee_of(ctx.nb, ctx.session) != args.artifact or checked is None:
        return ToolOutcome(tool=NAME, status="failed",
                           summary=f"artifact {args.artifact} is not the session's checked nominee: nothing to publish")
    staged = staged_dir(ctx, args.artifact)
    out = staged.with_name(staged.name.removesuffix(STAGED_SUFFIX))
    cfg = PublishJob(notebook=ctx.paths.notebook, session=ctx.session, nominee=args.artifact,
                     parent=parent_of(ctx.nb, ctx.session), runner_up=args.runner_up, staged=staged, out_dir=out,
                     checked=checked)
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
