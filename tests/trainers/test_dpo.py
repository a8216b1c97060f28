"""DPO + NLL: learns the preference, reports held-out reward metrics, caches reference log-probs."""

import json

import pytest
import torch
from pydantic import ValidationError
from trainer_testkit import MEMO, assert_trained, metric_series, reload_and_generate, user, write_jsonl
from transformers import AutoModelForCausalLM, AutoTokenizer

from core import chat
from trainers.common import ConfigError, LoRASettings
from trainers.dpo import DPOConfig, cache_key, split_heldout, train
from trainers.rows import PreferenceRow, read_rows


@pytest.fixture
def pairs(tmp_path):
    rows = [{"id": f"p{i}", "prompt": [user(q)], "chosen": a, "rejected": f"The answer is {i * 3 + 1}."}
            for i, (q, a) in enumerate(MEMO)]
    rows += [{"id": "h", "prompt": [user("What is 9 + 9?")], "chosen": "The answer is 18.", "rejected": "No."}]
    return write_jsonl(tmp_path / "pairs.jsonl", rows)


@torch.no_grad()
def _answer_logp(model, tok, prompt, answer) -> float:
    """Summed log-probability of the answer's supervised tokens (content + <|im_end|>) after the prompt."""
    r = chat.render(tok, [*prompt, {"role": "assistant", "content": answer}], "Be brief.")
    ids = torch.tensor([r.input_ids])
    logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
    return float((logp * torch.tensor(r.loss_mask[1:])).sum())


def _config(model_dir, data, out, **kw) -> DPOConfig:
    base = dict(model_path=model_dir, data_path=data, output_dir=out, lr=1e-2, steps=20, batch_size=4,
                micro_batch_size=4, beta=0.5, nll_weight=0.2, heldout_fraction=0.2, system_prompt="Be brief.")
    return DPOConfig(**(base | kw))


@pytest.mark.parametrize(("kind", "lora"), [("nemotron_h", LoRASettings(r=4, alpha=8)), ("llama", None)])
def test_dpo_learns_preference_and_reloads(kind, lora, model_dirs, pairs, tmp_path):
    result = train(_config(model_dirs[kind], pairs, tmp_path / "run", lora=lora))
    losses = metric_series(tmp_path / "run")
    dpo = metric_series(tmp_path / "run", "dpo")
    assert sum(losses[-3:]) < 0.8 * sum(losses[:3]) and sum(dpo[-3:]) / 3 < 0.35, dpo
    # At step 1 policy == reference: every DPO margin is exactly zero, so the DPO term is log 2.
    first = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["dpo"] == pytest.approx(0.6931, abs=1e-3) and first["reward_margin"] == pytest.approx(0, abs=1e-4)
    assert metric_series(tmp_path / "run", "reward_accuracy")[-1] > 0.5
    assert result.metrics["heldout_pairs"] == 2 and result.metrics["ref_logps_cached"] == 0.0
    assert_trained(result)
    trained = reload_and_generate(result).eval()
    # The held-out figures are those of the saved model against the reference, recomputed here from scratch.
    rows = read_rows(pairs, PreferenceRow)
    reference = AutoModelForCausalLM.from_pretrained(model_dirs[kind]).eval()
    tok = AutoTokenizer.from_pretrained(model_dirs[kind])
    margins = [0.5 * ((_answer_logp(trained, tok, r.prompt, r.chosen) - _answer_logp(reference, tok, r.prompt, r.chosen))
                      - (_answer_logp(trained, tok, r.prompt, r.rejected) - _answer_logp(reference, tok, r.prompt, r.rejected)))
               for r in (rows[i] for i in split_heldout(rows, 0.2)[1])]
    assert result.metrics["heldout_reward_margin"] == pytest.approx(sum(margins) / 2, abs=1e-3)
    assert result.metrics["heldout_reward_accuracy"] == sum(m > 0 for m in margins) / 2
    assert max(abs(m) for m in margins) > 0.05, margins  # the policy moved away from the reference


def test_reference_logprobs_are_cached_by_data_and_reference(model_dirs, pairs, tmp_path):
    config = _config(model_dirs["llama"], pairs, tmp_path / "a", steps=2)
    train(config)
    cache = config.cache_dir / f"{cache_key(config)}.json"
    assert cache.is_file()
    # Poison the cache: a rerun that reads it (and does not recompute) sees the poisoned values.
    blob = json.loads(cache.read_text())
    blob["logps"] = [[c + 5.0, r] for c, r in blob["logps"]]
    cache.write_text(json.dumps(blob))
    second = train(config.model_copy(update={"output_dir": tmp_path / "b"}))
    assert second.metrics["ref_logps_cached"] == 1.0
    first_margin = json.loads((tmp_path / "b" / "metrics.jsonl").read_text().splitlines()[0])["reward_margin"]
    assert first_margin == pytest.approx(-0.5 * 5.0, abs=1e-3)  # beta * (0 - 5): the cache was used
    # Another reference (different weights), other data or another dtype gets another key.
    other = config.model_copy(update={"reference_path": model_dirs["qwen2"]})
    assert cache_key(other) != cache_key(config)
    more = tmp_path / "more.jsonl"
    more.write_text(pairs.read_text() + pairs.read_text().splitlines(keepends=True)[0])
    assert cache_key(config.model_copy(update={"data_path": more})) != cache_key(config)
    assert cache_key(config.model_copy(update={"dtype": "bfloat16"})) != cache_key(config)


def test_heldout_split_is_independent_of_file_order(pairs):
    rows = read_rows(pairs, PreferenceRow)
    kept, held = split_heldout(rows, 0.2)
    assert len(held) == 2 and sorted(kept + held) == list(range(len(rows)))  # held-out pairs never train
    _, held_rev = split_heldout(rows[::-1], 0.2)
    assert sorted(rows[i].id for i in held) == sorted(rows[::-1][i].id for i in held_rev)


def test_bad_dpo_configs_are_refused(model_dirs, pairs, tmp_path):
    with pytest.raises(ValidationError, match="beta\n  Input should be greater than 0"):
        _config(model_dirs["llama"], pairs, tmp_path / "run", beta=0)
    with pytest.raises(ValidationError, match="reference_path: .* has no config.json"):
        _config(model_dirs["llama"], pairs, tmp_path / "run", reference_path=tmp_path)
    one = write_jsonl(tmp_path / "one.jsonl", [{"prompt": [user("q")], "chosen": "a", "rejected": "b"}])
    with pytest.raises(ConfigError, match="heldout_fraction: 0.2 leaves no training pairs of 1"):
        train(_config(model_dirs["llama"], one, tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_long_prompts_are_cut_from_the_left_and_long_answers_drop_their_pair(model_dirs, pairs, tmp_path):
    from trainers.batch import cut_answer

    tok = AutoTokenizer.from_pretrained(model_dirs["llama"])
    config = _config(model_dirs["llama"], pairs, tmp_path / "run", max_prompt_length=6, max_completion_length=12)
    prompt = [user("Please tell me, after thinking about it for a while: what is 2 + 2?")]
    whole = chat.render(tok, [*prompt, {"role": "assistant", "content": "4."}], "Be brief.")
    start = whole.loss_mask.index(1)
    got = cut_answer(tok, prompt, "4.", **_cut_settings(config))
    # The last 6 prompt tokens (the assistant header among them), then the whole answer with its end-of-turn.
    assert got.input_ids == whole.input_ids[start - 6 :] and got.loss_mask == [0] * 6 + whole.loss_mask[start:]
    assert got.truncated and got.supervised == sum(whole.loss_mask)
    assert cut_answer(tok, prompt, "word " * 20, **_cut_settings(config)) is None  # 21 answer tokens > 12: the pair is dropped
    long = write_jsonl(tmp_path / "long.jsonl", [json.loads(x) for x in pairs.read_text().splitlines()]
                       + [{"id": "long", "prompt": [user("Say a lot.")], "chosen": "word " * 20, "rejected": "No."}])
    result = train(_config(model_dirs["llama"], long, tmp_path / "run", steps=2, max_completion_length=12))
    assert result.metrics["dropped_pairs"] == 1.0 and result.steps == 2  # counted, and the run goes on


def _cut_settings(config) -> dict:
    return {k: getattr(config, k) for k in ("system_prompt", "max_len", "max_prompt_length", "max_completion_length")}
