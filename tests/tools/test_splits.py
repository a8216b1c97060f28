"""Feedback splits: deterministic from id hashes, order-free, stratified, repeated prompts kept together."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from pydantic import ValidationError

from tools.data.feedback import Battle
from tools.data.splits import SplitConfig, split_battles, split_file

VOTES = ("own", "other", "tie", "both_bad")


def _battles(n: int, seed: int = 0) -> list[Battle]:
    rng = random.Random(seed)
    return [Battle.model_validate({
        "id": f"battle-{i:04d}", "messages": [{"role": "user", "content": f"question {i} about topic {rng.random()}"}],
        "own": "a", "other": "b", "vote": rng.choice(VOTES), "meta": {"lang": rng.choice(["en", "de", "fr"])},
    }) for i in range(n)]


def test_same_file_in_any_order_gives_the_same_split(tmp_path, jsonl):
    battles = _battles(300)
    rows = [b.model_dump(exclude_none=True) for b in battles]
    cfg = SplitConfig(dev_fraction=0.15, sealed_fraction=0.1)
    _, first = split_file(jsonl(tmp_path / "a.jsonl", rows), cfg)
    _, again = split_file(tmp_path / "a.jsonl", cfg)
    random.Random(1).shuffle(rows)
    _, shuffled = split_file(jsonl(tmp_path / "b.jsonl", rows), cfg)
    assert first.assignment == again.assignment == shuffled.assignment
    assert first.sha256 == shuffled.sha256 and first.source_sha256 != shuffled.source_sha256
    # the hash, not the position, decides: holdouts are scattered over the id range
    dev_numbers = sorted(int(i.split("-")[1]) for i in first.ids("dev"))
    assert dev_numbers[0] < 60 and dev_numbers[-1] > 240


@pytest.mark.parametrize("stratify_by", [None, "lang"])
def test_each_class_is_within_one_battle_of_its_target(stratify_by):
    battles = _battles(413, seed=3)
    cfg = SplitConfig(dev_fraction=0.12, sealed_fraction=0.07, stratify_by=stratify_by)
    split = split_battles(battles, "0" * 64, cfg)
    key = (lambda b: b.vote) if stratify_by is None else (lambda b: (b.vote, b.meta["lang"]))
    sizes = Counter(key(b) for b in battles)
    for name, fraction in (("dev", cfg.dev_fraction), ("sealed", cfg.sealed_fraction)):
        got = Counter(key(b) for b in battles if split.assignment[b.id] == name)
        for cls, n in sizes.items():
            assert abs(got[cls] - n * fraction) <= 1, (name, cls, got[cls], n * fraction)
    assert sum(sum(c.values()) for c in split.counts.values()) == 413


def test_repeated_prompts_land_in_one_split():
    long = "please summarize the following paragraph about the history of the river trade in the old city"
    rows = [("a1", "What is the capital of France?"), ("a2", "what is the CAPITAL of   france"),
            ("n1", long), ("n2", f"Thanks. Now: {long.upper()} and make it short.")]
    # 8-word prompts have no 13-gram; each is found whole inside its longer twin.
    shorts = [f"Write a haiku about autumn rain in city{i}" for i in range(12)]
    rows += [(f"s{i}", p) for i, p in enumerate(shorts)] + [(f"t{i}", f"Hi! {p.lower()}, then explain it.")
                                                            for i, p in enumerate(shorts)]
    rows += [(f"x{i}", f"unrelated question number {i}") for i in range(40)]
    battles = [Battle.model_validate({"id": i, "messages": [{"role": "user", "content": p}], "own": "a", "other": "b",
                                      "vote": "own"}) for i, p in rows]
    for dev in (0.2, 0.3, 0.4):
        split = split_battles(battles, "0" * 64, SplitConfig(dev_fraction=dev, sealed_fraction=0.2))
        assert split.assignment["a1"] == split.assignment["a2"]
        assert split.assignment["n1"] == split.assignment["n2"]
        assert all(split.assignment[f"s{i}"] == split.assignment[f"t{i}"] for i in range(12))


def test_fractions_must_leave_training_data():
    with pytest.raises(ValidationError, match="must be below 1"):
        SplitConfig(dev_fraction=0.6, sealed_fraction=0.4)


def test_regrown_file_keeps_every_earlier_assignment(tmp_path, jsonl):
    from memory.notebook import Notebook
    from tools.data.splits import ingest_feedback

    battles = _battles(1100, seed=5)
    rows = [b.model_dump(exclude_none=True) for b in battles]
    cfg = SplitConfig(dev_fraction=0.15, sealed_fraction=0.1)
    with Notebook.open(tmp_path / "notebook.db") as nb:
        _, first = ingest_feedback(nb, jsonl(tmp_path / "round1.jsonl", rows[:1000]), cfg, tmp_path / "splits")
        _, grown = ingest_feedback(nb, jsonl(tmp_path / "round2.jsonl", rows), cfg, tmp_path / "splits")
    assert all(grown.assignment[i] == s for i, s in first.assignment.items())
    # Unpinned, the cut points move: some earlier holdout battle would now train.
    fresh = split_battles(battles, "0" * 64, cfg)
    assert any(s != "train" and fresh.assignment[i] == "train" for i, s in first.assignment.items())
    # And the grown split is still stratified within one battle per vote.
    sizes = Counter(b.vote for b in battles)
    for name, fraction in (("dev", cfg.dev_fraction), ("sealed", cfg.sealed_fraction)):
        got = Counter(b.vote for b in battles if grown.assignment[b.id] == name)
        assert all(abs(got[v] - n * fraction) <= 1 for v, n in sizes.items()), (name, got)
