"""Splits cannot be poisoned (issue 34, section 2): a group of colliding prompts is bounded (one battle
sharing 13-word runs with many others, or a template phrase in every prompt, must not carry them all out
of train, nor seal everything), and a split that would be empty or skewed past its stated share is
refused before the session opens: exit 2, the feedback file and the split named with the reason, and
no notebook, split file or other file written."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

from agent.config import load_lab_config
from agent.inputs import check_inputs, feedback_notes
from tools.data.feedback import Battle
from tools.data.splits import MAX_UNIT, SplitConfig, split_battles

sys.path.insert(0, str(Path(__file__).parent))
from hostile_kit import BATTLE, assert_refused, files, make_lab, run_cli, write_jsonl  # noqa: E402

WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa".split()


def _prompt(i: int) -> str:
    """A 14-word prompt of its own: no 13-word run in common with another (numbers are words too)."""
    return " ".join(f"{w}{i}" for w in WORDS[:14])


def _battle(bid: str, prompt: str, vote: str = "own") -> dict:
    return BATTLE | {"id": bid, "messages": [{"role": "user", "content": prompt}], "vote": vote}


def _split(rows: list[dict]):
    return split_battles([Battle.model_validate(r) for r in rows], "x", SplitConfig(dev_fraction=0.2, sealed_fraction=0.1))


def test_one_battle_quoting_many_others_does_not_carry_them_out_of_train(tmp_path: Path) -> None:
    rows = [_battle(f"b{i:03d}", _prompt(i)) for i in range(200)]
    rows.append(_battle("hub", " and ".join(_prompt(i) for i in range(150))))  # joins 150 battles into one group
    split = _split(rows)
    train = sum(split.counts["train"].values())
    assert 135 <= train <= 145, split.counts  # 70% of 201, as if the hub were not there
    lab = make_lab(tmp_path / "lab")
    write_jsonl(lab / "feedback.jsonl", rows)
    cfg = load_lab_config(lab)
    assert check_inputs(cfg) == []
    (note,) = feedback_notes(cfg)
    assert note.startswith("feedback: 151 battles share prompts or 13-word runs with battle 'b000'") and "split one by one" in note


def test_a_template_phrase_in_every_prompt_does_not_seal_everything() -> None:
    template = "please answer the following question carefully and show every step of your reasoning here"
    rows = [_battle(f"b{i:03d}", f"{template} {_prompt(i)}") for i in range(100)]
    split = _split(rows)
    sealed, dev = sum(split.counts["sealed"].values()), sum(split.counts["dev"].values())
    assert (sealed, dev) == (10, 20), split.counts  # before the bound: one unit of 100, all sealed


def _first_by_hash(prefix: str, n: int) -> list[str]:
    """n ids whose sha256 sorts before every other id of the file (the split fills sealed in that order)."""
    found, i = [], 0
    while len(found) < n:
        bid = f"{prefix}{i}"
        if hashlib.sha256(bid.encode()).hexdigest() < "04":
            found.append(bid)
        i += 1
    return found


CASES = {
    # 20% of 2 battles rounds to none. (Strata too small to hold out alone no longer empty a holdout: its count is
    # apportioned over them, tools/data/splits.py rule 3; three battles of two votes split 1/1/1.)
    "too few battles": ([_battle(f"b{i}", _prompt(i), vote) for i, vote in enumerate(["own", "tie"])],
                        "split 'sealed' would be empty"),
    # A group of copies within the bound, placed first: sealed takes all of it (MAX_UNIT of 60 battles, target 10%).
    "a group of copies skews sealed": ([_battle(bid, "the same prompt, copied " * 3) for bid in _first_by_hash("c", 1)]
                                       + [_battle(f"d{i}", "the same prompt, copied " * 3) for i in range(MAX_UNIT - 1)]
                                       + [_battle(f"u{i}", _prompt(i)) for i in range(40)],
                                       "split 'sealed' would hold 20 of 60 battles (33%), off its target share 20%"),
}


def test_an_empty_or_skewed_split_is_refused_before_the_session_opens(tmp_path: Path) -> None:
    labs = {}
    for case, (rows, _) in CASES.items():
        lab = make_lab(tmp_path / case.replace(" ", "-"))
        write_jsonl(lab / "feedback.jsonl", rows)
        labs[case] = (lab, files(lab))
    procs = run_cli([["--budget", "1gpuh", "--lab", str(lab), "--session", "s1"] for lab, _ in labs.values()])
    for (case, (lab, before)), proc in zip(labs.items(), procs, strict=True):
        assert_refused(proc.returncode, proc.stderr, "no session was opened", str(lab / "feedback.jsonl"), CASES[case][1])
        assert files(lab) == before and not (lab / "notebook.db").exists(), case
