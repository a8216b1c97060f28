"""A LoRA arm through the train tool: the adapter is its own artifact, merged back into the parent, and the merged
checkpoint is a checkpoint like any other (evaluated, souped, dosed, trained from, shipped as base + adapter); the
adapter evaluates through itself too.

Real jobs on the local executor over the labkit's tiny Llama: one LoRA SFT run (4 steps, r 8, the FP32 head, a
snapshot after step 2), its merges, an eval job, a soup of two merged rounds and a dose along a merged adapter.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from agent import toolbox
from agent.config import load_lab_config
from agent.planners.playbook import PlaybookSettings
from agent.runner import _runtime
from memory.notebook import Notebook
from tools import train as train_tool
from tools.data.datasets import WinnerSFTConfig, build_winner_sft, record_dataset
from tools.data.splits import SplitConfig, ingest_feedback
from tools.nomination.bundle import weights_source
from tools.promote import start_incumbent
from trainers.common import weights_sha256

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agent"))
from labkit import SYSTEM, make_lab  # noqa: E402

SESSION = "s1"
LORA = '\n[train.lora]\nr = 8\nalpha = 16.0\nfp32_head = true\n'


def _tool(ctx, tool: str, **args):
    outcome = toolbox.run(ctx, tool, toolbox.args_model(tool).model_validate(args), None)
    assert outcome.status == "done", outcome
    return outcome


@pytest.fixture
def lora_arm(tmp_path):
    lab = make_lab(tmp_path / "lab")
    with open(lab / "lab.toml", "a") as f:
        f.write(LORA)
    config = load_lab_config(lab)
    assert config.train_recipe().families["sft"].lora.fp32_head
    nb = Notebook.open(lab / "notebook.db")
    nb.open_session(SESSION, lab=str(lab), budget_gpuh=10.0, reserve_gpuh=0.5, planner="playbook", executor="local",
                    config={})
    rt = _runtime(nb, SESSION, lab, config, config.executor, PlaybookSettings.test(), "playbook", True)
    parent = start_incumbent(rt.ctx)
    split, _ = ingest_feedback(nb, lab / "feedback.jsonl", SplitConfig(dev_fraction=0.2, sealed_fraction=0.1),
                               lab / "splits", session=SESSION)
    manifest = build_winner_sft(WinnerSFTConfig(out=lab / "data" / "winner.jsonl", tokenizer=lab / "tokenizer",
                                                feedback=lab / "feedback.jsonl", split=split, system_prompt=SYSTEM))
    assert manifest.row_tokens_p99 is not None and 0 < manifest.row_tokens_p99 <= manifest.tokens
    dataset = record_dataset(nb, manifest, session=SESSION).id
    args = {"trainer": "sft", "parent": parent, "dataset": dataset, "method": "lora", "lr": 5e-3, "steps": 4,
            "batch_size": 4, "snapshots": [2]}
    outcome = _tool(rt.ctx, "train", **args)
    yield rt.ctx, nb, parent, dataset, args, outcome
    nb.close()


def test_a_lora_arm_is_an_adapter_merged_into_a_checkpoint(lora_arm):
    ctx, nb, parent, dataset, args, outcome = lora_arm
    adapter, merged = nb.artifact(outcome.data["adapter_id"]), nb.artifact(outcome.data["artifact_id"])
    assert adapter.kind == "adapter" and (Path(adapter.path) / "adapter_config.json").is_file()
    assert adapter.recipe["settings"]["method"] == "lora" and adapter.recipe["settings"]["lora"]["r"] == 8
    config = json.loads((Path(adapter.path) / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["lora_alpha"] == 16.0 and config["modules_to_save"] == ["lm_head"]
    with safe_open(Path(adapter.path) / "adapter_model.safetensors", "pt") as f:  # the FP32 head travels with it
        heads = [k for k in f.keys() if "lm_head" in k]
        assert heads and all(f.get_tensor(k).dtype.is_floating_point for k in heads)

    assert merged.kind == "checkpoint" and merged.parents == [parent, dataset, adapter.id]
    assert merged.recipe["adapter"] == adapter.id and merged.sha256 == weights_sha256(Path(merged.path))
    assert merged.sha256 != nb.artifact(parent).sha256  # the adapter changed the weights
    # The snapshot is an adapter too, merged into its own checkpoint that names the arm's merged checkpoint as run.
    [snap] = outcome.data["snapshots"]
    snap_merged = nb.artifact(snap["artifact_id"])
    assert snap_merged.kind == "checkpoint" and snap_merged.recipe["snapshot"]["run"] == merged.id
    assert nb.artifact(snap_merged.recipe["adapter"]).kind == "adapter"
    # A bundle may ship the merged nominee as its adapter over the parent's weights.
    assert weights_source(nb, merged, "adapter") == Path(adapter.path)

    # The merged checkpoint evaluates like any checkpoint, and the adapter through itself (its base with the adapter
    # folded in by the eval engine): greedy, both give the same answers.
    _tool(ctx, "evaluate", artifact=merged.id, suites=["digits"])
    [ev] = nb.evals(artifact_id=merged.id, session=SESSION)
    assert ev.suite == "digits" and ev.served
    looks = {}
    for artifact in (merged, adapter):
        _tool(ctx, "evaluate", artifact=artifact.id, suites=["digits"], diagnostic=True)
        [looks[artifact.kind]] = [e for e in nb.evals(artifact_id=artifact.id, session=SESSION) if not e.served]
    assert looks["adapter"].items == looks["checkpoint"].items and looks["adapter"].job_key != looks["checkpoint"].job_key

    # The merge tool folds the adapter in again, into the same weights.
    again = _tool(ctx, "merge", method="lora", models=[parent, adapter.id])
    assert nb.artifact(again.data["artifact_id"]).sha256 == merged.sha256

    # Round two trains from the merged round; a soup of the two merged rounds and a dose along the merged adapter.
    round2 = _tool(ctx, "train", **(args | {"parent": merged.id, "snapshots": []}))
    second = nb.artifact(round2.data["artifact_id"])
    assert second.parents[0] == merged.id and nb.artifact(round2.data["adapter_id"]).parents[0] == merged.id
    soup = _tool(ctx, "merge", method="soup", models=[merged.id, second.id])
    dose = _tool(ctx, "merge", method="dose", models=[parent, merged.id], alpha=0.5)
    for out in (soup, dose):
        assert nb.artifact(out.data["artifact_id"]).kind == "checkpoint"
    _tool(ctx, "evaluate", artifact=dose.data["artifact_id"], suites=["digits"])

    # A resumed tool re-attaches: nothing launched or registered twice.
    jobs, artifacts = len(nb.jobs(session=SESSION)), len(nb.artifacts(session=SESSION))
    assert train_tool._body(ctx, train_tool.Args.model_validate(args)).data == outcome.data
    assert (len(nb.jobs(session=SESSION)), len(nb.artifacts(session=SESSION))) == (jobs, artifacts)
