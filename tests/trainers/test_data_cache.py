"""The token cache: built once per (data sha256, tokenizer, settings), equal to direct encoding, reused after."""

from trainer_testkit import MEMO, user, write_jsonl
from transformers import AutoTokenizer

from trainers import data_cache
from trainers.batch import cut_answer, encode
from trainers.dpo import DPOConfig
from trainers.rows import PreferenceRow, SFTRow, read_rows


def test_rows_are_tokenized_once_and_equal_direct_encoding(model_dirs, sft_data):
    tok = AutoTokenizer.from_pretrained(model_dirs["llama"])
    rows = read_rows(sft_data, SFTRow)
    got, reused = data_cache.encoded_rows(rows, sft_data, model_dirs["llama"], "Be brief.", 24, "sft")
    assert not reused and got == [encode(tok, r.messages, "Be brief.", 24) for r in rows]
    assert all(e.truncated and len(e.input_ids) == 24 for e in got)  # the cut at max_len is cached too
    again, reused = data_cache.encoded_rows(rows, sft_data, model_dirs["llama"], "Be brief.", 24, "sft")
    assert reused and again == got
    # Other settings or other data bytes get another key (a new cache entry, not a stale one).
    _, reused = data_cache.encoded_rows(rows, sft_data, model_dirs["llama"], "Be brief.", 32, "sft")
    assert not reused
    sft_data.write_text(sft_data.read_text() + sft_data.read_text().splitlines(keepends=True)[0])
    more = read_rows(sft_data, SFTRow)
    extra, reused = data_cache.encoded_rows(more, sft_data, model_dirs["llama"], "Be brief.", 24, "sft")
    assert not reused and len(extra) == len(rows) + 1
    assert len(list((sft_data.parent / "token_cache").iterdir())) == 3


def test_pairs_cache_keeps_dropped_pairs_as_none(model_dirs, tmp_path):
    data = write_jsonl(tmp_path / "pairs.jsonl", [
        {"prompt": [user(q)], "chosen": a, "rejected": "No."} for q, a in MEMO[:3]]
        + [{"prompt": [user("Say a lot.")], "chosen": "word " * 30, "rejected": "No."}])
    config = DPOConfig(model_path=model_dirs["llama"], data_path=data, output_dir=tmp_path / "run",
                       max_completion_length=12, max_prompt_length=8)
    rows = read_rows(data, PreferenceRow)
    limits = (config.system_prompt, config.max_len, config.max_prompt_length, config.max_completion_length)
    pairs, reused = data_cache.encoded_pairs(rows, config.data_path, config.model_path, *limits)
    tok = AutoTokenizer.from_pretrained(model_dirs["llama"])
    assert not reused and pairs[3] is None
    cut = {k: getattr(config, k) for k in ("system_prompt", "max_len", "max_prompt_length", "max_completion_length")}
    assert pairs[:3] == [(cut_answer(tok, r.prompt, r.chosen, **cut), cut_answer(tok, r.prompt, r.rejected, **cut))
                         for r in rows[:3]]
    assert data_cache.encoded_pairs(rows, config.data_path, config.model_path, *limits) == (pairs, True)
