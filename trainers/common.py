"""What every trainer shares: the base config, typed failures, run paths, model and LoRA loading, results.

- `TrainConfig`: fields common to SFT, DPO, KL-CE and RFT (model, data, output dir, optimiser,
  LoRA). Each trainer's config extends it in its own file.
- `NonFiniteLoss` (message starts with `nan_loss:` and names the step) and `Preempted` (message
  starts with `preempted:`): the job launcher classifies failures by these prefixes.
- `RunPaths`: every path of a run directory, in one place.
- `load_policy`: a causal LM from a local path, full fine-tuning or LoRA through peft.
- `TrainResult`: what a finished run returns and writes to `result.json`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from core import chat, loading
from core.placement import Placement
from core.util import write_json_atomic
from core.versions import Versions
from core.wall import Wall
from core.weights import WEIGHTS_MANIFEST, weights_sha256, write_weights_manifest  # noqa: F401 (re-exported)
from trainers import distributed, lora_experts, mamba_kernels

# LoRA targets that work on Nemotron-H: peft refuses the Mamba mixer's out_proj and conv1d.
NEMOTRON_H_LORA_TARGETS = ["in_proj", "q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"]
# Routed experts are 3-D parameters, not nn.Linear modules: peft reaches them only by parameter name.
NEMOTRON_H_EXPERT_PARAMETERS = ["mixer.experts.up_proj", "mixer.experts.down_proj"]
DENSE_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Model types whose layers carry recurrent (Mamba) state: packed sequences would leak state across rows.
# Above this many parameters activation checkpointing is on by default: at 4096 tokens a 1B model's stored
# activations (~34 bytes x hidden x layers per token in bf16) already rival its weights and AdamW state.
ACTIVATION_CHECKPOINTING_ABOVE = 1_000_000_000
# Compiling the blocks (and graphing the Mamba mixers) pays back only where a step is long enough: on the H200 a
# tiny world's job spent 60-100 s compiling for 30 steps of a 1M-parameter model that trains in seconds eagerly
# (bench/results/gpu_session.json, sft 115.7 s against klce's 25.0 s once the compile cache was warm). Below this
# size `compile_blocks = None` stays eager.
COMPILE_BLOCKS_ABOVE = 100_000_000
# safetensors' dtype names (a header's "dtype") and the torch dtypes they store.
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
RECURRENT_MODEL_TYPES = {"nemotron_h", "mamba", "mamba2", "jamba", "zamba", "zamba2", "falcon_h1", "bamba"}


class NonFiniteLoss(RuntimeError):
    """The loss became NaN or inf; the message starts with 'nan_loss:' and names the step."""

    def __init__(self, step: int, value: float):
        super().__init__(f"nan_loss: step {step}: loss is {value}")
        self.step = step


class Preempted(RuntimeError):
    """The run got SIGTERM/SIGUSR2 and saved its resume state; calling train() again continues it."""

    def __init__(self, step: int, resume_dir: Path):
        super().__init__(f"preempted: step {step}: resume state saved to {resume_dir}")
        self.step = step


class ConfigError(ValueError):
    """A config that cannot run (found before any compute); the message names the field."""


class LoRASettings(BaseModel):
    """LoRA adapter settings (peft). Targets default to the working set for the model's architecture."""

    model_config = ConfigDict(extra="forbid")
    r: int = Field(16, gt=0, description="LoRA rank.")
    alpha: float = Field(32.0, gt=0, description="LoRA alpha (the update is scaled by alpha / r).")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the LoRA input.")
    target_modules: list[str] | None = Field(
        None, description="Module name suffixes to adapt; None = the architecture's default list."
    )
    target_parameters: list[str] | None = Field(
        None,
        description="Parameter name suffixes adapted directly (Nemotron-H routed experts); "
        "None = the architecture's default ([] for dense models).",
    )
    train_lm_head: bool = Field(False, description="Also train lm_head in full (peft modules_to_save), kept in FP32.")


class TrainConfig(BaseModel):
    """Fields every trainer shares. Trainers extend this with their own fields."""

    model_config = ConfigDict(extra="forbid")
    model_path: Path = Field(description="Local directory of the starting causal LM (config.json, safetensors, tokenizer).")
    data_path: Path = Field(description="JSONL training rows (format in trainers/rows.py).")
    output_dir: Path = Field(description="Run directory: config, metrics.jsonl, model/, resume/, result.json.")
    system_prompt: str | None = Field(None, description="Serving system prompt, added to rows without a system turn.")
    lora: LoRASettings | None = Field(None, description="LoRA settings; None = full fine-tuning.")
    lr: float = Field(1e-4, gt=0, description="Peak learning rate (AdamW).")
    steps: int = Field(100, gt=0, description="Optimizer steps.")
    batch_size: int = Field(8, gt=0, description="Rows per optimizer step.")
    micro_batch_size: int = Field(8, gt=0, description="Rows per forward pass (gradient accumulation up to batch_size).")
    max_len: int = Field(1024, gt=8, description="Token limit per row; longer rows are cut on the right and counted.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps, then the `schedule`'s decay.")
    schedule: Literal["linear", "cosine"] = Field(
        "linear", description="Decay after the warm-up: 'linear' to the floor, or 'cosine' (half a cosine) to the floor.")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="The floor the decay ends at, as a share of the peak lr "
                                "(0: linear decay to zero, the default).")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, gt=0, description="Max global gradient norm.")
    seed: int = Field(0, description="Seed for LoRA init, data order and sampling.")
    log_every: int = Field(1, gt=0, description="Write a metrics.jsonl line every this many steps.")
    save_every: int | None = Field(None, gt=0, description="Also save resume state every this many steps (None: only on signal).")
    snapshot_steps: list[int] = Field(
        default_factory=list, description="Steps (increasing, each below `steps`) after which the model is also saved "
        "whole to snapshots/step-<n>/, in the final model's format with its chat template (trajectory selection).")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="Compute dtype: auto = bfloat16 on GPU, float32 on CPU. Under FSDP2, trainable weights and "
        "AdamW state stay float32 (master copies) and frozen weights are stored in this dtype.")
    save_every_minutes: float | None = Field(
        None, gt=0, description="Also save resume state when this many minutes passed since the last save.")
    activation_checkpointing: bool | None = Field(
        None, description="Recompute each decoder block in backward; None = on for models above "
        "1e9 parameters (ACTIVATION_CHECKPOINTING_ABOVE).")
    loss_chunk_tokens: int = Field(
        1024, gt=0, description="Supervised positions per chunk of the head + loss (bounds float32 logits memory).")
    compile_blocks: bool | None = Field(
        None, description="torch.compile each decoder block in place (fuses the norms, rotary, activation and "
        "residual passes between the matmuls); None = on for one-process CUDA training of models above 1e8 "
        "parameters (COMPILE_BLOCKS_ABOVE). Not applied under FSDP2 or "
        "to Mamba blocks; with it, a hybrid's Mamba mixers replay their training forward and backward from CUDA "
        "graphs (trainers/step_graphs.py; not with activation checkpointing).")
    allow_slow_mamba: bool = Field(
        False, description="On a GPU, train a Mamba/hybrid model even without mamba-ssm and causal-conv1d's kernels "
        "(the `gpu` extra): transformers then falls back to its pure-torch scan, ~15x slower. False = refuse.")

    # Read by the memory estimate: whether the objective holds a frozen parent's logits beside the policy's.
    kl_to_parent: ClassVar[bool] = False

    def separate_parent(self) -> Path | None:
        """The frozen parent model held in memory beside the policy (None: none, or the policy's own base weights)."""
        return None

    @field_validator("model_path")
    @classmethod
    def _model_exists(cls, v: Path) -> Path:
        if not (v / "config.json").is_file():
            raise ValueError(f"{v}: no config.json (expected a local model directory)")
        return v

    @field_validator("data_path")
    @classmethod
    def _data_exists(cls, v: Path) -> Path:
        if not v.is_file():
            raise ValueError(f"{v}: data file does not exist")
        return v

    @property
    def compute_dtype(self) -> str:
        """The resolved dtype: "auto" is bfloat16 where a GPU is visible, float32 on CPU."""
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if torch.cuda.is_available() else "float32"

    @model_validator(mode="after")
    def _cross_fields(self) -> TrainConfig:
        if self.warmup_steps >= self.steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) must be below steps ({self.steps})")
        if any(not 0 < s < self.steps for s in self.snapshot_steps) or self.snapshot_steps != sorted(set(self.snapshot_steps)):
            raise ValueError(f"snapshot_steps ({self.snapshot_steps}) must increase and lie between 0 and steps "
                             f"({self.steps}), exclusive: the final model is saved anyway")
        if self.batch_size % self.micro_batch_size:
            raise ValueError(f"batch_size ({self.batch_size}) must be a multiple of micro_batch_size ({self.micro_batch_size})")
        if torch.cuda.is_available() and not self.allow_slow_mamba:
            model_type = loading.load_config(self.model_path).model_type
            check_mamba_kernels(model_type, mamba_kernels_missing(model_type))
        return self


class Snapshot(BaseModel):
    """The model saved whole at an intermediate step (TrainConfig.snapshot_steps)."""

    model_config = ConfigDict(extra="forbid")
    step: int = Field(description="Optimizer steps taken when it was saved.")
    model_dir: Path = Field(description="The saved model, in the format of the run's final model/.")
    lr: float = Field(description="Learning rate of its last step.")
    lr_sum: float = Field(description="Sum of the per-step learning rates up to it: how far the schedule carried it.")
    loss: float = Field(description="Loss of its last step.")
    tokens_seen: int = Field(description="Input tokens processed up to it.")


class TrainResult(BaseModel):
    """What a finished run returns; also written to the run directory's result.json."""

    model_config = ConfigDict(extra="forbid")
    run_dir: Path = Field(description="The run directory.")
    model_dir: Path = Field(description="The saved model: full weights, or a peft adapter when `adapter`.")
    adapter: bool = Field(description="model_dir holds a LoRA adapter over `base_model_path`.")
    base_model_path: Path = Field(description="The model the run started from.")
    steps: int = Field(description="Optimizer steps taken.")
    tokens_seen: int = Field(description="Input tokens processed by forward passes (padding excluded).")
    supervised_tokens: int = Field(description="Tokens that carried loss.")
    truncated_rows: int = Field(description="Rows cut at max_len (counted once per row).")
    wall_time_s: float = Field(description="Wall time of the optimizer steps over all sessions of the run (resumes included).")
    data_sha256: str = Field(description="sha256 of the training data file.")
    final_loss: float = Field(description="Loss of the last optimizer step.")
    resumed_at_steps: list[int] = Field(description="Steps at which the run was resumed from saved state.")
    metrics: dict[str, float] = Field(default_factory=dict, description="Trainer-specific final metrics.")
    world_size: int = Field(1, ge=1, description="Processes (one per GPU) the last session of the run used.")
    snapshots: list[Snapshot] = Field(default_factory=list, description="The intermediate models saved, by step.")
    placement: Placement | None = Field(None, description="Device, dtype, device name, ranks and trained tokens per "
                                        "second of the run's last session (None: recorded before runs said so).")
    versions: Versions | None = Field(None, description="The versions of torch, transformers, peft, trl and mamba-ssm the job ran with (stamped by the job wrapper, tools/jobs/jobrun.py).")
    wall: Wall | None = Field(None, description="Start-up, work and write-out seconds of the job (core/wall.py; completed by the job wrapper, tools/jobs/jobrun.py).")


class RunPaths(BaseModel):
    """Every path inside a run directory."""

    root: Path = Field(description="The run directory.")

    @property
    def config(self) -> Path:
        return self.root / "config.json"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def model(self) -> Path:
        return self.root / "model"

    @property
    def resume(self) -> Path:
        return self.root / "resume"

    @property
    def result(self) -> Path:
        return self.root / "result.json"

    def snapshot(self, step: int) -> Path:
        return self.root / "snapshots" / f"step-{step}"


def start_run(config: TrainConfig) -> RunPaths:
    """Creates the run dir and writes config.json; a dir holding a different config is refused."""
    paths = RunPaths(root=config.output_dir)
    payload = json.loads(config.model_dump_json())
    if paths.config.is_file() and json.loads(paths.config.read_text()) != payload:
        raise ConfigError(f"{paths.config}: the run directory holds a different config; use a new output_dir")
    paths.root.mkdir(parents=True, exist_ok=True)
    write_json_atomic(paths.config, payload)
    return paths


def finished_result(config: TrainConfig) -> TrainResult | None:
    """The stored result when this exact run already finished (a requeue of a done job is a no-op)."""
    paths = RunPaths(root=config.output_dir)
    if not paths.result.is_file():
        return None
    start_run(config)  # refuses a different config in the same directory
    return TrainResult.model_validate_json(paths.result.read_text())


def mamba_kernels_missing(model_type: str) -> list[str]:
    """What fast Mamba layers of a `model_type` model lack here ([] = nothing). Nemotron-H's mixers run on
    mamba-ssm's Triton SSD kernels (trainers/mamba_kernels.py: no CUDA extension needed); the other recurrent
    types rely on transformers' own lookup, where each package must import at its root (mamba_ssm pulls in its
    CUDA extension) and anything missing silently falls back to the pure-torch scan."""
    if model_type == "nemotron_h":
        return mamba_kernels.missing()
    missing = []
    try:
        from causal_conv1d import causal_conv1d_fn  # noqa: F401
    except ImportError as err:
        missing.append(f"causal_conv1d.causal_conv1d_fn ({err})")
    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined  # noqa: F401
    except ImportError as err:
        missing.append(f"mamba_ssm.ops.triton.ssd_combined ({err})")
    return missing


def fast_mamba(model: PreTrainedModel) -> PreTrainedModel:
    """On a GPU, a Nemotron-H model's Mamba mixers run mamba-ssm's Triton SSD kernels where they load; elsewhere
    (CPU, or allow_slow_mamba without the kernels) transformers' own path stays."""
    if torch.cuda.is_available() and model.config.model_type == "nemotron_h" and not mamba_kernels.missing():
        mamba_kernels.use_triton_ssd(model)
    return model


def packing_keeps_rows_apart(model_type: str) -> bool:
    """Whether packed rows stay independent in a `model_type` model on this machine: attention-only models
    always (block-diagonal masks from the position ids); Nemotron-H only on a GPU with the Triton SSD kernels
    (per-row `seq_idx`); other recurrent types never (transformers' fallback mixers cannot)."""
    if model_type not in RECURRENT_MODEL_TYPES:
        return True
    return model_type == "nemotron_h" and torch.cuda.is_available() and not mamba_kernels.missing()


def check_mamba_kernels(model_type: str, missing: list[str]) -> None:
    """Refuses GPU training of a recurrent model whose kernels are missing: no silent 15x slowdown."""
    if model_type in RECURRENT_MODEL_TYPES and missing:
        raise ValueError(
            f"model_path: a {model_type} model on a GPU needs the Mamba kernels, missing here: {'; '.join(missing)}; "
            "install them (see the README's Mamba kernels section) or set allow_slow_mamba: true to accept the "
            "pure-torch scan")


def is_recurrent(model_path: Path) -> bool:
    """True when the model has Mamba/recurrent layers (sequence packing is unsafe for them)."""
    return loading.load_config(model_path).model_type in RECURRENT_MODEL_TYPES


def lora_defaults(model_path: Path, lora: LoRASettings) -> tuple[list[str], list[str]]:
    """(target_modules, target_parameters) with the architecture's defaults filled in."""
    return lora_targets(loading.load_config(model_path).model_type, lora)


def lora_targets(model_type: str, lora: LoRASettings) -> tuple[list[str], list[str]]:
    """lora_defaults for a model type."""
    nemotron = model_type == "nemotron_h"
    modules = lora.target_modules or (NEMOTRON_H_LORA_TARGETS if nemotron else DENSE_LORA_TARGETS)
    params = lora.target_parameters
    if params is None:
        params = NEMOTRON_H_EXPERT_PARAMETERS if nemotron else []
    return modules, params


def check_lora_targets(model_path: Path, lora: LoRASettings) -> None:
    """Refuses LoRA targets that match nothing (checked on a meta-device model, no weights), and dropout on
    parameter targets."""
    modules, params = lora_defaults(model_path, lora)
    if params and lora.dropout:
        # peft's ParamWrapper raises on lora_dropout != 0 (dropout cannot be factored out of a weight delta).
        raise ConfigError(
            f"lora.dropout: {lora.dropout} cannot apply to target_parameters {params}; "
            "set dropout to 0 or target_parameters to []"
        )
    with torch.device("meta"):
        skeleton = loading.model_from_config(loading.load_config(model_path))
    module_names = [n for n, _ in skeleton.named_modules()]
    param_names = [n for n, _ in skeleton.named_parameters()]
    linear = {n for n, m in skeleton.named_modules() if isinstance(m, torch.nn.Linear)}
    for target in modules:
        found = [n for n in module_names if n == target or n.endswith("." + target)]
        if not found:
            raise ConfigError(f"lora.target_modules: {target!r} matches no module of {model_path}")
        other = [n for n in found if n not in linear]
        if other:  # an embedding, a norm, the root (trainers/targets.py: what lab.toml's check refuses before)
            raise ConfigError(f"lora.target_modules: {target!r} matches {other[0]!r}, a "
                              f"{type(skeleton.get_submodule(other[0])).__name__}: only linear projections are adapted")
    for target in params:
        if not any(n == target or n.endswith("." + target) for n in param_names):
            raise ConfigError(f"lora.target_parameters: {target!r} matches no parameter of {model_path}")


def load_tokenizer(model_path: Path) -> PreTrainedTokenizerBase:
    """The model's tokenizer; refused (ConfigError) when its chat template cannot be trained with (core.chat)."""
    tokenizer = loading.load_tokenizer(model_path)
    try:
        chat.check_tokenizer(tokenizer)
    except chat.ChatTemplateError as err:
        raise ConfigError(f"{model_path}: chat template: {err}") from None
    return tokenizer


def device() -> torch.device:
    """The job's device: this rank's GPU (the first visible one for a single process), else the CPU."""
    return distributed.device()


def load_frozen(model_path: Path, dtype: str) -> PreTrainedModel:
    """A model in eval mode with gradients off (reference / parent models), sharded when the job is distributed."""
    env = distributed.setup()
    torch_dtype = getattr(torch, dtype)

    def frozen(model: PreTrainedModel) -> PreTrainedModel:
        return fast_mamba(model).eval().requires_grad_(False)

    if not env.distributed:
        return frozen(loading.load_causal_lm(model_path, dtype=torch_dtype).to(device()))
    config = loading.load_config(model_path)
    return distributed.load_sharded(
        lambda: frozen(loading.model_from_config(config, dtype=torch_dtype)),
        lambda: frozen(loading.load_causal_lm(model_path, dtype=torch_dtype)),
        None, env).eval()


def compiles_by_default(device_type: str, n_params: int) -> bool:
    """`compile_blocks = None`'s choice: compiled blocks on CUDA for models above COMPILE_BLOCKS_ABOVE parameters."""
    return device_type == "cuda" and n_params > COMPILE_BLOCKS_ABOVE


def load_policy(model_path: Path, dtype: str, lora: LoRASettings | None, seed: int,
                activation_checkpointing: bool | None = None, compile_blocks: bool | None = None) -> PreTrainedModel:
    """The trainable model: all weights (lora None) or a peft LoRA adapter over frozen weights.

    Distributed, it is FSDP2-sharded; full fine-tuning then keeps float32 master weights and computes in
    `dtype` through the mixed-precision policy, LoRA stores its frozen base in `dtype`. On one process the decoder
    blocks are compiled where `compile_blocks` says so (None: on CUDA, above COMPILE_BLOCKS_ABOVE parameters). Measured on an H200: the dense 1B step
    (4 x 4096) 304.6 -> 243.9 ms compiled (bench/train_step_variants.py); the Nemotron-H 0.9B LoRA step (2 x 4096; its
    attention and MoE blocks compiled, trainers/lora_experts.py) 170.0 -> 98.5 ms, against full fine-tuning's 107.8 ms
    compiled in the same call (bench/README.md, hybrid LoRA: that step is host-bound, and varies by machine); its
    Mamba mixers replayed from CUDA graphs (`graph_mamba_mixers`) 106.2-106.4 -> 99.4-99.6 ms (full fine-tuning
    121.0-121.6 -> 101.0-104.2 ms; bench/results/train_step_variants-nemotron-h-graphs-1.json and -2.json).
    """
    env = distributed.setup()
    config = loading.load_config(model_path)
    storage = getattr(torch, "float32" if env.distributed and lora is None else dtype)

    def policy(model: PreTrainedModel, compiled: bool = False) -> PreTrainedModel:
        return make_trainable(model, model_path, lora, seed, activation_checkpointing, compiled)

    if not env.distributed:
        model = loading.load_causal_lm(model_path, dtype=storage).to(device())
        if compile_blocks is None:
            compile_blocks = compiles_by_default(device().type, model.num_parameters())
        return _adapters_in(policy(model, compile_blocks), storage)
    compute = getattr(torch, dtype) if dtype != "float32" else None
    return distributed.load_sharded(
        lambda: policy(loading.model_from_config(config, dtype=storage)),
        lambda: policy(loading.load_causal_lm(model_path, dtype=storage)),
        compute, env).train()


def _adapters_in(model: PreTrainedModel, dtype: torch.dtype) -> PreTrainedModel:
    """On one process, LoRA adapters stored in the compute dtype, like the weights of full fine-tuning there.

    peft keeps adapters in float32 over a bf16 base and casts each adapted layer's input to float32, so the adapter
    products run in float32: measured on an H200 (bench/results/train_step_variants-llama-1b.json, 1B Llama,
    4 x 4096) that LoRA step is 1.6x slower and peaks 1.5x higher than with bf16 adapters, and slower than full
    fine-tuning. Under FSDP2 the mixed-precision policy computes in bf16 over float32 masters instead, so the
    distributed path keeps float32 adapters. The FP32 head copy (train_lm_head) is no adapter and stays float32."""
    for name, param in model.named_parameters():
        if param.requires_grad and "lora_" in name:
            param.data = param.data.to(dtype)
    return model


def make_trainable(model: PreTrainedModel, model_path: Path | None, lora: LoRASettings | None, seed: int,
                   activation_checkpointing: bool | None, compile_blocks: bool = False) -> PreTrainedModel:
    """Training setup of a loaded (or meta) model: no KV cache, activation checkpointing, the LoRA adapter, and
    with `compile_blocks` its decoder blocks compiled (`compile_decoder_blocks`, after the adapter is in place).
    LoRA target defaults come from the model's own config (`model_path` is only named in messages)."""
    model = _make_trainable(model, lora, seed, activation_checkpointing)
    if compile_blocks:
        compile_decoder_blocks(model)
        graph_mamba_mixers(model)
    return model


def graph_mamba_mixers(model: torch.nn.Module) -> int:
    """On the one-GPU fast path (with `compile_blocks`), the Mamba mixers' training forward and backward replayed
    from CUDA graphs where their calls repeat (`trainers.step_graphs`); returns how many mixers. Nothing happens to
    a model on the CPU (its mixers are not on the Triton kernels there), or with activation checkpointing, whose
    point (not keeping the blocks' activations) the graphs' memory pools would undo.

    Why: the mixers run mamba-ssm's Triton SSD kernels launched from Python, ~20 a layer and pass; on the
    Nemotron-H bench shape (H200, 2 x 4096) that host work (30-34 ms a step for 6 layers) made the step host-bound,
    98.5-130.8 ms for 79.5 ms of kernels (bench/README.md, hybrid LoRA). Replayed, the 6 mixers take 3.8 ms of host
    time a step for their 39 ms of kernels; the step went 106.2-106.4 -> 99.4-99.6 ms with LoRA and 121.0-121.6 ->
    101.0-104.2 ms with full fine-tuning in two calls (bench/results/train_step_variants-nemotron-h-graphs-1.json, -2)."""
    checkpointing = any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())
    on_gpu = next(model.parameters()).is_cuda
    if checkpointing or not on_gpu or not mamba_kernels.on_triton(model):
        return 0
    return mamba_kernels.use_triton_ssd(model, graphed=True)


def decoder_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated decoder blocks: its longest `nn.ModuleList` (`model.layers` in transformers' causal
    LMs, under peft's wrappers too); blocks holding a Mamba mixer are left out (their Triton SSD kernels and the
    recurrent state are not for the compiler)."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    if not lists:
        return []
    blocks = max(lists, key=len)
    return [b for b in blocks if not any("Mamba" in type(m).__name__ for m in b.modules())]


def compile_decoder_blocks(model: torch.nn.Module, backend: str = "inductor") -> int:
    """torch.compile each decoder block in place (regional compilation); returns how many were compiled.

    Between its matmuls a transformer block runs a dozen memory-bound elementwise passes (RMSNorm in float32, rotary,
    SiLU x up, residual adds, their backward): measured on an H200 (bench/train_step_variants.py, 1B Llama, 4 x 4096)
    they took about 40% of an eager step's GPU time, and the launch gaps between them another 10% of the step.
    Inductor fuses them into a few kernels.
    The blocks share one code object, so one compilation (and one more when shapes vary: dynamic shapes) serves all
    of them. Parameter names, state dicts and hooks stay as they are (`nn.Module.compile` keeps the module).
    The Mamba mixers' LoRA-adapted in_proj is not compiled as a region of its own: on the Nemotron-H bench shape
    that measured slower in two of three H200 calls (bench/README.md, hybrid LoRA)."""
    blocks = decoder_blocks(model)
    for block in blocks:
        block.compile(backend=backend)
    return len(blocks)


def _make_trainable(model: PreTrainedModel, lora: LoRASettings | None, seed: int,
                    activation_checkpointing: bool | None) -> PreTrainedModel:
    model.config.use_cache = False
    fast_mamba(model)
    n_params = sum(p.numel() for p in model.parameters())
    if activation_checkpointing or (activation_checkpointing is None and n_params > ACTIVATION_CHECKPOINTING_ABOVE):
        # Non-reentrant: works with frozen inputs (LoRA) and with FSDP2's per-block hooks.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora is None:
        return model.train()
    from peft import LoraConfig, get_peft_model

    modules, params = lora_targets(model.config.model_type, lora)
    torch.manual_seed(seed)  # LoRA A matrices are random: same seed, same adapter init
    with loading.peft_wrapping():
        peft_model = get_peft_model(model, LoraConfig(
            r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=modules,
            target_parameters=params or None, modules_to_save=["lm_head"] if lora.train_lm_head else None,
        ))
    if lora.train_lm_head:
        _fp32_trainable_head(peft_model)
    lora_experts.use_plain_experts(peft_model)  # peft's experts LoRA, without its per-call parametrization
    return peft_model.train()


def _fp32_trainable_head(peft_model) -> None:
    """Keeps the trainable lm_head copy in FP32 (small updates to a BF16 head round away)."""
    head = peft_model.get_output_embeddings()
    trainable = head.modules_to_save["default"]
    trainable.float()
    # The hidden states arrive in the model dtype: cast them to the head weight's dtype at call time. That is FP32 on
    # one process; under FSDP2's mixed-precision policy the gathered weight is the compute dtype (the FP32 master
    # stays sharded), and an FP32 input would fail the matmul (first seen on an H200, bench/train_memory.py).
    trainable.register_forward_pre_hook(lambda m, args: (args[0].to(m.weight.dtype),))
