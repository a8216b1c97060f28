"""The train tool registers each snapshot of a run as its own checkpoint artifact (trajectory selection).

One real SFT job on the local executor (the labkit's tiny Llama, 4 steps, a snapshot after step 2), then an eval
job of the snapshot through the evaluate tool: a snapshot is a checkpoint like any other. Running the tool's body
again (as a resumed agent does) re-attaches to the finished job and registers nothing twice.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from agent import toolbox
from agent.config import load_lab_config
from agent.planners.playbook import PlaybookSettings
from agent.runner import _runtime
from agent.summary import summarize
from memory.notebook import Notebook
from tools import train as train_tool
from tools.data.datasets import WinnerSFTConfig, build_winner_sft, record_dataset
from tools.data.splits import SplitConfig, ingest_feedback
from tools.nomination import card
from tools.promote import start_incumbent
from trainers.common import weights_sha256

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agent"))
from labkit import SYSTEM, make_lab  # noqa: E402

SESSION = "s1"


def _tool(ctx, tool: str, **args):
    outcome = toolbox.run(ctx, tool, toolbox.args_model(tool).model_validate(args), None)
    assert outcome.status == "done", outcome
    return outcome


@pytest.fixture
def trained(tmp_path):
    lab = make_lab(tmp_path / "lab")
    config = load_lab_config(lab)
    nb = Notebook.open(lab / "notebook.db")
    nb.open_session(SESSION, lab=str(lab), budget_gpuh=10.0, reserve_gpuh=0.5, planner="playbook", executor="local",
                    config={})
    rt = _runtime(nb, SESSION, lab, config, config.executor, PlaybookSettings.test(), "playbook", True)
    parent = start_incumbent(rt.ctx)
    split, _ = ingest_feedback(nb, lab / "feedback.jsonl", SplitConfig(dev_fraction=0.2, sealed_fraction=0.1),
                               lab / "splits", session=SESSION)
    manifest = build_winner_sft(WinnerSFTConfig(out=lab / "data" / "winner.jsonl", tokenizer=lab / "tokenizer",
                                                feedback=lab / "feedback.jsonl", split=split, system_prompt=SYSTEM))
    dataset = record_dataset(nb, manifest, session=SESSION).id
    args = {"trainer": "sft", "parent": parent, "dataset": dataset, "lr": 1e-3, "steps": 4, "batch_size": 4,
            "snapshots": [2]}
    outcome = _tool(rt.ctx, "train", **args)
    yield rt.ctx, nb, parent, dataset, args, outcome
    nb.close()


def test_each_snapshot_is_its_own_checkpoint_with_its_lineage(trained):
    ctx, nb, parent, dataset, args, outcome = trained
    final_id = outcome.data["artifact_id"]
    [entry] = outcome.data["snapshots"]
    assert entry["step"] == 2
    final, snap = nb.artifact(final_id), nb.artifact(entry["artifact_id"])
    assert snap.kind == "checkpoint" and snap.name == f"{final.name}-step2"
    assert snap.parents == final.parents == [parent, dataset] and snap.job_key == final.job_key
    assert Path(snap.path).name == "step-2" and snap.sha256 == weights_sha256(Path(snap.path)) != final.sha256
    lineage = snap.recipe["snapshot"]
    assert (lineage["run"], lineage["step"], lineage["of_steps"]) == (final_id, 2, 4)
    # No warm-up, linear decay over 4 steps: the rates of steps 1 and 2 are 1e-3 and 0.75e-3.
    assert lineage["lr"] == pytest.approx(0.75e-3) and lineage["lr_sum"] == pytest.approx(1.75e-3)
    assert snap.recipe["served_decoding"] == final.recipe["served_decoding"]
    [build] = nb.decisions(SESSION, kind="build")
    assert build.payload.model_dump()["snapshots"] == [entry] and "snapshots step 2 (loss" in build.rationale
    assert "step 2" in outcome.summary

    # The planner sees it as a checkpoint of the same family and parent; the card's lineage gives its own step.
    seen = summarize(nb, SESSION).checkpoint(snap.id)
    assert (seen.origin, seen.parent) == ("train:sft", parent)
    row = card._lineage_section(nb, card.model_lineage(nb, snap.id))[-2]
    assert row.startswith(f"| `{snap.name}` | `sft` |") and "| 2<!-- nb artifact:" in row

    # Evaluated like any checkpoint, at its served decoding.
    _tool(ctx, "evaluate", artifact=snap.id, suites=["digits"])
    [ev] = nb.evals(artifact_id=snap.id, session=SESSION)
    assert ev.suite == "digits" and ev.served

    # A resumed tool re-attaches to the finished job: nothing launched or registered twice.
    jobs, artifacts = len(nb.jobs(session=SESSION)), len(nb.artifacts(session=SESSION))
    again = train_tool._body(ctx, train_tool.Args.model_validate(args))
    assert again.data == outcome.data
    assert (len(nb.jobs(session=SESSION)), len(nb.artifacts(session=SESSION))) == (jobs, artifacts)
    assert len(nb.decisions(SESSION, kind="build")) == 1


@pytest.mark.parametrize("snapshots", [[4], [0], [3, 2]])
def test_snapshot_steps_outside_the_run_are_refused_before_any_job(snapshots):
    with pytest.raises(ValidationError, match=r"snapshots .* must increase and lie between 0 and steps \(4\)"):
        train_tool.Args(trainer="sft", parent=1, dataset=2, steps=4, snapshots=snapshots)
