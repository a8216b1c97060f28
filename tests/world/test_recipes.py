"""The five seeds' recipes as named policies (agent/planners/recipes.py): each runs a whole `--protocol test`
session in the test world to a checked nomination, and its notebook shows the recipe's defining steps. A recipe
the lab cannot run is refused before any session opens, saying what to add.

The test labs register permissive bars (every p bar holds at p <= 1; guards of 100 noise floors), so candidates
are promoted and the recipes' later steps (a round from a merged round, a dose) run: the mechanics are under test
here, not the bars (tests/evals/test_bars_compare.py holds those).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from agent import runner
from agent.errors import SessionError
from agent.planners import recipes
from agent.planners.policy import VERSION
from agent.replay import replay
from memory.notebook import Notebook
from tools.world import parts

SESSION = "r1"
BUDGET = 5000.0

PERMISSIVE = """p_family = 10
floor_unit = "replicates"

[[bar]]
suite = "{judged}"
metric = "{metric}"
rule = "p <= 1.0"
test = "paired_t"

[[bar]]
suite = "synthetic"
metric = "correct"
rule = "delta >= -100.0 * noise_floor"

[[bar]]
suite = "loops"
metric = "looping"
rule = "delta <= 100.0 * noise_floor"

[[bar]]
suite = "stop"
metric = "stopped"
rule = "delta >= -100.0 * noise_floor"
"""


def _lab(world: Path, tmp_path: Path, reward: bool = False, margin: bool = False) -> Path:
    lab = tmp_path / "lab"
    shutil.copytree(world, lab, ignore=shutil.ignore_patterns("notebook.db*", "lab.lock", "graph.sqlite*"))
    text = (lab / "lab.toml").read_text().replace('bars = "world/bars.toml"', 'bars = "recipe-bars.toml"', 1)
    if reward:
        text = text.replace('kind = "oracle"\n', f'kind = "reward_model"\npath = "{parts.REWARD_MODEL}"\n', 1)
    if margin:
        text += '\n[[evals]]\nname = "margin"\nscorer = "battle_margin"\n'
    (lab / "lab.toml").write_text(text)
    judged = {"judged": "holdout", "metric": "win" if reward else "win_score"}
    (lab / "recipe-bars.toml").write_text(PERMISSIVE.format(**judged))
    return lab


def _run(lab: Path, recipe: str) -> Notebook:
    rc = runner.start(lab, SESSION, BUDGET, "playbook", "local", "test", quiet=True, recipe=recipe)
    nb = Notebook.open(lab / "notebook.db")
    assert rc == 0, nb.session(SESSION).status
    nominated = nb.decisions(SESSION, kind="nominate")
    assert nominated and nb.session(SESSION).status == "done"  # a checked nomination (check-bundle passed)
    opened = nb.decisions(SESSION, kind="open")[0].payload
    assert (opened.policy.name, opened.policy.protocol) == (recipe, "test")
    assert replay(lab, SESSION).same  # the recorded session replays to the same decisions under its recorded policy
    return nb


def _calls(nb: Notebook, tool: str) -> list:
    return [c for c in nb.tool_calls(SESSION) if c.tool == tool]


def test_aspen(toy_world: Path, tmp_path: Path):
    nb = _run(_lab(toy_world, tmp_path), "aspen")
    builders = [c.args["builder"] for c in _calls(nb, "build_dataset") if c.status == "done"]
    assert builders == ["winner_sft", "own_replay", "mix"]
    mix = [c for c in _calls(nb, "build_dataset") if c.args["builder"] == "mix"][0]
    assert [p["kl_only"] for p in mix.args["parts"]] == [False, True]  # the own-policy replay carries KL only
    [arm] = [c for c in _calls(nb, "train") if c.status == "done"]
    assert (arm.args["trainer"], arm.args["method"], arm.args["lora_r"], arm.args["fp32_head"]) == ("klce", "lora", 64, True)
    adapter = nb.artifact(arm.result["data"]["adapter_id"])
    run_config = json.loads((Path(adapter.path).parent / "config.json").read_text())
    assert adapter.kind == "adapter" and run_config["lora"]["r"] == 64 and run_config["lora"]["train_lm_head"]
    snapshots = arm.result["data"]["snapshots"]
    assert snapshots  # saved steps, screened for trajectory selection
    screened = {c.args["artifact"] for c in _calls(nb, "evaluate")}
    assert {s["artifact_id"] for s in snapshots} <= screened


def test_brook(toy_world: Path, tmp_path: Path):
    nb = _run(_lab(toy_world, tmp_path), "brook")
    # Each round's loop-fix pairs come from the lab's own train battles (issue 43): built where the model's answers
    # to them looped or ran past the cap, else a recorded skip (the round trains on the battle pairs alone).
    fixes = [c for c in _calls(nb, "build_dataset") if c.args["builder"] == "loop_fix_pairs" and c.status == "done"]
    skips = [c for c in _calls(nb, "skip") if "loop-fix pairs" in c.args["step"]]
    assert len(fixes) + len(skips) == 2, (fixes, skips)
    assert all(nb.artifact(f.result["data"]["artifact_id"]).recipe["row_kind"] == "pairs" for f in fixes)
    rounds = [c for c in _calls(nb, "train") if c.status == "done"]
    assert [c.args["trainer"] for c in rounds] == ["dpo", "dpo"] and all(c.args["method"] == "lora" for c in rounds)
    first = rounds[0].result["data"]["artifact_id"]
    assert rounds[1].args["parent"] == first  # round 2 trains from round 1's merged checkpoint
    adapter = nb.artifact(rounds[0].result["data"]["adapter_id"])
    assert adapter.kind == "adapter" and adapter.id in nb.artifact(first).parents  # round 1 was merged back
    soups = [c for c in _calls(nb, "merge") if c.args["method"] == "soup"]
    assert soups and soups[0].args["models"] == [first, rounds[1].result["data"]["artifact_id"]]


def test_delta(toy_world: Path, tmp_path: Path):
    nb = _run(_lab(toy_world, tmp_path, reward=True), "delta")
    [arm] = [c for c in _calls(nb, "train") if c.status == "done"]
    assert (arm.args["trainer"], arm.args["method"]) == ("sft", "full")
    proxy = [e for e in nb.evals(session=SESSION) if e.suite == "holdout"]
    assert proxy and all("win" in e.metrics for e in proxy)  # the reward model's proxy win rate, a judged suite
    served = [c for c in _calls(nb, "tune_serving") if c.status == "done"]
    assert served and served[0].args["repetition_penalty"] > 1.0


def test_ember(toy_world: Path, tmp_path: Path):
    nb = _run(_lab(toy_world, tmp_path, margin=True), "ember")
    [sft] = [c for c in _calls(nb, "build_dataset") if c.args["builder"] == "winner_sft"]
    stats = nb.artifact(sft.result["data"]["artifact_id"]).recipe["stats"]
    assert stats["other_wins"] > 0 and stats["own_wins"] > 0  # opponent wins are trained on too
    assert [c.args["method"] for c in _calls(nb, "merge")][:1] == ["soup"]
    assert any(e.suite == "margin" for e in nb.evals(session=SESSION))


def test_islet(toy_world: Path, tmp_path: Path):
    nb = _run(_lab(toy_world, tmp_path), "islet")
    [pool] = [c for c in _calls(nb, "build_dataset") if c.status == "done"]
    assert pool.args["builder"] == "verified_pool"
    arms = [c for c in _calls(nb, "train") if c.args["trainer"] == "rft"]
    assert sorted(c.args.get("lr_scale") or 1.0 for c in arms) == [0.5, 1.0, 2.0]  # three learning rates
    assert nb.noise_floors(SESSION, "synthetic", "correct")
    assert len(nb.bars(nb.decisions(SESSION, kind="register_bars")[-1].payload.bars_id).spec["bars"]) == 4
    assert [c.args["method"] for c in _calls(nb, "merge")] == ["dose"]


def test_a_recipe_the_lab_cannot_run_is_refused_before_a_session_opens(toy_world: Path, tmp_path: Path):
    lab = _lab(toy_world, tmp_path)
    with pytest.raises(SessionError, match=r"recipe delta cannot run in this lab: delta judges by a reward model's "
                                           r"proxy win rate: set \[judge\] kind = \"reward_model\""):
        runner.start(lab, SESSION, BUDGET, "playbook", "local", "test", quiet=True, recipe="delta")
    text = (lab / "lab.toml").read_text()
    pool = text[text.index('[[data]]\nname = "verified"'):text.index('verifier = "synthetic"\n') + 23]
    (lab / "lab.toml").write_text(text.replace(pool, ""))  # the lab without its verified pool
    with pytest.raises(SessionError, match=r"islet samples on-policy answers to the lab's own verified items"):
        runner.start(lab, SESSION, BUDGET, "playbook", "local", "test", quiet=True, recipe="islet")
    assert not (lab / "notebook.db").exists() or not Notebook.open(lab / "notebook.db").sessions()


def test_every_recipe_is_a_named_versioned_policy():
    facts = {"margin_suite": "margin", "verified_pool": "verified"}
    for name in recipes.RECIPES:
        settings = recipes.settings(name, "full", facts)
        assert (settings.name, settings.protocol, settings.version) == (name, "full", VERSION)
        assert settings.ref() == {"name": name, "protocol": "full", "version": VERSION}
