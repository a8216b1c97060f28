"""Tool `train`: one training arm (SFT, DPO + NLL, KL-leashed CE, RFT) from a parent checkpoint on a
built dataset, as a job; the trained checkpoint becomes a candidate artifact.

Every setting comes from the lab's `[train]` (trainers/recipe.py: the user's recipe, or the rules over the base
model for what it leaves out); the planner may propose lr, steps, batch and the family's own knobs, within the
ranges `trainers.recipe.out_of_range` checks (the gates call it; a scaled lr is checked as the arm trains it,
`trainers.recipe.proposed_lr`). Lengths, epochs and token batches are settled against the dataset
here (`trainers.recipe.arm_settings`), and every setting goes to the trainer. The run directory is named by
content (trainer, settled settings, parent and dataset sha256), so the same arm always has the same job key.

A LoRA arm (`method = "lora"`, with its r, alpha, targets and FP32 head) trains a peft adapter, registered as an
artifact of kind `adapter`; the tool then merges it into the parent (`trainers.merge.merge_lora`, streamed, in the
parent's dtypes) and registers the merged weights as the arm's checkpoint, which names the adapter among its
parents: the eval engine evaluates it like any checkpoint, soups and doses take it like any other, a next round
trains from it, and a bundle can ship it as base + adapter (tools/nomination/bundle.py). The outcome's data gives
both: `artifact_id` (the merged checkpoint) and `adapter_id`.

With `snapshots`, the run also saves its model at those steps (trainers: TrainConfig.snapshot_steps); each is
registered as its own checkpoint artifact `<run>-step<n>` (same producing job, parents and served decoding as the
final one; `recipe.snapshot` holds the final checkpoint's id as `run`, the step, and the learning rate of that
step and summed so far), so evaluation, compare, promote and the card's lineage take it like any checkpoint.
The outcome's data lists them as `snapshots: [{step, artifact_id}]`.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from core.weights import weights_sha256
from memory.records import GateRefusal
from tools.context import (
    ToolContext,
    ToolOutcome,
    artifact_of_job,
    content_name,
    invoke,
    record_once,
    served_of,
)
from tools.jobs.launcher import JobFailed
from trainers import recipe as recipes

if TYPE_CHECKING:  # the trainers (torch, transformers) load when an arm's job is built, not with the agent
    from trainers import merge
    from trainers.common import LoRASettings

NAME = "train"
Trainer = Literal["sft", "dpo", "klce", "rft"]
_ROW_KINDS = {"sft": {"sft"}, "dpo": {"pairs"}, "klce": {"sft", "klce"}, "rft": {"items"}}


class Args(BaseModel):
    """Train one arm; what is left out is the lab's [train] value for the family."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    trainer: Trainer = Field(description="sft (winner answers), dpo (pairs, with NLL), klce (CE with a KL leash), rft (verified samples).")
    parent: int = Field(description="Artifact id of the checkpoint to start from (usually the incumbent).")
    dataset: int = Field(description="Artifact id of a built dataset of the row kind the trainer reads.")
    method: Literal["full", "lora"] | None = Field(None, description="Full fine-tuning or a LoRA adapter (merged "
                                                   "back into the parent); None: [train]'s method.")
    lr: float | None = Field(None, gt=0, le=1e-1, description="Peak learning rate; None: [train]'s.")
    lora_r: int | None = Field(None, ge=1, le=4096, description="A LoRA arm's rank; None: [train.lora]'s (a recipe "
                               "that fixes its geometry, e.g. Aspen's r64, says it here).")
    fp32_head: bool | None = Field(None, description="A LoRA arm also trains lm_head in full, in FP32; None: "
                                   "[train.lora]'s.")
    lr_scale: float | None = Field(None, gt=0, le=100, description="A multiple of the lr the arm would have (its own "
                                   "`lr`, else [train]'s): how a sweep is written without knowing the model's lr. "
                                   "The scaled lr is what the [train] range is checked against.")
    steps: int | None = Field(None, ge=1, le=10_000_000, description="Optimizer steps; None: [train]'s (or its epochs).")
    batch_size: int | None = Field(None, ge=1, le=1 << 30, description="Global batch in [train]'s batch_unit "
                                   "(sequences unless it says tokens); None: [train]'s.")
    beta: float | None = Field(None, gt=0, description="dpo: inverse temperature; None: [train.dpo]'s.")
    nll_weight: float | None = Field(None, ge=0, description="dpo: weight of the chosen answer's NLL term.")
    kl_coef: float | None = Field(None, ge=0, description="klce: weight of the KL to the parent.")
    k: int | None = Field(None, ge=1, le=256, description="rft: samples per prompt.")
    seed: int = Field(0, ge=0, description="Data order and sampling seed.")
    snapshots: tuple[int, ...] = Field(
        (), description="Steps (increasing, each below steps) after which the run also saves its model; each becomes "
        "its own checkpoint artifact, evaluated and compared like any other (trajectory selection).")
    snapshot_fractions: tuple[float, ...] = Field(
        (), description="Shares of the run (increasing, each in (0, 1)) after which it also saves its model, settled "
        "to steps once the run's steps are known (e.g. (1/3, 2/3)); added to `snapshots`.")

    @model_validator(mode="after")
    def _fractions_inside_the_run(self) -> Args:
        f = list(self.snapshot_fractions)
        if any(not 0 < x < 1 for x in f) or f != sorted(set(f)):
            raise ValueError(f"snapshot_fractions {f} must increase and lie between 0 and 1, exclusive")
        return self

    @model_validator(mode="after")
    def _snapshots_inside_the_run(self) -> Args:
        # Against [train]'s steps the tool checks them when it settles the arm (_snapshot_problem).
        if self.steps is not None and _snapshot_problem(self.snapshots, self.steps):
            raise ValueError(_snapshot_problem(self.snapshots, self.steps))
        return self


def _snapshot_problem(snapshots: tuple[int, ...], steps: int) -> str | None:
    if any(not 0 < s < steps for s in snapshots) or list(snapshots) != sorted(set(snapshots)):
        return (f"snapshots {list(snapshots)} must increase and lie between 0 and steps ({steps}), exclusive: the "
                "final model is a checkpoint anyway")
    return None


def snapshot_steps(args: Args, steps: int) -> tuple[int, ...]:
    """The steps the run saves its model at: `snapshots` and the settled `snapshot_fractions` of its steps."""
    settled = {round(f * steps) for f in args.snapshot_fractions} - {0, steps}
    return tuple(sorted(set(args.snapshots) | settled))


def lab_recipe(ctx: ToolContext) -> recipes.TrainRecipe:
    """The lab's [train], settled (a LabSpec built without one: the rules over the parent model)."""
    if ctx.lab.train is not None:
        return ctx.lab.train
    verifiers = [s.name for s in ctx.lab.open_suites if s.scorer in recipes.VERIFYING_SCORERS and s.file is not None]
    return recipes.resolve(recipes.TrainSection(), recipes.model_shape(ctx.lab.parent), verifiers)


def settle(ctx: ToolContext, args: Args) -> recipes.ArmSettings:
    """The arm's settings: the proposal, else [train], with lengths and epochs settled against the dataset."""
    family = lab_recipe(ctx).families[args.trainer]
    manifest = ctx.nb.artifact(args.dataset).recipe
    p99 = manifest.get("row_tokens_p99")
    if args.trainer == "rft" and p99 is not None:  # items are prompts: a training row adds the sampled answer
        p99 += _answer_cap(ctx, args, family)
    size = recipes.DatasetSize(rows=max(1, int(manifest.get("rows", 1))), tokens=int(manifest.get("tokens", 0)),
                               p99_row_tokens=p99)
    return recipes.arm_settings(family, args.model_dump(mode="json"), size)


def sizing(ctx: ToolContext, args: Args, arm: recipes.ArmSettings) -> dict[str, Any]:
    """What the launcher forecasts an arm from: its rows (work units of this lab's measured throughput), and the
    tokens it trains on and its parent's active parameters (the model-based forecast before any measurement)."""
    manifest = ctx.nb.artifact(args.dataset).recipe
    row_tokens = min(arm.max_len, manifest.get("tokens", 0) / max(1, int(manifest.get("rows", 1)))) or arm.max_len
    out: dict[str, Any] = {"work_units": float(arm.steps * arm.batch_size), "job_class": "train",
                           "tokens": float(arm.steps * arm.batch_size * row_tokens)}
    return out | _active(Path(ctx.nb.artifact(args.parent).path))


def _active(model: Path) -> dict[str, Any]:
    try:
        return {"active_params": recipes.model_shape(model).params_active}
    except (OSError, ValueError, KeyError):  # no readable config.json here: the forecast falls back to its bound
        return {}


def _answer_cap(ctx: ToolContext, args: Args, family: recipes.FamilyRecipe) -> int:
    """rft: the sampled answers' token cap: [train.rft] max_answer_len within the served cap (an answer the
    nominee would be cut off in is no clean target)."""
    served = served_of(ctx, args.parent).max_new_tokens
    return min(served, family.max_answer_len or served)


def _verifier(ctx: ToolContext, family: recipes.FamilyRecipe, dataset_recipe: dict[str, Any]) -> str:
    """rft: the scorer of the verifier suite (the eval scorer is the reward): the one the dataset names, else the
    first of [train.rft] verifiers."""
    names = family.verifiers or []
    wanted = dataset_recipe.get("config", {}).get("source", {}).get("verifier")  # a verified_pool dataset's
    name = wanted if wanted in names else (names[0] if names else None)
    scorer = ctx.lab.suite(name).scorer if name is not None else "synthetic"
    return recipes.VERIFYING_SCORERS[scorer]


def _lora(arm: recipes.ArmSettings, args: Args) -> LoRASettings | None:
    from trainers.common import LoRASettings

    if arm.lora is None:
        return None
    r = args.lora_r or arm.lora.r
    alpha = arm.lora.alpha * r / arm.lora.r  # the lab's alpha / r scale kept at another rank
    head = arm.lora.fp32_head if args.fp32_head is None else args.fp32_head
    return LoRASettings(r=r, alpha=alpha, dropout=arm.lora.dropout, target_modules=arm.lora.target_modules,
                        target_parameters=arm.lora.target_parameters, train_lm_head=head)


def trainer_module(name: Trainer) -> ModuleType:
    """The trainer's module (trainers.sft, .dpo, .klce, .rft): imported with the first arm's job, so the agent
    process loads torch only when it trains."""
    return importlib.import_module(f"trainers.{name}")


def _config(ctx: ToolContext, args: Args, arm: recipes.ArmSettings, out) -> tuple[Any, Any]:
    """The trainer's job function and config: the arm's settings (`ArmSettings.trainer_fields`), and what this
    arm's parent, data, seed and run directory add."""
    trainer = trainer_module(args.trainer)
    parent = ctx.nb.artifact(args.parent)
    data = ctx.nb.artifact(args.dataset)
    served = served_of(ctx, args.parent)
    fields = arm.trainer_fields(args.trainer) | {
        "model_path": parent.path, "data_path": data.path, "output_dir": str(out),
        "system_prompt": served.system_prompt or None, "lora": _lora(arm, args), "seed": args.seed,
        "snapshot_steps": list(snapshot_steps(args, arm.steps))}
    match args.trainer:
        case "sft":
            return trainer.train, trainer.SFTConfig(**fields)
        case "dpo":
            return trainer.train, trainer.DPOConfig(**fields)
        case "klce":
            return trainer.train, trainer.KLCEConfig(**fields)
        case "rft":
            family = lab_recipe(ctx).families["rft"]
            temperature = served.temperature if served.temperature > 0 else 1.0
            return trainer.train, trainer.RFTConfig(**fields, temperature=temperature,
                                                    max_new_tokens=_answer_cap(ctx, args, family),
                                                    scorer=_verifier(ctx, family, data.recipe))


def _body(ctx: ToolContext, args: Args) -> ToolOutcome:
    parent, data = ctx.nb.artifact(args.parent), ctx.nb.artifact(args.dataset)
    if parent.kind != "checkpoint" or data.kind != "dataset":
        return ToolOutcome(tool=NAME, status="failed", summary=f"parent {args.parent} must be a checkpoint and "
                           f"dataset {args.dataset} a dataset (got {parent.kind}, {data.kind})")
    kind = data.recipe.get("row_kind")
    if kind not in _ROW_KINDS[args.trainer]:
        return ToolOutcome(tool=NAME, status="failed", summary=f"{args.trainer} reads {sorted(_ROW_KINDS[args.trainer])} "
                           f"rows; dataset {data.name} holds {kind} rows")
    arm = settle(ctx, args)
    problem = _snapshot_problem(snapshot_steps(args, arm.steps), arm.steps)
    if problem:
        return ToolOutcome(tool=NAME, status="failed", summary=problem)
    # Named by content: the parent and data by their sha256, never by notebook row ids (another session in the
    # lab, or a replay's scratch notebook, numbers the same artifacts differently).
    name = content_name(args.trainer, {"args": args.model_dump(mode="json", exclude={"parent", "dataset"}),
                                       "settings": arm.model_dump(mode="json"), "parent": parent.sha256,
                                       "data": data.sha256})
    fn, cfg = _config(ctx, args, arm, ctx.paths.run(name))
    try:
        result, key = ctx.wait(args.trainer, fn, cfg, **sizing(ctx, args, arm))
    except JobFailed as exc:
        if exc.record.failure_class != "config":
            raise
        return _refused_arm(ctx, args, exc)
    train = result.train if args.trainer == "rft" else result
    # A LoRA run's adapters are merged into the parent first (jobs of their own): nothing is registered until
    # every merge is done, so a failed merge leaves no half-registered arm behind.
    merged = {step: _merge_job(ctx, args.parent, path) for step, path in _adapters(train)} if train.adapter else {}
    with ctx.nb.transaction():  # the run's checkpoints and their decision land together, or none of them
        final = _register_final(ctx, args, arm, name, train, key)
        snaps = _register_snapshots(ctx, args, arm, name, final, train, key)
        artifact_id, adapter_id, snaps = _register_merged(ctx, args, arm, name, final, snaps, merged)
        summary = (f"{name}: {args.trainer} ({arm.method}) from {parent.name} on {data.name}, {train.steps} steps "
                   f"at lr {arm.lr:g}, final loss {train.final_loss:.4f}")
        if adapter_id is not None:
            summary += f"; adapter {adapter_id} merged into the parent"
        if train.snapshots:
            summary += "; snapshots " + ", ".join(f"step {s.step} (loss {s.loss:.4f}, lr so far {s.lr_sum:.3g})"
                                                  for s in train.snapshots)
        extra = ({"snapshots": snaps} if snaps else {}) | ({"adapter_id": adapter_id} if adapter_id else {})
        record_once(ctx, "build", summary, {"artifact_id": artifact_id, "trainer": args.trainer,
                                            "final_loss": train.final_loss, "job_key": key} | extra)
    data_out = {"artifact_id": artifact_id, "job_key": key} | extra
    return ToolOutcome(tool=NAME, status="done", summary=summary, data=data_out)


def _refused_arm(ctx: ToolContext, args: Args, exc: JobFailed) -> ToolOutcome:
    """A trainer that refused its own settings (class config: a [train] value the parent or the data cannot take,
    found before any compute) refuses the arm: a `refuse` decision the gates read back (the same arm is not proposed
    again), in words the project minted; the trainer's own message (it names the key) is kept for a person only."""
    reason = (f"the {args.trainer} job refused its settings before training (class config, job {exc.record.key[:12]}): "
              "a [train] value this parent or dataset cannot take; see the job's message")
    ctx.nb.record_decision(ctx.session, "refuse", f"train arm refused: {reason}"[:300],
                           GateRefusal(tool=NAME, args=args.model_dump(mode="json"), reason=reason))
    return ToolOutcome(tool=NAME, status="refused", summary=f"arm refused: {reason}",
                       data={"job_key": exc.record.key}, detail=exc.record.failure_detail or "")


def _recipe(ctx: ToolContext, args: Args, arm: recipes.ArmSettings, train) -> dict[str, Any]:
    return {"trainer": args.trainer, "parent": args.parent, "dataset": args.dataset,
            "hparams": args.model_dump(mode="json"), "settings": arm.model_dump(mode="json"),
            "run_dir": str(train.run_dir), "served_decoding": served_of(ctx, args.parent).model_dump(mode="json")}


def _kind(train) -> str:
    return "adapter" if train.adapter else "checkpoint"


def _register_final(ctx: ToolContext, args: Args, arm: recipes.ArmSettings, name: str, train, key: str) -> int:
    """The run's final checkpoint (or adapter) as an artifact (once: a resumed tool finds it by its job)."""
    found = artifact_of_job(ctx, key)
    if found is not None:
        return found
    return ctx.nb.add_artifact(kind=_kind(train), name=name, path=str(train.model_dir),
                               sha256=weights_sha256(train.model_dir), parents=[args.parent, args.dataset],
                               recipe=_recipe(ctx, args, arm, train) | {"final_loss": train.final_loss},
                               job_key=key, session=ctx.session).id


def _register_snapshots(ctx: ToolContext, args: Args, arm: recipes.ArmSettings, name: str, run: int, train,
                        key: str) -> list[dict[str, int]]:
    """Each snapshot of the run as its own checkpoint (or adapter) artifact, with its lineage: the parent and
    dataset (like the final), the run's final artifact, its step and the learning rate so far.
    Returns [{step, artifact_id}]."""
    known = {a.name: a.id for a in ctx.nb.artifacts(kind=_kind(train), session=ctx.session, job_key=key)}
    out = []
    for snap in train.snapshots:
        snap_name = f"{name}-step{snap.step}"
        if snap_name not in known:
            lineage = {"run": run, "step": snap.step, "of_steps": train.steps, "lr": snap.lr, "lr_sum": snap.lr_sum,
                       "loss": snap.loss, "tokens_seen": snap.tokens_seen}
            known[snap_name] = ctx.nb.add_artifact(
                kind=_kind(train), name=snap_name, path=str(snap.model_dir), sha256=weights_sha256(snap.model_dir),
                parents=[args.parent, args.dataset], recipe=_recipe(ctx, args, arm, train) | {"snapshot": lineage},
                job_key=key, session=ctx.session).id
        out.append({"step": snap.step, "artifact_id": known[snap_name]})
    return out


def _adapters(train) -> list[tuple[int, Any]]:
    """(step, adapter directory) of a LoRA run: each snapshot, then the final adapter (step = the run's steps)."""
    return [(s.step, s.model_dir) for s in train.snapshots] + [(train.steps, train.model_dir)]


def _merge_job(ctx: ToolContext, parent: int, adapter_dir) -> tuple[merge.MergeResult, str]:
    """Merge one adapter into the parent's weights (a `merge` job, named by the adapter's and parent's weights)."""
    from trainers import merge

    base = ctx.nb.artifact(parent)
    name = content_name("lora", {"base": base.sha256, "adapter": weights_sha256(adapter_dir)})
    out = ctx.paths.merged(name)
    fields = {"base": base.path, "adapter": str(adapter_dir)}
    # Re-attaching to a finished merge: its output exists, which the must-not-exist check would refuse.
    cfg = merge.LoRAMergeConfig.model_construct(**fields, output_dir=out) if out.exists() else \
        merge.LoRAMergeConfig(**fields, output_dir=out)
    return ctx.wait("merge", merge.merge_lora, cfg)


def _register_merged(ctx: ToolContext, args: Args, arm: recipes.ArmSettings, name: str, final: int,
                     snaps: list[dict[str, int]], merged: dict[int, tuple[merge.MergeResult, str]]
                     ) -> tuple[int, int | None, list[dict[str, int]]]:
    """A LoRA run's merged checkpoints: (the arm's checkpoint, its adapter, the snapshots as merged checkpoints).
    Each merged checkpoint names its parent, dataset and adapter as parents, and its recipe carries the adapter's
    (lineage, settings, served decoding) plus `adapter`. A full run passes through unchanged."""
    if not merged:
        return final, None, snaps
    adapters = {s["step"]: s["artifact_id"] for s in snaps} | {max(merged): final}
    out: dict[int, int] = {}
    for step in sorted(merged, reverse=True):  # the final first: the snapshots' lineage names it as their run
        (result, key), adapter = merged[step], ctx.nb.artifact(adapters[step])
        recipe = adapter.recipe | {"adapter": adapter.id, "merge": "lora"}
        if "snapshot" in recipe:
            recipe["snapshot"] = recipe["snapshot"] | {"run": out[max(merged)]}
        found = artifact_of_job(ctx, key)
        out[step] = found if found is not None else ctx.nb.add_artifact(
            kind="checkpoint", name=f"{adapter.name}-merged", path=str(result.output_dir),
            sha256=result.weights_sha256, parents=[args.parent, args.dataset, adapter.id], recipe=recipe,
            job_key=key, session=ctx.session).id
    return out[max(merged)], final, [{"step": s["step"], "artifact_id": out[s["step"]]} for s in snaps]


def run(ctx: ToolContext, args: Args, decision_seq: int | None = None) -> ToolOutcome:
    return invoke(ctx, NAME, args, _body, decision_seq)
