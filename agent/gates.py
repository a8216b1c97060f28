"""Gates: pure functions run before every action, whatever the planner proposed.

Each gate reads only the proposed call, the notebook summary (agent/summary.py), the job's forecast
and the lab root, and returns the reason to refuse or None. The graph records a refusal as a
`refuse` decision and the planner observes it. Together they enforce, for any planner:

- budget admission: forecast + spent + reserved + the nomination reserve must fit the budget;
- bars before scores: nothing is evaluated, calibrated or compared before bars are registered;
- no training data derived from holdouts: trainers and mixes read only datasets built (and leak
  audited) in this session, whose builders read the train split alone;
- served decoding for promotion: only a comparison at the candidate's served decoding that cleared
  every bar against the current incumbent promotes it;
- the sealed confirmation once, and for the nominee only;
- no argument naming a path outside the lab;
- a training arm inside the lab's `[train]` ranges (a proposal outside them is a recorded refusal).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from agent.summary import Summary
from trainers.recipe import TrainRecipe, out_of_range

JOB_TOOLS = {"ingest", "build_dataset", "train", "merge", "evaluate", "calibrate", "tune_serving", "sealed_open"}
_SCORING_TOOLS = {"evaluate", "calibrate", "tune_serving", "compare", "sealed_open"}


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _strings(v)


def paths_inside_lab(tool: str, args: dict[str, Any], s: Summary, forecast: float, lab: Path) -> str | None:
    root = lab.resolve()
    for text in _strings(args):
        if "/" in text or "\\" in text or text.startswith(("~", "..")):
            p = Path(text).expanduser()
            resolved = (p if p.is_absolute() else root / p).resolve()
            if not resolved.is_relative_to(root):
                return f"argument {text!r} names a path outside the lab directory {root}"
    return None


def budget_admission(tool: str, args: dict[str, Any], s: Summary, forecast: float, lab: Path) -> str | None:
    if tool not in JOB_TOOLS or tool == "sealed_open":  # the sealed check is what the reserve is kept for
        return None
    admission = s.view.ledger.admission(forecast)
    return None if admission.admitted else f"budget: {admission.reason}"


def bars_before_scores(tool: str, args: dict[str, Any], s: Summary, forecast: float, lab: Path) -> str | None:
    if tool in _SCORING_TOOLS and s.bars is None:
        return f"{tool} before any bars are registered: bars come before scores (register_bars first)"
    return None


def audited_training_data(tool: str, args: dict[str, Any], s: Summary, forecast: float, lab: Path) -> str | None:
    audited = {d.id for d in s.datasets if d.audit_passed}
    wanted = [args.get("dataset")] if tool == "train" else [p.get("dataset") for p in args.get("parts", [])]
    if tool not in ("train", "build_dataset"):
        return None
    for ref in wanted:
        if ref is not None and ref not in audited:
            return (f"dataset {ref} is not a leak-audited dataset built from this session's train split; "
                    "training data may not come from holdouts or outside the session")
    return None


def served_promotion(tool: str, args: dict[str, Any], s: Summary, forecast: float, lab: Path) -> str | None:
    if tool != "promote":
        return None
    eligibility = s.view.promotion(args.get("candidate", -1))
    return None if eligibility.promotable else "; ".join(eligibility.reasons)


def sealed_once_for_nominee(tool: str, args: dict[str, Any], s: Summary, forecast: float, lab: Path) -> str | None:
    if tool != "sealed_open":
        return None
    if s.sealed_opened:
        return "the sealed confirmation was already opened in this session: it is scored once"
    if s.nominee is None or args.get("artifact") != s.nominee:
        return f"the sealed confirmation is for the nominee only (nominee: {s.nominee}, asked: {args.get('artifact')})"
    return None


def known_artifacts(tool: str, args: dict[str, Any], s: Summary, forecast: float, lab: Path) -> str | None:
    known = {c.id for c in s.checkpoints} | {d.id for d in s.datasets}
    for key in ("artifact", "candidate", "parent", "dataset"):
        if key in args and args[key] not in known:
            return f"{key} {args[key]} is not an artifact of this session"
    for ref in args.get("models", []):
        if ref not in known:
            return f"model {ref} is not an artifact of this session"
    return None


GATES: tuple[Callable[[str, dict[str, Any], Summary, float, Path], str | None], ...] = (
    paths_inside_lab, known_artifacts, budget_admission, bars_before_scores, audited_training_data,
    served_promotion, sealed_once_for_nominee,
)


def train_within_ranges(tool: str, args: dict[str, Any], recipe: TrainRecipe | None) -> str | None:
    if tool != "train" or recipe is None:
        return None
    reasons = out_of_range(recipe, args)
    return "outside the lab's [train] ranges: " + "; ".join(reasons) if reasons else None


def check(tool: str, args: dict[str, Any], summary: Summary, forecast_gpuh: float, lab: Path,
          train: TrainRecipe | None = None) -> str | None:
    """The first gate's reason to refuse, or None when every gate passes (`train`: the lab's settled [train])."""
    for gate in GATES:
        reason = gate(tool, args, summary, forecast_gpuh, lab)
        if reason is not None:
            return reason
    return train_within_ranges(tool, args, train)
