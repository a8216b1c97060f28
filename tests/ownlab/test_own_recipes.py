"""Each named recipe (agent/planners/recipes.py) on the suite's own lab (tests/ownlab/ownlab.py) at the test protocol
(the smallest: the five together would take far past the suite's budget at any larger one): a checked nomination
with nothing of the toy world in any dataset it built, or, for a recipe the lab cannot run, a refusal before any
session opens that says what to add.

delta judges by a reward model's proxy win rate: on the own lab with its HTTP judge it is refused with that
reason; with a local reward model as the lab's judge (the README's other kind for a team's lab; its holdout bar
then reads the reward-proxy `win`) it runs.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import ownlab  # noqa: E402
from test_own_lab import SESSION, Ran, assert_only_own_data, checked_nomination, run_session  # noqa: E402

from agent.planners import recipes  # noqa: E402
from core import tiny  # noqa: E402
from memory.notebook import Notebook  # noqa: E402

pytestmark = pytest.mark.slow


def _with_reward_model(lab: Path) -> None:
    """The lab's judge as a local reward model (a tiny one, built here), its holdout bar on the proxy win rate."""
    tiny.build_reward_model(lab / "models" / "chat", lab / "models" / "reward", seed=0)
    text = (lab / "lab.toml").read_text()
    start, end = text.index("[judge]\n"), text.index("[train]\n")
    (lab / "lab.toml").write_text(text[:start] + '[judge]\nkind = "reward_model"\npath = "models/reward"\n\n' + text[end:])
    bars = (lab / "bars.toml").read_text()
    (lab / "bars.toml").write_text(bars.replace('metric = "win_score"', 'metric = "win"', 1))


@pytest.mark.parametrize("recipe", recipes.RECIPES)
def test_each_recipe_runs_to_a_checked_nomination_on_the_own_lab(recipe: str, tmp_path: Path):
    with ownlab.judge_server() as (url, judge):
        lab = ownlab.make_lab(tmp_path / "lab", url)
        if recipe == "delta":
            _with_reward_model(lab)
        proc = run_session(lab, "--protocol", "test", "--recipe", recipe)
        ran = Ran(lab, proc, list(judge.requests), list(judge.authorized))
    checked_nomination(ran)
    with Notebook.open(lab / "notebook.db", readonly=True) as nb:
        opened = nb.decisions(SESSION, kind="open")[0].payload
    assert (opened.policy.name, opened.policy.protocol) == (recipe, "test")
    assert_only_own_data(lab)
    if recipe != "delta":
        assert ran.judge_requests and all(ran.judge_authorized)  # the lab's own judge judged its holdout


def test_delta_on_the_own_labs_http_judge_is_refused_before_a_session_opens(tmp_path: Path):
    with ownlab.judge_server() as (url, _):
        lab = ownlab.make_lab(tmp_path / "lab", url)
        proc: subprocess.CompletedProcess = run_session(lab, "--protocol", "test", "--recipe", "delta")
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "recipe delta cannot run in this lab" in proc.stderr
    assert 'set [judge] kind = "reward_model"' in proc.stderr
    assert not (lab / "notebook.db").exists()
