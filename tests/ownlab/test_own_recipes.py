"""Each named recipe (agent/planners/recipes.py) on the suite's own lab (tests/ownlab/ownlab.py) at the test protocol
(the smallest: the five together would take far past the suite's budget at any larger one): a checked nomination
with nothing of the toy world in any dataset it built, the recipe's defining steps in its notebook, a replay to the
same decisions; or, for a recipe the lab cannot run, a refusal before any session opens that says what to add.

The recipe labs register permissive bars (`recipe-bars.toml`: the judged holdout's p bar holds at p <= 1, the guards
at 100 noise floors, one replicate per eval), so candidates are promoted and each recipe's later steps (a round from a merged round, a soup,
a dose) run: the mechanics are under test here, not the bars (tests/evals/test_bars_compare.py and the own lab's
combined session hold those).

delta judges by a reward model's proxy win rate: on the own lab with its HTTP judge it is refused with that
reason; with a local reward model as the lab's judge (the README's other kind for a team's lab; its holdout bar
then reads the reward-proxy `win`) it runs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import ownlab  # noqa: E402
from test_own_lab import SESSION, Ran, assert_only_own_data, checked_nomination, cli, run_session  # noqa: E402

from agent.planners import recipes  # noqa: E402
from agent.planners.policy import VERSION  # noqa: E402
from core import tiny  # noqa: E402
from memory.notebook import Notebook  # noqa: E402

PERMISSIVE = """p_family = 10

[[bar]]
suite = "holdout"
metric = "{metric}"
rule = "p <= 1.0"
test = "paired_t"

[[bar]]
suite = "follow"
metric = "strict"
rule = "delta >= -100.0 * noise_floor"

[[bar]]
suite = "stop"
metric = "stopped"
rule = "delta >= -100.0 * noise_floor"

[[bar]]
suite = "loops"
metric = "looping"
rule = "delta <= 100.0 * noise_floor"
"""


def _with_reward_model(lab: Path) -> None:
    """The lab's judge as a local reward model (a tiny one, built here), its holdout bar on the proxy win rate."""
    tiny.build_reward_model(lab / "models" / "chat", lab / "models" / "reward", seed=0)
    text = (lab / "lab.toml").read_text()
    start, end = text.index("[judge]\n"), text.index("[train]\n")
    (lab / "lab.toml").write_text(text[:start] + '[judge]\nkind = "reward_model"\npath = "models/reward"\n\n' + text[end:])


def _calls(nb: Notebook, tool: str) -> list:
    return [c for c in nb.tool_calls(SESSION) if c.tool == tool]


def _aspen(nb: Notebook) -> None:
    builders = [c.args["builder"] for c in _calls(nb, "build_dataset") if c.status == "done"]
    assert builders == ["winner_sft", "own_replay", "mix"], builders
    mix = [c for c in _calls(nb, "build_dataset") if c.args["builder"] == "mix"][0]
    assert [p["kl_only"] for p in mix.args["parts"]] == [False, True]  # the own-policy replay carries KL only
    [arm] = [c for c in _calls(nb, "train") if c.status == "done"]
    assert (arm.args["trainer"], arm.args["method"], arm.args["lora_r"], arm.args["fp32_head"]) == ("klce", "lora", 64, True)
    adapter = nb.artifact(arm.result["data"]["adapter_id"])
    run_config = json.loads((Path(adapter.path).parent / "config.json").read_text())
    assert adapter.kind == "adapter" and run_config["lora"]["r"] == 64 and run_config["lora"]["train_lm_head"]
    snapshots = arm.result["data"]["snapshots"]
    assert snapshots  # saved steps, screened for trajectory selection
    assert {s["artifact_id"] for s in snapshots} <= {c.args["artifact"] for c in _calls(nb, "evaluate")}


def _brook(nb: Notebook) -> None:
    # Each round's loop-fix pairs come from the lab's own train battles: built where the model's answers to them
    # looped or ran past the cap, else a recorded skip (the round trains on the battle pairs alone).
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


def _delta(nb: Notebook) -> None:
    [arm] = [c for c in _calls(nb, "train") if c.status == "done"]
    assert arm.args["trainer"] == "sft"
    proxy = [e for e in nb.evals(session=SESSION) if e.suite == "holdout"]
    assert proxy and all("win" in e.metrics for e in proxy)  # the reward model's proxy win rate, a judged suite
    served = [c for c in _calls(nb, "tune_serving") if c.status == "done"]
    assert served and served[0].args["repetition_penalty"] > 1.0


def _ember(nb: Notebook) -> None:
    [sft] = [c for c in _calls(nb, "build_dataset") if c.args["builder"] == "winner_sft"]
    stats = nb.artifact(sft.result["data"]["artifact_id"]).recipe["stats"]
    assert stats["other_wins"] > 0 and stats["own_wins"] > 0  # opponent wins are trained on too
    assert [c.args["method"] for c in _calls(nb, "merge")][:1] == ["soup"]
    assert any(e.suite == "margin" for e in nb.evals(session=SESSION))


def _islet(nb: Notebook) -> None:
    [pool] = [c for c in _calls(nb, "build_dataset") if c.status == "done"]
    assert pool.args["builder"] == "verified_pool"
    arms = [c for c in _calls(nb, "train") if c.args["trainer"] == "rft"]
    assert sorted(c.args.get("lr_scale") or 1.0 for c in arms) == [0.5, 1.0, 2.0]  # three learning rates
    assert nb.noise_floors(SESSION, "follow", "strict")
    assert len(nb.bars(nb.decisions(SESSION, kind="register_bars")[-1].payload.bars_id).spec.bars) == 4
    assert [c.args["method"] for c in _calls(nb, "merge")] == ["dose"]


DEFINING: dict[str, Callable[[Notebook], None]] = {
    "aspen": _aspen, "brook": _brook, "delta": _delta, "ember": _ember, "islet": _islet}


@pytest.mark.slow
@pytest.mark.parametrize("recipe", recipes.RECIPES)
def test_each_recipe_runs_to_a_checked_nomination_on_the_own_lab(recipe: str, tmp_path: Path):
    with ownlab.judge_server() as (url, judge):
        lab = ownlab.make_lab(tmp_path / "lab", url, bars="recipe-bars.toml")
        (lab / "recipe-bars.toml").write_text(PERMISSIVE.format(metric="win" if recipe == "delta" else "win_score"))
        if recipe == "delta":
            _with_reward_model(lab)
        proc = run_session(lab, "--protocol", "test", "--recipe", recipe)
        ran = Ran(lab, proc, list(judge.requests), list(judge.authorized))
    checked_nomination(ran, again_from_cli=False)  # the combined session's test runs the CLI's check on its bundle
    with Notebook.open(lab / "notebook.db", readonly=True) as nb:
        # a candidate whose bundle is refused falls back to the next (recorded failed): the last two are the nominee's
        assert [(c.tool, c.status) for c in nb.tool_calls(SESSION) if c.tool in ("nominate", "publish")][-2:] == [
            ("nominate", "done"), ("publish", "done")]
        opened = nb.decisions(SESSION, kind="open")[0].payload
        assert (opened.policy.name, opened.policy.protocol) == (recipe, "test")
        DEFINING[recipe](nb)
    assert_only_own_data(lab)
    if recipe != "delta":
        assert ran.judge_requests and all(ran.judge_authorized)  # the lab's own judge judged its holdout
    replayed = cli("replay", SESSION, "--lab", str(lab), timeout=600)
    assert replayed.returncode == 0, replayed.stdout[-6000:] + replayed.stderr[-2000:]


def test_a_recipe_the_lab_cannot_run_is_refused_before_a_session_opens(tmp_path: Path):
    """delta on the lab's HTTP judge, and islet on the lab without its verified pool: exit 2, what to add, no session."""
    with ownlab.judge_server() as (url, judge):
        lab = ownlab.make_lab(tmp_path / "lab", url)
        delta: subprocess.CompletedProcess = run_session(lab, "--protocol", "test", "--recipe", "delta")
        text = (lab / "lab.toml").read_text()
        pool = text[text.index("[[data]]                                 # our own checkable"):text.index("[[evals]]")]
        (lab / "lab.toml").write_text(text.replace(pool, ""))
        islet: subprocess.CompletedProcess = run_session(lab, "--protocol", "test", "--recipe", "islet")
    for proc in (delta, islet):
        assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr
    assert "recipe delta cannot run in this lab" in delta.stderr and 'set [judge] kind = "reward_model"' in delta.stderr
    assert "islet samples on-policy answers to the lab's own verified items" in islet.stderr
    assert not (lab / "notebook.db").exists() and not judge.requests


def test_every_recipe_is_a_named_versioned_policy():
    facts = {"margin_suite": "margin", "verified_pool": "verified"}
    for name in recipes.RECIPES:
        settings = recipes.settings(name, "full", facts)
        assert (settings.name, settings.protocol, settings.version) == (name, "full", VERSION)
        assert settings.ref() == {"name": name, "protocol": "full", "version": VERSION}
