"""Ground truth: the fresh sample is leak-free, and a checkpoint against itself is a coin flip."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tools.data.leak import audit
from tools.world import build as world
from tools.world.truth import draw_sample, truth, world_references

REPO = Path(__file__).resolve().parents[2]


def test_the_truth_sample_shares_no_prompt_with_any_split_suite_or_data(toy_world):
    tasks, refs = draw_sample(toy_world, 600, seed=0)
    sources = {r.source for r in refs}
    assert sources == {"feedback", "eval:synthetic", "eval:loops", "data:stage1", "data:verified"}
    assert audit([t.prompt() for t in tasks], world_references(toy_world)).passed
    again, _ = draw_sample(toy_world, 600, seed=0)
    assert [t.id for t in again] == [t.id for t in tasks]  # reproducible from its seed
    other, _ = draw_sample(toy_world, 600, seed=1)
    # Another truth seed is another sample (independent draws: small families can repeat a prompt).
    assert len({t.id for t in other} & {t.id for t in tasks}) < 30


def test_the_parent_against_itself_is_fifty_percent_within_its_ci(toy_world):
    parent = toy_world / world.PARENT
    result = truth(toy_world, parent, None, n=160, seed=0)
    assert result.audit_passed and result.n == 160
    assert result.ci_low <= 0.5 <= result.ci_high
    assert result.ci_high - result.ci_low > 0  # two independent sampled draws, not one answer twice
    assert set(result.per_family) == {"letter_count", "word_count", "digit_sum", "long_division",
                                      "arithmetic_chain", "string_edit", "json_format", "follow_up"}


def test_truth_cli_against_the_opponent(toy_world, tmp_path):
    out = tmp_path / "truth.json"
    done = subprocess.run([sys.executable, "run_agent.py", "world", "truth", str(toy_world / world.PARENT), "--lab",
                           str(toy_world), "--vs", "opponent", "--n", "40", "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "true win rate" in done.stdout and out.is_file()


def test_truth_refuses_a_missing_checkpoint(toy_world, tmp_path):
    done = subprocess.run([sys.executable, "run_agent.py", "world", "truth", str(tmp_path / "nope"), "--lab",
                           str(toy_world)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "not a checkpoint directory" in done.stderr and "Traceback" not in done.stderr
