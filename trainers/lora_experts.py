"""LoRA on Nemotron-H's routed experts without peft's per-call parametrization, so the MoE blocks compile.

Why: peft adapts a 3-D expert parameter (`target_parameters`) through `ParamWrapper`, whose forward registers a
`torch.nn.utils.parametrize` parametrization on the experts module and removes it again on every call. That swaps
the module's class each time: under `torch.compile` the MoE block graph-breaks (`type.__delattr__`, an in-place
`set_` on a graph input, a generator context manager) and recompiles on every call, because the guarded class was
freed (measured on an H200, bench/README.md, hybrid LoRA: 13 graph breaks and 23 graphs in 6 steps; 201 ms a
step compiled against 167 ms eager).

`use_plain_experts(model)` binds `experts_forward` on the outermost `ParamWrapper` of each adapted experts
module (instance attribute, as `trainers.mamba_kernels` binds its mixer forward): the same arithmetic as peft's
(each expert's weight W + s * B @ A, folded by one baddbmm as peft's `_LoraFactorsProxy` does), as plain tensor
code, then transformers' grouped experts path (`_grouped_mm`, the kernel its `grouped_mm` experts implementation
uses). Parameter names, state dicts, saved adapters and `merge` stay peft's; with adapters disabled, merged or
more than one adapter active, peft's own forward runs.
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


def use_plain_experts(model: torch.nn.Module) -> int:
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
    experts) over each adapted projection's folded weight."""
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
    """Per expert group: x (W + s * L @ R)^T, where L @ R (experts x out x rank, experts x rank x in) is peft's delta
    weight over `weight` (experts x out x in), folded in by one baddbmm. Folding measured faster than the unfused
    low-rank path x W^T + s * (x R^T) L^T on an H200 (bench/README.md, hybrid LoRA: 98.5 against 122.5 ms a step):
    the unfused path's six extra grouped matmuls of width `rank` per projection cost more than the full-size weight
    gradient they avoid."""
    from transformers.integrations.moe import _grouped_mm

    if factors is not None:
        lhs, rhs, scaling = factors
        weight = torch.baddbmm(weight, lhs, rhs, alpha=scaling)
    return _grouped_mm(x, weight.transpose(-2, -1), offs=offsets)
