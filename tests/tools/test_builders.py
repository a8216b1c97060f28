"""Dataset builders on a small hand-made lab: exact expected rows, manifests, leak audit, notebook records."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from core.chat import render
from core.util import file_sha256
from evals.synthetic import check, generate
from evals.types import Item
from memory.notebook import Notebook
from tools.data.datasets import (
    BattlePairsConfig,
    DatasetError,
    MixConfig,
    MixPart,
    ReplayMixConfig,
    ReplaySource,
    SyntheticVerifiedConfig,
    WinnerSFTConfig,
    build_battle_pairs,
    build_mix,
    build_replay_mix,
    build_synthetic_verified,
    build_winner_sft,
    clean_answer,
    manifest_path,
    read_manifest,
    record_dataset,
)
from tools.data.splits import Split, SplitConfig, ingest_feedback
from trainers.rows import KLCERow, PreferenceRow, SFTRow, read_rows

SYS = "You are a careful assistant."
DEV = "Explain why the sky looks blue during the day but red and orange at sunset in simple words"
SEALED = "Write a short story about a lighthouse keeper who finds a message in a bottle on the beach"
EVAL = "List three prime numbers greater than one hundred and explain how you checked that each is prime"
T1_OWN = ("Boil it for 9 minutes [1]. See [the guide](https://example.com/eggs).\n\n"
          "Sources:\n- https://example.com/eggs")


@pytest.fixture
def lab(tmp_path, battle, jsonl, tokenizer_dir) -> dict:
    battles = [
        battle("t1", "How do I boil an egg?", "own", own=T1_OWN, other="Fry it."),
        battle("t2", "Capital of Italy?", "other", own="Milan", other="Rome【3†source】."),
        battle("t3", "Tell a joke", "tie"),
        battle("t4", "Write a poem", "both_bad"),
        battle("t5", vote="own", own="Ahoy!", other="Hello.", messages=[
            {"role": "system", "content": "Talk like a pirate."}, {"role": "user", "content": "Say hello"}]),
        battle("d1", DEV, "own"),
        battle("s1", SEALED, "other"),
    ]
    fb = jsonl(tmp_path / "feedback.jsonl", battles)
    assignment = {b["id"]: {"d": "dev", "s": "sealed"}.get(b["id"][0], "train") for b in battles}
    split = Split(source_sha256=file_sha256(fb), config=SplitConfig(dev_fraction=0.15, sealed_fraction=0.15),
                  assignment=assignment, counts={})
    (tmp_path / "split.json").write_text(split.model_dump_json())
    suite = jsonl(tmp_path / "suite.jsonl", [{"id": "e1", "messages": [{"role": "user", "content": EVAL}]}])
    base = {"tokenizer": tokenizer_dir, "feedback": fb, "split": tmp_path / "split.json", "eval_suites": [suite]}
    return {"dir": tmp_path, "base": base}


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


def test_winner_sft_rows_and_manifest(lab, tokenizer_dir):
    out = lab["dir"] / "out" / "winner.jsonl"
    m = build_winner_sft(WinnerSFTConfig(out=out, system_prompt=SYS, repeat=2, cleanup=True, **lab["base"]))
    system = {"role": "system", "content": SYS}
    expected = [
        [system, _user("How do I boil an egg?"), {"role": "assistant", "content": "Boil it for 9 minutes. See the guide."}],
        [system, _user("Capital of Italy?"), {"role": "assistant", "content": "Rome."}],
        # the battle's own system turn is kept (the eval prompts of the same battles keep it too), not replaced
        [{"role": "system", "content": "Talk like a pirate."}, _user("Say hello"), {"role": "assistant", "content": "Ahoy!"}],
    ]
    assert _rows(out) == [{"id": f"{b}#{k}", "messages": e} for b, e in zip(("t1", "t2", "t5"), expected, strict=True) for k in range(2)]
    assert (m.rows, m.row_kind, m.sha256) == (6, "sft", file_sha256(out))
    assert m.stats["excluded_tie_or_both_bad"] == 2 and m.stats["holdout_battles_excluded"] == 2
    assert m.stats["battle_system_turns_kept"] == 1
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    assert m.tokens == sum(len(render(tok, r["messages"]).input_ids) for r in _rows(out)) > 0
    assert {s.role: s.sha256 for s in m.sources} == {
        "feedback": file_sha256(lab["base"]["feedback"]), "split": file_sha256(lab["base"]["split"]),
        "eval_suite": file_sha256(lab["base"]["eval_suites"][0])}
    assert m.audit.passed and m.audit.references == {"dev": 1, "eval:suite.jsonl": 1, "sealed": 1}
    on_disk = json.loads(manifest_path(out).read_text())
    assert on_disk["audit_sha256"] == m.audit.sha256() and on_disk["sha256"] == file_sha256(out)
    assert on_disk["config"]["repeat"] == 2


def test_battle_pairs_exclude_ties_and_both_bad(lab):
    out = lab["dir"] / "pairs.jsonl"
    m = build_battle_pairs(BattlePairsConfig(out=out, system_prompt="", **lab["base"]))
    assert _rows(out) == [
        {"id": "t1", "prompt": [_user("How do I boil an egg?")], "chosen": T1_OWN, "rejected": "Fry it."},
        {"id": "t2", "prompt": [_user("Capital of Italy?")], "chosen": "Rome【3†source】.", "rejected": "Milan"},
        {"id": "t5", "prompt": [{"role": "system", "content": "Talk like a pirate."}, _user("Say hello")],
         "chosen": "Ahoy!", "rejected": "Hello."},
    ]
    assert m.row_kind == "pairs" and m.rows == 3 and m.sha256 == file_sha256(out)


def test_clean_answer_keeps_code_and_real_brackets():
    text = "Use `a[1]` on [0, 1] here [2][3].\n```python\nx = a[1]  # [1]\n```\nMore at [docs](http://d.io/x) and [a note]."
    assert clean_answer(text) == "Use `a[1]` on [0, 1] here.\n```python\nx = a[1]  # [1]\n```\nMore at docs and [a note]."
    assert clean_answer("Answer.\n\n**References**\n1. Smith 2020\n[2] https://x.org") == "Answer."
    # a "Sources" heading followed by prose is not a trailing source list
    assert clean_answer("A.\nSources:\n- one\nThen more text.") == "A.\nSources:\n- one\nThen more text."


def _replay_sources(d: Path, extra_a: list | None = None) -> tuple[Path, Path, list, list]:
    a = [{"messages": [_user(f"a question {i}"), {"role": "assistant", "content": f"a answer {i}"}]} for i in range(5)]
    a[2]["messages"].insert(0, {"role": "system", "content": "old system prompt"})
    a += extra_a or []
    b = [{"messages": [_user(f"b question {i}"), {"role": "assistant", "content": f"b answer {i}"}], "other": i}
         for i in range(4)]
    (d / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in a))
    pq.write_table(pa.Table.from_pylist(b), d / "b.parquet")
    return d / "a.jsonl", d / "b.parquet", a, b


def test_replay_mix_caps_and_seed(lab):
    pa_, pb, a, b = _replay_sources(lab["dir"])
    srcs = [ReplaySource(name="a", path=pa_), ReplaySource(name="b", path=pb, cap=2)]
    picks = set()
    for seed in range(6):
        out = lab["dir"] / f"replay{seed}.jsonl"
        m = build_replay_mix(ReplayMixConfig(out=out, system_prompt=SYS, sources=srcs, seed=seed, **lab["base"]))
        rows = _rows(out)
        assert m.rows == 7 and m.stats == {"a.available": 5, "a.taken": 5, "b.available": 4, "b.taken": 2}
        # a row's own system turn is kept; the serving one only where it has none
        assert rows[:5] == [{"id": f"a:{i + 1}", "messages": r["messages"] if r["messages"][0]["role"] == "system"
                             else [{"role": "system", "content": SYS}, *r["messages"]]} for i, r in enumerate(a)]
        b_rows = [r["messages"][1:] for r in rows[5:]]
        assert all(x in [r["messages"] for r in b] for x in b_rows)
        picks.add(json.dumps(b_rows))
        if seed == 0:
            again = build_replay_mix(ReplayMixConfig(out=lab["dir"] / "again.jsonl", system_prompt=SYS, sources=srcs,
                                                     seed=0, **lab["base"]))
            assert again.sha256 == m.sha256
    assert len(picks) > 1  # the seed picks the sample


def test_replay_bad_rows_are_listed_and_nothing_written(lab):
    bad = [{"messages": [_user("q"), {"role": "user", "content": "no answer"}]}, {"messages": "text"}]
    pa_, _, _, _ = _replay_sources(lab["dir"], extra_a=bad)
    out = lab["dir"] / "replay.jsonl"
    with pytest.raises(DatasetError) as err:
        build_replay_mix(ReplayMixConfig(out=out, system_prompt=SYS, sources=[ReplaySource(name="a", path=pa_)], **lab["base"]))
    assert "row 6: messages: the last turn must be the assistant's" in str(err.value)
    assert "row 7: messages: expected a non-empty list" in str(err.value)
    assert not out.exists()


@pytest.mark.parametrize("planted", [
    DEV,
    "  explain WHY the sky looks blue during the day, but red and orange at sunset   IN SIMPLE WORDS",
    "My kid asks: " + " ".join(SEALED.split()[1:14]) + "? Any ideas?",
    "Two tasks. First " + EVAL.lower() + ". Second, be brief.",
])
def test_a_planted_holdout_or_eval_prompt_is_dropped_and_recorded(lab, planted):
    # Rejection-only (issue 34): the overlapping row is dropped, named in the manifest, and the rest is built.
    extra = [{"messages": [_user(planted), {"role": "assistant", "content": "x"}]}]
    pa_, _, a, _ = _replay_sources(lab["dir"], extra_a=extra)
    out = lab["dir"] / "out" / "replay.jsonl"
    m = build_replay_mix(ReplayMixConfig(out=out, system_prompt=SYS, sources=[ReplaySource(name="a", path=pa_)], **lab["base"]))
    assert m.rows == len(a) - 1 and m.leak_dropped == 1 and m.leak_dropped_ids == ["a:6"]
    assert [(h.row, h.row_id) for h in m.audit.hits] == [(5, "a:6")]
    assert all(planted not in json.dumps(r) for r in _rows(out)) and len(_rows(out)) == len(a) - 1
    assert read_manifest(out).leak_dropped_ids == ["a:6"]


def test_winner_sft_drops_a_train_battle_that_quotes_a_holdout(lab, battle, jsonl):
    fb = lab["base"]["feedback"]
    rows = [json.loads(x) for x in fb.read_text().splitlines()]
    rows[0]["messages"][0]["content"] = "Quick one: " + " ".join(DEV.split()[3:17])
    jsonl(fb, rows)
    split = Split.model_validate_json(lab["base"]["split"].read_text())
    lab["base"]["split"].write_text(split.model_copy(update={"source_sha256": file_sha256(fb)}).model_dump_json())
    out = lab["dir"] / "w.jsonl"
    m = build_winner_sft(WinnerSFTConfig(out=out, system_prompt=SYS, **lab["base"]))
    assert m.leak_dropped_ids == ["t1#0"] and m.audit.hits[0].source == "dev" and m.audit.hits[0].key == "d1"
    assert all(not r["id"].startswith("t1#") for r in _rows(out))


def test_split_of_another_file_is_refused(lab, jsonl, battle):
    jsonl(lab["base"]["feedback"], [battle("t1")])
    with pytest.raises(DatasetError, match="re-ingest the feedback"):
        build_winner_sft(WinnerSFTConfig(out=lab["dir"] / "w.jsonl", system_prompt=SYS, **lab["base"]))


def test_synthetic_verified_rows_pass_the_checker_and_avoid_eval_items(lab, jsonl):
    taken = generate("digit_sum", 4, seed=7)
    # plant the first generated digit-sum item in the eval suite: the builder must draw around it
    jsonl(lab["base"]["eval_suites"][0], [taken[0].item.model_dump(mode="json")])
    out = lab["dir"] / "synth.jsonl"
    m = build_synthetic_verified(SyntheticVerifiedConfig(out=out, system_prompt=SYS, seed=7,
                                                         counts={"digit_sum": 4, "string_edit": 3}, **lab["base"]))
    rows = _rows(out)
    assert m.rows == 7 and m.stats == {"digit_sum": 4, "string_edit": 3} and m.audit.passed
    prompts = [r["messages"][1]["content"] for r in rows]
    assert taken[0].item.messages[0].content not in prompts
    assert prompts[:3] == [t.item.messages[0].content for t in taken[1:4]]
    tasks = {t.item.messages[0].content: t for f in ("digit_sum", "string_edit") for t in generate(f, 8, seed=7)}
    for r in rows:
        assert r["messages"][0] == {"role": "system", "content": SYS}
        assert check(tasks[r["messages"][1]["content"]].item, r["messages"][2]["content"])


def test_mix_weights_kinds_and_tamper_check(lab):
    w = lab["dir"] / "w.jsonl"
    build_winner_sft(WinnerSFTConfig(out=w, system_prompt=SYS, repeat=2, **lab["base"]))
    pa_, pb, _, _ = _replay_sources(lab["dir"])
    r = lab["dir"] / "r.jsonl"
    build_replay_mix(ReplayMixConfig(out=r, system_prompt=SYS, sources=[ReplaySource(name="a", path=pa_),
                                                                        ReplaySource(name="b", path=pb)], **lab["base"]))
    out = lab["dir"] / "mix.jsonl"
    m = build_mix(MixConfig(out=out, parts=[MixPart(path=w, weight=2), MixPart(path=r, weight=0.4)], seed=3, **lab["base"]))
    rows = [json.dumps(x, sort_keys=True) for x in _rows(out)]
    assert m.rows == len(rows) == 6 * 2 + round(0.4 * 9)
    counts = Counter(rows)
    assert all(counts[json.dumps(x, sort_keys=True)] == 2 for x in _rows(w))  # weight 2: every row twice
    replay = {json.dumps(x, sort_keys=True) for x in _rows(r)}
    assert sum(counts[x] for x in replay) == 4 and all(counts[x] <= 1 for x in replay)
    assert {s.sha256 for s in m.sources if s.role == "dataset"} == {file_sha256(w), file_sha256(r)}

    p = lab["dir"] / "p.jsonl"
    build_battle_pairs(BattlePairsConfig(out=p, system_prompt=SYS, **lab["base"]))
    with pytest.raises(DatasetError, match="mix row kinds"):
        build_mix(MixConfig(out=lab["dir"] / "bad.jsonl", parts=[MixPart(path=w, weight=1), MixPart(path=p, weight=1)], **lab["base"]))
    with open(r, "a") as f:
        f.write(json.dumps({"messages": [_user("sneaked in"), {"role": "assistant", "content": "x"}]}) + "\n")
    with pytest.raises(DatasetError, match="changed after the build"):
        build_mix(MixConfig(out=lab["dir"] / "bad.jsonl", parts=[MixPart(path=r, weight=1)], **lab["base"]))


def test_artifacts_are_immutable_and_recorded_in_the_notebook(lab):
    out = lab["dir"] / "w.jsonl"
    m = build_winner_sft(WinnerSFTConfig(out=out, system_prompt=SYS, **lab["base"]))
    assert build_winner_sft(WinnerSFTConfig(out=out, system_prompt=SYS, **lab["base"])).sha256 == m.sha256
    with pytest.raises(DatasetError, match="exists with different content"):
        build_winner_sft(WinnerSFTConfig(out=out, system_prompt=SYS, repeat=3, **lab["base"]))
    assert file_sha256(out) == m.sha256
    with Notebook.open(lab["dir"] / "nb.db") as nb:
        art = record_dataset(nb, m)
        assert nb.artifacts(kind="dataset") == [art]
    assert (art.sha256, art.path, art.recipe["audit_sha256"]) == (m.sha256, str(out), m.audit.sha256())


def test_outputs_parse_as_the_trainers_rows(lab):
    w, p, items = lab["dir"] / "w.jsonl", lab["dir"] / "p.jsonl", lab["dir"] / "items.jsonl"
    build_winner_sft(WinnerSFTConfig(out=w, system_prompt=SYS, **lab["base"]))
    build_battle_pairs(BattlePairsConfig(out=p, system_prompt=SYS, **lab["base"]))
    m = build_synthetic_verified(SyntheticVerifiedConfig(out=items, system_prompt=SYS, rows="items", seed=1,
                                                         counts={"long_division": 3}, **lab["base"]))
    assert [r.id for r in read_rows(w, SFTRow)] == ["t1#0", "t2#0", "t5#0"]
    assert [r.chosen for r in read_rows(p, PreferenceRow)] == [T1_OWN, "Rome【3†source】.", "Ahoy!"]
    rft = read_rows(items, Item)  # the RFT trainer's prompt rows: eval items, gold kept for the checker
    assert m.row_kind == "items" and [i.id for i in rft] == [t.item.id for t in generate("long_division", 3, seed=1)]
    assert all(i.gold and "remainder" in i.gold for i in rft)


def test_command_line_builds_and_refuses_a_dataset_that_is_all_leak(lab, tmp_path):
    repo = Path(__file__).resolve().parents[2]
    base = {k: (str(v) if isinstance(v, Path) else [str(x) for x in v]) for k, v in lab["base"].items()}
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(base | {"out": str(tmp_path / "w.jsonl"), "system_prompt": SYS}))
    run = [sys.executable, "-m", "tools.data.datasets", "winner_sft", str(cfg)]
    res = subprocess.run(run, cwd=repo, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "3 rows" in res.stdout and file_sha256(tmp_path / "w.jsonl") in res.stdout

    (tmp_path / "a.jsonl").write_text(json.dumps({"messages": [_user(DEV.upper()), {"role": "assistant", "content": "x"}]}) + "\n")
    cfg.write_text(json.dumps(base | {"out": str(tmp_path / "r.jsonl"), "system_prompt": SYS,
                                      "sources": [{"name": "a", "path": str(tmp_path / "a.jsonl")}]}))
    res = subprocess.run([*run[:3], "replay_mix", str(cfg)], cwd=repo, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "all 1 training prompt(s) overlap" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "r.jsonl").exists() and not manifest_path(tmp_path / "r.jsonl").exists()

    cfg.write_text(json.dumps(base | {"out": str(tmp_path / "x.jsonl"), "system_prompt": SYS, "repeat": 0}))
    res = subprocess.run(run, cwd=repo, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "repeat" in res.stderr


def test_ingested_split_of_feedback_with_repeated_prompts_builds_clean(tmp_path, battle, jsonl, tokenizer_dir):
    # Real feedback repeats prompts (exactly, re-cased, or quoted in longer ones). The split keeps such
    # battles together, so a winner-SFT build from an ingested split never trips its own audit.
    long = "compare the causes of the first and the second world war in five short bullet points for a student"
    prompts = ["hi", "Hi!", "HI", long, f"Please: {long.upper()}. Thanks!", f"{long}, then add a summary"]
    prompts += [f"unrelated question {i} about cooking and travel" for i in range(30)]
    rows = [battle(f"b{i:02d}", p, ("own", "other")[i % 2], own=f"answer {i}") for i, p in enumerate(prompts)]
    fb = jsonl(tmp_path / "fb.jsonl", rows)
    with Notebook.open(tmp_path / "nb.db") as nb:
        split_path, record = ingest_feedback(nb, fb, SplitConfig(dev_fraction=0.3, sealed_fraction=0.3), tmp_path / "splits")
    assert len({record.assignment[f"b{i:02d}"] for i in range(3)}) == 1
    assert len({record.assignment[f"b{i:02d}"] for i in range(3, 6)}) == 1
    m = build_winner_sft(WinnerSFTConfig(out=tmp_path / "w.jsonl", tokenizer=tokenizer_dir, feedback=fb,
                                         split=split_path, system_prompt=SYS))
    assert m.audit.passed and m.rows == sum(s == "train" for s in record.assignment.values())


def test_mix_with_a_kl_only_replay_part_gives_klce_rows(lab):
    w, r = lab["dir"] / "w.jsonl", lab["dir"] / "r.jsonl"
    build_winner_sft(WinnerSFTConfig(out=w, system_prompt=SYS, **lab["base"]))
    pa_, _, _, _ = _replay_sources(lab["dir"])
    build_replay_mix(ReplayMixConfig(out=r, system_prompt=SYS, sources=[ReplaySource(name="a", path=pa_)], **lab["base"]))
    out = lab["dir"] / "klce.jsonl"
    m = build_mix(MixConfig(out=out, parts=[MixPart(path=w, weight=1), MixPart(path=r, weight=1, kl_only=True)], **lab["base"]))
    rows = read_rows(out, KLCERow)
    assert m.row_kind == "klce" and len(rows) == 3 + 5
    assert sorted((r.id, r.kl_only) for r in rows) == sorted(
        [(i, False) for i in ("t1#0", "t2#0", "t5#0")] + [(f"a:{i}", True) for i in range(1, 6)])
    p = lab["dir"] / "p.jsonl"
    build_battle_pairs(BattlePairsConfig(out=p, system_prompt=SYS, **lab["base"]))
    with pytest.raises(DatasetError, match="kl_only parts need SFT rows"):
        build_mix(MixConfig(out=lab["dir"] / "x.jsonl", parts=[MixPart(path=p, weight=1, kl_only=True)], **lab["base"]))


def test_a_battles_own_system_prompt_reaches_the_rendered_training_rows(tmp_path, battle, jsonl, tokenizer_dir):
    # Every battle was answered under a system prompt of its own (a long one, shared by a dev battle as real
    # deployments share theirs). Its SFT, DPO and KL-CE rows keep it, rendered as the trainers render them (the
    # serving prompt passed as the default, which a row's own system turn wins over); and the leak audit, which
    # reads user turns only, does not take the shared system prompt for a copied holdout prompt.
    own = "You are Quill, the support assistant of a bookshop in Lyon; answer in two sentences at most, politely."
    rows = [battle(f"t{i}", vote="own", own=f"Answer {i}.", other=f"Other {i}.", messages=[
        {"role": "system", "content": own}, {"role": "user", "content": f"Question {i} about opening hours"}])
        for i in range(3)]
    rows.append(battle("d1", vote="own", messages=[{"role": "system", "content": own}, _user(DEV)]))
    fb = jsonl(tmp_path / "fb.jsonl", rows)
    split = Split(source_sha256=file_sha256(fb), config=SplitConfig(dev_fraction=0.2, sealed_fraction=0.1),
                  assignment={b["id"]: "dev" if b["id"] == "d1" else "train" for b in rows}, counts={})
    (tmp_path / "split.json").write_text(split.model_dump_json())
    base = {"tokenizer": tokenizer_dir, "feedback": fb, "split": tmp_path / "split.json", "system_prompt": SYS}
    w, p = tmp_path / "w.jsonl", tmp_path / "p.jsonl"
    sft, pairs = build_winner_sft(WinnerSFTConfig(out=w, **base)), build_battle_pairs(BattlePairsConfig(out=p, **base))
    base.pop("system_prompt")
    klce = build_mix(MixConfig(out=tmp_path / "k.jsonl", parts=[MixPart(path=w, weight=1, kl_only=True)], **base))
    assert (sft.rows, pairs.rows, klce.rows) == (3, 3, 3) and sft.leak_dropped == pairs.leak_dropped == 0
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    conversations = ([r.messages for r in read_rows(w, SFTRow)] + [r.messages for r in read_rows(tmp_path / "k.jsonl", KLCERow)]
                     + [[*r.prompt, {"role": "assistant", "content": r.chosen}] for r in read_rows(p, PreferenceRow)])
    for messages in conversations:
        text = tok.decode(render(tok, messages, SYS).input_ids)
        assert own in text and SYS not in text
    assert sft.stats["battle_system_turns_kept"] == 3
