"""What a job will cost before it runs, from the model and what this lab's earlier jobs measured.

Pure functions over typed values: the session view (tools/session.py) gathers the measurements from the
notebook and asks here; nothing in this module reads the notebook, the clock or a GPU.

    model = model_compute(Path("lab/base"))                        # counts parameters on the meta device
    train_forecast(tokens=2e8, model=model, gpus=8, measured=[...], hardware=Hardware())
    # JobForecast(gpu_hours=..., wall_hours=..., source='measured' | 'declared_mfu', ...)
    eval_forecast(tokens=4e5, model=model, gpus=1, measured=[...], hardware=Hardware())

Training: model FLOPs per trained token are 6 x active parameters (forward 2, backward 4: Kaplan et al. 2020,
"Scaling Laws for Neural Language Models", section 2.1; the attention-score term is left out, as in the PaLM
paper's MFU). An MoE counts only the experts a token is routed to. The lab's speed is its achieved model FLOP/s
per GPU over earlier training jobs (which carries over between models of one lab: the same GPUs, kernels and
parallelism), else the declared MFU times the GPU's peak until a job has measured it.

Evals: decoding is bound by reading the weights once per step, so a token's cost scales with the active
parameters too; the lab's decode throughput per GPU, measured by earlier eval jobs and rescaled to this model's
active parameters, else a declared decode MFU (2 FLOPs per active parameter per token).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:  # the trainers (torch, transformers) load only when memory admission asks
    from trainers.common import TrainConfig

TRAIN_FLOPS_PER_PARAM = 6  # forward + backward, per token per active parameter
DECODE_FLOPS_PER_PARAM = 2  # forward only
TRAIN_KINDS = frozenset({"sft", "dpo", "klce", "rft"})
EVAL_KINDS = frozenset({"eval", "reference", "truth"})
# Kinds whose start-up is alike: training (model load, compiled blocks, checkpoint), serving a model (load, graph
# capture: evals, reference answers, the truth scorer, the bundle's reload).
KIND_GROUPS = (TRAIN_KINDS, EVAL_KINDS | {"bundle"})


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelCompute(_Frozen):
    """What a forecast needs of a model: its parameters, and those one token actually uses."""

    total_params: int = Field(gt=0, description="All parameters, every expert of an MoE included.")
    active_params: int = Field(gt=0, description="Parameters one token passes through: the dense part plus "
                               "num_experts_per_tok of the n_routed_experts routed experts.")

    @property
    def train_flops_per_token(self) -> float:
        return TRAIN_FLOPS_PER_PARAM * self.active_params

    @property
    def decode_flops_per_token(self) -> float:
        return DECODE_FLOPS_PER_PARAM * self.active_params


class Hardware(_Frozen):
    """The lab's GPUs as forecasts assume them before any job has measured them."""

    peak_flops_per_gpu: float = Field(989e12, gt=0, description="Dense bf16 FLOP/s of one GPU (H100/H200 SXM: 989e12).")
    declared_mfu: float = Field(0.25, gt=0, le=1, description="Model FLOPs utilisation assumed for training until a "
                                "training job of this lab has measured its own.")
    declared_decode_mfu: float = Field(0.02, gt=0, le=1, description="Share of peak FLOP/s assumed for decoding until "
                                       "an eval job has measured its throughput (decoding is bound by memory, not compute).")
    declared_startup_s: float = Field(15.0, ge=0, description="Start-up and write-out of a job that loads a model "
                                      "(process, CUDA initialisation, model load, graph capture) until one has "
                                      "measured it: about 10 s of process and CUDA on an H200, and the load.")
    declared_train_startup_s: float = Field(45.0, ge=0, description="The same for a training job until one has "
                                            "measured it: the load and the compiled blocks' first step (29 s on an "
                                            "H200 for a 0.9B hybrid: bench/results/train_throughput-nemotron-h-graphs-"
                                            "b4-2.json), then the checkpoint.")

    def startup_s(self, kind: str) -> float:
        """The declared start-up of a job of launcher kind `kind` that loads a model."""
        return self.declared_train_startup_s if kind in TRAIN_KINDS else self.declared_startup_s


DEFAULT_HARDWARE = Hardware()


class MeasuredJob(_Frozen):
    """One completed job of this lab, as the session view reads it from the notebook."""

    kind: Literal["train", "eval"] = Field(description="train: tokens trained; eval: tokens generated.")
    tokens: float = Field(gt=0, description="Tokens the job trained on (every epoch) or generated.")
    gpu_seconds: float = Field(gt=0, description="Seconds it ran times the GPUs it held (its measured device-seconds).")
    active_params: int = Field(gt=0, description="Active parameters of the model it ran (ModelCompute.active_params).")


class JobForecast(_Frozen):
    """A job's forecast cost."""

    gpu_hours: float = Field(ge=0, description="Forecast GPU-hours (the ledger's unit).")
    wall_hours: float = Field(ge=0, description="Forecast wall-clock hours on its GPUs.")
    tokens_per_s_per_gpu: float = Field(gt=0, description="The throughput assumed, tokens per second per GPU.")
    source: Literal["measured", "declared_mfu"] = Field(
        description="measured: from earlier jobs of this lab; declared_mfu: the lab's declared MFU (no measurement yet).")
    measured_jobs: int = Field(ge=0, description="Earlier jobs the throughput was taken from.")


def active_parameters(total: int, routed_expert_params: int, n_routed_experts: int | None,
                      experts_per_token: int | None) -> int:
    """Parameters one token passes through: the routed experts count only for the share a token is sent to."""
    if not n_routed_experts or not routed_expert_params:
        return total
    return total - routed_expert_params + routed_expert_params * (experts_per_token or 0) // n_routed_experts


def model_compute(model_path: Path) -> ModelCompute:
    """ModelCompute of a checkpoint or config directory, counted on the meta device (no weights read).

    Routed experts are the parameters under an `.experts.` module (Nemotron-H, Qwen-MoE, Mixtral's
    `block_sparse_moe.experts`); a shared expert is dense and counts whole."""
    import torch

    from core import loading

    config = loading.load_config(model_path)
    with torch.device("meta"):
        model = loading.model_from_config(config)
    total = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    experts = getattr(config, "n_routed_experts", None) or getattr(config, "num_local_experts", None)
    per_token = getattr(config, "num_experts_per_tok", None)
    return ModelCompute(total_params=total, active_params=active_parameters(total, routed, experts, per_token))


def train_forecast(tokens: float, model: ModelCompute, gpus: int, measured: Sequence[MeasuredJob] = (),
                   hardware: Hardware = DEFAULT_HARDWARE) -> JobForecast:
    """A training job's cost: `tokens` trained (rows x length x epochs) of `model` on `gpus` GPUs.

    The speed is the model FLOP/s per GPU that this lab's earlier training jobs achieved (their FLOPs over their
    GPU-seconds, pooled), else the declared MFU of the GPU's peak."""
    _positive(tokens=tokens, gpus=gpus)
    runs = [m for m in measured if m.kind == "train"]
    if runs:
        flops_per_gpu_s = sum(TRAIN_FLOPS_PER_PARAM * m.active_params * m.tokens for m in runs) / sum(
            m.gpu_seconds for m in runs)
        source: Literal["measured", "declared_mfu"] = "measured"
    else:
        flops_per_gpu_s = hardware.declared_mfu * hardware.peak_flops_per_gpu
        source = "declared_mfu"
    return _forecast(tokens, flops_per_gpu_s / model.train_flops_per_token, gpus, source, len(runs))


def eval_forecast(tokens: float, model: ModelCompute, gpus: int, measured: Sequence[MeasuredJob] = (),
                  hardware: Hardware = DEFAULT_HARDWARE) -> JobForecast:
    """An eval job's cost: `tokens` to generate (items x replicates x expected answer length) on `gpus` GPUs.

    The speed is the decode throughput this lab's earlier eval jobs measured, each rescaled from its model's
    active parameters to this one's (a step reads every active weight once), else the declared decode MFU."""
    _positive(tokens=tokens, gpus=gpus)
    runs = [m for m in measured if m.kind == "eval"]
    if runs:
        # Pooled as parameter-tokens per GPU-second, so a long job weighs more than a short one.
        param_tokens_per_gpu_s = sum(m.active_params * m.tokens for m in runs) / sum(m.gpu_seconds for m in runs)
        rate = param_tokens_per_gpu_s / model.active_params
        source: Literal["measured", "declared_mfu"] = "measured"
    else:
        rate = hardware.declared_decode_mfu * hardware.peak_flops_per_gpu / model.decode_flops_per_token
        source = "declared_mfu"
    return _forecast(tokens, rate, gpus, source, len(runs))


class MeasuredRun(_Frozen):
    """One completed job of this lab with its wall split (core/wall.py), as the launcher reads it from the notebook."""

    kind: str = Field(description="Launcher kind: sft, eval, reference, merge, bundle, ...")
    model_job: bool = Field(description="Whether a model ran in it (its resources named a device).")
    fixed_s: float = Field(ge=0, description="Start-up and write-out seconds: what the job costs whatever its size.")
    work_s: float = Field(ge=0, description="Seconds of work.")
    units: float | None = Field(None, description="Its work units (rows x steps, suites x replicates), when sized.")
    tokens: float | None = Field(None, description="Tokens it was sized by (trained, or generated at most).")
    active_params: int | None = Field(None, description="Active parameters of its model.")


class RunSize(_Frozen):
    """What is known before launch of the job to forecast."""

    kind: str
    model_job: bool
    units: float | None = None
    tokens: float | None = None
    active_params: int | None = None
    job_class: Literal["train", "eval"] | None = None


def run_seconds(size: RunSize, runs: Sequence[MeasuredRun]) -> float | None:
    """Wall seconds of one run of a job, from this lab's earlier runs: a fixed part (start-up and write-out, measured
    on jobs of its kind, else of its group (KIND_GROUPS), else on jobs that load a model like it does, or that do
    not) plus its work (its units at
    its kind's seconds per unit; else its tokens at its class's seconds per token, rescaled by active parameters;
    else its kind's mean work). None when no earlier run says anything about it. A job's fixed part does not
    grow with its size: pooling whole runs per unit (the throughput forecast) charged a 3-replicate eval three
    start-ups."""
    same = [r for r in runs if r.kind == size.kind]
    group = next((g for g in KIND_GROUPS if size.kind in g), frozenset())
    alike = same or [r for r in runs if r.kind in group]
    if not alike and size.kind in TRAIN_KINDS:
        return None  # no training measured: an eval's start-up says nothing of compiled blocks (the declared one)
    alike = alike or [r for r in runs if r.model_job == size.model_job]
    if not alike:
        return None
    fixed = sum(r.fixed_s for r in alike) / len(alike)
    return fixed + _work_seconds(size, same, runs)


def _work_seconds(size: RunSize, same: Sequence[MeasuredRun], runs: Sequence[MeasuredRun]) -> float:
    sized = [r for r in same if r.units]
    if size.units and sized:
        return size.units * sum(r.work_s for r in sized) / sum(r.units or 0.0 for r in sized)
    kinds = TRAIN_KINDS if size.job_class == "train" else EVAL_KINDS
    by_tokens = [r for r in runs if r.kind in kinds and r.tokens and r.active_params]
    if size.tokens and size.active_params and by_tokens:
        # seconds per (token x active parameter), pooled: a step reads (decode) or multiplies (train) every weight
        per = sum(r.work_s for r in by_tokens) / sum((r.tokens or 0.0) * (r.active_params or 0) for r in by_tokens)
        return size.tokens * size.active_params * per
    if same:
        return sum(r.work_s for r in same) / len(same)
    return 0.0


def _forecast(tokens: float, tokens_per_s_per_gpu: float, gpus: int, source: Literal["measured", "declared_mfu"],
              n: int) -> JobForecast:
    gpu_seconds = tokens / tokens_per_s_per_gpu
    return JobForecast(gpu_hours=gpu_seconds / 3600, wall_hours=gpu_seconds / gpus / 3600,
                       tokens_per_s_per_gpu=tokens_per_s_per_gpu, source=source, measured_jobs=n)


def _positive(**values: float) -> None:
    bad = [f"{k} = {v}" for k, v in values.items() if not v > 0]
    if bad:
        raise ValueError(f"a forecast needs positive {', '.join(bad)}")


# ---- memory admission ---------------------------------------------------------------------------

MAX_GPUS_SUGGESTED = 512  # more GPUs are tried by doubling up to this many


class MemoryOption(_Frozen):
    """One change to a training config that its memory estimate says would fit the GPU."""

    change: str = Field(description="What to change: 'micro_batch_size = 1', 'LoRA (r 16)', '16 GPUs'.")
    per_gpu_gib: float = Field(description="The estimate per GPU after the change, GiB.")


def fitting_alternatives(config: TrainConfig, world_size: int, gpu_memory_gib: float) -> list[MemoryOption]:
    """What would fit a GPU of `gpu_memory_gib` for a training config that does not on `world_size` GPUs: micro-batch
    1, LoRA (full fine-tuning only), or the fewest GPUs (doubling) that would; each with its estimate (trainers/memory.py).
    Empty when none of them would fit."""
    from trainers.common import LoRASettings
    from trainers.memory import GIB, estimate_job

    def fits(candidate: TrainConfig, world: int) -> float | None:
        total = estimate_job(candidate, world).total / GIB
        return total if total <= gpu_memory_gib else None

    options = []
    if config.micro_batch_size > 1:
        one = config.model_copy(update={"micro_batch_size": 1})
        if (gib := fits(one, world_size)) is not None:
            options.append(MemoryOption(change="micro_batch_size = 1", per_gpu_gib=round(gib, 2)))
    if config.lora is None:
        lora = LoRASettings()
        if (gib := fits(config.model_copy(update={"lora": lora}), world_size)) is not None:
            options.append(MemoryOption(change=f"LoRA (r {lora.r})", per_gpu_gib=round(gib, 2)))
    world = world_size * 2
    while world <= MAX_GPUS_SUGGESTED:
        if (gib := fits(config, world)) is not None:
            options.append(MemoryOption(change=f"{world} GPUs", per_gpu_gib=round(gib, 2)))
            break
        world *= 2
    return options
