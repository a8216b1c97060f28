"""[train] settled per family (trainers/recipe.py): the rules over a model's config.json, what the user writes,
the ranges a planner's proposal is held to, an arm's settings against its dataset, and the cosine schedule.

Configs only, no weights: a 7B-shaped dense model and a 30B-A3B-shaped MoE model, with the published shapes of
Qwen2.5-7B and Qwen3-30B-A3B (7.6B parameters; 30.5B total, 3.3B active)."""

from __future__ import annotations

import json
import math

import pytest
from pydantic import ValidationError

from trainers.loop import _schedule
from trainers.recipe import (
    DatasetSize,
    TrainSection,
    arm_settings,
    model_shape,
    out_of_range,
    resolve,
    rule_max_len,
    shape_of_config,
)

DENSE_7B = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 3584,
            "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
            "vocab_size": 152064, "max_position_embeddings": 32768, "tie_word_embeddings": False}
MOE_30B_A3B = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048,
               "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
               "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
               "num_experts_per_tok": 8, "vocab_size": 151936, "max_position_embeddings": 40960,
               "tie_word_embeddings": False}


def _recipe(config: dict, section: dict | None = None, tmp_path=None):
    return resolve(TrainSection.model_validate(section or {}, strict=True), shape_of_config(config), ["math"])


def test_model_shapes_from_config_json_alone(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(MOE_30B_A3B))  # no weights in the directory
    moe = model_shape(tmp_path)
    assert moe.moe and moe.context == 40960 and moe.params_total == pytest.approx(30.5e9, rel=0.02)
    assert moe.params_active == pytest.approx(3.3e9, rel=0.05)
    dense = shape_of_config(DENSE_7B)
    assert not dense.moe and dense.params_total == dense.params_active == pytest.approx(7.6e9, rel=0.02)


@pytest.mark.parametrize("config", [DENSE_7B, MOE_30B_A3B], ids=["7B", "30B-A3B"])
def test_documented_defaults_for_real_models(config):
    full = _recipe(config)
    for family in ("sft", "klce", "rft"):
        f = full.families[family]
        assert (f.method, f.lr, f.lr_range) == ("full", 1e-5, (1e-6, 3e-5))
        assert (f.schedule, f.warmup_ratio, f.min_lr_ratio, f.batch, f.batch_unit) == ("cosine", 0.03, 0.1, 64, "sequences")
        assert f.steps is None and f.epochs == 1.0 and f.source["lr"] == "rule"
    assert full.families["dpo"].lr == 1e-6 and full.families["dpo"].beta == 0.1
    assert full.families["rft"].verifiers == ["math"] and full.families["klce"].kl_coef == 0.1
    lora = _recipe(config, {"method": "lora"})
    assert lora.families["sft"].lr == 1e-4 and lora.families["dpo"].lr == 1e-5 and lora.families["sft"].lora.r == 16
    # Lengths: the dataset's 99th-percentile row rounded up to 256 tokens, never past the model's context.
    context = config["max_position_embeddings"]
    assert full.families["sft"].context == context and full.families["sft"].max_len is None
    assert rule_max_len(context, 3000) == 3072 and rule_max_len(context, 100_000) == context
    assert rule_max_len(context, None) == 4096
    # Micro-batches by size: 2 sequences for 7B, 1 for 30B total.
    assert full.families["sft"].micro_batch == (2 if config is DENSE_7B else 1)


def test_user_values_win_per_family_then_train_then_rules():
    recipe = _recipe(DENSE_7B, {"method": "lora", "lr_range": [1e-5, 3e-4], "lora": {"r": 64, "fp32_head": True},
                                "dpo": {"lr": 5e-6, "lr_range": [1e-6, 1e-5], "method": "full"},
                                "klce": {"kl_coef": 0.5, "replay_share": 0.3}})
    sft, dpo, klce = (recipe.families[f] for f in ("sft", "dpo", "klce"))
    assert (sft.method, sft.lr, sft.lr_range, sft.lora.r, sft.lora.alpha, sft.lora.fp32_head) == \
        ("lora", 1e-4, (1e-5, 3e-4), 64, 128.0, True)
    assert sft.source["method"] == "lab.toml [train]" and dpo.source["lr"] == "lab.toml [train.dpo]"
    assert (dpo.method, dpo.lr, dpo.lr_range) == ("full", 5e-6, (1e-6, 1e-5))
    assert (klce.kl_coef, klce.replay_share) == (0.5, 0.3)
    # A rule's default outside the user's range goes to the range's nearest end.
    assert _recipe(DENSE_7B, {"lr_range": [2e-5, 5e-5]}).families["sft"].lr == 2e-5


@pytest.mark.parametrize(("section", "message"), [
    ({"sft": {"lr": 1e-3, "lr_range": [1e-6, 1e-4]}}, "lr = 0.001 is outside lr_range"),
    ({"lr_range": [1e-4, 1e-6]}, "lr_range [0.0001, 1e-06] must be [low, high]"),
    ({"steps": 10, "epochs": 2.0}, "give steps or epochs, not both"),
    ({"batch": 8, "micro_batch": 16}, "micro_batch (16) cannot exceed batch (8)"),
    ({"dpo": {"beta": 5.0, "beta_range": [0.01, 1.0]}}, "beta = 5 is outside beta_range"),
])
def test_contradictions_are_refused(section, message):
    with pytest.raises(ValidationError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        TrainSection.model_validate(section, strict=True)


def test_contradictions_across_tables_and_past_the_context():
    with pytest.raises(ValueError, match=r"train.sft: lr = 0.001 \(lab.toml \[train.sft\]\) is outside lr_range"):
        _recipe(DENSE_7B, {"lr_range": [1e-6, 1e-4], "sft": {"lr": 1e-3}})
    with pytest.raises(ValueError, match=r"train.sft: max_len \(65536\) exceeds the model's context \(32768\)"):
        _recipe(DENSE_7B, {"max_len": 65536})


def test_proposals_outside_the_ranges_are_named():
    recipe = _recipe(DENSE_7B)
    assert out_of_range(recipe, {"trainer": "sft", "lr": 2e-5, "batch_size": 64}) == []
    assert out_of_range(recipe, {"trainer": "sft"}) == []  # what it leaves out is [train]'s own
    reasons = out_of_range(recipe, {"trainer": "dpo", "lr": 1e-3, "beta": 3.0, "batch_size": 4096})
    assert reasons == ["lr 0.001 is outside [train.dpo] lr_range [1e-07, 3e-06]",
                       "batch_size 4096 sequences is outside [train.dpo] batch_range [16, 256]",
                       "beta 3 is outside [train.dpo] beta_range [0.01, 1]"]
    assert out_of_range(recipe, {"trainer": "ppo"}) == ["trainer 'ppo' is not one of sft, dpo, klce, rft"]


def test_an_arm_settles_lengths_epochs_and_token_batches_against_its_dataset():
    data = DatasetSize(rows=1000, tokens=1_500_000, p99_row_tokens=2900)
    arm = arm_settings(_recipe(DENSE_7B).families["sft"], {"lr": 2e-5}, data)
    assert (arm.lr, arm.max_len, arm.batch_size, arm.micro_batch_size) == (2e-5, 3072, 64, 2)
    assert arm.steps == math.ceil(1000 / 64) and arm.warmup_steps == round(0.03 * arm.steps)
    tokens = _recipe(DENSE_7B, {"batch_unit": "tokens", "batch": 96_000, "micro_batch": 6000, "steps": 50})
    arm = arm_settings(tokens.families["sft"], {}, data)  # 1500 tokens a row
    assert (arm.batch_size, arm.micro_batch_size, arm.steps) == (64, 4, 50)


def test_cosine_decays_to_its_floor_and_linear_stays_as_it_was():
    cosine = _schedule(2, 10, "cosine", 0.1)
    assert [cosine(s) for s in (0, 1, 2)] == [0.5, 1.0, 1.0]
    assert cosine(9) == pytest.approx(0.1 + 0.9 * 0.5 * (1 - math.cos(math.pi / 8)))
    assert cosine(10) == pytest.approx(0.1) and all(cosine(s) > cosine(s + 1) for s in range(2, 10))
    linear = _schedule(0, 4)
    assert [linear(s) for s in range(4)] == [1.0, 0.75, 0.5, 0.25]
