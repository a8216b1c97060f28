"""DPO + NLL: learns the preference, reports held-out reward metrics, caches reference log-probs."""

import json

import pytest
from pydantic import ValidationError
from trainer_testkit import MEMO, assert_trained, metric_series, reload_and_generate, user, write_jsonl

from trainers.common import ConfigError, LoRASettings
from trainers.dpo import DPOConfig, cache_key, split_heldout, train
from trainers.rows import PreferenceRow, read_rows


@pytest.fixture
def pairs(tmp_path):
    rows = [{"id": f"p{i}", "prompt": [user(q)], "chosen": a, "rejected": f"The answer is {i * 3 + 1}."}
            for i, (q, a) in enumerate(MEMO)]
    rows += [{"id": "h", "prompt": [user("What is 9 + 9?")], "chosen": "The answer is 18.", "rejected": "No."}]
    return write_jsonl(tmp_path / "pairs.jsonl", rows)


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
    assert result.metrics["heldout_pairs"] == 2 and 0 <= result.metrics["heldout_reward_accuracy"] <= 1
    assert "heldout_reward_margin" in result.metrics and result.metrics["ref_logps_cached"] == 0.0
    assert_trained(result)
    reload_and_generate(result)


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
    # Another reference (different weights) gets another key.
    other = config.model_copy(update={"reference_path": model_dirs["qwen2"]})
    assert cache_key(other) != cache_key(config)


def test_heldout_split_is_independent_of_file_order(pairs):
    rows = read_rows(pairs, PreferenceRow)
    _, held = split_heldout(rows, 0.2)
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
