"""Every trainer refuses bad configs (negative lr, missing data file, LoRA target that does not exist, LoRA
dropout on parameter targets) before any compute: a clear message naming the field, and no run directory."""

import pytest
from pydantic import ValidationError
from trainer_testkit import MEMO, assistant, user, write_jsonl

from evals.synthetic import generate
from trainers import dpo, klce, rft, sft
from trainers.common import ConfigError, LoRASettings


def _data(kind: str, tmp_path):
    if kind == "dpo":
        return write_jsonl(tmp_path / "d.jsonl", [{"prompt": [user(q)], "chosen": a, "rejected": "No."} for q, a in MEMO])
    if kind == "rft":
        path = tmp_path / "d.jsonl"
        path.write_text("".join(t.item.model_dump_json() + "\n" for t in generate("digit_sum", 2, 0)))
        return path
    return write_jsonl(tmp_path / "d.jsonl", [{"messages": [user(q), assistant(a)]} for q, a in MEMO])


TRAINERS = {"sft": (sft.SFTConfig, sft.train), "dpo": (dpo.DPOConfig, dpo.train),
            "klce": (klce.KLCEConfig, klce.train), "rft": (rft.RFTConfig, rft.train)}

BAD = [
    ({"lr": -1e-3}, ValidationError, "lr\n  Input should be greater than 0"),
    ({"data_path": "missing.jsonl"}, ValidationError, "missing.jsonl: data file does not exist"),
    ({"lora": LoRASettings(target_modules=["nope_proj"])}, ConfigError, "lora.target_modules: 'nope_proj' matches no module"),
    ({"lora": LoRASettings(dropout=0.1)}, ConfigError, "lora.dropout: 0.1 cannot apply to target_parameters"),
]


@pytest.mark.parametrize("trainer", TRAINERS)
@pytest.mark.parametrize(("change", "error", "message"), BAD, ids=["lr", "data", "target", "dropout"])
def test_every_trainer_refuses_before_compute(trainer, change, error, message, model_dirs, tmp_path):
    config_type, train = TRAINERS[trainer]
    fields = dict(model_path=model_dirs["nemotron_h"], data_path=_data(trainer, tmp_path), output_dir=tmp_path / "run")
    if "data_path" in change:
        change = {"data_path": tmp_path / change["data_path"]}
    with pytest.raises(error, match=message):
        train(config_type(**(fields | change)))
    assert not (tmp_path / "run").exists()
