"""The offline tokenizer and tiny models: deterministic, reloadable, generating."""

import hashlib

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from core import chat, tiny


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_tokenizer_is_deterministic_and_has_chat_tokens(tmp_path, tokenizer_dir):
    again = tiny.build_tokenizer(tmp_path / "again")
    assert _sha(again / "tokenizer.json") == _sha(tokenizer_dir / "tokenizer.json")
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert tok.convert_tokens_to_ids(list(chat.SPECIAL_TOKENS)) == [0, 1, 2, 3]
    assert tok.eos_token == chat.EOT_TOKEN and tok.pad_token == chat.PAD_TOKEN
    assert 500 <= len(tok) <= 2048
    text = 'What is 12 + 30? "x" -> 42.\n'
    assert tok.decode(tok(text)["input_ids"]) == text


def test_models_are_deterministic(tmp_path, tokenizer_dir, model_dirs):
    again = tiny.build_model("llama", tokenizer_dir, tmp_path / "llama", seed=0)
    assert _sha(again / "model.safetensors") == _sha(model_dirs["llama"] / "model.safetensors")
    other = tiny.build_model("llama", tokenizer_dir, tmp_path / "llama1", seed=1)
    assert _sha(other / "model.safetensors") != _sha(model_dirs["llama"] / "model.safetensors")


@pytest.mark.parametrize("kind", tiny.MODEL_KINDS)
def test_model_reloads_and_generates(kind, model_dirs):
    path = model_dirs[kind]
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert model.config.model_type == kind
    prompt = torch.tensor([chat.render_prompt(tok, [{"role": "user", "content": "What is 2 + 2?"}])])
    out = model.generate(prompt, max_new_tokens=6, do_sample=False)
    assert out.shape[1] > prompt.shape[1]
    assert model.generation_config.eos_token_id == chat.stop_ids(tok)  # derived from the template and tokenizer


def test_nemotron_h_has_every_block_type(model_dirs):
    model = AutoModelForCausalLM.from_pretrained(model_dirs["nemotron_h"])
    assert model.config.layers_block_type == ["linear_attention", "moe", "full_attention", "mlp"]
    names = {n for n, _ in model.named_parameters()}
    assert any("mixer.experts.up_proj" in n for n in names) and any("mixer.in_proj" in n for n in names)


def test_unknown_kind_is_refused(tmp_path, tokenizer_dir):
    with pytest.raises(ValueError, match="kind 'gpt2' is not one of"):
        tiny.build_model("gpt2", tokenizer_dir, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_reward_model_scores(tmp_path, tokenizer_dir):
    path = tiny.build_reward_model(tokenizer_dir, tmp_path / "rm")
    model = AutoModelForSequenceClassification.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    batch = tok(["hello there", "What is 2 + 2? 4"], return_tensors="pt", padding=True)
    assert model(**batch).logits.shape == (2, 1)
