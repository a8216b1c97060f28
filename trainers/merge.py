"""Weight merges: LoRA merge-back, linear soups and dose interpolation, streamed across safetensors shards.

- `merge_lora(LoRAMergeConfig)`: base + peft adapter -> full weights (peft `merge_and_unload`).
- `soup(SoupConfig)`: sum_i w_i * theta_i with weights summing to 1 (Wortsman et al. 2022, "Model
  soups", uniform/weighted soup).
- `dose(DoseConfig)`: a + alpha * (b - a), alpha may lie outside [0, 1] (extrapolation past b or
  back beyond a; the task-vector arithmetic of Ilharco et al. 2023, "Editing Models with Task
  Arithmetic"). alpha = 0 and alpha = 1 return a and b bit-exactly.

Soups and doses stream: tensors are read in chunks of a few MiB with plain file reads (no memory map
keeps pages resident), combined in FP32 scratch, cast back to their dtype and written shard by shard in
the layout of the first model, each shard hashed as it is written; so peak memory stays a few chunks per
shard in flight, not shards or models (bench/merge_throughput.py measures it against a plain copy). Key sets, shapes and dtypes are compared for all
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

import hashlib
import json
import math
import os
import shutil
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import NamedTuple

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from safetensors import safe_open

from trainers.common import weights_sha256, write_weights_manifest

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


# Elements per streamed chunk: 1 MiB of FP32 scratch, so the several elementwise passes of a combine
# (convert, scale, add, cast back) run in cache instead of each going out to memory (2-3x faster than
# 16 MiB chunks on a 2-core host), while reads and writes stay large; memory is a few chunks per shard.
CHUNK_ELEMENTS = 1 << 18
# Output shards written at once: each has its own sha256 (a sequential hash runs near 2 GB/s on one core),
# so several shards in flight keep hashing and page-cache writes off the critical path.
MAX_WORKERS = 4
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}

# combine(input chunks, output chunk, fp32 scratch, fp32 scratch): writes the merged chunk into the output.
Combine = Callable[[list[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor], None]


class _Entry(NamedTuple):
    """One tensor of a safetensors file: dtype name, shape, absolute byte range in the file."""

    dtype: str
    shape: list[int]
    start: int
    end: int


def read_header(path: Path) -> dict[str, _Entry]:
    """The safetensors header (u64 little-endian length, then JSON) with offsets made absolute."""
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
    base = 8 + length
    return {k: _Entry(v["dtype"], v["shape"], base + v["data_offsets"][0], base + v["data_offsets"][1])
            for k, v in header.items() if k != "__metadata__"}


def _header_bytes(keys: list[str], entries: dict[str, _Entry]) -> bytes:
    """A safetensors header laying `keys` out back to back; padded so the data starts 8-byte aligned."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for k in keys:
        size = entries[k].end - entries[k].start
        header[k] = {"dtype": entries[k].dtype, "shape": entries[k].shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


def _pread(fd: int, path: Path, buf: torch.Tensor, offset: int) -> torch.Tensor:
    """Fills the uint8 tensor `buf` from the file at `offset`: a plain read, so no mapped page stays resident."""
    view, done = memoryview(buf.numpy()), 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise MergeError(f"{path}: file ends inside a tensor (byte {offset + done})")
        done += got
    return buf


def _dtype(path: Path, name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise MergeError(f"{path}: dtype {name} is not supported by merges (expected one of {sorted(_DTYPES)})")
    return _DTYPES[name]


def _write_shard(out_path: Path, keys: list[str], sources: list[dict[str, tuple[Path, _Entry]]],
                 combine: Combine) -> str:
    """Writes one output shard chunk by chunk; returns its sha256, hashed from the bytes as they are written."""
    ref = {k: sources[0][k][1] for k in keys}
    dtypes = {k: _dtype(sources[0][k][0], ref[k].dtype) for k in keys}
    width = max((d.itemsize for d in dtypes.values()), default=1) * CHUNK_ELEMENTS
    in_bufs = [torch.empty(width, dtype=torch.uint8) for _ in sources]
    out_buf = torch.empty(width, dtype=torch.uint8)
    acc, tmp = torch.empty(CHUNK_ELEMENTS, dtype=torch.float32), torch.empty(CHUNK_ELEMENTS, dtype=torch.float32)
    header = _header_bytes(keys, ref)
    digest = hashlib.sha256(header)
    with ExitStack() as stack, open(out_path, "wb") as out:
        fds: dict[Path, int] = {}
        for path in {src[k][0] for src in sources for k in keys}:
            fds[path] = os.open(path, os.O_RDONLY)
            stack.callback(os.close, fds[path])
        out.write(header)
        for k in keys:
            size = dtypes[k].itemsize
            numel = (ref[k].end - ref[k].start) // size
            for first in range(0, numel, CHUNK_ELEMENTS):
                n = min(CHUNK_ELEMENTS, numel - first)
                chunks = [_pread(fds[path], path, buf[: n * size], entry.start + first * size).view(dtypes[k])
                          for buf, (path, entry) in zip(in_bufs, (src[k] for src in sources), strict=True)]
                combine(chunks, out_buf[: n * size].view(dtypes[k]), acc[:n], tmp[:n])
                view = memoryview(out_buf[: n * size].numpy())
                digest.update(view)
                out.write(view)
    return digest.hexdigest()


def _sources(models: list[Path], maps: list[dict[str, str]]) -> list[dict[str, tuple[Path, _Entry]]]:
    """Per model: tensor name -> (its shard file, its header entry)."""
    out = []
    for model, weight_map in zip(models, maps, strict=True):
        headers = {file: read_header(model / file) for file in set(weight_map.values())}
        out.append({k: (model / file, headers[file][k]) for k, file in weight_map.items()})
    return out


def stream_merge(models: list[Path], combine: Combine, output_dir: Path) -> MergeResult:
    """Writes combine(chunks of all models) for every tensor, shard by shard, then swaps the dir in.

    Inputs are read with plain reads chunk by chunk (no memory maps held open), merged into preallocated
    FP32 scratch, and each output shard is hashed as it is written, so the result's weights_sha256 needs no
    second pass over the output; up to MAX_WORKERS shards are written at once."""
    first_map = check_compatible(models)
    shards = sorted(set(first_map.values()))
    names = {s: f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i, s in enumerate(shards)}
    tmp = output_dir.with_name(output_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    sources = _sources(models, [shard_map(m) for m in models])
    jobs = {names[s]: sorted(k for k, v in first_map.items() if v == s) for s in shards}
    try:
        with ThreadPoolExecutor(max_workers=min(MAX_WORKERS, len(jobs))) as pool:
            futures = {name: pool.submit(_write_shard, tmp / name, keys, sources, combine) for name, keys in jobs.items()}
            shard_sha = {name: f.result() for name, f in futures.items()}
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    total = sum(e.end - e.start for _, e in sources[0].values())
    index = {"metadata": {"total_size": total}, "weight_map": {k: names[s] for k, s in sorted(first_map.items())}}
    (tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    _copy_side_files(models[0], tmp)
    # The digests taken while writing become the output's weights manifest (replacing the first model's, which
    # the side files brought along), so neither this result nor a later weights_sha256 re-reads the shards.
    digest = write_weights_manifest(tmp, shard_sha)
    tmp.rename(output_dir)
    return MergeResult(output_dir=output_dir, tensors=len(first_map), shards=len(shards), weights_sha256=digest)


def _soup_combine(weights: list[float]) -> Combine:
    def combine(chunks: list[torch.Tensor], out: torch.Tensor, acc: torch.Tensor, tmp: torch.Tensor) -> None:
        # sum_i w_i * float(t_i) with each product rounded to FP32 before the sum, as `acc += w * t.float()`
        # would do, but in place: no FP32 temporaries per tensor.
        acc.copy_(chunks[0]).mul_(weights[0])
        for w, t in zip(weights[1:], chunks[1:], strict=True):
            acc.add_(tmp.copy_(t).mul_(w))
        out.copy_(acc)

    return combine


def _dose_combine(alpha: float) -> Combine:
    def combine(chunks: list[torch.Tensor], out: torch.Tensor, acc: torch.Tensor, tmp: torch.Tensor) -> None:
        a, b = chunks
        # The endpoints are returned as stored: a + 0*(b-a) would turn -0.0 into +0.0, and
        # a + 1*(b-a) can round away from b, so "alpha=0 is a" would not hold bit for bit.
        if alpha == 0:
            out.copy_(a)
        elif alpha == 1:
            out.copy_(b)
        else:  # float(a) + alpha * (float(b) - float(a)), each step rounded to FP32, then cast back
            acc.copy_(a)
            out.copy_(tmp.copy_(b).sub_(acc).mul_(alpha).add_(acc))

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
