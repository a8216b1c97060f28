"""The toy world is always a lab its agent accepts (issue 44, item 11): `world build --size test --seed 11` made
feedback whose split the agent refused at ingest ("split 'sealed' would hold 1 of 64 battles"): 64 battles over 8
families and 4 votes are some 30 strata of 1-4 battles, and 10% of each rounded to nothing. Splits now take exact
counts, apportioned over the strata (tools/data/splits.py, rule 3).

Every seed 0-20 of the test size is built as far as its feedback (the world's own battle prompts, opponent and noisy
oracle, tools/world/build.py `voted_battles`) and ingested with the world's own [feedback] settings. The parent's
answers need a trained model (a minute a seed), so two stand-ins answer instead: a parent that is mostly wrong (the
test-size parent is) and one right half of the time; the split does not read the answers, only the votes they get.
"""

from __future__ import annotations

import json
import random
import tomllib
from pathlib import Path

import pytest

from tools.data.splits import SplitConfig, split_problems
from tools.ingest import SplitJob, split_job
from tools.world import build as world

SEEDS = range(21)


def _own_answers(tasks: list, right_share: float, seed: int) -> list[str]:
    """A stand-in parent: the reference's answer line for `right_share` of the prompts, another prompt's otherwise."""
    rng = random.Random(seed)
    lines = [t.reference.splitlines()[-1] for t in tasks]
    return [lines[i] if rng.random() < right_share else lines[(i + 1) % len(lines)] for i in range(len(tasks))]


def _world_split_config(seed: int) -> SplitConfig:
    spec = world.SIZES["test"]
    feedback = tomllib.loads(world.lab_toml(seed, "test", spec, spec.sft_rows))["feedback"]
    return SplitConfig(dev_fraction=feedback["dev_fraction"], sealed_fraction=feedback["sealed_fraction"],
                       stratify_by=feedback.get("stratify_by"))


@pytest.mark.parametrize("right_share", [0.1, 0.5])
def test_every_test_size_seed_makes_feedback_its_agent_ingests(tmp_path: Path, right_share: float):
    refused = {}
    for seed in SEEDS:
        tasks = world.draw_pools(seed, world.SIZES["test"]).battles
        rows, _ = world.voted_battles(tasks, _own_answers(tasks, right_share, seed), seed)
        feedback = tmp_path / f"seed{seed}" / "battles.jsonl"
        feedback.parent.mkdir()
        feedback.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        config = _world_split_config(seed)
        split = split_job(SplitJob(feedback=feedback, config=config, out_dir=feedback.parent / "splits"))
        problems = split_problems(split)
        if problems:
            refused[seed] = problems
            continue
        n = len(rows)
        sizes = {name: sum(votes.values()) for name, votes in split.counts.items()}
        # Exact counts: each holdout holds its share of the battles, rounded once (the world's prompts do not collide).
        assert sizes["sealed"] == int(n * config.sealed_fraction + 0.5), (seed, sizes)
        assert sizes["dev"] == int(n * config.dev_fraction + 0.5), (seed, sizes)
    assert refused == {}, refused


def test_the_factored_feedback_is_what_the_build_votes(toy_world: Path):
    """`voted_battles` on the built parent's own answers gives the test world's feedback file byte for byte (the
    stand-ins above go through the very code the build runs)."""
    rows = [json.loads(line) for line in (toy_world / world.FEEDBACK).read_text(encoding="utf-8").splitlines()]
    own = {r["id"]: r["own"] for r in rows}
    tasks = world.draw_pools(0, world.SIZES["test"]).battles
    texts = [own.get(f"b-{t.id.replace('/', '-')}", "") for t in tasks]
    again, _ = world.voted_battles(tasks, texts, world.hash_seed(0, "battles-gen") % 2**31)
    assert again == rows
