"""U+2028, U+2029 and U+0085 inside strings survive the whole chain (issue 10, item 4):
feedback -> split -> builder -> trainer rows -> eval items. `str.splitlines()` splits on all three,
so one reader in the chain that used it would cut a row in two; every reader now goes through
core/jsonl.py, which splits on "\\n" only. The files are written with the characters raw, as
canonical_json and pydantic write them."""

from __future__ import annotations

import json
from pathlib import Path

from core import tiny
from evals.job import read_items, write_jsonl
from evals.types import Battle as ItemBattle
from evals.types import Item
from memory.notebook import Notebook
from tools.data.datasets import BattlePairsConfig, WinnerSFTConfig, build_battle_pairs, build_winner_sft
from tools.data.feedback import load_feedback
from tools.data.splits import Split, SplitConfig, ingest_feedback
from trainers.rows import PreferenceRow, SFTRow, read_rows

SEPARATORS = ("\u2028", "\u2029", "\u0085")
TOPICS = ["apples", "rivers", "engines", "violins", "glaciers", "sparrows", "lanterns", "copper", "tigers",
          "harbors", "puzzles", "comets", "orchards", "tunnels", "meadows", "beacons"]


def _battles() -> list[dict]:
    rows = []
    for i, topic in enumerate(TOPICS):
        sep = SEPARATORS[i % 3]
        rows.append({"id": f"u{i}", "messages": [{"role": "user", "content": f"Tell me about {topic}{sep}briefly please"}],
                     "own": f"{topic.title()} are{sep}remarkable.", "other": f"No idea{sep}about {topic}.",
                     "vote": ("own", "other")[i % 2]})
    return rows


def test_line_separators_survive_feedback_split_builder_rows_and_items(tmp_path: Path):
    feedback = tmp_path / "feedback.jsonl"
    feedback.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in _battles()), encoding="utf-8")
    assert all(sep.encode() in feedback.read_bytes() for sep in SEPARATORS)

    # feedback -> split
    parsed = load_feedback(feedback)
    by_id = {b.id: b for b in parsed.battles}
    assert len(by_id) == len(TOPICS) and by_id["u0"].own == "Apples are\u2028remarkable."
    with Notebook.open(tmp_path / "notebook.db") as nb:
        split_path, record = ingest_feedback(nb, feedback, SplitConfig(dev_fraction=0.25, sealed_fraction=0.125),
                                             tmp_path / "splits")
    split = Split.model_validate_json(split_path.read_text(encoding="utf-8"))
    train, dev = sorted(split.ids("train")), sorted(split.ids("dev"))
    assert train and dev and record.sha256 == split.sha256

    # eval items from the dev battles, written raw by the eval job's writer and read back by its reader
    items = [Item(id=i, messages=by_id[i].messages, battle=ItemBattle(chosen=by_id[i].preferred, rejected=by_id[i].rejected))
             for i in dev]
    suite = tmp_path / "dev_items.jsonl"
    write_jsonl(suite, items)
    assert read_items(suite) == items

    # builder (which also reads the suite as audit references) -> trainer rows
    tok = tiny.build_tokenizer(tmp_path / "tok", corpus=[" ".join(TOPICS)] * 4, vocab_size=400)
    common = dict(tokenizer=tok, feedback=feedback, split=split_path, eval_suites=[suite], system_prompt="")
    sft = build_winner_sft(WinnerSFTConfig(out=tmp_path / "sft.jsonl", **common))
    pairs = build_battle_pairs(BattlePairsConfig(out=tmp_path / "pairs.jsonl", **common))
    assert sft.audit.passed and pairs.audit.passed
    sft_rows = {r.id.split("#")[0]: r for r in read_rows(tmp_path / "sft.jsonl", SFTRow)}
    pair_rows = {r.id: r for r in read_rows(tmp_path / "pairs.jsonl", PreferenceRow)}
    assert sorted(sft_rows) == sorted(pair_rows) == train
    for i in train:
        b = by_id[i]
        assert sft_rows[i].messages[0].content == b.messages[0].content and sft_rows[i].messages[-1].content == b.preferred
        assert (pair_rows[i].chosen, pair_rows[i].rejected) == (b.preferred, b.rejected)
        assert any(sep in pair_rows[i].chosen for sep in SEPARATORS)
    assert any(sep.encode() in (tmp_path / "sft.jsonl").read_bytes() for sep in SEPARATORS)  # written raw, read whole
