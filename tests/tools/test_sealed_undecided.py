"""A sealed battle suite (delta's reward-proxy confirmation) whose sealed battles hold no decisive vote: the
confirmation is opened once and recorded as undecided, with no job on an empty items file and no crash; the card
says undecided (real split job, real notebook, the real tool)."""

from __future__ import annotations

from pathlib import Path

from evals.decoding import Decoding
from memory.notebook import Notebook
from memory.state import fold
from tools import sealed_open
from tools.context import LabSpec, LabSuite, ToolContext
from tools.data.splits import SplitConfig
from tools.ingest import SplitJob, holdout_battles, split_job
from tools.nomination import card
from tools.paths import LabPaths


def test_a_sealed_battle_suite_without_a_decisive_vote_is_recorded_undecided(tmp_path: Path, battle, jsonl):
    # 2 own and 2 other votes are too few for a share of the 4 sealed battles (their remainders, 0.2 each, lose to the
    # ties' 0.6 in the apportionment): every sealed battle is one of the 36 ties, which name no preferred answer.
    votes = ["own"] * 2 + ["other"] * 2 + ["tie"] * 36
    feedback = jsonl(tmp_path / "feedback.jsonl", [battle(f"b{i:02d}", f"question number {i} about the shop", v)
                                                     for i, v in enumerate(votes)])
    paths = LabPaths(root=tmp_path, session="s")
    config = SplitConfig(dev_fraction=0.2, sealed_fraction=0.1)
    split = split_job(SplitJob(feedback=feedback, config=config, out_dir=paths.splits))
    nb = Notebook.open(tmp_path / "notebook.db")
    nb.open_session("s", lab=str(tmp_path), budget_gpuh=10, reserve_gpuh=0, planner="playbook", executor="local",
                    config={})
    nb.record_split(source_path=str(feedback), source_sha256=split.source_sha256, config=config.model_dump(mode="json"),
                    counts=split.counts, assignment=dict(split.assignment), session="s")
    lab = LabSpec(parent=tmp_path / "parent", tokenizer=tmp_path / "parent", feedback=feedback, dev_fraction=0.2,
                  sealed_fraction=0.1, suites=[LabSuite(name="confirm", scorer="reward_proxy", sealed=True)],
                  bars=None, served=Decoding(), time_limit_min=5)
    ctx = ToolContext(nb=nb, session="s", paths=paths, lab=lab, jobs=None)  # type: ignore[arg-type]  # no job may run
    assert "sealed" in split.assignment.values() and holdout_battles(ctx, sealed=True).read_text() == ""
    nominee = nb.add_artifact(kind="checkpoint", name="arm", path=str(tmp_path / "arm"), sha256="0" * 64, session="s")
    nb.record_decision("s", "nominate", "the incumbent", {"artifact_id": nominee.id})

    outcome = sealed_open.run(ctx, sealed_open.Args(artifact=nominee.id))
    assert outcome.status == "done" and outcome.data["undecided"] == ["confirm"] and outcome.data["eval_ids"] == []
    assert "confirm undecided (its sealed battles hold no decisive vote)" in outcome.summary
    [opened] = nb.decisions("s", kind="confirm")  # opened once: a second look stays impossible
    [recorded] = nb.decisions("s", kind="evaluate")
    assert recorded.payload.undecided == ["confirm"] and recorded.payload.sealed
    assert not nb.jobs(session="s")
    state = fold(nb, "s")
    assert [(c.suite, c.undecided) for c in state.confirmations] == [("confirm", True)]
    lines = card._sealed_section(nb, state, nominee)
    assert any("undecided: its sealed battles hold no decisive vote" in x and str(opened.seq) in x for x in lines)
    nb.close()
