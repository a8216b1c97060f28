"""The toy world's parts for the seeds' recipes (tools/world/parts.py), used through the tools on the test world:

- `[judge] kind = "reward_model"` with the world's reward model scores the judge suites as reward-proxy suites
  (they are no longer dropped): an eval job records a reward-proxy win rate on the dev battles; a battle_margin
  suite without a file scores the dev battles' log-prob margin;
- the verified pool ([[data]] kind = "verified") builds a leak-audited RFT dataset that names its verifier, and an
  RFT arm trains on it with that suite's scorer as the verifier.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from agent import toolbox
from agent.config import LabConfigError, load_lab_config
from agent.inputs import check_inputs
from agent.planners.playbook import PlaybookSettings
from agent.runner import _runtime
from memory.notebook import Notebook
from tools.promote import start_incumbent
from tools.world import parts

SESSION = "s1"


@pytest.fixture
def world(toy_world: Path) -> Path:
    return toy_world


def _tool(ctx, tool: str, **args):
    outcome = toolbox.run(ctx, tool, toolbox.args_model(tool).model_validate(args), None)
    assert outcome.status == "done", outcome
    return outcome


def _lab(world: Path, tmp_path: Path, edit=None) -> Path:
    lab = tmp_path / "lab"
    shutil.copytree(world, lab, ignore=shutil.ignore_patterns("notebook.db*", "lab.lock"))
    if edit is not None:
        (lab / "lab.toml").write_text(edit((lab / "lab.toml").read_text()))
    return lab


def _ctx(lab: Path):
    config = load_lab_config(lab)
    nb = Notebook.open(lab / "notebook.db")
    nb.open_session(SESSION, lab=str(lab), budget_gpuh=50.0, reserve_gpuh=0.5, planner="playbook", executor="local",
                    config={})
    rt = _runtime(nb, SESSION, lab, config, config.executor, PlaybookSettings.test(), "playbook", True)
    parent = start_incumbent(rt.ctx)
    _tool(rt.ctx, "ingest")
    return rt.ctx, nb, parent


def test_the_world_ships_a_fitted_reward_model_and_a_verified_pool(world: Path):
    info = json.loads((world / "world" / "world.json").read_text())["reward_model"]
    assert info["pairs"] >= 10 and info["accuracy_after"] > max(info["accuracy_before"], 0.8)
    assert (world / parts.REWARD_MODEL / "config.json").is_file()
    pool = [json.loads(line) for line in (world / parts.VERIFIED_POOL).read_text().splitlines()]
    suite = {json.loads(line)["messages"][-1]["content"] for line in (world / "world/suites/synthetic.jsonl").open()}
    assert len(pool) == 32 and all(p["gold"] for p in pool) and not suite & {p["messages"][-1]["content"] for p in pool}
    config = load_lab_config(world)
    assert [(d.name, d.kind, d.verifier) for d in config.data][-1] == ("verified", "verified", "synthetic")
    assert check_inputs(config) == []


def _reward_judge(text: str) -> str:
    return (text.replace('kind = "oracle"\n', f'kind = "reward_model"\npath = "{parts.REWARD_MODEL}"\n', 1)
            + '\n[[evals]]\nname = "margin"\nscorer = "battle_margin"\n')


def test_a_reward_model_judge_scores_the_judge_suites_as_reward_proxy(world: Path, tmp_path: Path):
    lab = _lab(world, tmp_path, _reward_judge)
    # The world's bars name the judge's metrics: with a reward-model judge they are refused, naming the metric.
    assert any("bars" in p and "holdout" in p for p in check_inputs(load_lab_config(lab)))
    ctx, nb, parent = _ctx(lab)
    assert (ctx.lab.suite("holdout").scorer, ctx.lab.suite("confirm").scorer) == ("reward_proxy", "reward_proxy")
    assert ctx.lab.reward_model == lab / parts.REWARD_MODEL and ctx.lab.suite("margin").file is None
    _tool(ctx, "evaluate", artifact=parent, suites=["holdout", "margin"])
    evals = {e.suite: e for e in nb.evals(artifact_id=parent, session=SESSION)}
    assert 0.0 <= evals["holdout"].metrics["win"] <= 1.0 and "margin" in evals["holdout"].metrics
    assert 0.0 <= evals["margin"].metrics["prefers_chosen"] <= 1.0
    dev = nb.latest_split().counts["dev"]
    assert len(evals["margin"].items) == dev.get("own", 0) + dev.get("other", 0)  # the decisive dev battles


def test_reward_proxy_suites_without_a_reward_model_are_refused_at_load(world: Path, tmp_path: Path):
    lab = _lab(world, tmp_path, lambda t: t + '\n[[evals]]\nname = "proxy"\nscorer = "reward_proxy"\n')
    with pytest.raises(LabConfigError, match=r"reward_proxy suites \(proxy\) need a reward model"):
        load_lab_config(lab)
    lab = _lab(world, tmp_path / "b", lambda t: t.replace('verifier = "synthetic"', 'verifier = "loops"'))
    with pytest.raises(LabConfigError, match=r"data\[1\].verifier: 'loops' is no \[\[evals\]\] suite with a verifying"):
        load_lab_config(lab)


def test_rft_on_the_labs_own_verified_pool(world: Path, tmp_path: Path):
    ctx, nb, parent = _ctx(_lab(world, tmp_path))
    built = _tool(ctx, "build_dataset", builder="verified_pool", source="verified", n=8)
    data = nb.artifact(built.data["artifact_id"])
    assert data.recipe["builder"] == "verified_pool" and data.recipe["rows"] == 8 and data.recipe["audit"]["hits"] == []
    assert data.recipe["config"]["source"]["verifier"] == "synthetic"
    assert any(s["role"] == "data:verified" for s in data.recipe["sources"])
    refused = toolbox.run(ctx, "build_dataset", toolbox.args_model("build_dataset").model_validate(
        {"builder": "verified_pool", "source": "stage1"}), None)
    assert refused.status == "failed" and "kind 'verified'" in refused.summary
    arm = _tool(ctx, "train", trainer="rft", parent=parent, dataset=data.id, steps=2, batch_size=2, k=2)
    run = Path(nb.artifact(arm.data["artifact_id"]).recipe["run_dir"]).parent  # RFT: the SFT phase runs in sft/
    assert json.loads((run / "config.json").read_text())["scorer"] == "evals.synthetic:score"
    assert json.loads((run / "sampling.json").read_text())["prompts"] == 8
