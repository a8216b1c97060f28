"""Weight merges: LoRA merge-back, linear soups and dose interpolation, streamed across safetensors shards.

- `merge_lora(LoRAMergeConfig)`: base + peft LoRA adapter -> full weights W + s * B @ A, streamed like the soups:
  each stored tensor read chunk by chunk in its stored dtype, the update added in FP32 and cast back, so the merged
  model has the base's keys, shapes and dtypes (it can be souped with its siblings) and memory stays a few chunks
  plus the LoRA factors of the tensors in flight, never the model (peft's `merge_and_unload` loads all of it).
  It folds plain LoRA on Linear layers and on parameters (routed experts: per-expert tensors stacked at load, or
  3-D tensors in either orientation) and copies peft `modules_to_save` tensors (an FP32-trained lm_head) cast to
  the stored dtype; DoRA, fan_in_fan_out, LoRA biases, trainable tokens and load-time conversions other than
  renaming and expert stacking are refused, by name, before anything is written.
- `soup(SoupConfig)`: sum_i w_i * theta_i with weights summing to 1 (Wortsman et al. 2022, "Model
  soups", uniform/weighted soup).
- `dose(DoseConfig)`: a + alpha * (b - a), alpha may lie outside [0, 1] (extrapolation past b or
  back beyond a; the task-vector arithmetic of Ilharco et al. 2023, "Editing Models with Task
  Arithmetic"). alpha = 0 and alpha = 1 return a and b bit-exactly.

Soups and doses stream: tensors are read in chunks of a few MiB with plain file reads (no memory map
keeps pages resident), combined in FP32 scratch, cast back to their dtype and written shard by shard in
the layout of the first model, each shard hashed as it is written and flushed to disk while the next chunks
are combined; so peak memory stays a few chunks per shard in flight, not shards or models, and the merge runs
at a plain copy's speed (bench/merge_throughput.py measures both). Key sets, shapes and dtypes are compared for
all inputs before anything is written; the output is built in a temporary directory, fsynced and renamed into
place, with config and tokenizer files copied from the first model and a fresh shard index.

Why in-house: peft's `add_weighted_adapter` / `merge_and_unload` and mergekit-style tools load whole models; a
plain streamed loop is short and keeps the memory bound. What the LoRA merge folds in where is still peft's and
transformers' own answer: peft wraps a meta-device copy of the base (no weights) to name every adapter tensor, its
target parameter and its scale, and transformers' load-time key conversion (e.g. Nemotron-H's `backbone.` prefix
and per-expert tensors stacked into one 3-D parameter) maps each target back to the stored tensors.

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
import queue
import shutil
import sys
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import NamedTuple

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from safetensors import safe_open

from core.versions import Versions
from core.wall import Wall
from trainers.common import SAFETENSORS_DTYPES, write_weights_manifest

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# Side files a merge does not carry over: the adapter's own config and peft's adapter model card.
NOT_SIDE_FILES = {INDEX, "adapter_config.json", "README.md"}


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
    """Fold a peft LoRA adapter into its base model's weights (streamed; the output keeps the base's dtypes)."""

    model_config = ConfigDict(extra="forbid")
    base: Path = Field(description="The base model directory the adapter was trained on.")
    adapter: Path = Field(description="The peft adapter directory (adapter_config.json, adapter_model.safetensors).")
    output_dir: Path = Field(description="Where the merged full model is written (must not exist).")

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
        if not (v / ADAPTER_WEIGHTS).is_file():
            raise ValueError(f"{v}: no {ADAPTER_WEIGHTS} (expected a peft adapter saved as safetensors)")
        return v


class MergeResult(BaseModel):
    """What a merge wrote."""

    model_config = ConfigDict(extra="forbid")
    output_dir: Path = Field(description="The merged model directory.")
    tensors: int = Field(description="Number of tensors written.")
    shards: int = Field(description="Number of safetensors shards written.")
    weights_sha256: str = Field(description="sha256 over the output shards (names and bytes).")
    versions: Versions | None = Field(None, description="The versions of torch, transformers, peft, trl and mamba-ssm the job ran with (stamped by the job wrapper, tools/jobs/jobrun.py).")
    wall: Wall | None = Field(None, description="Start-up, work and write-out seconds of the job (core/wall.py; completed by the job wrapper, tools/jobs/jobrun.py).")


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
    """config, generation config, tokenizer, chat template: everything but weights, the index and adapter files."""
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name not in NOT_SIDE_FILES:
            shutil.copy2(f, dst / f.name)


# Elements per streamed chunk: 1 MiB of FP32 scratch, so the several elementwise passes of a combine
# (convert, scale, add, cast back) run in cache instead of each going out to memory (2-3x faster than
# 16 MiB chunks on a 2-core host), while reads and writes stay large; memory is a few chunks per shard.
CHUNK_ELEMENTS = 1 << 18
# Output shards written at once. Each shard has its own sha256, which is sequential (about 1-2 GB/s on one core),
# so shards in flight are what spreads hashing over the cores; each shard's pipeline runs its combining thread, a
# writer and a flusher (see _ShardPipeline).
MAX_WORKERS = max(1, min(8, (os.cpu_count() or 2) // 2))
# Chunk slots per shard in flight between its combining thread and its writer: each holds one chunk of every input
# and of the output, so a shard's memory is PIPELINE_DEPTH chunks.
PIPELINE_DEPTH = 3
# Output bytes a shard's writer lets pile up before its flusher pushes them to disk (fdatasync) while the merge goes
# on. Without it the page cache held the whole output until the caller's final fsync, and that flush ran after all
# the combining instead of beside it (on the GPU machine the final fsync of 4.3 GB took 1.6-2.0 s, more than half
# of a plain copy's time).
FLUSH_BYTES = 64 << 20
_DTYPES = SAFETENSORS_DTYPES

# combine(tensor name, index of the chunk's first element, input chunks, output chunk, fp32 scratch, fp32 scratch):
# writes the merged chunk into the output.
Combine = Callable[[str, int, list[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor], None]


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


class _Chunk(NamedTuple):
    """Elements [first, first + n) of one tensor."""

    key: str
    first: int
    n: int


class _Slot:
    """Reusable buffers for one chunk in flight: one uint8 buffer per input, one for the output, and the chunk."""

    def __init__(self, inputs: int, width: int):
        self.inputs = [torch.empty(width, dtype=torch.uint8) for _ in range(inputs)]
        self.output = torch.empty(width, dtype=torch.uint8)
        self.chunk = _Chunk("", 0, 0)
        self.nbytes = 0


# work(slot, fp32 scratch, fp32 scratch): reads slot.chunk of every input and fills slot.output and slot.nbytes.
Work = Callable[[_Slot, torch.Tensor, torch.Tensor], None]


class _ShardPipeline:
    """One output shard's chunks, in order: the calling thread reads and combines each into one of PIPELINE_DEPTH
    reusable slots; a writer thread hashes it (the shard's sha256) and appends it; a flusher thread pushes what was
    written to disk every FLUSH_BYTES (fdatasync). Combining, hashing and writing, and the disk overlap, so a shard
    takes its slowest stage's time, not the sum; the output is fsynced before `run` returns.

    An error of the writer or the flusher is kept, stops the combining at its next slot and is raised by `run`; an
    error while combining stops the writer and the flusher before it propagates, so no thread is left waiting."""

    def __init__(self, out, digest, inputs: int, width: int):
        self.out, self.digest = out, digest
        self.error: BaseException | None = None
        self.free: queue.Queue = queue.Queue()
        for _ in range(PIPELINE_DEPTH):
            self.free.put(_Slot(inputs, width))
        self.filled: queue.Queue = queue.Queue()
        self.unflushed, self.closing = 0, False
        self.flush_wanted = threading.Event()

    def run(self, plan: list[_Chunk], work: Work) -> None:
        threads = [threading.Thread(target=fn, daemon=True) for fn in (self._write_all, self._flush_loop)]
        for t in threads:
            t.start()
        acc, tmp = torch.empty(CHUNK_ELEMENTS, dtype=torch.float32), torch.empty(CHUNK_ELEMENTS, dtype=torch.float32)
        try:
            for chunk in plan:
                slot = self.free.get()
                if self.error is not None:
                    break
                slot.chunk = chunk
                work(slot, acc, tmp)
                self.filled.put(slot)
        finally:
            self.filled.put(None)
            threads[0].join()
            self.closing = True
            self.flush_wanted.set()
            threads[1].join()
        if self.error is not None:
            raise self.error
        self.out.flush()
        os.fsync(self.out.fileno())

    def _write_all(self) -> None:
        while (slot := self.filled.get()) is not None:
            if self.error is None:
                try:
                    self._write(slot)
                # Kept and raised by run() in the merge's thread (a full disk, say), which stops handing out chunks.
                except BaseException as err:  # noqa: BLE001
                    self.error = err
            self.free.put(slot)

    def _write(self, slot: _Slot) -> None:
        view = memoryview(slot.output[: slot.nbytes].numpy())
        self.digest.update(view)
        self.out.write(view)
        self.unflushed += slot.nbytes
        if self.unflushed >= FLUSH_BYTES:
            self.out.flush()
            self.unflushed = 0
            self.flush_wanted.set()

    def _flush_loop(self) -> None:
        while True:
            self.flush_wanted.wait()
            self.flush_wanted.clear()
            if self.closing:
                return
            try:
                os.fdatasync(self.out.fileno())
            except OSError as err:
                self.error = self.error or err


def _write_shard(out_path: Path, keys: list[str], sources: list[dict[str, tuple[Path, _Entry]]],
                 combine: Combine, threads: int) -> str:
    """Writes one output shard chunk by chunk; returns its sha256, hashed from the bytes as they are written.

    This thread's torch ops use `threads` intra-op threads, its share of the cores: several shards are combined at
    once, and each worker's own full team of intra-op threads would oversubscribe the cores on chunks this small."""
    own = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _write_shard_chunks(out_path, keys, sources, combine)
    finally:
        torch.set_num_threads(own)


def _write_shard_chunks(out_path: Path, keys: list[str], sources: list[dict[str, tuple[Path, _Entry]]],
                        combine: Combine) -> str:
    ref = {k: sources[0][k][1] for k in keys}
    dtypes = {k: _dtype(sources[0][k][0], ref[k].dtype) for k in keys}
    width = max((d.itemsize for d in dtypes.values()), default=1) * CHUNK_ELEMENTS
    plan = []
    for k in keys:
        numel = (ref[k].end - ref[k].start) // dtypes[k].itemsize
        plan += [_Chunk(k, first, min(CHUNK_ELEMENTS, numel - first)) for first in range(0, numel, CHUNK_ELEMENTS)]
    header = _header_bytes(keys, ref)
    digest = hashlib.sha256(header)
    with ExitStack() as stack, open(out_path, "wb") as out:
        fds: dict[Path, int] = {}
        for path in {src[k][0] for src in sources for k in keys}:
            fds[path] = os.open(path, os.O_RDONLY)
            stack.callback(os.close, fds[path])
            os.posix_fadvise(fds[path], 0, 0, os.POSIX_FADV_SEQUENTIAL)  # larger readahead for a cold input

        def work(slot: _Slot, acc: torch.Tensor, tmp: torch.Tensor) -> None:
            key, first, n = slot.chunk
            dtype = dtypes[key]
            slot.nbytes = n * dtype.itemsize
            chunks = []
            for buf, src in zip(slot.inputs, sources, strict=True):
                path, entry = src[key]
                chunks.append(_pread(fds[path], path, buf[: slot.nbytes], entry.start + first * dtype.itemsize)
                              .view(dtype))
            combine(key, first, chunks, slot.output[: slot.nbytes].view(dtype), acc[:n], tmp[:n])

        out.write(header)
        _ShardPipeline(out, digest, len(sources), width).run(plan, work)
    return digest.hexdigest()


def _sources(models: list[Path], maps: list[dict[str, str]]) -> list[dict[str, tuple[Path, _Entry]]]:
    """Per model: tensor name -> (its shard file, its header entry)."""
    out = []
    for model, weight_map in zip(models, maps, strict=True):
        headers = {file: read_header(model / file) for file in set(weight_map.values())}
        out.append({k: (model / file, headers[file][k]) for k, file in weight_map.items()})
    return out


def stream_merge(models: list[Path], combine: Combine, output_dir: Path, side_files: Path | None = None) -> MergeResult:
    """Writes combine(chunks of all models) for every tensor, shard by shard, then swaps the dir in.

    Inputs are read with plain reads chunk by chunk (no memory maps held open), merged into preallocated
    FP32 scratch, and each output shard is hashed as it is written, so the result's weights_sha256 needs no
    second pass over the output; up to MAX_WORKERS shards are written at once, each through its own pipeline of
    threads (combine, hash and write, flush: _ShardPipeline), and every shard is on disk (fsynced) before the
    directory is renamed into place. Side files (config, tokenizer)
    come from the first model, then from `side_files` when given (a LoRA adapter's tokenizer and chat template)."""
    first_map = check_compatible(models)
    shards = sorted(set(first_map.values()))
    names = {s: f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i, s in enumerate(shards)}
    tmp = output_dir.with_name(output_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    sources = _sources(models, [shard_map(m) for m in models])
    jobs = {names[s]: sorted(k for k, v in first_map.items() if v == s) for s in shards}
    try:
        workers = min(MAX_WORKERS, len(jobs))
        # Each worker: its combining thread with this many intra-op threads, and its writer (the hash and the
        # writes). On the GPU machine (16 cores, 4 shards of 1 GB, flushes beside) this soup took 3.1 s; with a
        # reader and a hasher of their own per shard 8.5 s, with 3 combining threads of one intra-op thread each
        # per shard 5.1 s (bench/results/merge_throughput-h200-*.json): more threads only contended.
        threads = max(1, (os.cpu_count() or 1) // (2 * workers))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            futures = {name: pool.submit(_write_shard, tmp / name, keys, sources, combine, threads)
                       for name, keys in jobs.items()}
            shard_sha = {name: f.result() for name, f in futures.items()}
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    total = sum(e.end - e.start for _, e in sources[0].values())
    index = {"metadata": {"total_size": total}, "weight_map": {k: names[s] for k, s in sorted(first_map.items())}}
    (tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    _copy_side_files(models[0], tmp)
    if side_files is not None:
        _copy_side_files(side_files, tmp)
    # The digests taken while writing become the output's weights manifest (replacing the first model's, which
    # the side files brought along), so neither this result nor a later weights_sha256 re-reads the shards.
    digest = write_weights_manifest(tmp, shard_sha)
    tmp.rename(output_dir)
    return MergeResult(output_dir=output_dir, tensors=len(first_map), shards=len(shards), weights_sha256=digest)


def _soup_combine(weights: list[float]) -> Combine:
    def combine(_key: str, _first: int, chunks: list[torch.Tensor], out: torch.Tensor, acc: torch.Tensor,
                tmp: torch.Tensor) -> None:
        # sum_i w_i * float(t_i) with each product rounded to FP32 before the sum, as `acc += w * t.float()`
        # would do, but in place: no FP32 temporaries per tensor.
        acc.copy_(chunks[0]).mul_(weights[0])
        for w, t in zip(weights[1:], chunks[1:], strict=True):
            acc.add_(tmp.copy_(t).mul_(w))
        out.copy_(acc)

    return combine


def _dose_combine(alpha: float) -> Combine:
    def combine(_key: str, _first: int, chunks: list[torch.Tensor], out: torch.Tensor, acc: torch.Tensor,
                tmp: torch.Tensor) -> None:
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


class _Target(NamedTuple):
    """The LoRA update of one runtime parameter: for each expert e (one block for nn.Linear), the block
    scale * (B_e @ A_e), transposed when the parameter is laid out (experts, in, out)."""

    lora_a: str
    lora_b: str
    scale: float
    experts: int
    transposed: bool


class _Update(NamedTuple):
    """What one stored tensor receives: blocks `blocks` of its runtime parameter's update, stacked by rows."""

    target: str
    blocks: range


class _LoRAPlan(NamedTuple):
    """Which stored tensor gets which update, found and checked before anything is written."""

    targets: dict[str, _Target]
    updates: dict[str, _Update]
    replaced: dict[str, str]


def _adapter_config(adapter: Path):
    """The peft LoraConfig, refusing what this merge does not fold in (each a different update formula)."""
    from peft import LoraConfig

    path = adapter / "adapter_config.json"
    if json.loads(path.read_text()).get("peft_type") != "LORA":
        raise MergeError(f"{path}: field peft_type: expected 'LORA'")
    config = LoraConfig.from_pretrained(adapter)
    refused = {"use_dora": config.use_dora, "fan_in_fan_out": config.fan_in_fan_out, "lora_bias": config.lora_bias,
               "bias": config.bias != "none", "trainable_token_indices": bool(config.trainable_token_indices),
               "layer_replication": bool(config.layer_replication)}
    for field, used in refused.items():
        if used:
            raise MergeError(f"{path}: field {field}: {getattr(config, field)!r} is not supported by the streamed "
                             "merge (plain LoRA only)")
    config.inference_mode = True
    return config


def _runtime_sources(skeleton, stored: list[str]) -> dict[str, tuple[list[str], bool]]:
    """runtime parameter name -> (its stored tensors, stacked), by transformers' own load-time key conversion:
    renamings, then at most one converter; `stacked` = per-expert tensors stacked on dim 0 (MergeModulelist),
    listed in the order from_pretrained stacks them. Tensors under any other converter map to an empty list."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        MergeModulelist,
        WeightConverter,
        WeightRenaming,
        dot_natural_key,
        rename_source_key,
    )

    transforms = get_model_conversion_mapping(skeleton)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    meta = skeleton.state_dict()
    prefix = skeleton.base_model_prefix
    out: dict[str, tuple[list[str], bool]] = {}
    for key in sorted(stored, key=dot_natural_key):  # from_pretrained's order, which fixes the expert index
        name, pattern = rename_source_key(key, renamings, converters, prefix, meta)
        if name not in meta and key in meta:  # as from_pretrained: a stored name that needs no renaming
            name, pattern = rename_source_key(key, [], [], prefix, meta)
        converter = by_pattern.get(pattern) if pattern is not None else None
        stacked = converter is not None and len(converter.source_patterns) == 1 and len(converter.operations) == 1 \
            and isinstance(converter.operations[0], MergeModulelist) and converter.operations[0].dim == 0
        keys, _ = out.setdefault(name, ([], stacked))
        if converter is None or stacked:
            keys.append(key)
    return out


def _check_adapter_tensors(adapter: Path, expected: dict[str, list[int]], entries: dict[str, _Entry]) -> None:
    """The adapter file holds exactly the tensors peft would save for this config and base, in their shapes."""
    missing, unexpected = sorted(set(expected) - set(entries)), sorted(set(entries) - set(expected))
    if missing or unexpected:
        raise MergeError(f"{adapter / ADAPTER_WEIGHTS}: tensors differ from what adapter_config.json gives for this "
                         f"base (missing {missing[:3]}, unexpected {unexpected[:3]})")
    for key, shape in expected.items():
        if entries[key].shape != shape:
            raise MergeError(f"{adapter / ADAPTER_WEIGHTS}: tensor {key} is {entries[key].shape}, the base "
                             f"needs {shape}")


def _lora_plan(base: Path, adapter: Path, base_entries: dict[str, _Entry],
               adapter_entries: dict[str, _Entry]) -> _LoRAPlan:
    """Names every adapter tensor's target on a meta-device copy of the base wrapped by peft, then maps each
    target to its stored tensors, checking names, shapes and dtypes."""
    from peft import get_peft_model
    from peft.tuners.lora import Linear, ParamWrapper
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils import ModulesToSaveWrapper, get_peft_model_state_dict

    from core import loading

    config = _adapter_config(adapter)
    with torch.device("meta"):
        skeleton = loading.model_from_config(loading.load_config(base))
    sources = _runtime_sources(skeleton, list(base_entries))
    shapes = {k: list(v.shape) for k, v in skeleton.state_dict().items()}
    try:
        with loading.peft_wrapping():
            wrapped = get_peft_model(skeleton, config)
    except ValueError as e:  # peft's refusal of targets the base lacks
        raise MergeError(f"{adapter}: the adapter does not fit {base}: {str(e).splitlines()[0]}") from None
    _check_adapter_tensors(adapter, {k: list(v.shape) for k, v in get_peft_model_state_dict(wrapped).items()},
                           adapter_entries)
    targets, copies = {}, {}
    for name, module in wrapped.named_modules():
        runtime = name.removeprefix("base_model.model.").replace(".base_layer", "")
        if isinstance(module, ModulesToSaveWrapper):
            copies |= {f"{runtime}.{p}": f"{name}.{p}" for p, _ in module.original_module.named_parameters()}
        elif isinstance(module, ParamWrapper):
            # peft's rule: a 3-D parameter is (experts, out, in) unless its module says `is_transposed`.
            transposed = module.num_experts > 1 and bool(getattr(module.get_base_layer(), "is_transposed", False))
            targets[f"{runtime}.{module.parameter_name}"] = _Target(
                f"{name}.lora_A.weight", f"{name}.lora_B.weight", module.scaling["default"], module.num_experts,
                transposed)
        elif isinstance(module, Linear):
            targets[f"{runtime}.weight"] = _Target(f"{name}.lora_A.weight", f"{name}.lora_B.weight",
                                                   module.scaling["default"], 1, False)
        elif isinstance(module, BaseTunerLayer):
            raise MergeError(f"{adapter}: {runtime} is a LoRA {type(module).__name__} layer; the streamed merge "
                             "folds Linear and parameter (expert) targets only")
    updates = {}
    for param, target in targets.items():
        updates |= _stored_updates(base, param, target, shapes[param], sources, base_entries)
    replaced = {_single_stored(base, param, shapes[param], sources, base_entries): key for param, key in copies.items()}
    return _LoRAPlan(targets=targets, updates=updates, replaced=replaced)


def _stored_updates(base: Path, param: str, target: _Target, shape: list[int],
                    sources: dict[str, tuple[list[str], bool]], entries: dict[str, _Entry]) -> dict[str, _Update]:
    """stored tensor -> its update: the whole parameter's blocks, or one expert's block of a stacked one."""
    keys, stacked = sources.get(param, ([], False))
    if not stacked:
        key = _single_stored(base, param, shape, sources, entries)
        updates = {key: _Update(param, range(target.experts))}
    elif len(keys) != shape[0] or any(entries[k].shape != shape[1:] for k in keys):
        raise MergeError(f"{base}: the {len(keys)} stored tensors of {param} do not stack to its shape {shape}")
    else:
        updates = {k: _Update(param, range(e, e + 1)) for e, k in enumerate(keys)}
    for key in updates:
        if entries[key].dtype not in ("F32", "BF16", "F16"):
            raise MergeError(f"{base}: tensor {key} is {entries[key].dtype}; a LoRA update needs a float tensor")
    return updates


def _single_stored(base: Path, param: str, shape: list[int], sources: dict[str, tuple[list[str], bool]],
                   entries: dict[str, _Entry]) -> str:
    """The one stored tensor a runtime parameter loads from unchanged (renamed at most)."""
    keys, stacked = sources.get(param, ([], False))
    if stacked or len(keys) != 1:
        raise MergeError(f"{base}: LoRA target {param} is not stored as one tensor (stored as {keys[:3] or 'none'}; "
                         "the streamed merge follows renamings and expert stacking only)")
    if entries[keys[0]].shape != shape:
        raise MergeError(f"{base}: tensor {keys[0]} is {entries[keys[0]].shape}, the model needs {shape} for {param}")
    return keys[0]


class _LoRACombine:
    """combine() of merge_lora: W + scale * lhs @ rhs in FP32 (cast back to W's dtype), or the adapter's own copy
    of the tensor (peft modules_to_save), or W unchanged. The factors of a target are read once, when the first
    chunk of its stored tensors is combined, and dropped after the last: memory is the factors of the targets in
    flight."""

    def __init__(self, plan: _LoRAPlan, adapter_file: Path, fd: int, base_entries: dict[str, _Entry]):
        self._plan, self._file, self._fd = plan, adapter_file, fd
        self._entries, self._base = read_header(adapter_file), base_entries
        # Chunks still to come per target: the factors go once the last of them is combined, in whatever order.
        self._pending = Counter()
        for key, update in plan.updates.items():
            self._pending[update.target] += -(-math.prod(base_entries[key].shape) // CHUNK_ELEMENTS)
        self._blocks: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._lock = threading.Lock()

    def __call__(self, key: str, first: int, chunks: list[torch.Tensor], out: torch.Tensor, acc: torch.Tensor,
                 _tmp: torch.Tensor) -> None:
        (weight,) = chunks
        if key in self._plan.replaced:
            out.copy_(self._read(self._plan.replaced[key], first, len(out)))
        elif key in self._plan.updates:
            out.copy_(acc.copy_(weight).add_(self._delta(key, first, len(out))))
            self._release(self._plan.updates[key].target)
        else:
            out.copy_(weight)

    def _delta(self, key: str, first: int, n: int) -> torch.Tensor:
        """The update of elements [first, first + n) of the stored tensor (rows of its last dim), in FP32."""
        update = self._plan.updates[key]
        scale = self._plan.targets[update.target].scale
        blocks = self._factors(update.target)[update.blocks.start:update.blocks.stop]
        cols, height = self._base[key].shape[-1], blocks[0][0].shape[0]
        lo, hi = first // cols, -(-(first + n) // cols)
        rows = [(lhs[max(lo - b * height, 0):hi - b * height] @ rhs) * scale  # peft's (B @ A) * scaling
                for b, (lhs, rhs) in enumerate(blocks) if b * height < hi and (b + 1) * height > lo]
        flat = (torch.cat(rows) if len(rows) > 1 else rows[0]).view(-1)
        return flat[first - lo * cols:first - lo * cols + n]

    def _factors(self, name: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per expert (lhs, rhs) of a target in FP32: B_e, A_e with peft's layout (A rows grouped by expert, B
        columns interleaved: B viewed (out, r, experts)), swapped and transposed for an (experts, in, out) layout."""
        with self._lock:
            if name not in self._blocks:
                target = self._plan.targets[name]
                a, b = self._tensor(target.lora_a), self._tensor(target.lora_b)
                rank = a.shape[0] // target.experts
                pairs = [(b[:, e::target.experts], a[e * rank:(e + 1) * rank]) for e in range(target.experts)]
                if target.transposed:
                    pairs = [(rhs.T, lhs.T) for lhs, rhs in pairs]
                self._blocks[name] = [(lhs.contiguous(), rhs.contiguous()) for lhs, rhs in pairs]
            return self._blocks[name]

    def _release(self, name: str) -> None:
        with self._lock:
            self._pending[name] -= 1
            if self._pending[name] == 0:
                self._blocks.pop(name, None)

    def _tensor(self, key: str) -> torch.Tensor:
        entry = self._entries[key]
        return self._read(key, 0, math.prod(entry.shape)).reshape(entry.shape).float()

    def _read(self, key: str, first: int, n: int) -> torch.Tensor:
        """Elements [first, first + n) of an adapter tensor, as stored, by a plain read."""
        entry = self._entries[key]
        dtype = _dtype(self._file, entry.dtype)
        buf = torch.empty(n * dtype.itemsize, dtype=torch.uint8)
        return _pread(self._fd, self._file, buf, entry.start + first * dtype.itemsize).view(dtype)


def merge_lora(config: LoRAMergeConfig) -> MergeResult:
    """Streams base + scale * B @ A into config.output_dir in the base's layout and dtypes, with the adapter's
    tokenizer and chat template; every name, shape and dtype is checked before anything is written."""
    base_map = shard_map(config.base)
    base_entries = {k: entry for k, (_, entry) in _sources([config.base], [base_map])[0].items()}
    adapter_file = config.adapter / ADAPTER_WEIGHTS
    plan = _lora_plan(config.base, config.adapter, base_entries, read_header(adapter_file))
    fd = os.open(adapter_file, os.O_RDONLY)
    try:
        combine = _LoRACombine(plan, adapter_file, fd, base_entries)
        return stream_merge([config.base], combine, config.output_dir, side_files=config.adapter)
    finally:
        os.close(fd)


def main(argv: list[str] | None = None) -> int:
    """`python -m trainers.merge {lora|soup|dose} CONFIG.json`."""
    from core.entry import run_main

    kinds = {"lora": (LoRAMergeConfig, merge_lora), "soup": (SoupConfig, soup), "dose": (DoseConfig, dose)}
    return run_main("python -m trainers.merge", kinds, argv, bad_input=(MergeError,))


if __name__ == "__main__":
    sys.exit(main())
