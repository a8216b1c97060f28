"""LoRA on Nemotron-H's routed experts without peft's per-call parametrization: compilable, and no full-size
weight gradient for the frozen expert stack.

Why: peft adapts a 3-D expert parameter (`target_parameters`) through `ParamWrapper`, whose forward registers a
`torch.nn.utils.parametrize` parametrization on the experts module and removes it again on every call. That swaps
the module's class each time: under `torch.compile` the MoE block graph-breaks (`type.__delattr__`, an in-place
`set_` on a graph input, a generator context manager) and recompiles on every call, because the guarded class was
freed (bench/README.md, "hybrid LoRA": compiled 48.3k tokens/s against 61.6k eager). Eager, the parametrized
weight W + s * B @ A is a new full-size tensor per call, so backward computes the whole expert stack's weight
gradient (as full fine-tuning does) only to reduce it to the factors.

`use_unfused_experts(model)` binds `experts_forward` on the outermost `ParamWrapper` of each adapted experts
module (instance attribute, as `trainers.mamba_kernels` binds its mixer forward): the routed tokens go through
the frozen weights and, beside them, through the low-rank factors, y = x W^T + s * (x A^T) B^T per expert, with
transformers' grouped matmul (`_grouped_mm`, the kernel its own `grouped_mm` experts path uses). Parameter names,
state dicts, saved adapters and `merge` stay peft's; with adapters disabled, merged or more than one adapter
active, peft's own forward runs.
"""

from __future__ import annotations

from types import MethodType

import torch


def _experts_class() -> type:
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts

    return NemotronHExperts


def _wrapper_class() -> type:
    from peft.tuners.lora.layer import ParamWrapper

    return ParamWrapper


def use_unfused_experts(model: torch.nn.Module) -> int:
    """Binds `experts_forward` to each outermost peft `ParamWrapper` over a Nemotron-H experts module; returns
    how many experts modules it covers."""
    wrappers = [m for m in model.modules() if isinstance(m, _wrapper_class())]
    inner = {id(w.base_layer) for w in wrappers}
    bound = 0
    for module in wrappers:
        if id(module) not in inner and isinstance(module.get_base_layer(), _experts_class()):
            module.forward = MethodType(experts_forward, module)
            bound += 1
    return bound


def _chain(outer) -> list:
    """The nested ParamWrappers from `outer` inwards (one per adapted parameter)."""
    chain, layer = [], outer
    while isinstance(layer, _wrapper_class()):
        chain.append(layer)
        layer = layer.base_layer
    return chain


def experts_forward(outer, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """The adapted experts' forward: transformers' grouped experts path (non-gated, no bias: Nemotron-H's
    experts) with each adapted projection's low-rank term added beside the frozen weight."""
    chain = _chain(outer)
    if any(w.disable_adapters or w.merged or list(w.active_adapters) != [outer.active_adapters[0]] for w in chain):
        return type(outer).forward(outer, hidden_states, top_k_index, top_k_weights)
    adapter = outer.active_adapters[0]
    factors = {w.parameter_name: w.get_delta_factors(adapter) for w in chain if adapter in w.lora_A}
    experts = outer.get_base_layer()
    num_top_k, num_tokens, hidden_dim = top_k_index.size(-1), hidden_states.size(0), hidden_states.size(-1)
    expert_ids, perm = torch.sort(top_k_index.reshape(-1))
    routed = hidden_states[perm // num_top_k]
    # histc, as transformers counts (CUDA graph friendly); it takes float input on the CPU and int on CUDA.
    counts_of = expert_ids.float() if hidden_states.device.type == "cpu" else expert_ids.int()
    tokens_per_expert = torch.histc(counts_of, bins=experts.num_experts, min=0, max=experts.num_experts - 1)
    offsets = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)
    up = _linear(routed, experts.up_proj, factors.get("up_proj"), offsets)
    down = _linear(experts.act_fn(up), experts.down_proj, factors.get("down_proj"), offsets)
    weighted = down * top_k_weights.reshape(-1)[perm].unsqueeze(-1)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.size(0), device=perm.device)
    return weighted[inverse].view(num_tokens, num_top_k, hidden_dim).sum(dim=1).to(hidden_states.dtype)


def _linear(x: torch.Tensor, weight: torch.Tensor, factors, offsets: torch.Tensor) -> torch.Tensor:
    """Per expert group: x W^T, plus s * (x R^T) L^T when adapted, where L @ R (experts x out x rank, experts x rank
    x in) is peft's delta weight over `weight` (experts x out x in)."""
    from transformers.integrations.moe import _grouped_mm

    out = _grouped_mm(x, weight.transpose(-2, -1), offs=offsets)
    if factors is None:
        return out
    lhs, rhs, scaling = factors
    low = _grouped_mm(x, rhs.transpose(-2, -1), offs=offsets)
    return out + scaling * _grouped_mm(low, experts_major(lhs), offs=offsets)


@torch.library.custom_op("postlab::experts_major", mutates_args=())
def experts_major(lhs: torch.Tensor) -> torch.Tensor:
    """peft's per-expert lora_B factor (experts x out x rank, a permuted view whose experts axis is innermost in
    memory) transposed to experts x rank x out and stored contiguously, as grouped_mm needs each expert's matrix
    row- or column-major. A custom op because inductor dropped a plain `.contiguous()` here and handed grouped_mm
    the strided view (first seen on an H200: "Invalid strides/sizes, got [1, 16, 1024] ... [16, 64, 1024]")."""
    return lhs.transpose(-2, -1).contiguous()


@experts_major.register_fake
def _(lhs: torch.Tensor) -> torch.Tensor:
    return lhs.new_empty(lhs.shape[0], lhs.shape[2], lhs.shape[1])


def _experts_major_backward(ctx, grad: torch.Tensor) -> torch.Tensor:
    return grad.transpose(-2, -1)


experts_major.register_autograd(_experts_major_backward)
