"""SFT on tiny Nemotron-H and Llama: learns, changes weights, reloads, packs safely, refuses bad configs."""

import hashlib
import json

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file
from trainer_testkit import (
    MEMO,
    assert_trained,
    assistant,
    metric_series,
    reload_and_generate,
    user,
    weights,
    write_jsonl,
)

from trainers.batch import pad_batch
from trainers.common import ConfigError, LoRASettings, NonFiniteLoss
from trainers.rows import RowsError
from trainers.sft import SFTConfig, SFTObjective, encode_rows, train, validate


def _config(model_dir, data, out, **kw) -> SFTConfig:
    base = dict(model_path=model_dir, data_path=data, output_dir=out, lr=1e-2, steps=30, batch_size=8,
                micro_batch_size=4, system_prompt="Be brief.")
    return SFTConfig(**(base | kw))


@pytest.mark.parametrize(
    ("kind", "lora"),
    [("nemotron_h", None), ("nemotron_h", LoRASettings(r=4, alpha=8, train_lm_head=True)), ("llama", None),
     ("llama", LoRASettings(r=4, alpha=8, train_lm_head=True)), ("qwen2", None)],
    ids=["nemotron_h-full", "nemotron_h-lora", "llama-full", "llama-lora", "qwen2-full"],
)
def test_sft_learns_and_reloads(kind, lora, model_dirs, sft_data, tmp_path):
    out = tmp_path / "run"
    result = train(_config(model_dirs[kind], sft_data, out, lora=lora))
    losses = metric_series(out)
    assert len(losses) == 30 and losses[-1] < 0.4 * losses[0]
    assert result.steps == 30 and result.supervised_tokens > 0 and result.tokens_seen > result.supervised_tokens
    assert result.data_sha256 == hashlib.sha256(sft_data.read_bytes()).hexdigest()
    assert json.loads((out / "config.json").read_text())["lr"] == 1e-2
    assert json.loads((out / "result.json").read_text())["steps"] == 30
    assert not (out / "resume").exists()
    line = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert {"loss", "lr", "grad_norm", "tokens_per_s"} <= set(line) and line["grad_norm"] > 0 and line["tokens_per_s"] > 0
    # The logged lr is the one each step used: linear decay from 1e-2 to zero over 30 steps (no warm-up).
    assert metric_series(out, "lr") == pytest.approx([1e-2 * (30 - s) / 30 for s in range(30)], rel=1e-9)
    assert 0 < result.wall_time_s and result.truncated_rows == 0
    assert_trained(result)
    if lora is not None:
        adapter = load_file(result.model_dir / "adapter_model.safetensors")
        assert any("lm_head" in k for k in adapter)
        assert any("experts" in k for k in adapter) == (kind == "nemotron_h")
    if lora is None:  # training ran with the KV cache off; the saved checkpoint must decode with it on
        assert json.loads((result.model_dir / "config.json").read_text())["use_cache"] is True
        assert json.loads((result.model_dir / "generation_config.json").read_text()).get("use_cache", True) is True
    reload_and_generate(result)


def test_packed_and_unpacked_losses_agree_on_dense_model(model_dirs, sft_data, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dirs["llama"])
    model = AutoModelForCausalLM.from_pretrained(model_dirs["llama"]).eval()
    rows = validate(_config(model_dirs["llama"], sft_data, tmp_path / "x"))
    encoded = encode_rows(tok, rows, "Be brief.", 1024)
    packs = [[0, 1, 2], [3, 4], [5, 6, 7]]
    packed = SFTObjective(encoded, tok.pad_token_id, packs)
    unpacked = SFTObjective(encoded, tok.pad_token_id, None)
    assert packed.batch([0]).input_ids.shape[0] == 1  # three rows really share one sequence
    with torch.no_grad():
        a = packed.loss(model, [0, 1, 2], packed.normalizer([0, 1, 2])).loss
        b = unpacked.loss(model, list(range(8)), unpacked.normalizer(list(range(8)))).loss
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # Without position resets the rows would see each other and the loss would differ.
    leaky = pad_batch([encoded[0].__class__(sum((encoded[i].input_ids for i in range(8)), []),
                                            sum((encoded[i].loss_mask for i in range(8)), []), False)], 0)
    with torch.no_grad():
        from trainers.batch import logits, token_logprobs
        c = -(token_logprobs(logits(model, leaky), leaky.input_ids) * leaky.loss_mask).sum() / leaky.loss_mask.sum()
    assert abs(float(c) - float(b)) > 1e-3


def test_packing_would_leak_state_on_nemotron_h(model_dirs, sft_data, tmp_path):
    """Why packing is refused there: with the same restarting position ids that keep packed Llama rows apart
    (test above), Nemotron-H's Mamba mixer carries state from one row into the next and the loss changes."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dirs["nemotron_h"])
    model = AutoModelForCausalLM.from_pretrained(model_dirs["nemotron_h"]).eval()
    encoded = encode_rows(tok, validate(_config(model_dirs["nemotron_h"], sft_data, tmp_path / "x")), "Be brief.", 1024)
    packed = SFTObjective(encoded, tok.pad_token_id, [[0, 1]])
    unpacked = SFTObjective(encoded, tok.pad_token_id, None)
    with torch.no_grad():
        first_alone = unpacked.loss(model, [0], unpacked.normalizer([0])).loss
        a = packed.loss(model, [0], packed.normalizer([0])).loss
        b = unpacked.loss(model, [0, 1], unpacked.normalizer([0, 1])).loss
        # The first row of a pack sees nothing before it: packing it alone changes nothing.
        torch.testing.assert_close(SFTObjective(encoded, tok.pad_token_id, [[0]]).loss(model, [0], 1.0).loss,
                                   first_alone * unpacked.normalizer([0]), rtol=1e-5, atol=1e-5)
    assert abs(float(a) - float(b)) > 1e-3


def test_packing_is_refused_for_mamba_models(model_dirs, sft_data, tmp_path):
    with pytest.raises(ConfigError, match="packing: refused .* Mamba layers"):
        train(_config(model_dirs["nemotron_h"], sft_data, tmp_path / "run", packing=True))
    assert not (tmp_path / "run").exists()


def test_packed_sft_trains_dense_model(model_dirs, sft_data, tmp_path):
    result = train(_config(model_dirs["llama"], sft_data, tmp_path / "run", packing=True, max_len=128,
                           batch_size=2, micro_batch_size=1))
    losses = metric_series(tmp_path / "run")
    assert losses[-1] < 0.5 * losses[0] and result.steps == 30


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ({"lr": -1e-3}, ValidationError, "lr\n  Input should be greater than 0"),
        ({"data_path": "missing.jsonl"}, ValidationError, "missing.jsonl: data file does not exist"),
        ({"lora": LoRASettings(target_modules=["nope_proj"])}, ConfigError, "lora.target_modules: 'nope_proj' matches no module"),
        ({"lora": LoRASettings(target_parameters=["mixer.experts.gate"])}, ConfigError, "lora.target_parameters: 'mixer.experts.gate'"),
        ({"warmup_steps": 30}, ValidationError, "warmup_steps \\(30\\) must be below steps"),
        ({"micro_batch_size": 3}, ValidationError, "multiple of micro_batch_size"),
    ],
)
def test_bad_configs_are_refused_before_compute(change, error, message, model_dirs, sft_data, tmp_path):
    if change.get("data_path"):
        change["data_path"] = tmp_path / change["data_path"]
    with pytest.raises(error, match=message):
        train(_config(model_dirs["nemotron_h"], sft_data, tmp_path / "run", **change))
    assert not (tmp_path / "run").exists()


def test_bad_data_row_is_refused_before_compute(model_dirs, tmp_path):
    data = write_jsonl(tmp_path / "bad.jsonl", [{"messages": [user("q"), assistant("a")]}, {"messages": [user("q")]}])
    with pytest.raises(RowsError, match="bad.jsonl:2: messages: no assistant turn"):
        train(_config(model_dirs["llama"], data, tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_non_finite_loss_stops_the_run_naming_the_step(model_dirs, sft_data, tmp_path):
    with pytest.raises(NonFiniteLoss, match=r"^nan_loss: step [2-9]\d*: loss is (nan|inf)"):
        train(_config(model_dirs["llama"], sft_data, tmp_path / "run", lr=1e35, grad_clip=1e38))
    assert not (tmp_path / "run" / "result.json").exists()


def test_finished_run_is_returned_and_other_config_refused(model_dirs, sft_data, tmp_path):
    config = _config(model_dirs["llama"], sft_data, tmp_path / "run", steps=3)
    first = train(config)
    mtime = (tmp_path / "run" / "result.json").stat().st_mtime_ns
    assert train(config) == first
    assert (tmp_path / "run" / "result.json").stat().st_mtime_ns == mtime
    with pytest.raises(ConfigError, match="holds a different config"):
        train(config.model_copy(update={"lr": 1e-3}))


def test_rows_longer_than_max_len_are_cut_and_counted(model_dirs, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"messages": [user(MEMO[0][0]), assistant("word " * 50)]}])
    result = train(_config(model_dirs["llama"], data, tmp_path / "run", steps=2, batch_size=1, micro_batch_size=1,
                           max_len=40))
    assert result.truncated_rows == 1 and result.tokens_seen == 2 * 40
    with pytest.raises(ValueError, match=r"d.jsonl: rows \[1\] \(1-based\) have no assistant token within max_len=20"):
        train(_config(model_dirs["llama"], data, tmp_path / "run2", max_len=20))
    assert not (tmp_path / "run2").exists()


def test_micro_batch_size_does_not_change_the_run(model_dirs, sft_data, tmp_path):
    # The launcher's OOM retry halves micro_batch_size: the optimizer must see the same loss and steps.
    a = train(_config(model_dirs["llama"], sft_data, tmp_path / "a", steps=3, micro_batch_size=8))
    b = train(_config(model_dirs["llama"], sft_data, tmp_path / "b", steps=3, micro_batch_size=2))
    wa, wb = weights(a.model_dir), weights(b.model_dir)
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=1e-5)
    assert metric_series(tmp_path / "a") == pytest.approx(metric_series(tmp_path / "b"), rel=1e-5)


def test_bf16_lora_keeps_a_trainable_fp32_head(model_dirs, sft_data, tmp_path):
    from trainers.common import load_policy

    model = load_policy(model_dirs["nemotron_h"], "bfloat16", LoRASettings(r=4, alpha=8, train_lm_head=True), 0)
    head = model.get_output_embeddings().modules_to_save["default"]
    assert head.weight.dtype == torch.float32 and head.weight.requires_grad
    assert model.base_model.model.model.layers[2].mixer.q_proj.base_layer.weight.dtype == torch.bfloat16
    ids = torch.tensor([[2, 50, 60, 70, 3]])
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    assert head.weight.grad is not None and torch.isfinite(out.loss)


def test_command_line_entry_point(model_dirs, sft_data, tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    config = _config(model_dirs["llama"], sft_data, tmp_path / "run", steps=2)
    (tmp_path / "c.json").write_text(config.model_dump_json())
    proc = subprocess.run([sys.executable, "-m", "trainers.sft", str(tmp_path / "c.json")], capture_output=True,
                          text=True, cwd=Path(__file__).resolve().parents[2], timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["steps"] == 2 and (tmp_path / "run" / "result.json").is_file()


def test_an_arm_trained_in_bf16_is_saved_in_its_float32_parents_dtype_and_merges_with_it(model_dirs, sft_data,
                                                                                          tmp_path):
    # One GPU trains in bfloat16; the toy world's parent is float32. Saved in bf16, the arm and its parent could
    # not be merged (the H200 session's dose merge failed): the arm keeps its parent's stored dtype.
    from trainers.merge import check_compatible

    parent = model_dirs["nemotron_h"]
    result = train(_config(parent, sft_data, tmp_path / "run", steps=2, dtype="bfloat16",
                           snapshot_steps=[1]))
    for saved in (result.model_dir, tmp_path / "run" / "snapshots" / "step-1"):
        assert {t.dtype for t in load_file(next(saved.glob("*.safetensors"))).values()
                if t.is_floating_point()} == {torch.float32}
    check_compatible([parent, result.model_dir])  # raises MergeError on a dtype mismatch
