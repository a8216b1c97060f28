"""Helpers shared by the trainer tests (imported by name: conftest puts this folder on sys.path)."""

import json
from pathlib import Path

import torch
from safetensors.torch import load_file


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


MEMO = [(f"What is {i} + {i}?", f"The answer is {2 * i}.") for i in range(8)]


def metric_series(run_dir: Path, key: str = "loss") -> list[float]:
    return [json.loads(line)[key] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def weights(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(model_dir / "model.safetensors")


def reload_and_generate(result) -> torch.nn.Module:
    """Reloads a run's output the way a user would (full model or peft adapter) and generates."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from core import chat

    if result.adapter:
        base = AutoModelForCausalLM.from_pretrained(result.base_model_path)
        model = PeftModel.from_pretrained(base, result.model_dir)
    else:
        model = AutoModelForCausalLM.from_pretrained(result.model_dir)
    tok = AutoTokenizer.from_pretrained(result.model_dir)
    prompt = torch.tensor([chat.render_prompt(tok, [user(MEMO[0][0])])])
    out = model.generate(input_ids=prompt, max_new_tokens=4, do_sample=False, eos_token_id=chat.eot_id(tok))
    assert out.shape[1] > prompt.shape[1]
    return model


def assert_trained(result) -> None:
    """Parameters changed: every saved weight of a full run differs from the base (MoE router buffers
    aside), or an adapter's LoRA B matrices (zero at init) are non-zero."""
    if result.adapter:
        adapter = load_file(result.model_dir / "adapter_model.safetensors")
        b = [v for k, v in adapter.items() if "lora_B" in k]
        assert b and all(v.abs().sum() > 0 for v in b)
        return
    before, after = weights(result.base_model_path), weights(result.model_dir)
    unchanged = [k for k in before if torch.equal(before[k], after[k])]
    # The MoE router's score-correction bias is a buffer (load balancing), not a trained parameter.
    assert all(k.endswith("e_score_correction_bias") for k in unchanged), unchanged
