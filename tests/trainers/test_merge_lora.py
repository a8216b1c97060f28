"""Streamed LoRA merge-back against peft's own merge_and_unload: float32 and bfloat16 storage, Nemotron-H (renamed
keys, routed experts stacked from per-expert tensors, an FP32 lm_head copy), sharded and chunked; soupable output;
refusals before anything is written."""

import json
import shutil

import pytest
import torch
from peft import PeftModel
from trainer_testkit import MEMO, assistant, user, write_jsonl
from transformers import AutoModelForCausalLM

from trainers import merge
from trainers.common import WEIGHTS_MANIFEST, LoRASettings, weights_sha256
from trainers.merge import (
    INDEX,
    LoRAMergeConfig,
    MergeError,
    SoupConfig,
    merge_lora,
    read_header,
    shard_map,
    soup,
)
from trainers.sft import SFTConfig, train

EPS32, EPS_BF16 = torch.finfo(torch.float32).eps, torch.finfo(torch.bfloat16).eps
RANK = 4


@pytest.fixture(scope="module")
def lora_run(model_dirs, tmp_path_factory):
    """A Nemotron-H base saved in many small shards (experts of one layer across shards), and a LoRA adapter over
    it trained by the project's SFT: attention, Mamba in_proj, MLP and routed-expert targets, and an FP32 head."""
    root = tmp_path_factory.mktemp("lora_merge")
    base = root / "base"
    AutoModelForCausalLM.from_pretrained(model_dirs["nemotron_h"]).save_pretrained(base, max_shard_size="40KB")
    for f in model_dirs["nemotron_h"].iterdir():
        if not f.name.endswith("safetensors") and not (base / f.name).exists():
            shutil.copy(f, base / f.name)
    assert len(set(shard_map(base).values())) > 3
    data = write_jsonl(root / "sft.jsonl", [{"messages": [user(q), assistant(a)]} for q, a in MEMO])
    run = train(SFTConfig(model_path=base, data_path=data, output_dir=root / "run", lr=1e-2, steps=2, batch_size=8,
                          micro_batch_size=8, lora=LoRASettings(r=RANK, alpha=8, train_lm_head=True)))
    return base, run.model_dir


def _bf16_copy(src, dst):
    AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).save_pretrained(dst, max_shard_size="40KB")
    for f in src.iterdir():
        if not f.name.endswith(("safetensors", INDEX)) and not (dst / f.name).exists():
            shutil.copy(f, dst / f.name)
    return dst


def _peft_merged(base, adapter, dtype=torch.float32) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype)
    return PeftModel.from_pretrained(model, adapter).merge_and_unload().state_dict()


def _abs_update(base, adapter) -> dict[str, torch.Tensor]:
    """s * |B| @ |A| per parameter, in the runtime layout: peft's own merge of the factors' absolute values into
    zeroed weights (the magnitude that bounds the rounding of a length-r dot product)."""
    model = AutoModelForCausalLM.from_pretrained(base)
    for p in model.parameters():
        p.data.zero_()
    wrapped = PeftModel.from_pretrained(model, adapter)
    for name, p in wrapped.named_parameters():
        if "lora_" in name:
            p.data.abs_()
    return {k: v.abs() for k, v in wrapped.merge_and_unload().state_dict().items()}


def _within(got, expected, bound, what):
    excess = ((got.float() - expected.float()).abs() - bound).max()
    assert excess <= 0, f"{what}: exceeds its bound by {float(excess)}"


def _assert_matches_peft(base, adapter, merged, rank) -> list[str]:
    """Our merged weights against peft's merge_and_unload of the same base and adapter; returns the changed keys."""
    ours = AutoModelForCausalLM.from_pretrained(merged).state_dict()
    expected, before = _peft_merged(base, adapter), AutoModelForCausalLM.from_pretrained(base).state_dict()
    magnitude = _abs_update(base, adapter)
    assert ours.keys() == expected.keys()
    for k in expected:
        # Both sides compute fl(W + fl(s * fl(B @ A))) in float32; only the order of the length-r dot product may
        # differ (a row slice against the whole matrix): each side is within gamma_r * s|B||A| of the exact
        # product, plus one rounding of the product by s and of the sum, so
        # |ours - peft| <= (2r + 2) eps s|B||A| + 2 eps |W + dW| (Higham, Accuracy and Stability, 2nd ed., 3.1).
        bound = EPS32 * ((2 * rank + 2) * magnitude[k] + 2 * expected[k].abs())
        _within(ours[k], expected[k], bound, k)
    # The layout is the base's: same stored names, shapes and dtypes.
    assert {k: (e.shape, e.dtype) for k, e in _entries(merged).items()} == \
        {k: (e.shape, e.dtype) for k, e in _entries(base).items()}
    return [k for k in expected if not torch.equal(expected[k], before[k])]


def test_float32_merge_equals_peft_merge_and_unload(lora_run, tmp_path, monkeypatch):
    base, adapter = lora_run
    # Chunks of 100 elements: rows of 64 straddle chunks, each expert tensor spans 41 of them.
    monkeypatch.setattr(merge, "CHUNK_ELEMENTS", 100)
    result = merge_lora(LoRAMergeConfig(base=base, adapter=adapter, output_dir=tmp_path / "merged"))
    changed = _assert_matches_peft(base, adapter, result.output_dir, RANK)
    assert any(".experts." in k for k in changed) and "lm_head.weight" in changed and len(changed) >= 10
    assert result.shards == len(set(shard_map(base).values()))


def test_3d_experts_stored_transposed_equal_peft(tmp_path, monkeypatch):
    """GPT-OSS stores its experts as 3-D (experts, in, out) tensors (`is_transposed`): each stored tensor takes all
    experts' blocks, transposed. An untrained adapter with random B (init_lora_weights=False) moves every target."""
    from peft import LoraConfig, get_peft_model
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    config = GptOssConfig(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                          num_experts_per_tok=2, layer_types=["full_attention"] * 2)
    model = GptOssForCausalLM(config)
    model.save_pretrained(tmp_path / "base")
    get_peft_model(model, LoraConfig(r=2, lora_alpha=4, init_lora_weights=False, target_modules=["q_proj"],
                                     target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                                     )).save_pretrained(tmp_path / "adapter")
    assert _entries(tmp_path / "base")["model.layers.0.mlp.experts.gate_up_proj"].shape == [4, 32, 96]
    monkeypatch.setattr(merge, "CHUNK_ELEMENTS", 100)  # rows of 96 and expert blocks of 3072 straddle chunks
    result = merge_lora(LoRAMergeConfig(base=tmp_path / "base", adapter=tmp_path / "adapter",
                                        output_dir=tmp_path / "merged"))
    changed = _assert_matches_peft(tmp_path / "base", tmp_path / "adapter", result.output_dir, 2)
    assert sorted(k.split(".", 3)[-1] for k in changed) == sorted(
        ["mlp.experts.down_proj", "mlp.experts.gate_up_proj", "self_attn.q_proj.weight"] * 2)


def _entries(model_dir):
    return {k: e for f in set(shard_map(model_dir).values()) for k, e in read_header(model_dir / f).items()}


def test_bfloat16_merge_is_the_float32_formula_cast_back(lora_run, tmp_path):
    base, adapter = lora_run
    half = _bf16_copy(base, tmp_path / "half")
    result = merge_lora(LoRAMergeConfig(base=half, adapter=adapter, output_dir=tmp_path / "merged"))
    stored = {k: e.dtype for k, e in _entries(half).items()}
    assert {k: e.dtype for k, e in _entries(result.output_dir).items()} == stored  # stored dtypes kept
    assert stored["backbone.layers.1.mixer.experts.3.up_proj.weight"] == "BF16"
    ours = AutoModelForCausalLM.from_pretrained(result.output_dir, dtype=torch.bfloat16).state_dict()
    # The bf16 weights upcast exactly, so peft's float32 merge of them is our float32 sum before the cast:
    # ours = rnd_bf16(that), within half a bf16 ulp of it plus the float32 bound above.
    exact = _peft_merged(half, adapter, torch.float32)
    magnitude = _abs_update(half, adapter)
    peft_bf16 = _peft_merged(half, adapter, torch.bfloat16)
    differ = 0
    for k, v in ours.items():
        fp32_bound = EPS32 * ((2 * RANK + 2) * magnitude[k] + 2 * exact[k].abs())
        _within(v, exact[k], EPS_BF16 / 2 * exact[k].abs() + fp32_bound, k)
        # peft's bf16 merge adds the delta in float32 for Linear layers, but rounds a 3-D (expert) delta to bf16
        # before adding it: rnd(W + rnd(dW)) against our rnd(W + dW) differ by the two final roundings
        # (u |result| each) and the delta's rounding (u |dW| <= u s|B||A|, which cancellation in W + dW can
        # make larger than an ulp of the result), u = eps / 2.
        bound = EPS_BF16 * (peft_bf16[k].float().abs() + magnitude[k] / 2) + fp32_bound
        _within(v, peft_bf16[k], bound, k)
        differ += int((v != peft_bf16[k]).sum())
    assert differ > 0  # the double rounding of the expert deltas is real: the float32 path matters here


def test_merged_model_loads_matches_the_adapter_and_soups(lora_run, tmp_path):
    base, adapter = lora_run
    result = merge_lora(LoRAMergeConfig(base=base, adapter=adapter, output_dir=tmp_path / "merged"))
    ids = torch.randint(4, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model = AutoModelForCausalLM.from_pretrained(base)
        plain = model(ids).logits
        expected = PeftModel.from_pretrained(model, adapter).eval()(ids).logits
        got = AutoModelForCausalLM.from_pretrained(result.output_dir).eval()(ids).logits
    assert (expected - plain).abs().max() > 1e-3  # the adapter really changes the output
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    # Side files: the adapter's tokenizer and chat template, no adapter config or adapter model card.
    names = {f.name for f in result.output_dir.iterdir()}
    assert {"config.json", "tokenizer.json", "chat_template.jinja", INDEX, WEIGHTS_MANIFEST} <= names
    assert not names & {"adapter_config.json", "README.md", "adapter_model.safetensors"}
    # The manifest is the digest taken while writing, the one the bytes give.
    (result.output_dir / WEIGHTS_MANIFEST).rename(tmp_path / "manifest")
    assert weights_sha256(result.output_dir) == result.weights_sha256
    (tmp_path / "manifest").rename(result.output_dir / WEIGHTS_MANIFEST)
    assert json.loads((result.output_dir / WEIGHTS_MANIFEST).read_text())["weights_sha256"] == result.weights_sha256
    # A sibling of the base: a soup of the two checks as compatible and loads.
    souped = soup(SoupConfig(models=[result.output_dir, base], weights=[0.5, 0.5], output_dir=tmp_path / "soup"))
    AutoModelForCausalLM.from_pretrained(souped.output_dir)


def _adapter_copy(adapter, dst, config_edit=None, drop=None):
    from safetensors.torch import load_file, save_file

    shutil.copytree(adapter, dst)
    if config_edit:
        cfg = json.loads((dst / "adapter_config.json").read_text()) | config_edit
        (dst / "adapter_config.json").write_text(json.dumps(cfg))
    if drop:
        tensors = load_file(dst / "adapter_model.safetensors")
        save_file({k: v for k, v in tensors.items() if drop not in k}, dst / "adapter_model.safetensors")
    return dst


def test_refusals_name_the_problem_and_write_nothing(lora_run, model_dirs, tmp_path):
    base, adapter = lora_run
    out = tmp_path / "out"
    cases = [
        (base, _adapter_copy(adapter, tmp_path / "dora", {"use_dora": True}), r"adapter_config.json: field use_dora"),
        (base, _adapter_copy(adapter, tmp_path / "ia3", {"peft_type": "IA3"}), r"field peft_type: expected 'LORA'"),
        (base, _adapter_copy(adapter, tmp_path / "drop", drop="layers.2.mixer.q_proj.lora_B"),
         r"adapter_model.safetensors: tensors differ .*missing \['base_model.model.model.layers.2.mixer.q_proj"),
        (model_dirs["llama"], adapter, r"tensors differ from what adapter_config.json gives for this base"),
    ]
    for b, a, message in cases:
        with pytest.raises(MergeError, match=message):
            merge_lora(LoRAMergeConfig(base=b, adapter=a, output_dir=out))
        assert not out.exists() and not (tmp_path / "out.partial").exists()


def test_the_merge_tool_runs_the_streamed_merge(lora_run, tmp_path):
    from tools import merge as merge_tool

    base, adapter = lora_run
    args = merge_tool.Args(method="lora", models=[1, 2])
    fn, config = merge_tool._job(args, [base, adapter], tmp_path / "merged")
    assert fn is merge_lora and isinstance(config, LoRAMergeConfig)
    result = fn(config)
    assert result.shards == len(set(shard_map(base).values()))  # streamed in the base's layout, not re-saved
