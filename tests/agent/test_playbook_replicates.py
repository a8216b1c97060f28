"""Replicated guards and fallback finalists, on hand-made summaries (pure: no job, no notebook).

The setting: two first arms from the parent (1), SFT (3) and DPO (4), both made and screened on the cheap suites;
the parent is the calibrated incumbent. The bars read the mean of 3 served draws a side on the bars without a
p-value, so a finalist draws its replicates 1-2 before its comparison; a stage whose finalist the bars reject
judges its next screened candidate while the protocol's fallbacks allow.
"""

from __future__ import annotations

from agent.planners.playbook import next_step
from agent.summary import Call, Checkpoint, Summary
from agent.toolbox import canonical_args
from tests.agent.views import TOY_RULES, bars, ledger, summary, v3, verdict

RULES = TOY_RULES
CHEAP = ["synthetic", "loops"]
# The short protocol as it was before best of stage (sessions recorded so replay with it); best of stage's own
# order (every finalist's holdout look first, then the bars in the looks' order) is in test_playbook_best_of_stage.py.
CFG = v3(families=("sft", "dpo"), sweep=(), soup=False, dose_alphas=(), serving=(), finalists=1,
                       fallbacks=1, trajectory=(), stage="first_cleared", version=2)
REPLICATES = {"artifact": 3, "suites": CHEAP, "replicates": 3}


def _metrics(floors: float, holdout: bool = False) -> dict:
    out = {"synthetic": {"correct": round(0.50 + 0.05 * floors, 6)}, "loops": {"looping": 0.20}}
    return out | ({"holdout": {"win_score": 0.55}} if holdout else {})


def _call(id_: int, tool: str, args: dict, data: dict | None = None, status: str = "done") -> Call:
    return Call(id=id_, tool=tool, args=canonical_args(tool, args), status=status, summary="", data=data or {})


def _session(extra: list[Call] = (), sft_verdicts: list = (), dpo_floors: float = 1.0,
             replicates: int = 3) -> Summary:
    calls = [_call(1, "build_dataset", {"builder": "winner_sft"}, {"artifact_id": 2}),
             _call(2, "build_dataset", {"builder": "battle_pairs"}, {"artifact_id": 5}),
             _call(3, "train", {"trainer": "sft", "parent": 1, "dataset": 2, "lr": 1e-3, "steps": 30, "batch_size": 8,
                                "snapshots": []}, {"artifact_id": 3}),
             _call(4, "train", {"trainer": "dpo", "parent": 1, "dataset": 5, "lr": 2e-4, "steps": 30, "batch_size": 8,
                                "snapshots": []}, {"artifact_id": 4}),
             _call(5, "evaluate", {"artifact": 3, "suites": CHEAP}), _call(6, "evaluate", {"artifact": 4, "suites": CHEAP}),
             _call(7, "evaluate", {"artifact": 3, "suites": ["holdout"]}), *extra]
    cps = [Checkpoint(id=1, name="parent", origin="parent", parent=None, served_decoding="",
                      metrics=_metrics(0, holdout=True), verdicts=[]),
           Checkpoint(id=3, name="sft", origin="train:sft", parent=1, served_decoding="",
                      metrics=_metrics(2, holdout=True), verdicts=list(sft_verdicts)),
           Checkpoint(id=4, name="dpo", origin="train:dpo", parent=1, served_decoding="",
                      metrics=_metrics(dpo_floors), verdicts=[])]
    budget = ledger(100, 10, 0, 5)
    return summary(budget=budget, split={"id": 1, "sha256": "x", "counts": {}},
                   bars=bars(*RULES, p_family=3, replicates=replicates), parent=1,
                   incumbent=1, calibrated=[1], screen_floors={"synthetic/correct": 0.05, "loops/looping": 0.05},
                   checkpoints=cps, datasets=[], calls=calls, refusals=[], gate_refusals=[], failures=[],
                   consecutive_failed_arms=0, nominee=None, sealed_opened=False)


REJECTED = [verdict(1, 1, False)]


def test_a_finalist_draws_the_replicates_the_bars_read_before_its_comparison():
    step = next_step(_session(), CFG)
    assert (step.tool, step.args) == ("evaluate", REPLICATES)
    assert "mean of 3 served draws a side on synthetic, loops" in step.rationale
    step = next_step(_session([_call(8, "evaluate", REPLICATES)]), CFG)
    assert (step.tool, step.args) == ("compare", {"candidate": 3})


def test_one_look_bars_compare_at_once_and_failed_draws_are_not_compared():
    step = next_step(_session(replicates=1), CFG)
    assert (step.tool, step.args) == ("compare", {"candidate": 3})
    step = next_step(_session([_call(8, "evaluate", REPLICATES, status="failed")]), CFG)
    assert step.tool != "compare" and not (step.tool == "evaluate" and step.args["artifact"] == 3)


def test_a_rejected_finalist_hands_its_place_to_the_next_screened_candidate():
    done = [_call(8, "evaluate", REPLICATES), _call(9, "compare", {"candidate": 3})]
    step = next_step(_session(done, REJECTED), CFG)
    assert (step.tool, step.args) == ("evaluate", {"artifact": 4, "suites": ["holdout"]})
    more = [_call(10, "evaluate", {"artifact": 4, "suites": ["holdout"]}), _call(11, "evaluate", REPLICATES | {"artifact": 4})]
    s = _session(done + more, REJECTED)
    dpo = s.checkpoint(4).model_copy(update={"metrics": _metrics(1.0, holdout=True)})
    step = next_step(s.model_copy(update={"checkpoints": [c if c.id != 4 else dpo for c in s.checkpoints]}), CFG)
    assert (step.tool, step.args) == ("compare", {"candidate": 4})
    assert "(a fallback: 1 finalist(s) of this stage rejected)" in step.rationale
    # Without fallbacks, or when the next candidate screened no better than the incumbent, the stage is over.
    for cfg, floors in ((CFG.model_copy(update={"fallbacks": 0}), 1.0), (CFG, 0.0)):
        step = next_step(_session(done, REJECTED, dpo_floors=floors), cfg)
        assert (step.tool, step.args) == ("stop", {"reason": "protocol complete"})


def test_the_family_counts_the_fallbacks():
    assert CFG.comparisons() == 2 and CFG.model_copy(update={"fallbacks": 0}).comparisons() == 1
    assert CFG.model_copy(update={"fallbacks": 5}).comparisons() == 2  # never more than the stage's candidates


def test_a_call_recorded_before_an_argument_existed_is_still_found(tmp_path):
    # An evaluate recorded before `replicates` existed, read back from a real notebook by the summary.
    from agent.summary import summarize
    from memory.notebook import Notebook

    old = {"artifact": 3, "suites": CHEAP, "diagnostic": False}
    with Notebook.open(tmp_path / "notebook.db") as nb:
        nb.open_session("s", lab=str(tmp_path), budget_gpuh=10, reserve_gpuh=1, planner="playbook", executor="local",
                        config={})
        call = nb.record_tool_call("s", "evaluate", old)
        nb.finish_tool_call(call.id, "done", {"summary": "", "data": {}})
        s = summarize(nb, "s")
    assert s.call("evaluate", {"artifact": 3, "suites": CHEAP}).id == call.id
    assert s.call("evaluate", REPLICATES) is None
