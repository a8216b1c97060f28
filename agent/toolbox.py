"""The tools the planners may call: name -> (argument model, run function), their JSON schemas for
Chat Completions tool calling, and the job forecast the budget gate checks.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from pydantic import BaseModel

from memory.notebook import NotebookError
from tools import (
    build_dataset,
    calibrate,
    compare,
    evaluate,
    ground_truth,
    ingest,
    merge,
    nominate,
    promote,
    register_bars,
    sealed_open,
    skip,
    stop,
    train,
    tune_serving,
)
from tools.context import ToolContext, ToolOutcome
from tools.jobs.launcher import Launcher
from tools.nomination import publish
from tools.session import incumbent_of

TOOLS: dict[str, ModuleType] = {m.NAME: m for m in (
    ingest, register_bars, build_dataset, calibrate, train, merge, evaluate, compare, promote, tune_serving,
    skip, stop, nominate, sealed_open, ground_truth, publish,
)}
# The research loop's tools; nominate, sealed_open, ground_truth and publish run in the graph's nominate step.
NOMINATION_TOOLS = ("nominate", "sealed_open", "ground_truth", "publish")
PLANNER_TOOLS = tuple(n for n in TOOLS if n not in NOMINATION_TOOLS)
# Tools whose calls the planner's summary leaves out (agent/summary.py): the ground truth measures the agent.
HIDDEN_TOOLS = ("ground_truth",)


def args_model(tool: str) -> type[BaseModel]:
    return TOOLS[tool].Args


def canonical_args(tool: str, args: dict[str, Any]) -> dict[str, Any]:
    """Arguments as recorded: validated, defaults filled, JSON form (raises ValidationError)."""
    return args_model(tool).model_validate(args).model_dump(mode="json")


def run(ctx: ToolContext, tool: str, args: BaseModel, decision_seq: int | None) -> ToolOutcome:
    return TOOLS[tool].run(ctx, args, decision_seq)


def schemas(names: tuple[str, ...] = PLANNER_TOOLS) -> list[dict[str, Any]]:
    """OpenAI tool definitions generated from the pydantic argument models."""
    out = []
    for name in names:
        model = args_model(name)
        out.append({"type": "function", "function": {
            "name": name, "description": (model.__doc__ or name).strip(), "parameters": model.model_json_schema()}})
    return out


def _job_kind(ctx: ToolContext, tool: str, args: Any) -> tuple[str, dict[str, Any]] | None:
    """The launcher kind and sizing of the job a call will submit, as the tool sizes it (None: no
    job, or a data job declared free)."""
    open_names = [s.name for s in ctx.lab.open_suites]
    match tool:
        case "train":  # sized as the tool settles it: the proposal over the lab's [train], against the dataset
            try:
                return args.trainer, train.sizing(ctx, args, train.settle(ctx, args))
            except NotebookError:  # an unknown parent or dataset: the gates refuse the call
                return args.trainer, {}
        case "merge":
            return "merge", {}
        case "evaluate":  # each replicate generates every suite again
            return "eval", _eval_sizing(ctx, "eval", args.artifact, args.suites or open_names, args.replicates,
                                        args.reserve)
        case "tune_serving":
            return "eval", _eval_sizing(ctx, "eval", args.artifact, open_names, 1)
        case "sealed_open":
            return "eval", _eval_sizing(ctx, "eval", args.artifact, [s.name for s in ctx.lab.sealed_suites], 1)
        case "calibrate":
            return "eval", _eval_sizing(ctx, "eval", args.artifact, open_names, args.k)
    return None


def _eval_sizing(ctx: ToolContext, kind: str, artifact: int, names: list[str], replicates: int,
                 reserve: bool = False) -> dict[str, Any]:
    """The eval job's own sizing (tools/evaluate.py planned_sizing): its work units, and its tokens and model for the
    declared start-up and work before any eval is measured; the work units alone for an unknown artifact or suite
    (the gates refuse the call)."""
    try:
        return evaluate.planned_sizing(ctx, kind, artifact, names, replicates, reserve)
    except (NotebookError, KeyError, LookupError):
        return {"work_units": float(len(names) * replicates)}


def forecast_gpuh(ctx: ToolContext, launcher: Launcher, tool: str, args: BaseModel, own_gpuh: float = 0.0) -> float:
    """The launcher's own forecast of the call's job (0 for notebook-only tools and data jobs); `own_gpuh`: what the
    call's own unsettled jobs reserve (a resumed step), left out of the budget the job is sized on."""
    kind = _job_kind(ctx, tool, args)
    if kind is None:
        return 0.0
    gpuh = launcher.forecast(kind[0], ctx.resources(kind=kind[0], own_gpuh=own_gpuh, **kind[1])).gpuh
    judged = [s for s in ctx.lab.open_suites if s.judged]
    if tool == "calibrate" and judged:  # its reference answers are a job of their own, before the K replicates
        sizing = _eval_sizing(ctx, "reference", args.artifact, [s.name for s in judged], 1)
        gpuh += launcher.forecast("reference", ctx.resources(kind="reference", own_gpuh=own_gpuh, **sizing)).gpuh
    reserve_reference = [n for n in args.suites or [] if n in {s.name for s in judged}] \
        if tool == "evaluate" and args.reserve else []
    if reserve_reference and args.artifact == incumbent_of(ctx.nb, ctx.session):
        # the incumbent's reserve eval first generates its answers to the reserve's prompts (the reference)
        sizing = _eval_sizing(ctx, "reference", args.artifact, reserve_reference, 1, reserve=True)
        gpuh += launcher.forecast("reference", ctx.resources(kind="reference", own_gpuh=own_gpuh, **sizing)).gpuh
    return gpuh
