"""Unparseable judge replies are bounded (issue 43, item 11): a reply that does not end in one `VERDICT:` line is
recorded as unparsed with no score; past the lab's `max_unparsed_share` (5% by default) the suite is no
measurement, and the eval fails with the reason (JudgeFailed, recorded as the job's failure), its judgments kept."""

from __future__ import annotations

import json

import pytest

from agent.config import JudgeSection
from evals import judge


def _mumbling(every: int):
    """A judge that answers in the format, except for every `every`-th prompt, where it reasons and never concludes."""

    def reply(prompt: str, a: str, b: str) -> str:
        n = int(prompt.removeprefix("q"))
        if every and n % every == 0:
            return "Both answers have merits; it depends on what the user wants."
        return "Reasoning... A is right.\nVERDICT: " + ("A" if "good" in a else "B")

    return reply


def _suite(item, completion, n: int):
    items = [item(f"i{k}", f"q{k}") for k in range(n)]
    return items, [completion(i.id, "a good answer") for i in items], [completion(i.id, "a poor one") for i in items]


def test_unparsed_replies_within_the_bound_are_dropped_and_past_it_the_suite_fails(tmp_path, item, completion):
    items, cand, inc = _suite(item, completion, 40)
    # 2 of 40 items unparsed (5%): within the default bound, each recorded unparsed with no score.
    outcomes, _ = judge.score(items, cand, inc, _mumbling(20), seed=1, judgments_path=tmp_path / "a.jsonl")
    assert [o.label for o in outcomes].count("unparsed") == 2 and [o.label for o in outcomes].count("win") == 38
    # 6 of 40 (15%, as the 14% a team saw): refused with the reason, the judgments on disk for a person.
    with pytest.raises(judge.JudgeFailed, match=r"judge: 6 of 40 items got replies that do not end in one "
                                                r"'VERDICT: A\|B\|TIE\|BOTH_BAD' line \(15%\), over the tolerated 5% "
                                                r"\(\[judge\] max_unparsed_share\)"):
        judge.score(items, cand, inc, _mumbling(7), seed=1, judgments_path=tmp_path / "b.jsonl")
    assert len((tmp_path / "b.jsonl").read_text().splitlines()) == 80
    # A lab that accepts more says so, and the same replies are then a measurement.
    loose = judge.JudgePolicy(max_unparsed_share=0.2)
    outcomes, _ = judge.score(items, cand, inc, _mumbling(7), seed=1, judgments_path=tmp_path / "c.jsonl", policy=loose)
    assert [o.label for o in outcomes].count("unparsed") == 6


def test_the_bound_is_a_lab_setting_and_the_default_leaves_recorded_job_keys_unchanged():
    section = JudgeSection(kind="openai", base_url="http://127.0.0.1:9/v1", model="j", max_unparsed_share=0.1)
    assert section.max_unparsed_share == 0.1 and JudgeSection().max_unparsed_share == judge.UNPARSED_SHARE
    # A policy at the default dumps as before the setting existed (eval jobs' idempotency keys hash it).
    assert "max_unparsed_share" not in json.loads(judge.JudgePolicy(concurrency=3).model_dump_json())
    assert json.loads(judge.JudgePolicy(max_unparsed_share=0.1).model_dump_json())["max_unparsed_share"] == 0.1
