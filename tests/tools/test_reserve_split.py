"""The reserve split (issue 41): `[feedback] reserve_fraction` holds back more holdout prompts at ingest, apportioned
exactly per stratum like dev and sealed, disjoint from every other split, taken from what would have trained (dev and
sealed are the same battles as without it), audited like a holdout and never in a training set; without the key the
split is the one made before it, byte for byte; a lab.toml whose fractions leave under 10% to train is refused."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from core.util import file_sha256
from tests.agent.labkit import make_lab
from tools.data.datasets import BattlePairsConfig, WinnerSFTConfig, build_battle_pairs, build_winner_sft
from tools.data.feedback import Battle
from tools.data.splits import SplitConfig, split_battles, split_problems
from tools.ingest import SplitJob, counts_line, split_job

REPO = Path(__file__).resolve().parents[2]
VOTES = ("own", "other", "tie", "both_bad")
WITH = SplitConfig(dev_fraction=0.12, sealed_fraction=0.07, reserve_fraction=0.15, stratify_by="lang")


def _battles(n: int, seed: int = 0) -> list[Battle]:
    rng = random.Random(seed)
    return [Battle.model_validate({
        "id": f"battle-{i:04d}", "messages": [{"role": "user", "content": f"question {i} about topic {rng.random()} "
                                               "and the many other things a curious person would like to know"}],
        "own": f"answer {i} one", "other": f"answer {i} two", "vote": rng.choice(VOTES),
        "meta": {"lang": rng.choice(["en", "de", "fr"])}}) for i in range(n)]


def test_the_reserve_is_exact_per_stratum_and_disjoint_from_every_split():
    battles = _battles(413, seed=3)
    split = split_battles(battles, "0" * 64, WITH)
    assert set(split.counts) == {"train", "dev", "sealed", "reserve"} and not split_problems(split)
    ids = {name: split.ids(name) for name in WITH.names}
    assert sum(len(v) for v in ids.values()) == len(battles) == len(set().union(*ids.values()))  # a partition
    sizes = Counter((b.vote, b.meta["lang"]) for b in battles)
    for name in ("dev", "sealed", "reserve"):
        assert len(ids[name]) == round(len(battles) * WITH.target(name))  # the split's count is exact
        got = Counter((b.vote, b.meta["lang"]) for b in battles if split.assignment[b.id] == name)
        assert all(abs(got[k] - n * WITH.target(name)) <= 1 for k, n in sizes.items()), name  # and stratified


def test_a_reserve_takes_only_battles_that_would_train_and_no_reserve_is_the_split_as_before():
    battles = _battles(300, seed=7)
    without = SplitConfig(dev_fraction=0.12, sealed_fraction=0.07, stratify_by="lang")
    plain, reserved = split_battles(battles, "0" * 64, without), split_battles(battles, "0" * 64, WITH)
    assert all(reserved.assignment[i] == s for i, s in plain.assignment.items() if s != "train")
    assert {i for i, s in reserved.assignment.items() if s == "reserve"} <= plain.ids("train")
    # reserve_fraction = 0 is no key anywhere: the config as stored, the counts, the split file
    zero = split_battles(battles, "0" * 64, without.model_copy(update={"reserve_fraction": 0.0}))
    assert "reserve_fraction" not in without.model_dump(mode="json") and "reserve" not in plain.counts
    assert zero.model_dump_json() == plain.model_dump_json() and "reserve" not in plain.model_dump_json()
    assert WITH.model_dump(mode="json")["reserve_fraction"] == 0.15


def test_a_reserve_asked_for_later_fills_from_new_battles_only_and_one_dropped_keeps_its_battles():
    battles = _battles(600, seed=11)
    without = SplitConfig(dev_fraction=0.12, sealed_fraction=0.07, stratify_by="lang")
    first = split_battles(battles[:400], "0" * 64, without)
    grown = split_battles(battles, "0" * 64, WITH, pinned=first.assignment)
    assert all(grown.assignment[i] == s for i, s in first.assignment.items())  # a battle trained on stays train
    assert grown.ids("reserve") and grown.ids("reserve") <= {b.id for b in battles[400:]}
    # nothing new to fill it from: the empty reserve is refused, naming the split
    again = split_battles(battles[:400], "0" * 64, WITH, pinned=first.assignment)
    assert any("split 'reserve' would be empty" in p for p in split_problems(again))
    # a lab that stops asking for one keeps its reserve battles held out (never moved into training)
    dropped = split_battles(battles, "0" * 64, without, pinned=grown.assignment)
    assert dropped.ids("reserve") == grown.ids("reserve") and "reserve" in dropped.counts


def test_the_reserve_is_written_as_items_audited_as_a_holdout_and_never_trained_on(tmp_path, jsonl, tokenizer_dir):
    battles = _battles(120, seed=5)
    feedback = jsonl(tmp_path / "feedback.jsonl", [b.model_dump(exclude_none=True) for b in battles])
    made = split_job(SplitJob(feedback=feedback, config=WITH, out_dir=tmp_path / "splits"))
    sha = made.sha256[:16]
    items = [json.loads(x)["id"] for x in (tmp_path / "splits" / f"items-reserve-{sha}.jsonl").read_text().splitlines()]
    assert sorted(items) == sorted(made.ids("reserve"))  # what a reserve eval scores
    decisive = [json.loads(x)["id"] for x in (tmp_path / "splits" / f"battles-reserve-{sha}.jsonl").read_text().splitlines()]
    assert set(decisive) <= made.ids("reserve")
    assert counts_line({n: sum(v.values()) for n, v in made.counts.items()}).endswith(f"reserve {len(items)}")
    # A decisive train battle edited to quote a reserve prompt after the split (as a later feedback round might):
    # the leak audit drops its row, naming the reserve battle.
    reserve_id = sorted(made.ids("reserve"))[0]
    quoted = next(b for b in battles if b.id == reserve_id).prompt()
    train_id = sorted(i for i in made.ids("train") if next(b for b in battles if b.id == i).vote == "own")[0]
    rows = [b.model_dump(exclude_none=True) for b in battles]
    for row in rows:
        if row["id"] == train_id:
            row["messages"][0]["content"] = f"Please answer this for me: {quoted}"
    jsonl(feedback, rows)
    split_file = tmp_path / "splits" / f"split-{sha}.json"
    split_file.write_text(made.model_copy(update={"source_sha256": file_sha256(feedback)}).model_dump_json())
    base = {"tokenizer": tokenizer_dir, "feedback": feedback, "split": split_file}
    sft = build_winner_sft(WinnerSFTConfig(out=tmp_path / "sft.jsonl", system_prompt="", **base))
    pairs = build_battle_pairs(BattlePairsConfig(out=tmp_path / "pairs.jsonl", system_prompt="", **base))
    for manifest in (sft, pairs):
        assert manifest.audit.references["reserve"] == len(made.ids("reserve"))  # audited like dev and sealed
        assert manifest.stats["holdout_battles_excluded"] == len(battles) - len(made.ids("train"))
        text = Path(manifest.path).read_text()
        assert not any(f'"{i}#' in text for i in made.ids("reserve") | made.ids("dev") | made.ids("sealed"))
        assert quoted not in text and f'"{train_id}#' not in text
    assert [(h.source, h.key) for h in sft.audit.hits] == [("reserve", reserve_id)]


@pytest.mark.parametrize(("reserve", "refused"), [(0.65, True), (0.3, False)])
def test_a_reserve_that_leaves_under_10_percent_to_train_is_refused_naming_the_key(tmp_path, reserve, refused):
    lab = make_lab(tmp_path / "lab")  # dev 0.2 + sealed 0.1
    toml = lab / "lab.toml"
    toml.write_text(toml.read_text().replace("sealed_fraction = 0.1\n", f"sealed_fraction = 0.1\nreserve_fraction = {reserve}\n"))
    before = sorted(p.name for p in lab.iterdir())
    done = subprocess.run([sys.executable, "run_agent.py", "check-feedback", str(lab / "feedback.jsonl"), "--lab", str(lab)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    if not refused:
        assert done.returncode == 0, done.stderr
        return
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "feedback" in lines[0] and "reserve_fraction = 0.65" in lines[0] and "at least 10%" in lines[0], lines[0]
    assert str(toml) in lines[0]
    assert sorted(p.name for p in lab.iterdir()) == before  # nothing written
