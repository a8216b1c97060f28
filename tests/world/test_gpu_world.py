"""The GPU world's code on the CPU (issue 39, item 1): `--size gpu` builds a parent of real size on a GPU; the same
code builds here at the test's size (`gpu-test`), and its lab is a LoRA lab at the recipe's defaults for its
parent's shape, bf16, real GPU-hours and a GPU memory bound, whose arms train."""

from __future__ import annotations

import json
import shutil
import tomllib
from pathlib import Path

import pytest

from agent.config import load_lab_config
from tools.world.build import GPU_MAX_LEN, GPU_STEPS, PARENT, SIZES, STAGE1_DATA, build, load_spec, widths
from trainers.recipe import model_shape, rule_lr, rule_micro_batch


@pytest.fixture(scope="module")
def gpu_world(tmp_path_factory: pytest.TempPathFactory) -> Path:
    lab = tmp_path_factory.mktemp("gpu-world") / "lab"
    build(lab, seed=0, size="gpu-test")
    return lab


def test_the_gpu_parent_is_a_hybrid_of_real_size() -> None:
    import torch
    from transformers import NemotronHConfig, NemotronHForCausalLM

    spec = SIZES["gpu"]
    config = NemotronHConfig(vocab_size=spec.vocab, hidden_size=spec.hidden, layers_block_type=list(spec.layers),
                             n_routed_experts=spec.experts, tie_word_embeddings=False, **widths(spec))
    with torch.device("meta"):
        model = NemotronHForCausalLM(config)
    assert sum(p.numel() for p in model.parameters()) >= 300_000_000
    assert {type(layer.mixer).__name__ for layer in model.model.layers} == {
        "NemotronHAttention", "NemotronHMamba2Mixer", "NemotronHMoE"}


def test_the_gpu_lab_is_a_lora_lab_at_the_recipes_defaults(gpu_world: Path) -> None:
    config = load_lab_config(gpu_world)
    assert config.executor.gpu_memory_gib == 139 and config.executor.gpu_dtype == "bfloat16"
    assert config.executor.simulated_gpuh_per_device_s is None  # real GPU-hours, measured
    shape = model_shape(gpu_world / PARENT)
    recipe = config.train_recipe()
    for family, settings in recipe.families.items():
        assert settings.method == "lora" and settings.steps == GPU_STEPS and settings.max_len == GPU_MAX_LEN
        assert settings.lr == rule_lr(shape, "lora", family)  # the rule for this shape, stated in lab.toml
        assert settings.micro_batch == rule_micro_batch(shape) and settings.lora.r == 16
    stated = tomllib.loads((gpu_world / "lab.toml").read_text())
    assert stated["train"]["method"] == "lora" and "simulated_gpuh_per_device_s" not in stated["executor"]
    spec = load_spec(gpu_world)
    assert spec.size == "gpu-test" and spec.sizes.lab == "gpu" and spec.gpuh_per_device_s == pytest.approx(1 / 3600)
    parent = json.loads((gpu_world / PARENT / "config.json").read_text())
    assert set(parent["layers_block_type"]) == {"linear_attention", "moe", "full_attention"}  # Mamba-2, MoE, attention
    _, rebuilt = build(gpu_world, seed=0, size="gpu-test")
    assert not rebuilt  # cached like the other sizes


def test_a_lora_arm_trains_on_the_gpu_worlds_parent(gpu_world: Path, tmp_path: Path) -> None:
    from trainers.common import LoRASettings
    from trainers.sft import SFTConfig, train

    settings = load_lab_config(gpu_world).train_recipe().families["sft"]
    data = shutil.copy(gpu_world / STAGE1_DATA, tmp_path / "stage1.jsonl")  # the trainer caches tokens beside it
    config = SFTConfig(model_path=gpu_world / PARENT, data_path=Path(data), output_dir=tmp_path / "arm",
                       lr=settings.lr, steps=2, batch_size=4, micro_batch_size=2, max_len=settings.max_len,
                       lora=LoRASettings(r=settings.lora.r, alpha=settings.lora.alpha), seed=0)
    result = train(config)
    assert result.adapter and result.steps == 2 and (result.model_dir / "adapter_config.json").is_file()
    assert result.wall is not None and result.wall.work_s > 0 and "load" in result.wall.parts
