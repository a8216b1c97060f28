"""Tool `train`: one training arm (SFT, DPO + NLL, KL-leashed CE, RFT) from a parent checkpoint on a
built dataset, as a job; the trained checkpoint becomes a candidate artifact.

Full fine-tuning of the parent (the tiny models of the toy world train fully on a CPU; LoRA runs go
through `merge` with method lora before they are evaluated). The run directory is named by content
(trainer, settings, parent and dataset sha256), so the same arm always has the same job key.

With `snapshots`, the run also saves its model at those steps (trainers: TrainConfig.snapshot_steps); each is
registered as its own checkpoint artifact `<run>-step<n>` (same producing job, parents and served decoding as the
final one; `recipe.snapshot` holds the final checkpoint's id as `run`, the step, and the learning rate of that
step and summed so far), so evaluation, compare, promote and the card's lineage take it like any checkpoint.
The outcome's data lists them as `snapshots: [{step, artifact_id}]`.
"""

from __future__ import annotations

from typing import Any, Literal

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
from trainers import dpo, klce, rft, sft
from trainers.common import weights_sha256

NAME = "train"
Trainer = Literal["sft", "dpo", "klce", "rft"]
_ROW_KINDS = {"sft": {"sft"}, "dpo": {"pairs"}, "klce": {"sft", "klce"}, "rft": {"items"}}


class Args(BaseModel):
    """Train one arm; every setting has a conservative default."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    trainer: Trainer = Field(description="sft (winner answers), dpo (pairs, with NLL), klce (CE with a KL leash), rft (verified samples).")
    parent: int = Field(description="Artifact id of the checkpoint to start from (usually the incumbent).")
    dataset: int = Field(description="Artifact id of a built dataset of the row kind the trainer reads.")
    lr: float = Field(1e-4, gt=0, le=1e-1, description="Peak learning rate.")
    steps: int = Field(20, ge=1, le=100000, description="Optimizer steps.")
    batch_size: int = Field(8, ge=1, le=4096, description="Rows per optimizer step.")
    beta: float = Field(0.1, gt=0, description="dpo: inverse temperature.")
    nll_weight: float = Field(1.0, ge=0, description="dpo: weight of the chosen answer's NLL term.")
    kl_coef: float = Field(0.1, ge=0, description="klce: weight of the KL to the parent.")
    k: int = Field(4, ge=1, le=64, description="rft: samples per prompt.")
    seed: int = Field(0, ge=0, description="Data order and sampling seed.")
    snapshots: tuple[int, ...] = Field(
        (), description="Steps (increasing, each below steps) after which the run also saves its model; each becomes "
        "its own checkpoint artifact, evaluated and compared like any other (trajectory selection).")

    @model_validator(mode="after")
    def _snapshots_inside_the_run(self) -> Args:
        if any(not 0 < s < self.steps for s in self.snapshots) or list(self.snapshots) != sorted(set(self.snapshots)):
            raise ValueError(f"snapshots {list(self.snapshots)} must increase and lie between 0 and steps "
                             f"({self.steps}), exclusive: the final model is a checkpoint anyway")
        return self


def _config(ctx: ToolContext, args: Args, out) -> tuple[Any, Any]:
    parent = ctx.nb.artifact(args.parent)
    data = ctx.nb.artifact(args.dataset)
    served = served_of(ctx, args.parent)
    common = {"model_path": parent.path, "data_path": data.path, "output_dir": str(out),
              "system_prompt": served.system_prompt or None, "lr": args.lr, "steps": args.steps,
              "batch_size": args.batch_size, "micro_batch_size": args.batch_size, "seed": args.seed,
              "max_len": 512, "snapshot_steps": list(args.snapshots)}
    match args.trainer:
        case "sft":
            return sft.train, sft.SFTConfig(**common)
        case "dpo":
            return dpo.train, dpo.DPOConfig(**common, beta=args.beta, nll_weight=args.nll_weight)
        case "klce":
            return klce.train, klce.KLCEConfig(**common, kl_coef=args.kl_coef)
        case "rft":
            temperature = served.temperature if served.temperature > 0 else 1.0
            return rft.train, rft.RFTConfig(**common, k=args.k, temperature=temperature,
                                            max_new_tokens=min(served.max_new_tokens, 256))


def _body(ctx: ToolContext, args: Args) -> ToolOutcome:
    parent, data = ctx.nb.artifact(args.parent), ctx.nb.artifact(args.dataset)
    if parent.kind != "checkpoint" or data.kind != "dataset":
        return ToolOutcome(tool=NAME, status="failed", summary=f"parent {args.parent} must be a checkpoint and "
                           f"dataset {args.dataset} a dataset (got {parent.kind}, {data.kind})")
    kind = data.recipe.get("row_kind")
    if kind not in _ROW_KINDS[args.trainer]:
        return ToolOutcome(tool=NAME, status="failed", summary=f"{args.trainer} reads {sorted(_ROW_KINDS[args.trainer])} "
                           f"rows; dataset {data.name} holds {kind} rows")
    name = content_name(args.trainer, {"args": args.model_dump(mode="json"), "parent": parent.sha256, "data": data.sha256})
    fn, cfg = _config(ctx, args, ctx.paths.run(name))
    result, key = ctx.wait(args.trainer, fn, cfg, work_units=float(args.steps * args.batch_size))
    train = result.train if args.trainer == "rft" else result
    with ctx.nb.transaction():  # the run's checkpoints and their decision land together, or none of them
        artifact_id = _register_final(ctx, args, name, train, key)
        snaps = _register_snapshots(ctx, args, name, artifact_id, train, key)
        summary = (f"{name}: {args.trainer} from {parent.name} on {data.name}, {train.steps} steps at lr {args.lr:g}, "
                   f"final loss {train.final_loss:.4f}")
        if train.snapshots:
            summary += "; snapshots " + ", ".join(f"step {s.step} (loss {s.loss:.4f}, lr so far {s.lr_sum:.3g})"
                                                  for s in train.snapshots)
        record_once(ctx, "build", summary, {"artifact_id": artifact_id, "trainer": args.trainer,
                                            "final_loss": train.final_loss, "job_key": key}
                    | ({"snapshots": snaps} if snaps else {}))
    data_out = {"artifact_id": artifact_id, "job_key": key} | ({"snapshots": snaps} if snaps else {})
    return ToolOutcome(tool=NAME, status="done", summary=summary, data=data_out)


def _recipe(ctx: ToolContext, args: Args, train) -> dict[str, Any]:
    return {"trainer": args.trainer, "parent": args.parent, "dataset": args.dataset,
            "hparams": args.model_dump(mode="json"), "run_dir": str(train.run_dir),
            "served_decoding": served_of(ctx, args.parent).model_dump(mode="json")}


def _register_final(ctx: ToolContext, args: Args, name: str, train, key: str) -> int:
    """The run's final checkpoint as an artifact (once: a resumed tool finds it by its job)."""
    found = artifact_of_job(ctx, key)
    if found is not None:
        return found
    return ctx.nb.add_artifact(kind="checkpoint", name=name, path=str(train.model_dir),
                               sha256=weights_sha256(train.model_dir), parents=[args.parent, args.dataset],
                               recipe=_recipe(ctx, args, train) | {"final_loss": train.final_loss},
                               job_key=key, session=ctx.session).id


def _register_snapshots(ctx: ToolContext, args: Args, name: str, run: int, train, key: str) -> list[dict[str, int]]:
    """Each snapshot of the run as its own checkpoint artifact, with its lineage: the parent and dataset (like the
    final), the run's final checkpoint, its step and the learning rate so far. Returns [{step, artifact_id}]."""
    known = {a.name: a.id for a in ctx.nb.artifacts(kind="checkpoint", session=ctx.session, job_key=key)}
    out = []
    for snap in train.snapshots:
        snap_name = f"{name}-step{snap.step}"
        if snap_name not in known:
            lineage = {"run": run, "step": snap.step, "of_steps": train.steps, "lr": snap.lr, "lr_sum": snap.lr_sum,
                       "loss": snap.loss, "tokens_seen": snap.tokens_seen}
            known[snap_name] = ctx.nb.add_artifact(
                kind="checkpoint", name=snap_name, path=str(snap.model_dir), sha256=weights_sha256(snap.model_dir),
                parents=[args.parent, args.dataset], recipe=_recipe(ctx, args, train) | {"snapshot": lineage},
                job_key=key, session=ctx.session).id
        out.append({"step": snap.step, "artifact_id": known[snap_name]})
    return out


def run(ctx: ToolContext, args: Args, decision_seq: int | None = None) -> ToolOutcome:
    return invoke(ctx, NAME, args, _body, decision_seq)
