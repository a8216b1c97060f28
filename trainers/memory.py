"""Peak GPU memory of a training job per rank, estimated before it runs (recorded with the run; admission refuses
a job whose estimate exceeds the GPUs it asks for).

Per rank, under FSDP2 over `world` ranks (the single-process case is world = 1 without sharding):

- weights: trainable parameters as float32 master copies, frozen ones in the compute dtype, both / world;
- gradients and AdamW: float32, 4 + 8 bytes per trainable parameter, / world;
- gathered blocks: the largest decoder block unsharded in the compute dtype (the one running backward), and the
  root's embeddings and head;
- activations: per token per layer ~34 * hidden bytes in 16-bit (Korthikanti et al. 2022, "Reducing Activation
  Recomputation in Large Transformer Models", eq. 2, with flash/SDPA attention so no s^2 term); with activation
  checkpointing only each block's input (2 * hidden bytes) is kept per layer, plus one block recomputed;
- head and loss: one chunk of float32 logits [chunk, vocab] three times (logits, log-softmax, gradient);
  KL-CE adds the parent's chunk; a separate frozen parent/reference adds its sharded weights;
- a fixed CUDA context and allocator reserve (CUDA_RESERVE_BYTES).

The activation constant is for dense attention blocks; Mamba and MoE blocks differ, which is why the GPU
benchmark (bench/train_memory.py) records the measured peak next to this estimate for each configuration.

The parts do not all live at once: the total is what lives through the step (weights, gradients and AdamW state,
a separate parent, the reserve) plus the larger of the step's two peaks, backward (the gathered root, the
activations, and either the loss chunk or one block's backward: its gathered weights and, with LoRA on routed
experts, the folded W + s * B @ A of trainers.lora_experts) or the update (AdamW's foreach temporaries, one float32
copy of the second moments). Measured on one H200 (bench/README.md, issue 32): the total without the reserve is
within 0-6% of the allocated peak, and with it within 6.4% of the allocator's reserved peak, for the 3.2B bench
hybrid (full and LoRA r64 + FP32 head, micro-batch 1 and 2 x 4096) and the 30B-A3B LoRA r64 + FP32 head (98.3 and
99.0 GiB allocated, estimate 98.6 and 100.0 without the reserve).
"""

from __future__ import annotations

from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field

from core import loading
from trainers.common import ACTIVATION_CHECKPOINTING_ABOVE, ConfigError, LoRASettings, TrainConfig
from trainers.targets import adapter_sizes, names_of

ACT_BYTES_PER_TOKEN_LAYER_PER_HIDDEN = 34  # Korthikanti et al. 2022, 16-bit activations, no s^2 term
CUDA_RESERVE_BYTES = 2 * 1024**3  # CUDA context, NCCL buffers, allocator fragmentation
GIB = 1024**3


class ModelShape(BaseModel):
    """What the estimate needs from a model: counted on the meta device, no weights read."""

    model_config = ConfigDict(frozen=True)
    total_params: int = Field(description="All parameters (every expert of an MoE).")
    trainable_params: int = Field(description="Parameters that take updates (all, or LoRA adapters + head copy).")
    largest_block_params: int = Field(description="Parameters of the largest decoder block.")
    root_params: int = Field(description="Parameters outside the decoder blocks (embeddings, final norm, head).")
    hidden_size: int = Field(description="Model width.")
    num_layers: int = Field(description="Decoder blocks.")
    vocab_size: int = Field(description="Vocabulary (the head's output width).")
    folded_expert_params: int = Field(0, description="Routed-expert weights of the largest block that LoRA adapts "
                                      "(trainers.lora_experts folds W + s * B @ A for them at every call); 0 without.")


class MemoryEstimate(BaseModel):
    """Estimated peak GPU bytes per rank, by part."""

    world_size: int = Field(description="Ranks the job runs on (one GPU each).")
    weights: float = Field(description="Sharded weights: float32 trainable + compute-dtype frozen.")
    grads_and_optimizer: float = Field(description="Sharded float32 gradients and AdamW moments.")
    gathered_blocks: float = Field(description="The largest decoder block unsharded in the compute dtype (the one "
                                   "running backward).")
    gathered_root: float = Field(0.0, description="The root (embeddings, final norm, head) unsharded in the compute "
                                 "dtype: held through forward and backward.")
    activations: float = Field(description="Stored activations at the configured micro-batch and length.")
    head_and_loss: float = Field(description="Float32 logits of one loss chunk (x3), and the parent's for KL.")
    frozen_models: float = Field(description="A separate parent/reference model's sharded weights.")
    reserve: float = Field(description="CUDA context and allocator reserve.")
    optimizer_step: float = Field(0.0, description="AdamW's foreach temporaries at the update (one float32 copy of "
                                  "the second moments); the step's other peak, after the activations are freed.")
    expert_folds: float = Field(0.0, description="LoRA's folded expert weights of one MoE block and their gradient, "
                                "in the compute dtype, while that block runs backward.")

    @property
    def total(self) -> float:
        """What lives through the step, plus the larger of its two peaks: backward (the gathered root and the
        activations, with either the loss chunk or one block's backward: its gathered weights and folded experts)
        or the optimizer's update. Without `reserve` this is the allocated peak, with it the allocator's."""
        backward = self.gathered_root + self.activations + max(self.head_and_loss,
                                                               self.gathered_blocks + self.expert_folds)
        return (self.weights + self.grads_and_optimizer + self.frozen_models + self.reserve
                + max(backward, self.optimizer_step))


def model_shape(model_path: Path | str, lora: LoRASettings | None) -> ModelShape:
    """Parameter counts of the model (and its LoRA adapters) built on the meta device from its config."""
    return shape_of(loading.load_config(model_path), lora)


def shape_of(config, lora: LoRASettings | None) -> ModelShape:
    """model_shape for a transformers config object (no files needed: the 30B extrapolation uses it).

    Counted on the base model built on the meta device, the adapter's parameters added from its targets' shapes
    (trainers/targets.py): peft never runs here, so the launcher's admission, which calls this in the agent process,
    builds no adapter there (a target list over embeddings at r = 4096 once made peft fail inside the agent)."""
    from trainers.common import lora_targets
    from trainers.distributed import decoder_blocks

    with torch.device("meta"):
        model = loading.model_from_config(config)
    names = names_of(model)
    total = sum(p.numel() for p in model.parameters())
    adapters: dict[str, int] = {}
    head = 0
    if lora is not None:
        modules, params = lora_targets(config.model_type, lora)
        adapters = adapter_sizes(names, modules, params, lora.r)
        head = model.get_output_embeddings().weight.numel() if lora.train_lm_head else 0  # its trainable copy
    module_name = {id(m): n for n, m in model.named_modules()}
    blocks = decoder_blocks(model)

    def block_params(block: torch.nn.Module) -> int:
        prefix = module_name[id(block)] + "."
        return sum(p.numel() for p in block.parameters()) + sum(v for k, v in adapters.items() if k.startswith(prefix))

    in_blocks = sum(block_params(b) for b in blocks)
    trainable = total if lora is None else sum(adapters.values()) + head
    total += 0 if lora is None else trainable
    adapted = any("experts" in name for name in adapters)
    folded = max(sum(p.numel() for p in b.parameters() if p.ndim == 3) for b in blocks)
    return ModelShape(
        total_params=total, trainable_params=trainable, largest_block_params=max(block_params(b) for b in blocks),
        root_params=total - in_blocks, hidden_size=config.hidden_size, num_layers=len(blocks),
        vocab_size=config.vocab_size, folded_expert_params=folded if adapted else 0)


def estimate(shape: ModelShape, *, world_size: int, micro_batch_size: int, seq_len: int, compute_bytes: int,
             activation_checkpointing: bool, loss_chunk_tokens: int, parent_params: int = 0,
             kl: bool = False) -> MemoryEstimate:
    """Peak bytes per rank for one training configuration (see the module docstring for each term)."""
    trainable, frozen = shape.trainable_params, shape.total_params - shape.trainable_params
    tokens = micro_batch_size * seq_len
    per_layer = ACT_BYTES_PER_TOKEN_LAYER_PER_HIDDEN * shape.hidden_size * tokens
    if activation_checkpointing:
        activations = 2 * shape.hidden_size * tokens * shape.num_layers + per_layer
    else:
        activations = per_layer * shape.num_layers
    chunk_logits = 4 * min(loss_chunk_tokens, tokens) * shape.vocab_size
    return MemoryEstimate(
        world_size=world_size,
        weights=(4 * trainable + compute_bytes * frozen) / world_size,
        grads_and_optimizer=12 * trainable / world_size,
        gathered_blocks=compute_bytes * shape.largest_block_params,
        gathered_root=compute_bytes * shape.root_params,
        activations=activations,
        head_and_loss=3 * chunk_logits + (chunk_logits if kl else 0),
        frozen_models=compute_bytes * parent_params / world_size,
        reserve=CUDA_RESERVE_BYTES,
        optimizer_step=4 * trainable / world_size,
        expert_folds=compute_bytes * shape.folded_expert_params,
    )


def check_fits(est: MemoryEstimate, gpu_bytes: float, what: str) -> None:
    """Refuses a job whose estimated peak per rank exceeds one GPU's memory, naming the largest parts."""
    if est.total <= gpu_bytes:
        return
    parts = sorted(((k, v) for k, v in est.model_dump().items() if k != "world_size"), key=lambda kv: -kv[1])
    top = ", ".join(f"{k} {v / GIB:.1f} GiB" for k, v in parts[:3])
    raise ConfigError(f"{what}: estimated {est.total / GIB:.1f} GiB per GPU on {est.world_size} GPU(s) exceeds "
                      f"{gpu_bytes / GIB:.1f} GiB ({top}); use more GPUs, LoRA, activation checkpointing or a "
                      "smaller micro_batch_size")


def estimate_job(config: TrainConfig, world_size: int) -> MemoryEstimate:
    """The estimate for a trainer config on `world_size` GPUs (activation checkpointing resolved as the trainer
    resolves it; KL-CE's separate parent counted; the DPO reference pass runs before training, so it is not)."""
    shape = model_shape(config.model_path, config.lora)
    checkpointing = config.activation_checkpointing
    if checkpointing is None:
        checkpointing = shape.total_params > ACTIVATION_CHECKPOINTING_ABOVE
    kl = config.kl_to_parent
    separate = config.separate_parent()
    parent = model_shape(separate, None).total_params if separate is not None else 0
    return estimate(shape, world_size=world_size, micro_batch_size=config.micro_batch_size, seq_len=config.max_len,
                    compute_bytes=2 if config.compute_dtype == "bfloat16" else 4,
                    activation_checkpointing=checkpointing, loss_chunk_tokens=config.loss_chunk_tokens,
                    parent_params=parent, kl=kl)
