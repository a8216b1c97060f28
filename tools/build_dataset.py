"""Tool `build_dataset`: build one audited training set (any builder of tools/data/datasets.py) as a job.

The planner names the builder and its intent (repeat, cleanup, task counts, parts by dataset id);
the tool fills in the lab's files: the feedback, the session's split, every eval suite as an audit
reference, the serving system prompt. The build's leak audit runs in the job: a leaking dataset is
never written, and the failed job is recorded as data.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from evals.synthetic import Family
from tools import ingest
from tools.context import ToolContext, ToolOutcome, content_name, invoke, record_once, served_of
from tools.data import generated
from tools.data.datasets import BUILDERS as DATA_BUILDERS
from tools.data.datasets import DatasetManifest, MixPart, record_dataset

NAME = "build_dataset"
Builder = Literal["winner_sft", "battle_pairs", "replay_mix", "synthetic_verified", "verified_pool", "mix",
                  "own_replay", "loop_fix_pairs"]
BUILDERS = DATA_BUILDERS | generated.BUILDERS
GENERATING = frozenset(generated.BUILDERS)


class PartArg(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    dataset: int = Field(description="Artifact id of a built dataset.")
    weight: float = Field(1.0, gt=0, description="Row multiplier of this part.")
    kl_only: bool = Field(False, description="Replay part: its rows only anchor the model to its parent (KL-CE).")


class Args(BaseModel):
    """Build a dataset from the session's train split (never its holdouts) or from local data."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    builder: Builder = Field(description="winner_sft (preferred answers), battle_pairs (DPO pairs), replay_mix "
                                         "(local data), synthetic_verified (checked tasks), verified_pool (RFT items "
                                         "from the lab's own verified [[data]] pool), mix (of built datasets).")
    repeat: int = Field(1, ge=1, le=8, description="winner_sft: times each preferred answer is repeated.")
    cleanup: bool = Field(False, description="winner_sft / battle_pairs: strip citation markers and source links.")
    rows: Literal["sft", "items"] = Field("items", description="synthetic_verified: SFT rows, or prompt items for RFT.")
    counts: dict[Family, int] = Field(default_factory=dict, description="synthetic_verified: tasks per family.")
    parts: list[PartArg] = Field(default_factory=list, description="mix: the built datasets to combine.")
    source: str | None = Field(None, description="verified_pool: the [[data]] pool's name (kind = 'verified').")
    n: int | None = Field(None, gt=0, description="verified_pool: items drawn (all when unset); own_replay: prompts "
                          "answered.")
    model: int | None = Field(None, description="own_replay / loop_fix_pairs: artifact id of the checkpoint whose own "
                              "answers are generated (at its served decoding).")
    seed: int = Field(0, ge=0, description="Sampling / generation seed.")


def _by_content(ctx: ToolContext, args: Args) -> dict[str, Any]:
    """The arguments as an output's name hashes them: artifacts by their sha256, never by notebook row ids
    (another session in the lab, or a replay's scratch notebook, numbers the same artifacts differently)."""
    out = args.model_dump(mode="json")
    out["parts"] = [p | {"dataset": ctx.nb.artifact(p["dataset"]).sha256} for p in out["parts"]]
    if args.model is not None:
        out["model"] = ctx.nb.artifact(args.model).sha256
    return out


class BuildJob(BaseModel):
    """Config of the build job: one builder and its full config."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    builder: Builder = Field(description="Builder name (tools.data.datasets.BUILDERS).")
    config: dict[str, Any] = Field(description="The builder's config as JSON.")


def build_job(cfg: BuildJob) -> DatasetManifest:
    config_type, build = BUILDERS[cfg.builder]
    return build(config_type.model_validate(cfg.config))


def _config(ctx: ToolContext, args: Args, out: Path, split: Path) -> dict[str, Any]:
    lab = ctx.lab
    base: dict[str, Any] = {"out": str(out), "tokenizer": str(lab.tokenizer), "feedback": str(lab.feedback),
                            "split": str(split), "eval_suites": [str(s.file) for s in lab.suites if s.file is not None]}
    prompt = lab.served.system_prompt
    match args.builder:
        case "winner_sft":
            return base | {"system_prompt": prompt, "repeat": args.repeat, "cleanup": args.cleanup}
        case "battle_pairs":
            return base | {"system_prompt": prompt, "cleanup": args.cleanup}
        case "replay_mix":
            return base | {"system_prompt": prompt, "sources": [s.model_dump(mode="json") for s in lab.data],
                           "seed": args.seed}
        case "synthetic_verified":
            return base | {"system_prompt": prompt, "rows": args.rows, "counts": args.counts, "seed": args.seed}
        case "verified_pool":
            [pool] = [v for v in lab.verified if v.name == args.source]
            return base | {"source": pool.model_dump(mode="json"), "n": args.n, "seed": args.seed}
        case "mix":
            parts = [MixPart(path=Path(ctx.nb.artifact(p.dataset).path), weight=p.weight, kl_only=p.kl_only)
                     for p in args.parts]
            return base | {"parts": [p.model_dump(mode="json") for p in parts], "seed": args.seed}
        case "own_replay" | "loop_fix_pairs":
            device, dtype = ctx.placement("reference")
            decoding = served_of(ctx, args.model)
            gen = base | {"system_prompt": decoding.system_prompt, "model": ctx.nb.artifact(args.model).path,
                          "decoding": decoding.model_dump(mode="json"), "seed": args.seed, "device": device,
                          "dtype": dtype, "batch_size": lab.eval_batch_size or 64}
            if args.builder == "own_replay":
                return gen | {"sources": [s.model_dump(mode="json") for s in lab.data], "n": args.n}
            return gen | {"counts": args.counts}


def _problem(ctx: ToolContext, args: Args) -> str | None:
    if args.builder == "replay_mix" and not ctx.lab.data:
        return "replay_mix needs [[data]] sources in lab.toml; the lab has none"
    if args.builder == "verified_pool" and args.source not in {v.name for v in ctx.lab.verified}:
        known = ", ".join(v.name for v in ctx.lab.verified) or "none"
        return f"verified_pool needs source: a [[data]] pool of kind 'verified' (the lab's: {known})"
    if args.builder in ("synthetic_verified", "loop_fix_pairs") and not args.counts:
        return f"{args.builder} needs counts (tasks per family)"
    if args.builder in GENERATING:
        known = {a.id for a in ctx.nb.artifacts(kind="checkpoint", session=ctx.session)}
        if args.model not in known:
            return f"{args.builder} needs model: a checkpoint of this session whose own answers it generates"
        if args.builder == "own_replay" and (not ctx.lab.data or args.n is None):
            return "own_replay needs n and the lab's [[data]] chat sources (their prompts are answered)"
    if args.builder == "mix":
        if not args.parts:
            return "mix needs parts"
        for p in args.parts:
            if p.dataset not in {a.id for a in ctx.nb.artifacts(kind="dataset", session=ctx.session)}:
                return f"mix part {p.dataset} is not a dataset built in this session"
    return None


def _body(ctx: ToolContext, args: Args) -> ToolOutcome:
    split = ctx.nb.latest_split()
    if split is None:
        return ToolOutcome(tool=NAME, status="failed", summary="no feedback split yet: ingest first")
    problem = _problem(ctx, args)
    if problem:
        return ToolOutcome(tool=NAME, status="failed", summary=problem)
    name = content_name(args.builder, {"args": _by_content(ctx, args), "split": split.sha256})
    cfg = BuildJob(builder=args.builder, config=_config(ctx, args, ctx.paths.dataset(name), ingest.split_path(ctx, split.sha256)))
    if args.builder in GENERATING:  # a model generates: a job on the device the lab gives reference answers
        manifest, key = ctx.wait("reference", build_job, cfg)
    else:
        manifest, key = ctx.wait("build", build_job, cfg, estimate_gpuh=0.0, gpus=0)
    parents = [p.dataset for p in args.parts]
    known = [a for a in ctx.nb.artifacts(kind="dataset", session=ctx.session) if a.sha256 == manifest.sha256
             and a.path == manifest.path]
    artifact = known[0] if known else record_dataset(ctx.nb, manifest, session=ctx.session, parents=parents, job_key=key)
    summary = (f"dataset {artifact.name}: {manifest.rows} {manifest.row_kind} rows, {manifest.tokens} tokens, "
               f"leak audit passed ({manifest.audit.rows_checked} prompts vs {sum(manifest.audit.references.values())} references)")
    record_once(ctx, "build", summary, {"artifact_id": artifact.id, "builder": args.builder,
                                                           "rows": manifest.rows, "job_key": key})
    return ToolOutcome(tool=NAME, status="done", summary=summary,
                       data={"artifact_id": artifact.id, "row_kind": manifest.row_kind, "rows": manifest.rows})


def run(ctx: ToolContext, args: Args, decision_seq: int | None = None) -> ToolOutcome:
    return invoke(ctx, NAME, args, _body, decision_seq)
