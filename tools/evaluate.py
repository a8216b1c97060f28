"""Tool `evaluate`: score an artifact on the lab's open suites at its served decoding, as a job.

Served decoding is the only decoding that counts (invariant 4): `diagnostic = true` evaluates
greedily instead and records the evals as not served, so they can never promote. Every eval uses
the same base seed, so a candidate and its incumbent draw the same sampling seeds.

`reserve = true` scores suites that read the dev holdout on the reserve split's prompts instead (recorded as
`<suite>@reserve`): evidence a policy buys for a comparison the dev holdout left unresolved (evals/compare.py, the
reserve look). The incumbent goes first: its answers to the reserve's prompts (the judge suites' reference, a job of
its own) and its own first look at them; a candidate's reserve eval is judged against those answers.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

from evals.decoding import Decoding
from evals.job import EvalJobConfig, SuiteSpec, reserve_suite
from evals.job import run as run_eval
from evals.records import record_result, served_draws
from memory.notebook import EvalRecord
from tools.context import ToolContext, ToolOutcome, content_name, invoke, record_once, served_of
from tools.ingest import holdout_battles, holdout_items
from tools.paths import portable
from tools.session import incumbent_of, view
from trainers.recipe import model_shape

NAME = "evaluate"


class Args(BaseModel):
    """Evaluate one checkpoint artifact on the open (not sealed) suites."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    artifact: int = Field(description="Artifact id of the checkpoint.")
    suites: list[str] | None = Field(None, description="Suite names; default: every open suite of the lab.")
    diagnostic: bool = Field(False, description="Greedy decoding instead of the served one: recorded, never promotes.")
    replicates: int = Field(1, ge=1, le=16, description="Served draws wanted per suite: the replicates 0 .. n-1 the "
                            "artifact lacks at its served decoding are run (replicate k samples with seed k, like the "
                            "incumbent's calibration), so the bars' `replicates` can average them. Under greedy decoding "
                            "one look is exact and nothing more runs.")

    reserve: bool = Field(False, description="Score the named suites (those reading the dev holdout) on the reserve "
                          "split's prompts: evidence for an unresolved comparison, read only by its reserve look. The "
                          "incumbent first, then the candidate; one served draw.")

    @model_validator(mode="after")
    def _served_draws(self) -> Args:
        if self.replicates > 1 and self.diagnostic:
            raise ValueError("replicates > 1 are served draws: a diagnostic (greedy) eval is one exact look")
        if self.reserve and (self.diagnostic or self.replicates > 1 or not self.suites):
            raise ValueError("a reserve eval is one served draw of named suites (no diagnostic, no replicates)")
        return self

    @model_serializer(mode="wrap")
    def _without_no_reserve(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Recorded without `reserve` when false: calls recorded before the key keep their key."""
        return {k: v for k, v in handler(self).items() if k != "reserve" or v}


def suite_specs(ctx: ToolContext, names: list[str], reference: dict[str, str],
                reserve: bool = False) -> tuple[SuiteSpec, ...]:
    """The job's suites; judge suites score holdout prompts against the `reference` completions
    (the incumbent's, from its calibration), battle suites without a file (battle_margin, reward_proxy) the
    holdout's decisive battles; `reserve`: the reserve split's, as `<suite>@reserve`. Raises MissingReference when
    one is not there yet."""
    specs = []
    for name in names:
        suite = ctx.lab.suite(name)
        recorded = reserve_suite(name) if reserve else name
        if not suite.judged:
            items = suite.file or holdout_battles(ctx, suite.sealed, reserve)
            if items is None:
                raise MissingReference(f"{suite.scorer} suite {name} reads the holdout battles: ingest first")
            specs.append(SuiteSpec(name=recorded, scorer=suite.scorer, items_path=items, sealed=suite.sealed,
                                   constraint_mode=suite.constraint_mode))
            continue
        items = suite.file or holdout_items(ctx, suite.sealed, reserve)
        if items is None or name not in reference:
            raise MissingReference(f"judge suite {name} needs the ingested split and the incumbent's reference "
                                   "completions (calibrate the incumbent first)")
        specs.append(SuiteSpec(name=recorded, scorer="judge", items_path=items, sealed=suite.sealed,
                               incumbent_completions=reference[name]))
    return tuple(specs)


def _portable(ctx: ToolContext, suites: Iterable[SuiteSpec]) -> list[Any]:
    """The suites as an output's name hashes them: their files lab-relative (as job keys hold them), so a
    lab copied, moved or reached by another path names the same output the same."""
    roots = ctx.paths.spellings(ctx.nb.session(ctx.session).lab)
    return [portable(s.model_dump(mode="json"), roots) for s in suites]


class MissingReference(ValueError):
    """A judge suite asked for before its reference completions exist."""


def eval_job(ctx: ToolContext, artifact_id: int, suite_names: list[str], decoding: Decoding, served: bool,
             replicates: int, reference: dict[str, str] | None = None, first_replicate: int = 0,
             reserve: bool = False) -> EvalJobConfig:
    """The eval job of an artifact; its output directory is named by weights, decoding, suites and references."""
    artifact = ctx.nb.artifact(artifact_id)
    suites = suite_specs(ctx, suite_names, reference or {}, reserve)
    name = content_name("eval", {"weights": artifact.sha256, "decoding": decoding.fingerprint(),
                                 "suites": _portable(ctx, suites), "replicates": replicates,
                                 "served": served} | ({"first_replicate": first_replicate} if first_replicate else {}))
    return EvalJobConfig(checkpoint=artifact.path, decoding=decoding, served=served, suites=suites,
                         replicates=replicates, first_replicate=first_replicate,
                         judge=ctx.lab.judge if any(s.scorer == "judge" for s in suites) else None,
                         reward_model=ctx.lab.reward_model if any(s.scorer == "reward_proxy" for s in suites) else None,
                         output_dir=ctx.paths.evaluation(name), **engine_options(ctx, "eval"))


def engine_options(ctx: ToolContext, kind: str) -> dict[str, Any]:
    """Where and how an eval job of launcher kind `kind` generates, from its resources: on its GPU(s) in the lab's
    dtype with the engine's fast path (static cache, CUDA graphs) and a batch from lab.toml or the GPU's free memory;
    on the CPU in float32 at the lab's batch (64 by default)."""
    device, dtype = ctx.placement(kind)
    batch = ctx.lab.eval_batch_size
    if batch is None and device == "cpu":
        batch = 64
    return {"device": device, "dtype": dtype, "static_cache": device == "cuda", "batch_size": batch}


def reference_completions(ctx: ToolContext, artifact_id: int, names: list[str],
                          nomination: bool = False, reserve: bool = False) -> dict[str, str]:
    """Generate `artifact_id`'s answers to the judge suites' prompts at its served decoding (a job,
    not an eval: nothing is scored or recorded) and return suite -> completions file. `nomination`:
    the sealed confirmation's references, which run on the budget's nomination reserve like the rest of the
    nomination; `reserve`: the answers to the reserve split's prompts (a reserve look's reference)."""
    judged = [n for n in names if ctx.lab.suite(n).judged]
    if not judged:
        return {}
    specs = []
    for n in judged:
        items = ctx.lab.suite(n).file or holdout_items(ctx, ctx.lab.suite(n).sealed, reserve)
        if items is None:
            raise MissingReference(f"judge suite {n} reads the holdout split: ingest first")
        specs.append(SuiteSpec(name=f"{n}-reference", scorer="loops", items_path=items))
    artifact, decoding = ctx.nb.artifact(artifact_id), served_of(ctx, artifact_id)
    name = content_name("reference", {"weights": artifact.sha256, "decoding": decoding.fingerprint(),
                                      "suites": _portable(ctx, specs)})
    cfg = EvalJobConfig(checkpoint=artifact.path, decoding=decoding, served=True, suites=tuple(specs),
                        output_dir=ctx.paths.evaluation(name), **engine_options(ctx, "reference"))
    # Its own kind: one generation pass with no scoring, so its seconds per suite say nothing about an eval
    # job's (counted as "eval", they made the launcher forecast a K = 3 calibration at several times its cost).
    result, _ = ctx.wait("reference", run_eval, cfg, nomination=nomination, **eval_sizing(cfg))
    return {r.suite.removesuffix("-reference"): r.completions_path for r in result.suites}


def references_of(ctx: ToolContext, artifact_id: int) -> dict[str, str]:
    """The reference completions recorded by the artifact's calibration (empty when it has none)."""
    for c in ctx.nb.tool_calls(ctx.session):
        if c.tool == "calibrate" and c.args.get("artifact") == artifact_id and c.status == "done":
            return dict(c.outcome.data.get("reference", {}))
    return {}


def run_and_record(ctx: ToolContext, artifact_id: int, cfg: EvalJobConfig,
                   nomination: bool = False) -> tuple[list[EvalRecord], str]:
    """Run (or re-attach to) the eval job and record its evals once."""
    result, key = ctx.wait("eval", run_eval, cfg, nomination=nomination, **eval_sizing(cfg))
    known = [e for e in ctx.nb.evals(artifact_id=artifact_id, session=ctx.session) if e.job_key == key]
    return (known or record_result(ctx.nb, ctx.session, artifact_id, result, job_key=key)), key


def eval_sizing(cfg: EvalJobConfig) -> dict[str, Any]:
    """What the launcher forecasts an eval job from: suites x replicates (work units of this lab's measured
    throughput), and the most tokens it generates (items x replicates x the decoding's cap) with its model's active
    parameters (the model-based forecast before any measurement)."""
    return _sizing([s.items_path for s in cfg.suites], cfg.replicates, cfg.decoding.max_new_tokens,
                   Path(cfg.checkpoint))


def planned_sizing(ctx: ToolContext, kind: str, artifact_id: int, names: list[str], replicates: int,
                   reserve: bool = False) -> dict[str, Any]:
    """eval_sizing of the job a tool will submit, from what the job's config will be built from (the same items, the
    artifact's served cap, its checkpoint): the budget gate's forecast, before the config exists. `kind`: "eval", or
    "reference" (the judge suites' prompts once, unscored); `reserve`: on the reserve split's prompts."""
    if kind == "reference":
        names, replicates = [n for n in names if ctx.lab.suite(n).judged], 1
    items = []
    for n in names:
        suite = ctx.lab.suite(n)
        holdout = holdout_items if kind == "reference" or not suite.judged else holdout_battles
        items.append(suite.file or holdout(ctx, suite.sealed, reserve))
    return _sizing(items, replicates, served_of(ctx, artifact_id).max_new_tokens,
                   Path(ctx.nb.artifact(artifact_id).path))


def _sizing(items_paths: list[Path | str | None], replicates: int, max_new_tokens: int,
            checkpoint: Path) -> dict[str, Any]:
    items = sum(_lines(Path(p)) for p in items_paths if p is not None)
    out: dict[str, Any] = {"work_units": float(len(items_paths) * replicates), "job_class": "eval"}
    if items:
        out["tokens"] = float(items * replicates * max_new_tokens)
    try:
        out["active_params"] = model_shape(checkpoint).params_active
    except (OSError, ValueError, KeyError):  # an adapter or a directory without config.json: the bound applies
        pass
    return out


def _lines(path: Path) -> int:
    try:
        with path.open("rb") as f:
            return sum(1 for line in f if line.strip())
    except OSError:
        return 0


def metrics_line(evals: list[EvalRecord]) -> str:
    """'suite/metric=value' of replicate 0 of each suite (the look compare reads)."""
    parts = []
    for e in evals:
        if e.replicate == 0:
            parts += [f"{e.suite}/{m}={v:.3f}" for m, v in sorted(e.metrics.items()) if not m.startswith("n_")]
    return ", ".join(parts)


def leading_replicates(ctx: ToolContext, artifact_id: int, names: list[str], decoding: Decoding) -> int:
    """How many replicates 0 .. n-1 every suite of `names` already has (the first one missing starts the job)."""
    counts = []
    for suite in names:
        have, n = served_draws(ctx.nb, ctx.session, artifact_id, suite, decoding.fingerprint()), 0
        while n in have:
            n += 1
        counts.append(n)
    return min(counts)


def replicate_means(evals: list[EvalRecord]) -> str:
    """'suite/metric=value' of replicate 0, or over a job of later replicates, their mean (what was drawn)."""
    if any(e.replicate == 0 for e in evals):
        return metrics_line(evals)
    parts = []
    for suite in dict.fromkeys(e.suite for e in evals):
        reps = [e for e in evals if e.suite == suite]
        names = sorted(m for m, v in reps[0].metrics.items() if isinstance(v, int | float) and not m.startswith("n_"))
        parts += [f"{suite}/{m}={sum(e.metrics[m] for e in reps) / len(reps):.3f}" for m in names]
    return "mean of the new draws " + ", ".join(parts)


def _enough(ctx: ToolContext, args: Args, names: list[str], decoding: Decoding) -> ToolOutcome:
    """The served draws asked for are all recorded already (or greedy decoding, where one look is exact)."""
    draws = [served_draws(ctx.nb, ctx.session, args.artifact, suite, decoding.fingerprint()) for suite in names]
    evals = [e for have in draws for k, e in sorted(have.items()) if k < (1 if decoding.greedy else args.replicates)]
    why = "greedy decoding: one look is exact" if decoding.greedy else f"replicates 0-{args.replicates - 1} recorded"
    summary = f"{ctx.nb.artifact(args.artifact).name}: {why}, nothing to run"
    data = {"artifact_id": args.artifact, "eval_ids": [e.id for e in evals]}
    record_once(ctx, "evaluate", summary, data)
    return ToolOutcome(tool=NAME, status="done", summary=summary, data=data)


def _reserve_body(ctx: ToolContext, args: Args, names: list[str]) -> ToolOutcome:
    """One served draw of `names` on the reserve split's prompts (see the module docstring)."""
    state = view(ctx.nb, ctx.session)
    artifact, incumbent = ctx.nb.artifact(args.artifact), state.incumbent
    own = [n for n in names if ctx.lab.suite(n).file is not None]
    if state.split is None or not state.split.reserve or own:
        why = f"suites {own} have items of their own" if own else "the session's split holds no reserve"
        return ToolOutcome(tool=NAME, status="failed", summary=f"no reserve eval of {artifact.name}: {why}")
    served = served_of(ctx, args.artifact)
    if args.artifact != incumbent and any(not ctx.nb.evals(artifact_id=incumbent, suite=reserve_suite(n),
                                                           session=ctx.session) for n in names):
        return ToolOutcome(tool=NAME, status="failed", summary=f"no reserve eval of {artifact.name}: evaluate the "
                           f"incumbent {ctx.nb.artifact(incumbent).name} on the reserve first (its answers are the "
                           "reference)")
    try:
        reference = reference_completions(ctx, incumbent, names, reserve=True)
        cfg = eval_job(ctx, args.artifact, names, served, True, 1, reference, reserve=True)
    except MissingReference as exc:
        return ToolOutcome(tool=NAME, status="failed", summary=str(exc))
    evals, key = run_and_record(ctx, args.artifact, cfg)
    prompts = ", ".join(f"{e.suite} {len(e.items)}" for e in evals if e.replicate == 0)
    summary = (f"{artifact.name} on the reserve split (prompts: {prompts}; held out at ingest, read for no other "
               f"step): {metrics_line(evals)}")
    data = {"artifact_id": args.artifact, "eval_ids": [e.id for e in evals]}
    record_once(ctx, "evaluate", summary, data | {"job_key": key})
    return ToolOutcome(tool=NAME, status="done", summary=summary, data=data)


def _body(ctx: ToolContext, args: Args) -> ToolOutcome:
    artifact = ctx.nb.artifact(args.artifact)
    names = args.suites or [s.name for s in ctx.lab.open_suites]
    unknown = [n for n in names if n not in {s.name for s in ctx.lab.open_suites}]
    if artifact.kind not in ("checkpoint", "adapter") or unknown:  # an adapter: through it (evals.generate.load)
        return ToolOutcome(tool=NAME, status="failed", summary=f"not evaluable: artifact kind {artifact.kind}, "
                           f"unknown or sealed suites {unknown}")
    if args.reserve:
        return _reserve_body(ctx, args, names)
    served = served_of(ctx, args.artifact)
    decoding = served.model_copy(update={"temperature": 0.0, "top_p": 1.0}) if args.diagnostic else served
    reference = references_of(ctx, incumbent_of(ctx.nb, ctx.session))
    first = leading_replicates(ctx, args.artifact, names, decoding) if args.replicates > 1 and not decoding.greedy else 0
    if args.replicates > 1 and (decoding.greedy or first >= args.replicates):
        return _enough(ctx, args, names, decoding)
    try:
        cfg = eval_job(ctx, args.artifact, names, decoding, not args.diagnostic, args.replicates - first, reference,
                       first_replicate=first)
    except MissingReference as exc:
        return ToolOutcome(tool=NAME, status="failed", summary=str(exc))
    evals, key = run_and_record(ctx, args.artifact, cfg)
    drawn = f" (replicates {first}-{args.replicates - 1})" if args.replicates > 1 else ""
    summary = f"{artifact.name}{' (diagnostic, greedy)' if args.diagnostic else ''}{drawn}: {replicate_means(evals)}"
    record_once(ctx, "evaluate", summary, {"artifact_id": args.artifact, "eval_ids": [e.id for e in evals], "job_key": key})
    return ToolOutcome(tool=NAME, status="done", summary=summary,
                       data={"artifact_id": args.artifact, "eval_ids": [e.id for e in evals]})


def run(ctx: ToolContext, args: Args, decision_seq: int | None = None) -> ToolOutcome:
    return invoke(ctx, NAME, args, _body, decision_seq)
