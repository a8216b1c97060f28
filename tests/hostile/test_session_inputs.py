"""A session validates its inputs before it opens (issue 10, item 3): with a valid lab.toml but a
bad feedback, bars, eval suite or data file, `run` exits 2 listing every problem with its file and
line (or bar), and leaves no notebook file where there was none."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from agent.config import LabConfigError, load_lab_config
from agent.inputs import check_inputs, require_inputs

sys.path.insert(0, str(Path(__file__).parent))
from hostile_kit import BATTLE, assert_refused, battles, files, make_lab, run_cli, write_jsonl  # noqa: E402

USER = {"role": "user", "content": "1+1?"}


def _feedback_bad_vote(lab: Path) -> None:
    write_jsonl(lab / "feedback.jsonl", [*battles(3), BATTLE | {"id": "x", "vote": "draw"}])


def _feedback_empty(lab: Path) -> None:
    (lab / "feedback.jsonl").write_text("\n\n")


def _bars_unknown_suite(lab: Path) -> None:
    (lab / "bars.toml").write_text('[[bar]]\nsuite = "gsm8k"\nmetric = "correct"\nrule = "delta >= 0"\n')


def _suite_without_gold(lab: Path) -> None:
    write_jsonl(lab / "data/math.jsonl", [{"id": "m0", "messages": [USER], "gold": "2"}, {"id": "m1", "messages": [USER]}])


def _suite_bad_json(lab: Path) -> None:
    write_jsonl(lab / "data/math.jsonl", [{"id": "m0", "messages": [USER], "gold": "2"}, '{"id": "m1", "messages": ['])


def _suite_repeated_id(lab: Path) -> None:
    write_jsonl(lab / "data/math.jsonl", [{"id": "m0", "messages": [USER], "gold": "2"}] * 2)


def _suite_not_items(lab: Path) -> None:
    write_jsonl(lab / "data/math.jsonl", [{"id": "m0", "prompt": "1+1?", "gold": "2"}])


def _suite_synthetic_id(lab: Path) -> None:
    (lab / "lab.toml").write_text((lab / "lab.toml").read_text().replace('scorer = "math"', 'scorer = "synthetic"'))


def _suite_mcq_gold(lab: Path) -> None:
    (lab / "lab.toml").write_text((lab / "lab.toml").read_text().replace('scorer = "math"', 'scorer = "mcq"'))
    write_jsonl(lab / "data/math.jsonl", [{"id": "q0", "messages": [USER], "gold": "E", "choices": ["1", "2"]}])


def _data_ends_with_user(lab: Path) -> None:
    write_jsonl(lab / "data/replay.jsonl", [{"messages": [USER]}])


def _data_duplicate_key(lab: Path) -> None:
    (lab / "data/replay.jsonl").write_text('{"messages": [], "messages": [{"role": "user", "content": "x"}]}\n')


CASES = {
    "feedback bad vote": (_feedback_bad_vote, ["feedback: ", "feedback.jsonl: 1 problem(s)", "line 4: vote: unknown vote 'draw'"]),
    "feedback empty": (_feedback_empty, ["feedback.jsonl: 1 problem(s)", "the file holds no battles"]),
    "bars unknown suite": (_bars_unknown_suite, ["bars.toml: 1 problem(s)", "bar[0].suite: unknown suite 'gsm8k' (the lab evaluates: confirm, math)"]),
    "suite without gold": (_suite_without_gold, ["math.jsonl: 1 problem(s)", "line 2: item 'm1' has no gold (scorer math needs it)"]),
    "suite bad json": (_suite_bad_json, ["math.jsonl: 1 problem(s)", "line 2: invalid JSON"]),
    "suite repeated id": (_suite_repeated_id, ["line 2: id: duplicate item id 'm0' (first on line 1)"]),
    "suite not items": (_suite_not_items, ["line 1: messages: Field required (expected an eval item)"]),
    "synthetic id without family": (_suite_synthetic_id, ["line 1: id: item id 'm0' is not a synthetic item"]),
    "mcq gold not a letter": (_suite_mcq_gold, ["line 1: gold: 'E' is not one of the option letters A, B"]),
    "data ends with user": (_data_ends_with_user, ["data 'replay'", "replay.jsonl: 1 bad row(s)", "row 1: messages: the last turn must be the assistant's"]),
    "data duplicate key": (_data_duplicate_key, ["row 1: key 'messages' appears twice in one object"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_bad_input_file_is_named(tmp_path: Path, case: str):
    lab = make_lab(tmp_path / "lab")
    breaks, expected = CASES[case]
    breaks(lab)
    problems = check_inputs(load_lab_config(lab))
    assert len(problems) == 1, problems
    for words in expected:
        assert words in problems[0], (words, problems[0])


def test_every_bad_input_is_listed_at_once(tmp_path: Path):
    lab = make_lab(tmp_path / "lab")
    for breaks in (_feedback_bad_vote, _bars_unknown_suite, _suite_without_gold, _data_ends_with_user):
        breaks(lab)
    with pytest.raises(LabConfigError) as err:
        require_inputs(load_lab_config(lab), lab / "lab.toml")
    message = str(err.value)
    assert message.startswith(f"{lab / 'lab.toml'}: 4 input file(s) do not check out; no session was opened")
    for where in ("feedback.jsonl", "bars.toml", "math.jsonl", "replay.jsonl"):
        assert str(lab / "data" / where) in message or str(lab / where) in message, where


def test_the_cli_refuses_the_session_and_writes_no_notebook(tmp_path: Path):
    chosen = ["feedback bad vote", "bars unknown suite", "suite without gold", "data ends with user"]
    labs = []
    for i, case in enumerate(chosen):
        lab = make_lab(tmp_path / f"lab{i}")
        CASES[case][0](lab)
        labs.append((lab, files(lab)))
    procs = run_cli([["--budget", "1gpuh", "--lab", str(lab), "--session", "s1"] for lab, _ in labs])
    for case, (lab, before), proc in zip(chosen, labs, procs, strict=True):
        assert_refused(proc.returncode, proc.stderr, "no session was opened", *CASES[case][1][-1:])
        assert files(lab) == before and not (lab / "notebook.db").exists(), case


def test_a_valid_lab_has_no_input_problems(tmp_path: Path):
    lab = make_lab(tmp_path / "lab")
    write_jsonl(lab / "feedback.jsonl", [*battles(19), json.loads(json.dumps(BATTLE | {"id": "u", "own": "a\u2028b"}))])
    assert check_inputs(load_lab_config(lab)) == []
