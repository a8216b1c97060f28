"""The memory estimate: parameter counts from the meta device match the loaded models; the parts scale as stated."""

import pytest

from trainers.common import ConfigError, LoRASettings, load_policy
from trainers.memory import GIB, check_fits, estimate, estimate_job, model_shape
from trainers.sft import SFTConfig


@pytest.mark.parametrize("lora", [None, LoRASettings(r=4, alpha=8, train_lm_head=True)])
def test_shape_counts_match_the_loaded_model(model_dirs, lora):
    shape = model_shape(model_dirs["nemotron_h"], lora)
    model = load_policy(model_dirs["nemotron_h"], "float32", lora, seed=0)
    assert shape.total_params == sum(p.numel() for p in model.parameters())
    assert shape.trainable_params == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert shape.num_layers == model.config.num_hidden_layers and 0 < shape.largest_block_params < shape.total_params


def test_sharding_checkpointing_and_refusal(model_dirs, sft_data, tmp_path):
    shape = model_shape(model_dirs["llama"], None)
    kw = dict(micro_batch_size=2, seq_len=4096, compute_bytes=2, loss_chunk_tokens=1024)
    one = estimate(shape, world_size=1, activation_checkpointing=False, **kw)
    four = estimate(shape, world_size=4, activation_checkpointing=False, **kw)
    # Weights, gradients and AdamW state shard; activations and gathered blocks do not.
    assert four.weights == one.weights / 4 and four.grads_and_optimizer == one.grads_and_optimizer / 4
    assert four.activations == one.activations and one.grads_and_optimizer == 12 * shape.total_params
    ckpt = estimate(shape, world_size=1, activation_checkpointing=True, **kw)
    assert ckpt.activations < one.activations / shape.num_layers * 2
    assert one.head_and_loss == 3 * 4 * 1024 * shape.vocab_size  # one float32 chunk, not all 8192 positions
    check_fits(one, one.total, "x")
    with pytest.raises(ConfigError, match=r"estimated .* GiB per GPU on 1 GPU\(s\) exceeds 0.5 GiB \(reserve 2.0 GiB"):
        check_fits(one, 0.5 * GIB, "sft")
    job = estimate_job(SFTConfig(model_path=model_dirs["llama"], data_path=sft_data, output_dir=tmp_path / "r",
                                 micro_batch_size=2, batch_size=8, max_len=4096), 1)
    assert job.total == pytest.approx(estimate(shape, world_size=1, activation_checkpointing=False,
                                               **(kw | {"compute_bytes": 4})).total)

