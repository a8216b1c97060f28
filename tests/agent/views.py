"""Typed session views and summaries built in a test, without a notebook (for the pure planner and gate tests).

The view's counts are derived here the way the notebook derives them: each comparison tests every p bar of the
bars (so a finished `compare` call spends `len(p_rules)` p-values), and the incumbent chain is the parent, then
each candidate a finished `promote` call made incumbent.
"""

from __future__ import annotations

from typing import Any

from agent.planners.policy import PlaybookSettings
from agent.summary import Call, Checkpoint, Dataset, Summary
from evals.bars import Rule
from evals.compare import BarVerdict, PFamily
from tools.session import Ledger, RegisteredBars, SessionView, Verdict


def rule(suite: str, metric: str, statistic: str, op: str, value: float, *, floors: bool = False,
         test: str | None = None) -> Rule:
    return Rule(suite=suite, metric=metric, statistic=statistic, op=op, value=value,
                unit="noise_floor" if floors else "absolute",
                test=test or ("mcnemar_exact" if statistic == "p" else None), confidence=None)


HOLDOUT_P = rule("holdout", "win_score", "p", "<=", 0.05)
SYNTHETIC_GUARD = rule("synthetic", "correct", "delta", ">=", -1, floors=True)
LOOPS_GUARD = rule("loops", "looping", "delta", "<=", 1, floors=True)
TOY_RULES = (HOLDOUT_P, SYNTHETIC_GUARD, LOOPS_GUARD)


def bars(*rules: Rule, p_family: int | None = None, replicates: int = 1) -> RegisteredBars:
    return RegisteredBars(id=1, sha256="y", rules=rules, p_family=p_family, replicates=replicates)


def ledger(budget: float, spent: float, reserved: float, reserve: float) -> Ledger:
    return Ledger(budget_gpuh=budget, spent_gpuh=spent, reserved_gpuh=reserved, reserve_gpuh=reserve)


def bar_verdict(r: Rule, value: float, threshold: float, holds: bool) -> BarVerdict:
    return BarVerdict(bar=r, n=100, value=value, raw_p=value if r.statistic == "p" else None, threshold=threshold,
                      holds=holds)


def verdict(comparison_id: int, incumbent: int, promoted: bool, bars: list[BarVerdict] | None = None,
            candidate: int = -1) -> Verdict:
    """A comparison's verdict; `summary` sets its candidate from the checkpoint that holds it."""
    return Verdict(comparison_id=comparison_id, candidate=candidate, incumbent=incumbent, promoted=promoted,
                   bars=bars or [])


def summary(*, budget: Ledger, bars: RegisteredBars | None, parent: int | None, incumbent: int | None,
            checkpoints: list[Checkpoint], calls: list[Call], consecutive_failed_arms: int = 0,
            split: dict[str, Any] | None = None, calibrated: list[int] | None = None,
            noise_floors: dict[str, float] | None = None, datasets: list[Dataset] | None = None,
            **rest: Any) -> Summary:
    cps = [cp.model_copy(update={"verdicts": [v.model_copy(update={"candidate": cp.id}) for v in cp.verdicts]})
           for cp in checkpoints]
    per = len(bars.p_rules) if bars is not None else 0
    compared = sum(c.tool == "compare" and c.status == "done" for c in calls)
    family = PFamily(size=bars.p_family if bars is not None else None, spent=compared * per, per_comparison=per)
    chain = [parent] if parent is not None else []
    chain += [c.args["candidate"] for c in calls if c.tool == "promote" and c.status == "done"]
    if incumbent is not None and (not chain or chain[-1] != incumbent):
        chain.append(incumbent)
    view = SessionView(session="s", ledger=budget, parent=parent, incumbent=incumbent, chain=chain, bars=bars,
                       verdicts=sorted((v for cp in cps for v in cp.verdicts), key=lambda v: v.comparison_id),
                       p_family=family, failed_arms_in_row=consecutive_failed_arms)
    defaults = {"refusals": [], "gate_refusals": [], "failures": [], "nominee": None, "sealed_opened": False}
    return Summary(session="s", view=view, split=split if split is not None else {"id": 1, "sha256": "x", "counts": {}},
                   calibrated=calibrated or [], noise_floors=noise_floors or {}, checkpoints=cps,
                   datasets=datasets or [], calls=calls, **(defaults | rest))


# The policy's own arm numbers of versions 1-3 (the toy world's), for the tests written against those versions.
FIXED_ARMS = {"arms": "fixed", "lr": {"sft": 1e-3, "dpo": 2e-4, "klce": 1e-3, "rft": 1e-3}, "steps": 30, "batch_size": 8,
              "trajectory_shares": ()}


def v3(**settings: Any) -> PlaybookSettings:
    """A version-3 policy (fixed arms) with these settings (`version=2` and its rules may be given too)."""
    return PlaybookSettings(**({"version": 3} | FIXED_ARMS | settings))


def flags_era(protocol: PlaybookSettings, **flags: bool) -> dict[str, Any]:
    """A playbook record of the flags era (before named, versioned policies): the protocol's sizes with the
    version-3 arm numbers, no name, protocol, version or rule keys, and the given flags."""
    new = {"name", "protocol", "version", "calibration", "stage", "arms", "trajectory_shares", "finalist_rule"}
    return protocol.model_dump(mode="json", exclude=new) | {k: v for k, v in FIXED_ARMS.items() if k in
                                                            ("lr", "batch_size")} | {"steps": protocol.steps or 30} | flags
