"""The user's training recipe: `[train]` of lab.toml, the defaults derived from the model for what it leaves
out, and the ranges a planner may choose within. Pure: it reads a model's config.json (and the headers of its
safetensors files when they are there), never its weights, and imports neither torch nor transformers.

    [train]                 # settings for every trainer family ...
    method = "lora"
    lr_range = [2e-5, 2e-4]
    [train.lora]            # ... the LoRA adapter of every family that trains one
    r = 64
    fp32_head = true
    [train.dpo]             # ... and per family (sft, dpo, klce, rft), overriding [train]
    lr = 5e-6
    beta = 0.1

Resolution, per family and key: [train.<family>], else [train], else the model rule (DEFAULT_RULES, the README's
table). A derived default that falls outside a range the user wrote is moved to the range's nearest end; a value
the user wrote outside a range the user wrote is refused at load. Lengths and epochs depend on the dataset and are
settled when an arm trains (`trainer_settings`): `max_len` left out is the dataset's 99th-percentile row length,
rounded up to 256 tokens and capped at the model's context.

    shape = model_shape(Path("models/base"))
    recipe = resolve(TrainSection(), shape, verifier_suites=["math"])
    recipe.families["sft"].lr          # 1e-05 for a 7B model, full fine-tuning
    out_of_range(recipe, {"trainer": "sft", "lr": 1e-3})   # ['lr 0.001 is outside [train] lr_range ...']
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Family = Literal["sft", "dpo", "klce", "rft"]
FAMILIES: tuple[Family, ...] = ("sft", "dpo", "klce", "rft")
Method = Literal["full", "lora"]
BatchUnit = Literal["sequences", "tokens"]
Schedule = Literal["linear", "cosine"]


# The elements of a `<key>_range`: the bounds of the key itself (a learning rate is positive, a batch at least one
# row), so that `lr_range = [-1, 1]` or `batch_range = [0, 0]` is refused at load, naming the element, instead of
# reaching a trainer (pydantic's traceback at `act: train`) or the gate (a division by the batch).
LrBound = Annotated[float, Field(gt=0, le=1)]
StepsBound = Annotated[int, Field(ge=1, le=10_000_000)]
BatchBound = Annotated[int, Field(ge=1, le=1 << 30)]
BetaBound = Annotated[float, Field(gt=0, le=100)]
WeightBound = Annotated[float, Field(ge=0, le=100)]
KBound = Annotated[int, Field(ge=1, le=256)]
# A LoRA target: a module or parameter name suffix, dotted names of Python identifiers. The empty suffix would match
# the model's root (peft then adapts whatever it finds, nothing the user named); which modules a suffix matches is
# checked against the parent before a session opens (trainers/targets.py).
TargetName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*$", max_length=200)]


class _Strict(BaseModel):
    # Like every lab.toml section: unknown keys and wrong types are refused, never coerced.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


def _check_range(name: str, bounds: list[float] | None) -> None:
    if bounds is not None and bounds[0] > bounds[1]:
        raise ValueError(f"{name}_range [{bounds[0]:g}, {bounds[1]:g}] must be [low, high] with low <= high")


def _check_inside(name: str, value: float | None, bounds: list[float] | None) -> None:
    if value is not None and bounds is not None and not bounds[0] <= value <= bounds[1]:
        raise ValueError(f"{name} = {value:g} is outside {name}_range [{bounds[0]:g}, {bounds[1]:g}]")


def _check_multiple(batch: int | None, micro: int | None, where: str = "") -> None:
    # Gradient accumulation runs whole micro-batches: a batch that is no multiple of the micro-batch the user wrote
    # would train on another batch than the one written.
    if batch is not None and micro is not None and batch % micro:
        raise ValueError(f"{where}batch ({batch}) must be a multiple of micro_batch ({micro}): gradient "
                         "accumulation runs whole micro-batches")


class LoRASection(_Strict):
    """[train.lora] (or [train.<family>.lora]): the adapter; keys left out take the rules' defaults."""

    r: int | None = Field(None, ge=1, le=4096, description="LoRA rank (default 16).")
    alpha: float | None = Field(None, gt=0, le=65536, description="LoRA alpha; the update is scaled by alpha / r "
                                                                  "(default 2 x r).")
    dropout: float | None = Field(None, ge=0, lt=1, description="Dropout on the adapter input (default 0).")
    target_modules: list[TargetName] | None = Field(
        None, min_length=1, max_length=64, description="Module name suffixes to adapt (default: the architecture's list, "
        "trainers/common.py: attention and MLP projections, and Nemotron-H's Mamba in_proj).")
    target_parameters: list[TargetName] | None = Field(
        None, max_length=64, description="Parameter name suffixes adapted directly, e.g. routed experts stored as 3-D tensors "
        "(default: Nemotron-H's experts, none for dense models).")
    fp32_head: bool | None = Field(None, description="Also train lm_head in full, kept in FP32 (default false).")


class CommonSection(_Strict):
    """Keys every trainer family takes, in [train] (all families) or [train.<family>] (that family)."""

    method: Method | None = Field(None, description="'full' fine-tuning or a 'lora' adapter (default full).")
    lora: LoRASection | None = Field(None, description="The LoRA adapter, when method = 'lora'.")
    lr: float | None = Field(None, gt=0, le=1, description="Peak learning rate (default: the rules table).")
    lr_range: list[LrBound] | None = Field(None, min_length=2, max_length=2,
                                         description="[low, high] learning rates a planner may choose (default: "
                                                     "lr / 10 to lr x 3).")
    schedule: Schedule | None = Field(None, description="'cosine' decay to a floor, or 'linear' decay to zero, "
                                                        "after the warm-up (default cosine).")
    warmup_ratio: float | None = Field(None, ge=0, lt=1, description="Share of the steps spent warming up linearly "
                                                                     "(default 0.03).")
    min_lr_ratio: float | None = Field(None, ge=0, le=1, description="cosine: the floor, as a share of the peak "
                                                                     "learning rate (default 0.1).")
    steps: int | None = Field(None, ge=1, le=10_000_000, description="Optimizer steps (or give epochs).")
    epochs: float | None = Field(None, gt=0, le=1000, description="Passes over the dataset, turned into steps "
                                                                  "when the arm trains (default 1 when steps is "
                                                                  "not given either).")
    steps_range: list[StepsBound] | None = Field(None, min_length=2, max_length=2,
                                          description="[low, high] optimizer steps a planner may choose (default: "
                                                      "any).")
    batch_unit: BatchUnit | None = Field(None, description="Unit of batch and micro_batch: 'sequences' (rows, or "
                                                           "packs when packing) or 'tokens' (default sequences).")
    batch: int | None = Field(None, ge=1, le=1 << 30, description="Global batch per optimizer step, in batch_unit "
                                                                  "(default: the rules table).")
    batch_range: list[BatchBound] | None = Field(None, min_length=2, max_length=2,
                                          description="[low, high] global batches a planner may choose, in "
                                                      "batch_unit (default: batch / 4 to batch x 4).")
    micro_batch: int | None = Field(None, ge=1, le=1 << 30, description="Per forward pass, in batch_unit; the "
                                                                        "rest is gradient accumulation (default: "
                                                                        "the rules table).")
    max_len: int | None = Field(None, gt=8, le=1 << 22, description="Token limit of a training row, prompt and "
                                                                    "answer (default: the dataset's lengths up "
                                                                    "to the model's context).")
    max_prompt_len: int | None = Field(None, ge=1, le=1 << 22, description="dpo: prompt tokens kept (the last "
                                                                           "ones); default all within max_len.")
    max_answer_len: int | None = Field(None, ge=1, le=1 << 22, description="dpo: longest answer kept (longer "
                                                                           "pairs are dropped); rft: the sampled "
                                                                           "answers' token cap (default: the served "
                                                                           "max_new_tokens).")
    weight_decay: float | None = Field(None, ge=0, le=10, description="AdamW weight decay (default 0).")
    grad_clip: float | None = Field(None, gt=0, le=1e6, description="Max global gradient norm (default 1).")

    @model_validator(mode="after")
    def _own_ranges(self) -> CommonSection:
        for name in ("lr", "steps", "batch"):
            bounds = getattr(self, f"{name}_range")
            _check_range(name, bounds)
            _check_inside(name, getattr(self, name), bounds)
        if self.steps is not None and self.epochs is not None:
            raise ValueError("give steps or epochs, not both")
        if self.batch is not None and self.micro_batch is not None and self.micro_batch > self.batch:
            raise ValueError(f"micro_batch ({self.micro_batch}) cannot exceed batch ({self.batch})")
        _check_multiple(self.batch, self.micro_batch)
        return self


class SFTSection(CommonSection):
    """[train.sft]: supervised fine-tuning on preferred answers."""

    packing: bool | None = Field(None, description="Pack rows into max_len sequences (default false; refused "
                                                   "where a recurrent model's state would leak across rows).")


class DPOSection(CommonSection):
    """[train.dpo]: DPO with an NLL term on the chosen answer."""

    beta: float | None = Field(None, gt=0, le=100, description="DPO inverse temperature (default 0.1).")
    beta_range: list[BetaBound] | None = Field(None, min_length=2, max_length=2,
                                           description="[low, high] betas a planner may choose (default 0.01-1).")
    nll_weight: float | None = Field(None, ge=0, le=100, description="Weight of the chosen answer's NLL (default 1).")
    nll_weight_range: list[WeightBound] | None = Field(None, min_length=2, max_length=2,
                                                 description="[low, high] NLL weights a planner may choose "
                                                             "(default 0-2).")

    @model_validator(mode="after")
    def _dpo_ranges(self) -> DPOSection:
        for name in ("beta", "nll_weight"):
            _check_range(name, getattr(self, f"{name}_range"))
            _check_inside(name, getattr(self, name), getattr(self, f"{name}_range"))
        return self


class KLCESection(CommonSection):
    """[train.klce]: cross-entropy on preferred answers with a forward-KL leash to the frozen parent."""

    kl_coef: float | None = Field(None, ge=0, le=100, description="Weight of the KL to the parent (default 0.1).")
    kl_coef_range: list[WeightBound] | None = Field(None, min_length=2, max_length=2,
                                              description="[low, high] KL weights a planner may choose "
                                                          "(default 0-1).")
    replay_share: float | None = Field(None, ge=0, lt=1, description="Share of a KL-CE dataset's rows drawn from "
                                                                     "replay data, carrying KL only (default 0.2).")

    @model_validator(mode="after")
    def _klce_ranges(self) -> KLCESection:
        _check_range("kl_coef", self.kl_coef_range)
        _check_inside("kl_coef", self.kl_coef, self.kl_coef_range)
        return self


class RFTSection(CommonSection):
    """[train.rft]: rejection-sampling fine-tuning; the verifier is an eval suite's scorer."""

    k: int | None = Field(None, ge=1, le=256, description="Samples per prompt (default 4).")
    k_range: list[KBound] | None = Field(None, min_length=2, max_length=2,
                                      description="[low, high] samples per prompt a planner may choose "
                                                  "(default 1-16).")
    verifiers: list[str] | None = Field(None, min_length=1, description="[[evals]] suite names whose scorers "
                                                                        "verify samples (default: every suite "
                                                                        "with a verifying scorer).")

    @model_validator(mode="after")
    def _rft_ranges(self) -> RFTSection:
        _check_range("k", self.k_range)
        _check_inside("k", self.k, self.k_range)
        return self


class TrainSection(CommonSection):
    """[train] of lab.toml: keys for every family here, per family in its own table."""

    sft: SFTSection = Field(default_factory=SFTSection, description="SFT settings.")
    dpo: DPOSection = Field(default_factory=DPOSection, description="DPO + NLL settings.")
    klce: KLCESection = Field(default_factory=KLCESection, description="KL-leashed CE settings.")
    rft: RFTSection = Field(default_factory=RFTSection, description="Rejection-sampling FT settings.")


# ---- the model ---------------------------------------------------------------------------------------------

class ModelShape(BaseModel):
    """What the defaults are derived from, read from a model's config.json."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    model_type: str = Field(description="config.json's model_type.")
    architecture: str = Field(description="The first of config.json's architectures ('' when none is named).")
    params_total: int = Field(description="Parameters: counted from the safetensors headers where present, else "
                                          "estimated from the config.")
    params_active: int = Field(description="Parameters one token passes through (MoE: the routed experts it uses).")
    context: int = Field(description="The model's context length (max_position_embeddings or its kin).")
    moe: bool = Field(description="Whether the model routes tokens to experts.")


_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length")
_EXPERT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")
_TOPK_KEYS = ("num_experts_per_tok", "moe_topk", "num_experts_per_token", "top_k")
DEFAULT_CONTEXT = 4096  # a config that names no context length


def _first(cfg: dict[str, Any], keys: tuple[str, ...], default: Any = None) -> Any:
    return next((cfg[k] for k in keys if isinstance(cfg.get(k), int | float) and cfg[k]), default)


def _layer_kinds(cfg: dict[str, Any], experts: int) -> list[str]:
    """One of 'mamba', 'attention', 'mlp', 'moe' or 'attention+mlp' / 'attention+moe' per block."""
    pattern = cfg.get("hybrid_override_pattern")
    if isinstance(pattern, str) and pattern:  # Nemotron-H: M mamba, * attention, - MLP, E MoE
        return [{"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}.get(c, "mlp") for c in pattern]
    types = cfg.get("layers_block_type") or cfg.get("layer_types")
    layers = int(cfg.get("num_hidden_layers") or cfg.get("n_layer") or cfg.get("num_layers") or 0)
    if cfg.get("model_type") == "nemotron_h" and isinstance(types, list):
        names = {"linear_attention": "mamba", "mamba": "mamba", "full_attention": "attention", "attention": "attention",
                 "moe": "moe", "mlp": "mlp"}
        return [names.get(str(t), "mlp") for t in types]
    return ["attention+moe" if experts else "attention+mlp"] * layers


def _block_params(kind: str, cfg: dict[str, Any], hidden: int, experts: int, topk: int) -> tuple[int, int]:
    """(total, active) parameters of one block: standard projection shapes, norms and biases left out."""
    heads = int(cfg.get("num_attention_heads") or cfg.get("n_head") or 1)
    kv = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    inter = int(cfg.get("intermediate_size") or cfg.get("ffn_hidden_size") or 4 * hidden)
    moe_inter = int(cfg.get("moe_intermediate_size") or inter)
    gated = cfg.get("model_type") != "nemotron_h"  # Nemotron-H's MLPs and experts are up/down only (relu^2)
    mats = 3 if gated else 2
    attn = hidden * head_dim * (heads + 2 * kv) + heads * head_dim * hidden
    mlp = mats * hidden * inter
    shared = int(cfg.get("n_shared_experts") or 0) * mats * hidden * int(cfg.get("moe_shared_expert_intermediate_size")
                                                                          or moe_inter)
    expert = mats * hidden * moe_inter
    moe = (experts * expert + shared + hidden * experts, topk * expert + shared + hidden * experts)
    if kind == "mamba":
        m_heads = int(cfg.get("mamba_num_heads") or 2 * hidden // int(cfg.get("mamba_head_dim") or 64))
        m_inner = m_heads * int(cfg.get("mamba_head_dim") or 64)
        groups, state = int(cfg.get("n_groups") or 1), int(cfg.get("ssm_state_size") or 128)
        n = hidden * (2 * m_inner + 2 * groups * state + m_heads) + m_inner * hidden
        return n, n
    parts = {"attention": (attn, attn), "mlp": (mlp, mlp), "moe": moe}
    total = active = 0
    for piece in kind.split("+"):
        t, a = parts[piece]
        total, active = total + t, active + a
    return total, active


def _safetensors_params(model_dir: Path) -> int | None:
    """Parameters counted from the safetensors headers (8-byte length, then JSON): exact, and no weight is read."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for f in files:
        with f.open("rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
        total += sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
    return total


def shape_of_config(cfg: dict[str, Any], counted_total: int | None = None) -> ModelShape:
    """The shape of a config.json's contents (multimodal configs: their text_config); `counted_total` replaces the
    estimated total where the weights were counted, and the active count keeps the estimate's share."""
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    text = {**text, "model_type": text.get("model_type", cfg.get("model_type", ""))}
    hidden = int(text.get("hidden_size") or text.get("n_embd") or text.get("d_model") or 0)
    experts = int(_first(text, _EXPERT_KEYS, 0))
    topk = int(_first(text, _TOPK_KEYS, 1 if experts else 0))
    total = active = 0
    for kind in _layer_kinds(text, experts):
        t, a = _block_params(kind, text, hidden, experts, topk)
        total, active = total + t, active + a
    embed = int(text.get("vocab_size") or 0) * hidden * (1 if text.get("tie_word_embeddings") else 2)
    total, active = total + embed, active + embed
    if counted_total:
        active = round(counted_total * active / total) if total else counted_total
        total = counted_total
    archs = cfg.get("architectures") or [""]
    return ModelShape(model_type=str(text["model_type"]), architecture=str(archs[0]), params_total=total,
                      params_active=active, context=int(_first(text, _CONTEXT_KEYS, DEFAULT_CONTEXT)),
                      moe=experts > 0)


def model_shape(model_dir: Path) -> ModelShape:
    """The shape of the model in `model_dir` (its config.json; safetensors headers for the exact total)."""
    cfg = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    return shape_of_config(cfg, _safetensors_params(model_dir))


# ---- the rules -------------------------------------------------------------------------------------------

B = 1_000_000_000
# The rules table (README, "Writing [train] for a real model"). Learning rates follow the seeds' cards (full
# fine-tuning of a 30B-A3B model at 3e-7 to 1e-5, LoRA at 2e-5 to 2e-4) and common practice for smaller models:
# (params_total at least, full lr, lora lr); the first row that fits wins.
LR_RULES: tuple[tuple[int, float, float], ...] = ((B, 1e-5, 1e-4), (100_000_000, 3e-5, 2e-4), (0, 1e-4, 5e-4))
DPO_LR_FACTOR = 0.1  # DPO moves the policy along a log-ratio whose gradient is far steeper than CE's
# (params_total below, micro-batch in sequences): what fits beside AdamW state at a few thousand tokens a row.
MICRO_RULES: tuple[tuple[int, int], ...] = ((B, 8), (4 * B, 4), (16 * B, 2))
GLOBAL_BATCH = 64  # sequences; the seeds trained with 32-128
TOKENS_PER_ROW = 2048  # batch_unit = "tokens" without a batch: the rules' sequences at this many tokens each
LENGTH_QUANTUM = 256
LENGTH_WITHOUT_DATA = 4096  # max_len before a dataset's lengths are known, capped at the context
DEFAULT_RULES = {
    "method": "full",
    "lr (full fine-tuning)": "1e-5 above 1B parameters (total), 3e-5 above 100M, else 1e-4; dpo: x 0.1",
    "lr (lora)": "1e-4 above 1B parameters (total), 2e-4 above 100M, else 5e-4; dpo: x 0.1",
    "lr_range": "lr / 10 to lr x 3",
    "lora": "r 16, alpha 2 x r, dropout 0, the architecture's target modules, no FP32 head",
    "schedule": "cosine to a floor of 0.1 x the peak, warm-up 3% of the steps",
    "steps": "1 epoch of the dataset",
    "batch": f"{GLOBAL_BATCH} sequences; batch_range batch / 4 to batch x 4",
    "micro_batch": "8 sequences below 1B parameters, 4 below 4B, 2 below 16B, else 1",
    "max_len": f"the dataset's 99th-percentile row, rounded up to {LENGTH_QUANTUM} tokens, at most the context",
    "max_answer_len": "rft: the served max_new_tokens; dpo: no limit",
    "weight_decay / grad_clip": "0 / 1.0",
    "kl_coef / replay_share": "0.1 in [0, 1] / 0.2",
    "beta / nll_weight": "0.1 in [0.01, 1] / 1.0 in [0, 2]",
    "k / verifiers": "4 in [1, 16] / every suite whose scorer verifies (math, mcq, constraints, synthetic)",
    "packing": "off",
}
VERIFYING_SCORERS = {"math": "evals.math:score", "mcq": "evals.mcq:score", "constraints": "evals.constraints:score",
                     "synthetic": "evals.synthetic:score"}


def _round(x: float) -> float:
    return float(f"{x:.3g}")  # 1e-5 / 10 is 1.0000000000000002e-06 in floats; a table reads 1e-06


def rule_lr(shape: ModelShape, method: Method, family: Family) -> float:
    full, lora = next(((f, lo) for floor, f, lo in LR_RULES if shape.params_total > floor), LR_RULES[-1][1:])
    return _round((lora if method == "lora" else full) * (DPO_LR_FACTOR if family == "dpo" else 1.0))


def rule_micro_batch(shape: ModelShape) -> int:
    return next((m for below, m in MICRO_RULES if shape.params_total < below), 1)


def rule_max_len(context: int, p99_row_tokens: int | None) -> int:
    """The dataset's 99th-percentile row rounded up to LENGTH_QUANTUM, capped at the context (LENGTH_WITHOUT_DATA
    when the dataset's lengths are not known)."""
    if p99_row_tokens is None:
        return min(context, LENGTH_WITHOUT_DATA)
    return min(context, max(LENGTH_QUANTUM, -(-p99_row_tokens // LENGTH_QUANTUM) * LENGTH_QUANTUM))


# ---- the resolved recipe ----------------------------------------------------------------------------------

class LoRARecipe(BaseModel):
    """The adapter of a LoRA family, every value settled."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    r: int = Field(description="LoRA rank.")
    alpha: float = Field(description="LoRA alpha.")
    dropout: float = Field(description="Adapter input dropout.")
    target_modules: list[str] | None = Field(description="Module suffixes; None: the architecture's list.")
    target_parameters: list[str] | None = Field(description="Parameter suffixes; None: the architecture's.")
    fp32_head: bool = Field(description="lm_head trained in full, in FP32.")


class FamilyRecipe(BaseModel):
    """One trainer family's settings and ranges, settled; `source` says where each value came from."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    family: Family = Field(description="The trainer family.")
    method: Method = Field(description="Full fine-tuning or LoRA.")
    lora: LoRARecipe = Field(description="The adapter (used when method is lora).")
    lr: float = Field(description="Default peak learning rate.")
    lr_range: tuple[float, float] = Field(description="Learning rates a planner may choose.")
    schedule: Schedule = Field(description="Decay after warm-up.")
    warmup_ratio: float = Field(description="Share of the steps warming up.")
    min_lr_ratio: float = Field(description="cosine floor as a share of the peak.")
    steps: int | None = Field(description="Default optimizer steps (None: from epochs).")
    epochs: float | None = Field(description="Default passes over the dataset (None: steps given).")
    steps_range: tuple[int, int] | None = Field(description="Steps a planner may choose; None: any.")
    batch_unit: BatchUnit = Field(description="Unit of batch and micro_batch.")
    batch: int = Field(description="Default global batch.")
    batch_range: tuple[int, int] = Field(description="Global batches a planner may choose.")
    micro_batch: int = Field(description="Per forward pass.")
    max_len: int | None = Field(description="Row token limit; None: from the dataset (rule_max_len).")
    max_prompt_len: int | None = Field(description="dpo: prompt tokens kept; None: all.")
    max_answer_len: int | None = Field(description="dpo: longest answer; rft: sampled answer cap; None: default.")
    context: int = Field(description="The model's context length: no row limit exceeds it.")
    weight_decay: float = Field(description="AdamW weight decay.")
    grad_clip: float = Field(description="Gradient norm clip.")
    packing: bool | None = Field(None, description="sft: pack rows.")
    kl_coef: float | None = Field(None, description="klce: KL weight.")
    kl_coef_range: tuple[float, float] | None = Field(None, description="klce: KL weights a planner may choose.")
    replay_share: float | None = Field(None, description="klce: share of replay rows.")
    beta: float | None = Field(None, description="dpo: beta.")
    beta_range: tuple[float, float] | None = Field(None, description="dpo: betas a planner may choose.")
    nll_weight: float | None = Field(None, description="dpo: NLL weight.")
    nll_weight_range: tuple[float, float] | None = Field(None, description="dpo: NLL weights a planner may choose.")
    k: int | None = Field(None, description="rft: samples per prompt.")
    k_range: tuple[int, int] | None = Field(None, description="rft: samples per prompt a planner may choose.")
    verifiers: list[str] | None = Field(None, description="rft: the suites whose scorers verify.")
    source: dict[str, str] = Field(description="Key -> 'lab.toml [train.<family>]', 'lab.toml [train]' or 'rule'.")


class TrainRecipe(BaseModel):
    """[train] settled for every family, with the model shape the rules read."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    shape: ModelShape = Field(description="The base model's shape.")
    families: dict[Family, FamilyRecipe] = Field(description="Per family.")


def _clamp(value: float, bounds: tuple[float, float] | list[float] | None) -> float:
    return value if bounds is None else min(max(value, bounds[0]), bounds[1])


class _Pick:
    """Values of one family: its own table, then [train], then a rule; records where each came from."""

    def __init__(self, family: Family, own: CommonSection, common: TrainSection):
        self.family, self.own, self.common, self.source = family, own, common, {}

    def __call__(self, key: str, rule: Any = None) -> Any:
        for table, where in ((self.own, f"lab.toml [train.{self.family}]"), (self.common, "lab.toml [train]")):
            if key in type(table).model_fields and getattr(table, key) is not None:
                self.source[key] = where
                return getattr(table, key)
        self.source[key] = "rule"
        return rule


def _lora(pick: _Pick) -> LoRARecipe:
    tables = [t for t in (pick.own.lora, pick.common.lora) if t is not None]

    def value(key: str, default: Any) -> Any:
        return next((getattr(t, key) for t in tables if getattr(t, key) is not None), default)

    r = value("r", 16)
    return LoRARecipe(r=r, alpha=value("alpha", 2.0 * r), dropout=value("dropout", 0.0),
                      target_modules=value("target_modules", None), target_parameters=value("target_parameters", None),
                      fp32_head=value("fp32_head", False))


def _family(family: Family, common: TrainSection, shape: ModelShape, verifier_suites: list[str]) -> FamilyRecipe:
    own: CommonSection = getattr(common, family)
    pick = _Pick(family, own, common)
    method = pick("method", "full")
    lr_range = pick("lr_range")
    lr = pick("lr") or _clamp(rule_lr(shape, method, family), lr_range)
    lr_range = tuple(lr_range or (_round(lr / 10), _round(lr * 3)))
    batch_range = pick("batch_range")
    batch_unit = pick("batch_unit", "sequences")
    per_row = 1 if batch_unit == "sequences" else TOKENS_PER_ROW
    batch = pick("batch") or int(_clamp(GLOBAL_BATCH * per_row, batch_range))
    micro = pick("micro_batch") or min(batch, rule_micro_batch(shape) * per_row)
    if micro > batch:
        raise ValueError(f"train.{family}: micro_batch ({micro}) cannot exceed batch ({batch})")
    if pick.source.get("batch") != "rule" and pick.source.get("micro_batch") != "rule":  # both written, apart
        _check_multiple(batch, micro, f"train.{family}: ")
    steps, epochs = pick("steps"), pick("epochs")
    values: dict[str, Any] = dict(
        family=family, method=method, lora=_lora(pick), lr=lr, lr_range=lr_range,
        schedule=pick("schedule", "cosine"), warmup_ratio=pick("warmup_ratio", 0.03), min_lr_ratio=pick("min_lr_ratio", 0.1),
        steps=steps, epochs=epochs if steps is not None or epochs is not None else 1.0,
        steps_range=tuple(pick("steps_range")) if pick("steps_range") else None,
        batch_unit=batch_unit, batch=batch, batch_range=tuple(batch_range or (max(1, batch // 4), batch * 4)),
        micro_batch=micro, max_len=pick("max_len"), max_prompt_len=pick("max_prompt_len"),
        max_answer_len=pick("max_answer_len"), context=shape.context, weight_decay=pick("weight_decay", 0.0),
        grad_clip=pick("grad_clip", 1.0))
    if values["steps"] is not None:
        values["epochs"] = None
    if values["max_len"] is not None and values["max_len"] > shape.context:
        raise ValueError(f"train.{family}: max_len ({values['max_len']}) exceeds the model's context ({shape.context})")
    match family:
        case "sft":
            values["packing"] = pick("packing", False)
        case "klce":
            values |= dict(kl_coef=pick("kl_coef", 0.1), kl_coef_range=tuple(pick("kl_coef_range") or (0.0, 1.0)),
                           replay_share=pick("replay_share", 0.2))
        case "dpo":
            values |= dict(beta=pick("beta", 0.1), beta_range=tuple(pick("beta_range") or (0.01, 1.0)),
                           nll_weight=pick("nll_weight", 1.0),
                           nll_weight_range=tuple(pick("nll_weight_range") or (0.0, 2.0)))
        case "rft":
            values |= dict(k=pick("k", 4), k_range=tuple(pick("k_range") or (1, 16)),
                           verifiers=pick("verifiers", list(verifier_suites)))
    for name in ("lr", "steps", "batch", "kl_coef", "beta", "nll_weight", "k"):
        value, bounds = values.get(name), values.get(f"{name}_range")
        if value is None or bounds is None:
            continue
        if pick.source.get(name) == "rule":  # a rule's default outside the user's range: its nearest end
            values[name] = type(value)(_clamp(value, bounds))
        elif not bounds[0] <= value <= bounds[1]:  # both written, in different tables
            raise ValueError(f"train.{family}: {name} = {value:g} ({pick.source[name]}) is outside {name}_range "
                             f"[{bounds[0]:g}, {bounds[1]:g}] ({pick.source.get(name + '_range', 'rule')})")
    return FamilyRecipe(**values, source=dict(sorted(pick.source.items())))


def resolve(section: TrainSection, shape: ModelShape, verifier_suites: list[str]) -> TrainRecipe:
    """[train] settled for every family. `verifier_suites`: the lab's suites whose scorer verifies (RFT's default).
    Raises ValueError naming the key for what cannot hold (a max_len past the context, micro above batch)."""
    return TrainRecipe(shape=shape, families={f: _family(f, section, shape, verifier_suites) for f in FAMILIES})


# ---- an arm's settings, and a planner's proposal against the ranges -----------------------------------------

PROPOSABLE = ("lr", "steps", "batch_size", "beta", "nll_weight", "kl_coef", "k")
_RANGE_OF = {"lr": "lr_range", "steps": "steps_range", "batch_size": "batch_range", "beta": "beta_range",
             "nll_weight": "nll_weight_range", "kl_coef": "kl_coef_range", "k": "k_range"}


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def proposed_lr(settings: FamilyRecipe, proposal: dict[str, Any]) -> float:
    """The peak lr an arm proposes (its args as JSON): its own `lr`, else its family's [train] lr, times its
    `lr_scale` (how a sweep is written without knowing the model's lr). The one home of that rule: the range check
    (`out_of_range`) reads it, and so does the arm that trains (`arm_settings`)."""
    lr = proposal.get("lr") or settings.lr
    scale = proposal.get("lr_scale")
    return lr if scale is None else lr * scale


def out_of_range(recipe: TrainRecipe, proposal: dict[str, Any]) -> list[str]:
    """Why a `train` proposal (its args as JSON: trainer, lr, lr_scale, steps, batch_size, ...) leaves [train]'s
    ranges; [] when it stays inside. Values the proposal leaves out are [train]'s own and always inside; a scaled lr
    is checked as scaled (`proposed_lr`)."""
    family = proposal.get("trainer")
    if family not in FAMILIES:
        return [f"trainer {family!r} is not one of {', '.join(FAMILIES)}"]
    settings = recipe.families[family]
    if proposal.get("lr_scale") is not None:
        if not _number(proposal["lr_scale"]):
            return [f"lr_scale {proposal['lr_scale']!r} is not a number"]
        if proposal.get("lr") is None or _number(proposal["lr"]):
            proposal = proposal | {"lr": proposed_lr(settings, proposal)}
    reasons = []
    for name in PROPOSABLE:
        value, bounds = proposal.get(name), getattr(settings, _RANGE_OF[name])
        if value is None or bounds is None:
            continue
        if not _number(value):
            reasons.append(f"{name} {value!r} is not a number")
        elif not bounds[0] <= value <= bounds[1]:
            unit = f" {settings.batch_unit}" if name == "batch_size" else ""
            reasons.append(f"{name} {value:g}{unit} is outside [train.{family}] {_RANGE_OF[name]} "
                           f"[{bounds[0]:g}, {bounds[1]:g}]")
    return reasons


class DatasetSize(BaseModel):
    """What the settings of an arm read from its dataset's manifest."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    rows: int = Field(ge=1, description="Rows of the dataset (pairs count once).")
    tokens: int = Field(ge=0, description="Tokens of all rendered rows.")
    p99_row_tokens: int | None = Field(None, description="99th-percentile rendered row length; None: not recorded.")


class ArmSettings(BaseModel):
    """An arm's trainer settings, settled from its family's recipe, the proposal and the dataset."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    method: Method = Field(description="Full fine-tuning or LoRA.")
    lora: LoRARecipe | None = Field(description="The adapter; None for full fine-tuning.")
    lr: float = Field(description="Peak learning rate.")
    schedule: Schedule = Field(description="Decay after warm-up.")
    warmup_steps: int = Field(description="Linear warm-up steps.")
    min_lr_ratio: float = Field(description="cosine floor as a share of the peak.")
    steps: int = Field(description="Optimizer steps.")
    batch_size: int = Field(description="Rows (or packs) per optimizer step.")
    micro_batch_size: int = Field(description="Rows (or packs) per forward pass; divides batch_size.")
    max_len: int = Field(description="Row token limit.")
    max_prompt_len: int | None = Field(description="dpo: prompt tokens kept.")
    max_answer_len: int | None = Field(description="dpo: longest answer; rft: sampled answer cap.")
    weight_decay: float = Field(description="AdamW weight decay.")
    grad_clip: float = Field(description="Gradient norm clip.")
    packing: bool = Field(False, description="sft: pack rows.")
    kl_coef: float | None = Field(None, description="klce: KL weight.")
    beta: float | None = Field(None, description="dpo: beta.")
    nll_weight: float | None = Field(None, description="dpo: NLL weight.")
    k: int | None = Field(None, description="rft: samples per prompt.")

    def trainer_fields(self, family: Family) -> dict[str, Any]:
        """The arm's settings as its family's trainer config takes them (trainers.common.TrainConfig's fields and
        the family's own, by their names there): the one place an arm's settings become a trainer's. The caller
        adds what is not a setting (paths, the LoRA adapter, seed, snapshot steps; rft's sampling)."""
        own = {"sft": {"packing": self.packing}, "klce": {"kl_coef": self.kl_coef}, "rft": {"k": self.k},
               "dpo": {"beta": self.beta, "nll_weight": self.nll_weight, "max_prompt_length": self.max_prompt_len,
                       "max_completion_length": self.max_answer_len}}
        return {"lr": self.lr, "steps": self.steps, "batch_size": self.batch_size,
                "micro_batch_size": self.micro_batch_size, "max_len": self.max_len, "warmup_steps": self.warmup_steps,
                "schedule": self.schedule, "min_lr_ratio": self.min_lr_ratio, "weight_decay": self.weight_decay,
                "grad_clip": self.grad_clip} | own[family]


def _rows_of(amount: int, unit: BatchUnit, row_tokens: float) -> int:
    """A batch in rows: sequences are rows; tokens are divided by a row's tokens (a pack's when packing)."""
    return amount if unit == "sequences" else max(1, int(amount // max(row_tokens, 1.0)))


def arm_settings(settings: FamilyRecipe, proposal: dict[str, Any], data: DatasetSize) -> ArmSettings:
    """The settings one arm trains with: the proposal's values where it gives them, else the recipe's, and what
    depends on the dataset (max_len, steps from epochs, token batches in rows) settled here."""
    def pick(name: str, default: Any) -> Any:
        return proposal[name] if proposal.get(name) is not None else default

    method = pick("method", settings.method)
    max_len = settings.max_len or rule_max_len(settings.context, data.p99_row_tokens)
    packing = bool(settings.packing)
    row_tokens = max_len if packing else data.tokens / data.rows
    batch = _rows_of(pick("batch_size", settings.batch), settings.batch_unit, row_tokens)
    micro = min(batch, _rows_of(settings.micro_batch, settings.batch_unit, row_tokens))
    while batch % micro:  # gradient accumulation needs whole micro-batches: the largest divisor at most `micro`
        micro -= 1
    rows = math.ceil(data.tokens / max_len) if packing else data.rows
    steps = pick("steps", settings.steps) or max(1, math.ceil((settings.epochs or 1.0) * rows / batch))
    return ArmSettings(
        method=method, lora=settings.lora if method == "lora" else None, lr=proposed_lr(settings, proposal),
        schedule=settings.schedule, warmup_steps=min(steps - 1, round(settings.warmup_ratio * steps)),
        min_lr_ratio=settings.min_lr_ratio, steps=steps, batch_size=batch, micro_batch_size=micro, max_len=max_len,
        max_prompt_len=settings.max_prompt_len, max_answer_len=settings.max_answer_len,
        weight_decay=settings.weight_decay, grad_clip=settings.grad_clip, packing=packing,
        kl_coef=pick("kl_coef", settings.kl_coef), beta=pick("beta", settings.beta),
        nll_weight=pick("nll_weight", settings.nll_weight), k=pick("k", settings.k))
