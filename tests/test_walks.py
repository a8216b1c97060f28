"""Configs stop at the builder (issue 42, item 3): the walks scripts/walks.py measures stay at most as long as they
are now, so a config passed down again, or read again below its entry point, fails here first.

On the code of Dec 3 (8f09ceb) the walks were: evals/job.py:run:cfg 6 stays / 25 returns, trainers/dpo.py:train:config
13 / 73, sft 10 / 56, klce 10 / 53, rft 5 / 21; the [train] lr was read or written in 6 files (4 once the arm's lr
has one home: trainers.recipe.proposed_lr, PlaybookSettings.arm, ArmSettings.trainer_fields).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Upper bounds: (stays, returns).
BOUNDS = {
    "evals/job.py:run:cfg": (0, 0),
    "trainers/dpo.py:train:config": (6, 58),
    "trainers/sft.py:train:config": (5, 51),
    "trainers/klce.py:train:config": (5, 48),
    "trainers/rft.py:train:config": (5, 21),
    "[train] lr": (4, 0),
}


def _walks():
    spec = importlib.util.spec_from_file_location("walks", REPO / "scripts" / "walks.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("walks", module)  # its dataclasses look their module up by name
    spec.loader.exec_module(sys.modules["walks"])
    return sys.modules["walks"]


def test_no_walk_grows():
    measured = _walks().measure()
    assert measured.keys() == BOUNDS.keys()
    longer = {name: (got, BOUNDS[name]) for name, got in measured.items()
              if got[0] > BOUNDS[name][0] or got[1] > BOUNDS[name][1]}
    assert not longer, f"walks longer than their bounds (measured, bound): {longer}"


def test_the_walker_follows_a_config_passed_down_and_counts_reads_below(tmp_path):
    walks = _walks()
    texts = {"trainers/x.py": "def train(config):\n    a = config.lr\n    return inner(config, a)\n\n"
                              "def inner(c, a):\n    return c.steps + c.seed + a\n"}
    stays, returns, own, reached = walks.walk(walks.parse(texts), "trainers/x.py", "train", "config")
    assert (stays, returns, own, reached) == (1, 2, 1, ["trainers.x:inner"])
