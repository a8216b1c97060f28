"""Weight merges: LoRA merge-back, linear soups and dose interpolation, streamed across safetensors shards.

- `merge_lora(LoRAMergeConfig)`: base + peft adapter -> full weights (peft `merge_and_unload`).
- `soup(SoupConfig)`: sum_i w_i * theta_i with weights summing to 1 (Wortsman et al. 2022, "Model
  soups", uniform/weighted soup).
- `dose(DoseConfig)`: a + alpha * (b - a), alpha may lie outside [0, 1] (extrapolation past b or
  back beyond a; the task-vector arithmetic of Ilharco et al. 2023, "Editing Models with Task
  Arithmetic"). alpha = 0 and alpha = 1 return a and b bit-exactly.

Soups and doses stream: tensors are read one at a time through safetensors' memory map, combined in
FP32, cast back to their dtype and written shard by shard in the layout of the first model, so peak
memory stays near one output shard, not two models. Key sets, shapes and dtypes are compared for all
inputs before anything is written; the output is built in a temporary directory and renamed into
place, with config and tokenizer files copied from the first model and a fresh shard index.

Why in-house: peft's `add_weighted_adapter` and mergekit-style tools load whole models; a plain
streamed loop is short and keeps the memory bound.

Commands:

    .venv/bin/python -m trainers.merge lora CONFIG.json
    .venv/bin/python -m trainers.merge soup CONFIG.json
    .venv/bin/python -m trainers.merge dose CONFIG.json
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from safetensors import safe_open
from safetensors.torch import save_file

from trainers.common import weights_sha256

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class MergeError(ValueError):
    """Inputs that cannot be merged (mismatched keys, shapes, dtypes, architectures)."""


def _model_dir(v: Path) -> Path:
    if not (v / "config.json").is_file():
        raise ValueError(f"{v}: no config.json (expected a local model directory)")
    if not (v / INDEX).is_file() and not (v / SINGLE).is_file():
        raise ValueError(f"{v}: no {SINGLE} or {INDEX}")
    return v


def _fresh_output(v: Path) -> Path:
    if v.exists():
        raise ValueError(f"{v}: output directory already exists")
    return v


class SoupConfig(BaseModel):
    """Weighted average of checkpoints of one architecture."""

    model_config = ConfigDict(extra="forbid")
    models: list[Path] = Field(min_length=2, description="Model directories (safetensors, same keys/shapes/dtypes).")
    weights: list[float] = Field(description="One weight per model; they must sum to 1.")
    output_dir: Path = Field(description="Where the souped model is written (must not exist).")

    @field_validator("models")
    @classmethod
    def _models_ok(cls, v: list[Path]) -> list[Path]:
        return [_model_dir(p) for p in v]

    @field_validator("output_dir")
    @classmethod
    def _out_ok(cls, v: Path) -> Path:
        return _fresh_output(v)

    @model_validator(mode="after")
    def _weights(self) -> SoupConfig:
        if len(self.weights) != len(self.models):
            raise ValueError(f"weights: {len(self.weights)} weights for {len(self.models)} models")
        if not math.isclose(sum(self.weights), 1.0, abs_tol=1e-6):
            raise ValueError(f"weights: must sum to 1, got {sum(self.weights)}")
        return self


class DoseConfig(BaseModel):
    """a + alpha * (b - a)."""

    model_config = ConfigDict(extra="forbid")
    a: Path = Field(description="The start model directory (alpha = 0).")
    b: Path = Field(description="The end model directory (alpha = 1).")
    alpha: float = Field(description="Dose; values outside [0, 1] extrapolate.")
    output_dir: Path = Field(description="Where the interpolated model is written (must not exist).")

    @field_validator("a", "b")
    @classmethod
    def _models_ok(cls, v: Path) -> Path:
        return _model_dir(v)

    @field_validator("output_dir")
    @classmethod
    def _out_ok(cls, v: Path) -> Path:
        return _fresh_output(v)

    @field_validator("alpha")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError(f"alpha: must be finite, got {v}")
        return v


class LoRAMergeConfig(BaseModel):
    """Fold a peft LoRA adapter into its base model's weights."""

    model_config = ConfigDict(extra="forbid")
    base: Path = Field(description="The base model directory the adapter was trained on.")
    adapter: Path = Field(description="The peft adapter directory (adapter_config.json, adapter_model.safetensors).")
    output_dir: Path = Field(description="Where the merged full model is written (must not exist).")
    dtype: str = Field("float32", pattern="^(float32|bfloat16)$", description="Dtype the merge is computed and saved in.")

    @field_validator("base")
    @classmethod
    def _base_ok(cls, v: Path) -> Path:
        return _model_dir(v)

    @field_validator("output_dir")
    @classmethod
    def _out_ok(cls, v: Path) -> Path:
        return _fresh_output(v)

    @field_validator("adapter")
    @classmethod
    def _adapter(cls, v: Path) -> Path:
        if not (v / "adapter_config.json").is_file():
            raise ValueError(f"{v}: no adapter_config.json (expected a peft adapter directory)")
        return v


class MergeResult(BaseModel):
    """What a merge wrote."""

    model_config = ConfigDict(extra="forbid")
    output_dir: Path = Field(description="The merged model directory.")
    tensors: int = Field(description="Number of tensors written.")
    shards: int = Field(description="Number of safetensors shards written.")
    weights_sha256: str = Field(description="sha256 over the output shards (names and bytes).")


def shard_map(model_dir: Path) -> dict[str, str]:
    """tensor name -> shard file name, from the index or the single safetensors file."""
    if (model_dir / INDEX).is_file():
        return json.loads((model_dir / INDEX).read_text())["weight_map"]
    with safe_open(model_dir / SINGLE, framework="pt") as f:
        return dict.fromkeys(f.keys(), SINGLE)


def _signature(model_dir: Path, weight_map: dict[str, str]) -> dict[str, tuple[list[int], str]]:
    """tensor name -> (shape, dtype), read from headers only."""
    out = {}
    for shard in sorted(set(weight_map.values())):
        with safe_open(model_dir / shard, framework="pt") as f:
            for key in f.keys():
                sl = f.get_slice(key)
                out[key] = (list(sl.get_shape()), sl.get_dtype())
    return out


def check_compatible(models: list[Path]) -> dict[str, str]:
    """Refuses inputs whose architecture, key sets, shapes or dtypes differ; returns the first's shard map."""
    first_type = json.loads((models[0] / "config.json").read_text()).get("model_type")
    maps = [shard_map(m) for m in models]
    ref = _signature(models[0], maps[0])
    for model, weight_map in zip(models[1:], maps[1:], strict=True):
        model_type = json.loads((model / "config.json").read_text()).get("model_type")
        if model_type != first_type:
            raise MergeError(f"{model}: model_type {model_type!r} differs from {models[0]}'s {first_type!r}")
        sig = _signature(model, weight_map)
        if sig.keys() != ref.keys():
            only = sorted(set(sig) ^ set(ref))[:3]
            raise MergeError(f"{model}: tensor names differ from {models[0]} (e.g. {only})")
        for key, (shape, dtype) in sig.items():
            if (shape, dtype) != ref[key]:
                raise MergeError(f"{model}: tensor {key} is {dtype}{shape}, {models[0]} has {ref[key][1]}{ref[key][0]}")
    return maps[0]


def _copy_side_files(src: Path, dst: Path) -> None:
    """config, generation config, tokenizer, chat template: everything but weights and the index."""
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != INDEX:
            shutil.copy2(f, dst / f.name)


def stream_merge(models: list[Path], combine: Callable[[list[torch.Tensor]], torch.Tensor], output_dir: Path) -> MergeResult:
    """Writes combine(tensors of all models) for every tensor, shard by shard, then swaps the dir in."""
    first_map = check_compatible(models)
    shards = sorted(set(first_map.values()))
    names = {s: f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i, s in enumerate(shards)}
    tmp = output_dir.with_name(output_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    maps = [shard_map(m) for m in models]
    total = 0
    with ExitStack() as stack:
        handles: dict[tuple[int, str], object] = {}

        def read(i: int, key: str) -> torch.Tensor:
            file = maps[i][key]
            if (i, file) not in handles:
                handles[(i, file)] = stack.enter_context(safe_open(models[i] / file, framework="pt"))
            return handles[(i, file)].get_tensor(key)

        for shard in shards:
            keys = [k for k, s in first_map.items() if s == shard]
            out = {k: combine([read(i, k) for i in range(len(models))]).contiguous() for k in keys}
            total += sum(t.numel() * t.element_size() for t in out.values())
            save_file(out, tmp / names[shard], metadata={"format": "pt"})
            del out
    index = {"metadata": {"total_size": total}, "weight_map": {k: names[s] for k, s in sorted(first_map.items())}}
    (tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    _copy_side_files(models[0], tmp)
    tmp.rename(output_dir)
    return MergeResult(output_dir=output_dir, tensors=len(first_map), shards=len(shards),
                       weights_sha256=weights_sha256(output_dir))


def _soup_combine(weights: list[float]) -> Callable[[list[torch.Tensor]], torch.Tensor]:
    def combine(tensors: list[torch.Tensor]) -> torch.Tensor:
        acc = torch.zeros(tensors[0].shape, dtype=torch.float32)
        for w, t in zip(weights, tensors, strict=True):
            acc += w * t.float()
        return acc.to(tensors[0].dtype)

    return combine


def _dose_combine(alpha: float) -> Callable[[list[torch.Tensor]], torch.Tensor]:
    def combine(tensors: list[torch.Tensor]) -> torch.Tensor:
        a, b = tensors
        # The endpoints are returned as stored: a + 0*(b-a) would turn -0.0 into +0.0, and
        # a + 1*(b-a) can round away from b, so "alpha=0 is a" would not hold bit for bit.
        if alpha == 0:
            return a
        if alpha == 1:
            return b
        return (a.float() + alpha * (b.float() - a.float())).to(a.dtype)

    return combine


def soup(config: SoupConfig) -> MergeResult:
    """Streams the weighted average of config.models into config.output_dir."""
    return stream_merge(config.models, _soup_combine(config.weights), config.output_dir)


def dose(config: DoseConfig) -> MergeResult:
    """Streams a + alpha * (b - a) into config.output_dir."""
    return stream_merge([config.a, config.b], _dose_combine(config.alpha), config.output_dir)


def merge_lora(config: LoRAMergeConfig) -> MergeResult:
    """Loads base + adapter, folds the adapter in, and saves full weights with the adapter's tokenizer."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(config.base, dtype=getattr(torch, config.dtype))
    merged = PeftModel.from_pretrained(base, config.adapter).merge_and_unload()
    tmp = config.output_dir.with_name(config.output_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    merged.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(config.adapter).save_pretrained(tmp)
    tmp.rename(config.output_dir)
    weight_map = shard_map(config.output_dir)
    return MergeResult(output_dir=config.output_dir, tensors=len(weight_map), shards=len(set(weight_map.values())),
                       weights_sha256=weights_sha256(config.output_dir))


def main(argv: list[str] | None = None) -> int:
    """`python -m trainers.merge {lora|soup|dose} CONFIG.json`."""
    from core.entry import run_main

    kinds = {"lora": (LoRAMergeConfig, merge_lora), "soup": (SoupConfig, soup), "dose": (DoseConfig, dose)}
    return run_main("python -m trainers.merge", kinds, argv, bad_input=(MergeError,))


if __name__ == "__main__":
    sys.exit(main())
