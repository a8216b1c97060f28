"""Typed session views and summaries built in a test, without a notebook (for the pure planner and gate tests).

The state's counts are derived here the way the fold derives them: each comparison tests every p bar of the
bars (so a finished `compare` call spends `len(p_rules)` p-values), the incumbent chain is the parent, then
each candidate a finished `promote` call made incumbent (an `incumbent` event each), and the judged candidates are
those of the finished `compare` calls that did not leave it unresolved.
"""

from __future__ import annotations

from typing import Any

from agent.planners.policy import PlaybookSettings
from agent.summary import Call, Checkpoint, Dataset, Summary
from memory.records import BarsSpec, BarVerdict, Ledger, Rule
from memory.state import IncumbentChange, PFamily, RegisteredBars, SessionState, Verdict


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
    return RegisteredBars(id=1, seq=1, sha256="y", registered_at="2026-01-01T00:00:00+00:00",
                          spec=BarsSpec(bars=rules, p_family=p_family, replicates=replicates))


def ledger(budget: float, spent: float, reserved: float, reserve: float) -> Ledger:
    return Ledger(budget_gpuh=budget, spent_gpuh=spent, reserved_gpuh=reserved, reserve_gpuh=reserve)


def bar_verdict(r: Rule, value: float, threshold: float, holds: bool) -> BarVerdict:
    return BarVerdict(bar=r, n=100, value=value, raw_p=value if r.statistic == "p" else None, threshold=threshold,
                      holds=holds)


def verdict(comparison_id: int, incumbent: int, cleared: bool, bars: list[BarVerdict] | None = None,
            candidate: int = -1) -> Verdict:
    """A comparison's verdict; `summary` sets its candidate from the checkpoint that holds it."""
    bars = bars or []
    return Verdict(comparison_id=comparison_id, seq=comparison_id, candidate=candidate, incumbent=incumbent, bars_id=1,
                   cleared=cleared, bars=bars, floors=[None] * len(bars),
                   raw_p=[b.raw_p for b in bars if b.raw_p is not None])


def state(*, ledger: Ledger, parent: int | None, chain: list[int], bars: RegisteredBars | None = None,
          verdicts: list[Verdict] | None = None, p_family: PFamily | None = None, failed_arms_in_row: int = 0,
          session: str = "s", judged: list[int] | None = None) -> SessionState:
    """A session state whose incumbent chain is `chain` (the parent first, then each change of incumbent)."""
    changes = [IncumbentChange(seq=100 + i, artifact_id=a, previous=b, comparison_id=0)
               for i, (b, a) in enumerate(zip(chain, chain[1:], strict=False))]
    return SessionState(session=session, opened=None, ledger=ledger, parent=parent, changes=changes,
                        registrations=[bars] if bars is not None else [], floors=[], verdicts=verdicts or [],
                        p_family=p_family or PFamily(size=None, spent=0, per_comparison=0), confirmations=[],
                        split=None, nominee=None, refusals=[], truths=[], failed_arms_in_row=failed_arms_in_row,
                        head=None, judged=judged or [])


def summary(*, budget: Ledger, bars: RegisteredBars | None, parent: int | None, incumbent: int | None,
            checkpoints: list[Checkpoint], calls: list[Call], consecutive_failed_arms: int = 0,
            split: dict[str, Any] | None = None, calibrated: list[int] | None = None,
            screen_floors: dict[str, float] | None = None, datasets: list[Dataset] | None = None,
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
    view = state(ledger=budget, parent=parent, chain=chain, bars=bars,
                 verdicts=sorted((v for cp in cps for v in cp.verdicts), key=lambda v: v.comparison_id),
                 p_family=family, failed_arms_in_row=consecutive_failed_arms,
                 judged=list(dict.fromkeys(c.args["candidate"] for c in calls if c.tool == "compare"
                                           and c.status != "open" and not c.data.get("unresolved"))))
    defaults = {"refusals": [], "gate_refusals": [], "failures": [], "nominee": None, "sealed_opened": False}
    return Summary(session="s", view=view, split=split if split is not None else {"id": 1, "sha256": "x", "counts": {}},
                   calibrated=calibrated or [], noise_floors=[], screen_floors=screen_floors or {}, checkpoints=cps,
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
    new = {"name", "protocol", "version", "calibration", "stage", "arms", "trajectory_shares", "finalist_rule",
           "evidence"}
    return protocol.model_dump(mode="json", exclude=new) | {k: v for k, v in FIXED_ARMS.items() if k in
                                                            ("lr", "batch_size")} | {"steps": protocol.steps or 30} | flags
