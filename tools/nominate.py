"""Tool `nominate`: write a candidate's serving bundle and check it, as a job; only a bundle that
passes every check makes the `nominate` decision. A failing bundle is a recorded `refuse` listing
each failure (memory.records.BundleRefusal), its directory is removed, and the graph tries the next
candidate (then the parent).

The bundle job (`bundle_job`) reads the notebook read-only, writes the bundle to the candidate's
`bundles/<session>-<name>.candidate` directory (tools/nomination/bundle.py: weights, the one renderer's chat
template, served decoding, evidence, model card) and runs check-bundle on it (tools/nomination/check_bundle.py:
template compiles and renders like the trainer's renderer, the bundle reloads as a server loads it
and answers cleanly).

The nomination is not published yet: the sealed confirmation is opened for the nominee next
(tools/sealed_open.py; it needs this `nominate` decision), and tools/nomination/publish.py then rewrites the
card with the sealed result, checks that nothing else changed since this check and moves the bundle
to `bundles/<session>-<name>`.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from core.placement import measured
from memory.notebook import Notebook
from tools.context import ToolContext, ToolOutcome, invoke, record_once, served_of
from tools.nomination.bundle import BundleError, bundle_files, bundle_sha256, write_bundle
from tools.nomination.check_bundle import check_bundle, reload_device
from tools.nomination.staging import BundleOutcome, CardJob, refuse, staged_dir

NAME = "nominate"


class Args(BaseModel):
    """Nominate one checkpoint as the session's result (its bundle must pass check-bundle)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    artifact: int = Field(description="Artifact id of the nominee (normally the incumbent).")
    runner_up: int | None = Field(None, description="The best candidate not nominated (the card's third column).")


class BundleJob(CardJob):
    out_dir: Path = Field(description="Bundle directory (must not exist).")


def checked(path: Path, notebook: Path) -> BundleOutcome:
    """check-bundle on `path`; the outcome carries the bundle hash and every failed check."""
    report = check_bundle(path, notebook)
    problems = [f"{name}: {msg}" for name, msgs in report.failures().items() for msg in msgs]
    files = bundle_files(path)
    return BundleOutcome(path=str(path), sha256=bundle_sha256(files), passed=report.ok, problems=problems,
                         files={name: d.sha256 for name, d in files.items()})


def bundle_job(cfg: BundleJob) -> BundleOutcome:
    return _bundle(cfg).model_copy(update={"placement": measured(*reload_device(), tokens=0, seconds=0.0)})


def _bundle(cfg: BundleJob) -> BundleOutcome:
    if not cfg.out_dir.exists():  # (a requeued job whose bundle was written checks it again)
        with Notebook.open(cfg.notebook, readonly=True) as nb:
            try:
                write_bundle(nb, cfg.session, cfg.nominee, cfg.out_dir, parent_id=cfg.parent,
                             runner_up_id=cfg.runner_up)
            except BundleError as exc:
                return BundleOutcome(path="", sha256="", passed=False, problems=[f"writer: {exc}"])
    outcome = checked(cfg.out_dir, cfg.notebook)
    if not outcome.passed:  # the failures are the record; a refused bundle is not left to be mistaken for one
        shutil.rmtree(cfg.out_dir)
        return outcome.model_copy(update={"path": ""})
    return outcome


def _body(ctx: ToolContext, args: Args) -> ToolOutcome:
    # Imported here, not at the top: the bundle jobs unpickle this module in a fresh interpreter, and
    # these pull in torch and transformers (the publish job needs neither).
    from tools.evaluate import metrics_line
    from tools.session import parent_of

    artifact = ctx.nb.artifact(args.artifact)
    served = served_of(ctx, args.artifact)
    evals = [e for e in ctx.nb.evals(artifact_id=args.artifact, session=ctx.session)
             if e.served and e.decoding_sha256 == served.fingerprint()]
    if not evals:  # a bundle ships the decoding its evaluations used: nothing to bundle, no job
        return refuse(ctx, NAME, args.artifact, None,
                      [f"writer: {artifact.name} has no eval at its served decoding: a bundle ships what was measured"])
    cfg = BundleJob(notebook=ctx.paths.notebook, session=ctx.session, nominee=args.artifact,
                    parent=parent_of(ctx.nb, ctx.session), runner_up=args.runner_up,
                    out_dir=staged_dir(ctx, args.artifact))
    bundle, key = ctx.wait("bundle", bundle_job, cfg, nomination=True)
    if not bundle.passed:
        return refuse(ctx, NAME, args.artifact, key, bundle.problems)
    firsts = {e.suite: e for e in reversed(evals) if e.replicate == 0}
    summary = (f"nominee {artifact.name} served at decoding {served.fingerprint()[:12]}: "
               f"{metrics_line(list(firsts.values()))}; its bundle passed check-bundle ({bundle.path})")
    record_once(ctx, "nominate", summary, {"artifact_id": args.artifact})
    return ToolOutcome(tool=NAME, status="done", summary=summary, data={
        "artifact_id": args.artifact, "bundle": bundle.path, "job_key": key, "files": bundle.files})


def run(ctx: ToolContext, args: Args, decision_seq: int | None = None) -> ToolOutcome:
    return invoke(ctx, NAME, args, _body, decision_seq)
