"""Rules version 7 on hand-made summaries (pure: no job, no notebook): a comparison the dev holdout leaves unresolved
after the draws bought on its prompts takes the reserve's prompts for its last registered look (the incumbent's reserve
eval first, then the candidate's, then the reserve look), within the gates like every eval; without a reserve, or
under version 6, the looks are version 6's step for step.

The setting: the short protocol after both first arms (SFT 3, DPO 4) were screened and looked at on the holdout; SFT
leads, so it goes under the bars first. The bars register 3 sequential looks at the holdout's p bar.
"""

from __future__ import annotations

from agent.planners.playbook import PlaybookSettings, next_step
from agent.summary import Call, Checkpoint, Refused, Summary
from agent.toolbox import canonical_args
from memory.records import BarsSpec
from memory.state import RegisteredBars
from tests.agent.views import LOOPS_GUARD, SYNTHETIC_GUARD, ledger, rule, summary

SHORT = PlaybookSettings.short()
V6 = PlaybookSettings(**(SHORT.model_dump() | {"version": 6, "evidence": None}))
HOLDOUT_T = rule("holdout", "win_score", "p", "<=", 0.05, test="paired_t")
BARS = RegisteredBars(id=1, seq=1, sha256="y", registered_at="2026-01-01T00:00:00+00:00",
                      spec=BarsSpec(bars=(HOLDOUT_T, SYNTHETIC_GUARD, LOOPS_GUARD), p_family=3, looks=3,
                                    look_spending=0.5, continue_p=0.25))
RESERVE = {"id": 1, "sha256": "x", "counts": {"train": 26, "dev": 19, "sealed": 6, "reserve": 13},
           "reserve_suites": ["holdout"]}
NO_RESERVE = {"id": 1, "sha256": "x", "counts": {"train": 39, "dev": 19, "sealed": 6}}
HOLDOUT = ["holdout"]


def _done(id_: int, tool: str, args: dict, data: dict | None = None) -> Call:
    return Call(id=id_, tool=tool, args=canonical_args(tool, args), status="done", summary="", data=data or {})


def _cp(id_: int, origin: str, win: float) -> Checkpoint:
    return Checkpoint(id=id_, name=f"c{id_}", origin=origin, parent=None if id_ == 1 else 1, served_decoding="",
                      metrics={"synthetic": {"correct": 0.6}, "loops": {"looping": 0.2}, "holdout": {"win_score": win}},
                      verdicts=[])


def _summary(extra: list[Call], split: dict, refused: list[Refused] = ()) -> Summary:
    args = {f: {"trainer": f, "parent": 1, "dataset": d, "steps": SHORT.steps} for f, d in (("sft", 2), ("dpo", 5))}
    calls = [_done(1, "build_dataset", {"builder": "winner_sft"}, {"artifact_id": 2}),
             _done(2, "build_dataset", {"builder": "battle_pairs"}, {"artifact_id": 5}),
             _done(3, "train", args["sft"], {"artifact_id": 3}), _done(4, "train", args["dpo"], {"artifact_id": 4}),
             _done(5, "evaluate", {"artifact": 3, "suites": ["synthetic", "loops"]}),
             _done(6, "evaluate", {"artifact": 4, "suites": ["synthetic", "loops"]}),
             _done(7, "evaluate", {"artifact": 3, "suites": HOLDOUT}),
             _done(8, "evaluate", {"artifact": 4, "suites": HOLDOUT}), *extra]
    return summary(budget=ledger(100, 10, 0, 5), bars=BARS, parent=1, incumbent=1, calibrated=[1], split=split,
                   screen_floors={"synthetic/correct": 0.05, "loops/looping": 0.05}, calls=calls,
                   checkpoints=[_cp(1, "parent", 0.5), _cp(3, "train:sft", 0.65), _cp(4, "train:dpo", 0.55)],
                   gate_refusals=list(refused))


UNRESOLVED = {"unresolved": True}
# SFT's first two looks, both unresolved, with the dev draw bought between them
TWO_LOOKS = [_done(9, "compare", {"candidate": 3, "look": 1}, UNRESOLVED),
             _done(10, "evaluate", {"artifact": 3, "suites": HOLDOUT, "replicates": 2}),
             _done(11, "compare", {"candidate": 3, "look": 2}, UNRESOLVED)]
INCUMBENT_RESERVE = {"artifact": 1, "suites": HOLDOUT, "reserve": True}
CANDIDATE_RESERVE = {"artifact": 3, "suites": HOLDOUT, "reserve": True}


def _step(extra: list[Call], split: dict, cfg: PlaybookSettings = SHORT, refused: list[Refused] = ()):
    step = next_step(_summary(extra, split, refused), cfg)
    return step.tool, step.args, step.rationale


def test_an_unresolved_comparison_draws_the_reserve_for_its_last_look():
    assert SHORT.version == 7 and SHORT.evidence == "sequential_reserve"
    assert _step([], RESERVE)[:2] == ("compare", {"candidate": 3, "look": 1})
    # the draws on the dev prompts come first, as under version 6
    assert _step(TWO_LOOKS[:1], RESERVE)[:2] == ("evaluate", {"artifact": 3, "suites": HOLDOUT, "replicates": 2})
    assert _step(TWO_LOOKS[:2], RESERVE)[:2] == ("compare", {"candidate": 3, "look": 2})
    # then the reserve: the incumbent's answers and first look at its prompts, the candidate's, the reserve look
    tool, args, why = _step(TWO_LOOKS, RESERVE)
    assert (tool, args) == ("evaluate", INCUMBENT_RESERVE)
    assert "reserve split's 13 battles" in why and "the incumbent's first" in why
    incumbent = [_done(12, "evaluate", INCUMBENT_RESERVE)]
    assert _step(TWO_LOOKS + incumbent, RESERVE)[:2] == ("evaluate", CANDIDATE_RESERVE)
    tool, args, why = _step(TWO_LOOKS + incumbent + [_done(13, "evaluate", CANDIDATE_RESERVE)], RESERVE)
    assert (tool, args) == ("compare", {"candidate": 3, "look": 3, "reserve": True})
    assert "the reserve's 13 battles were drawn" in why and "look 3 of 3" in why and "the reserve look" in why


def test_without_a_reserve_or_under_version_6_the_last_look_draws_the_dev_prompts_again():
    third_draw = ("evaluate", {"artifact": 3, "suites": HOLDOUT, "replicates": 3})
    assert _step(TWO_LOOKS, NO_RESERVE)[:2] == third_draw  # version 7 without a reserve: version 6 step for step
    assert _step(TWO_LOOKS, RESERVE, V6)[:2] == third_draw  # version 6 never reads a reserve
    # a reserve whose prompts no p bar's suite reads (a judged suite with items of its own): no reserve look
    assert _step(TWO_LOOKS, RESERVE | {"reserve_suites": ["other"]})[:2] == third_draw
    drawn = TWO_LOOKS + [_done(12, "evaluate", {"artifact": 3, "suites": HOLDOUT, "replicates": 3})]
    assert _step(drawn, RESERVE, V6)[:2] == ("compare", {"candidate": 3, "look": 3})


def test_a_reserve_draw_the_budget_refuses_leaves_the_candidate_unjudged():
    refused = [Refused(tool="evaluate", args=canonical_args("evaluate", INCUMBENT_RESERVE), reason="budget")]
    tool, args, _ = _step(TWO_LOOKS, RESERVE, refused=refused)
    # the stage goes on with its next finalist: SFT is neither compared at look 3 nor drawn again
    assert (tool, args) == ("compare", {"candidate": 4, "look": 1})
