"""Builders that generate with a model (tools/data/generated.py), on a tiny random model on the CPU: own-policy
replay rows carry the model's own answers, and loop-fix pairs choose a train battle's preferred answer over the
model's answer that ran past the served cap."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from core import tiny
from core.util import file_sha256
from evals.decoding import Decoding
from evals.generate import generate, load
from evals.types import Item
from tools.data.datasets import DatasetError, ReplaySource
from tools.data.generated import LoopFixConfig, OwnReplayConfig, build_loop_fix_pairs, build_own_replay
from tools.data.splits import Split, SplitConfig

SERVED = Decoding(temperature=0.7, top_p=0.95, max_new_tokens=12)


@pytest.fixture(scope="module")
def model(tmp_path_factory, tokenizer_dir) -> Path:
    return tiny.build_model("llama", tokenizer_dir, tmp_path_factory.mktemp("m") / "model", seed=3)


@pytest.fixture
def base(tmp_path, battle, jsonl, tokenizer_dir) -> dict:
    battles = [battle("t1", "How do I boil an egg?", "own"), battle("d1", "Why is the sky blue at noon?", "other")]
    fb = jsonl(tmp_path / "feedback.jsonl", battles)
    split = Split(source_sha256=file_sha256(fb), config=SplitConfig(dev_fraction=0.4, sealed_fraction=0.2),
                  assignment={"t1": "train", "d1": "dev"}, counts={})
    (tmp_path / "split.json").write_text(split.model_dump_json())
    return {"tokenizer": tokenizer_dir, "feedback": fb, "split": tmp_path / "split.json", "eval_suites": [],
            "system_prompt": "Be brief.", "decoding": SERVED.model_dump(mode="json"), "seed": 5}


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_own_replay_answers_the_replay_prompts_with_the_models_own_answers(tmp_path, base, jsonl, model):
    chats = [{"messages": [{"role": "user", "content": f"Name a colour number {i}"},
                           {"role": "assistant", "content": "The data's own answer."}]} for i in range(6)]
    source = ReplaySource(name="stage1", path=jsonl(tmp_path / "chats.jsonl", chats))
    cfg = OwnReplayConfig(**base, out=tmp_path / "own.jsonl", model=model, sources=[source], n=4)
    manifest = build_own_replay(cfg)
    rows = _rows(tmp_path / "own.jsonl")
    assert manifest.builder == "own_replay" and manifest.row_kind == "sft" and 0 < len(rows) <= 4
    assert all(r["messages"][0] == {"role": "system", "content": "Be brief."} for r in rows)
    assert not any(r["messages"][-1]["content"] == "The data's own answer." for r in rows)
    # The answers are the model's own, at its served decoding and the build's seed: the same engine call again.
    items = [Item(id=r["id"], messages=[m for m in r["messages"] if m["role"] != "system"][:-1]) for r in rows]
    again = generate(load(model), items, SERVED, 5)
    assert [a.text for a in again] == [r["messages"][-1]["content"] for r in rows]
    assert manifest.stats["prompts"] == 4 and manifest.stats["answered"] == len(rows)


def test_loop_fix_pairs_choose_the_preferred_answer_over_one_that_never_stops(tmp_path, base, model):
    cfg = LoopFixConfig(**base, out=tmp_path / "fix.jsonl", model=model)
    manifest = build_loop_fix_pairs(cfg)
    rows = _rows(tmp_path / "fix.jsonl")
    # A random model never emits its end-of-turn within 12 tokens: its answer to the one decisive train battle ran
    # to the cap. The pair is the lab's own: the battle's prompt and its human-preferred answer, nothing generated.
    assert manifest.row_kind == "pairs" and manifest.stats["pairs"] == manifest.stats["not_stopped"] == 1
    [row] = rows
    feedback = {b["id"]: b for b in _rows(base["feedback"])}
    assert row["id"] == "t1" and row["chosen"] == feedback["t1"]["own"] and row["chosen"] != row["rejected"]
    assert row["prompt"] == [{"role": "system", "content": "Be brief."}, *feedback["t1"]["messages"]]
    assert {s.role for s in manifest.sources} == {"feedback", "split"}  # no generated task file, no other source


def test_generating_builders_refuse_what_gives_nothing(tmp_path, base, jsonl, model):
    empty = ReplaySource(name="none", path=jsonl(tmp_path / "c.jsonl", [
        {"messages": [{"role": "assistant", "content": "no prompt"}]}]))
    with pytest.raises(DatasetError, match="own_replay: the replay sources hold no prompt"):
        build_own_replay(OwnReplayConfig(**base, out=tmp_path / "o.jsonl", model=model, sources=[empty], n=2))
    assert not (tmp_path / "o.jsonl").exists()


# ---- prompts past the context (issue 44, item 10) ---------------------------------------------------------------
# A replay prompt far past the model's context used to reach generation, which refused it inside the job: the build
# failed as a generic "error". Prompts are now checked against the context (config.json max_position_embeddings, the
# tiny llama's 2048) and the [train] max_len before generating: the ones past it are skipped and counted, and a
# pool where none fits is refused before any job is submitted.

LONG = "why " * 2100  # past the tiny llama's 2048-token context


def _chat(prompt: str) -> dict:
    return {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": "The data's answer."}]}


def test_prompts_past_the_context_are_skipped_and_counted(tmp_path, base, jsonl, model):
    source = ReplaySource(name="stage1", path=jsonl(tmp_path / "chats.jsonl",
                                                    [_chat(f"Name a colour number {i}") for i in range(3)] + [_chat(LONG)]))
    manifest = build_own_replay(OwnReplayConfig(**base, out=tmp_path / "own.jsonl", model=model, sources=[source], n=4))
    assert manifest.stats["too_long"] == 1 and manifest.stats["prompts"] == 3
    assert all(len(r["messages"][1]["content"]) < 100 for r in _rows(tmp_path / "own.jsonl"))


def test_a_pool_where_no_prompt_fits_is_refused_before_the_job(tmp_path, base, jsonl, model):
    from memory.notebook import Notebook
    from tools import build_dataset
    from tools.context import LabSpec, LabSuite, ToolContext
    from tools.data.generated import length_refusal
    from tools.paths import LabPaths

    source = ReplaySource(name="stage1", path=jsonl(tmp_path / "chats.jsonl", [_chat(LONG), _chat(LONG + "more")]))
    cfg = OwnReplayConfig(**base, out=tmp_path / "own.jsonl", model=model, sources=[source], n=2)
    reason = length_refusal("own_replay", cfg.model_dump(mode="json"))
    assert reason == ("own_replay: none of the 2 prompts fits: each one's tokens exceed 2036, the model's context of "
                      "2048 tokens (config.json max_position_embeddings) less the served max_new_tokens 12; nothing to "
                      "generate")
    with pytest.raises(DatasetError, match="own_replay: none of the 2 replay prompts fits the model's context"):
        build_own_replay(cfg)  # the job itself, reached another way, refuses with the same reason
    # A [train] max_len the battle's prompt fills: loop_fix_pairs is refused by it, naming it.
    short = LoopFixConfig(**base, out=tmp_path / "fix.jsonl", model=model, max_len=4)
    assert "[train] max_len 4 less one answer token" in length_refusal("loop_fix_pairs", short.model_dump(mode="json"))
    assert length_refusal("loop_fix_pairs", LoopFixConfig(**base, out=tmp_path / "f.jsonl", model=model)
                          .model_dump(mode="json")) is None

    # The tool: a failed step with the reason, and no job (the context has no launcher: a job would raise).
    nb = Notebook.open(tmp_path / "notebook.db")
    nb.open_session("s", lab=str(tmp_path), budget_gpuh=10, reserve_gpuh=0, planner="playbook", executor="local",
                    config={})
    nb.record_split(source_path=str(base["feedback"]), source_sha256="0" * 64, config={}, counts={},
                    assignment={"t1": "train", "d1": "dev"}, session="s")
    checkpoint = nb.add_artifact(kind="checkpoint", name="arm", path=str(model), sha256="0" * 64, session="s")
    lab = LabSpec(parent=model, tokenizer=base["tokenizer"], feedback=base["feedback"], dev_fraction=0.4,
                  sealed_fraction=0.2, suites=[LabSuite(name="holdout", scorer="judge")], bars=None, data=[source],
                  served=SERVED, time_limit_min=5)
    ctx = ToolContext(nb=nb, session="s", paths=LabPaths(root=tmp_path, session="s"), lab=lab, jobs=None)  # type: ignore[arg-type]
    outcome = build_dataset.run(ctx, build_dataset.Args(builder="own_replay", model=checkpoint.id, n=2))
    assert outcome.status == "failed" and outcome.summary.startswith("own_replay: none of the 2 prompts fits")
    assert not nb.jobs(session="s")
    nb.close()
