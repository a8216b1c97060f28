"""Lengths are bounded at input (issue 34, section 2): an eval item's or a feedback battle's prompt that
cannot be answered within the model's context (config.json's max_position_embeddings, less the served
max_new_tokens) is refused before the session opens: exit 2, the file, line (or battle) and item named
with the count and the rule, no notebook or other file written. A 10 MB prompt is refused after bounded
work (it once made an eval job try to allocate 28.7 GB)."""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import pytest

from agent.config import load_lab_config
from agent.inputs import check_inputs
from core import tiny

sys.path.insert(0, str(Path(__file__).parent))
from hostile_kit import BATTLE, assert_refused, battles, files, make_lab, run_cli, write_jsonl  # noqa: E402

CONTEXT = 512  # the served max_new_tokens of hostile_kit's lab.toml is 256: prompts get 256 tokens


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny.build_tokenizer(tmp_path_factory.mktemp("tok"))


def _lab(root: Path, tokenizer: Path) -> Path:
    lab = make_lab(root)
    for d in ("models/base", "models/parent"):
        (lab / d / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": CONTEXT}))
        shutil.copytree(tokenizer, lab / d, dirs_exist_ok=True)
    write_jsonl(lab / "feedback.jsonl", battles(20))
    return lab


def _item(i: int, prompt: str) -> dict:
    return {"id": f"m{i}", "messages": [{"role": "user", "content": prompt}], "gold": "1"}


def _suite_10mb(lab: Path) -> None:
    write_jsonl(lab / "data/math.jsonl", [_item(0, "1+1?"), _item(1, "x" * 10_800_000)])


def _suite_just_over(lab: Path) -> None:
    write_jsonl(lab / "data/math.jsonl", [_item(0, "1+1?"), _item(1, "1+1? " * 200), _item(2, "2+2?")])


def _battle_prompt(lab: Path) -> None:
    write_jsonl(lab / "feedback.jsonl", [*battles(20), BATTLE | {"id": "long-1", "vote": "own",
                                                                "messages": [{"role": "user", "content": "why? " * 400}]}])


CASES = {
    "a 10.8 MB suite prompt": (_suite_10mb, ["data/math.jsonl:2: item 'm1': prompt of more than 512 tokens exceeds the "
                                             "model's context of 512 tokens", "max_position_embeddings"]),
    "a suite prompt just over": (_suite_just_over, ["data/math.jsonl:2: item 'm1': prompt of", "less the served "
                                                    "max_new_tokens 256"]),
    "a battle's prompt": (_battle_prompt, ["feedback.jsonl: battle 'long-1': prompt of"]),
}


def test_prompts_past_the_context_are_refused_before_the_session_opens(tmp_path: Path, tokenizer: Path) -> None:
    labs = {}
    for case, (make, _) in CASES.items():
        lab = _lab(tmp_path / case.replace(" ", "-").replace(".", ""), tokenizer)
        make(lab)
        labs[case] = (lab, files(lab))
    start = time.monotonic()
    procs = run_cli([["--budget", "1gpuh", "--lab", str(lab), "--session", "s1"] for lab, _ in labs.values()])
    assert time.monotonic() - start < 120  # bounded work, 10 MB prompt included
    for (case, (lab, before)), proc in zip(labs.items(), procs, strict=True):
        assert_refused(proc.returncode, proc.stderr, "no session was opened", *CASES[case][1])
        assert files(lab) == before and not (lab / "notebook.db").exists(), case


def test_prompts_within_the_context_pass(tmp_path: Path, tokenizer: Path) -> None:
    lab = _lab(tmp_path / "lab", tokenizer)
    write_jsonl(lab / "data/math.jsonl", [_item(0, "1+1? " * 40)])  # well within 256 tokens
    assert check_inputs(load_lab_config(lab)) == []


def test_an_eval_job_refuses_prompts_past_the_context_before_generating(tmp_path: Path, tokenizer: Path) -> None:
    # What reaches a job without a lab's input check (a holdout battle, an edited suite): refused before any
    # cache is sized, the first line the project's own, the ids (public text) after it, escaped.
    from evals.decoding import Decoding
    from evals.generate import PromptTooLong, generate, load
    from evals.types import Item

    loaded = load(tiny.build_model("llama", tokenizer, tmp_path / "model"))  # max_position_embeddings 2048
    items = [Item.model_validate(_item(0, "1+1?")),
             Item.model_validate(_item(1, "why? " * 40) | {"id": "m1-long"})]
    with pytest.raises(PromptTooLong) as err:
        generate(loaded, items, Decoding(max_new_tokens=2000), seed=0)
    first, rest = str(err.value).split("\n", 1)
    assert first == ("1 of 2 prompt(s) plus max_new_tokens 2000 exceed the model's context of 2048 tokens; "
                     "nothing generated")
    assert rest.startswith("items: 'm1-long' (") and "\n" not in rest
    assert len(generate(loaded, items[:1], Decoding(max_new_tokens=4), seed=0)) == 1  # within it: generated
