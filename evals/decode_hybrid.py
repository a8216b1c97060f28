"""The eval engine's static decode loop on Nemotron-H hybrids: Mamba-2 state in static buffers, Triton decode kernels.

`evals.generate`'s static loop keeps a model's whole decode state in preallocated buffers and replays each decode
step as one CUDA graph. A hybrid's state is more than a KV cache: each Mamba-2 mixer carries a convolution window
[batch, conv channels, kernel] and an SSM state [batch, heads, head dim, state] from step to step. transformers'
`StaticCache` (5.24) already allocates both per Mamba layer (`LinearAttentionLayer`, updated in place, so their
addresses stay fixed) next to the attention layers' static KV cache; what the engine adds here:

- `bind(model, kernels)`: while the engine prefills, captures or steps, each Mamba-2 mixer's forward with a cache
  is `cached_forward`: a one-token step is in_proj, the causal-conv window update, `selective_state_update` (one
  kernel over every head and row: Dao & Gu 2024, "Transformers are SSMs", the recurrent form of SSD), the gated
  RMSNorm and out_proj; a prefill is the chunked SSD scan returning its final state into the cache. Everything
  else (no cache: `generate`'s own calls, training) runs the class's forward, so the same model serves both.
- `kernels_for(device)`: on CUDA, mamba-ssm's Triton kernels (`selective_state_update`, `mamba_chunk_scan_combined`,
  the gated `rmsnorm_fn`, loaded without mamba-ssm's package `__init__`, which needs its CUDA extension) and this
  module's Triton causal-conv window update; without them (CPU, or mamba-ssm missing) transformers' own PyTorch
  functions, the same ones `generate` runs, so on the CPU the engine's tokens are `generate`'s. A missing kernel
  is said once per process (a logged warning), and decoding goes on with the fallback.
- `decode_masks(bias)`: the decode step's masks as the model takes them precomputed: the engine's additive bias
  for attention, none for the Mamba layers (a generated token is never padding, as transformers' own
  `create_recurrent_attention_mask` says), so the step builds no mask on the host.

The MoE layers decode through transformers' grouped-matmul experts (`grouped_mm`, its default on CUDA): tokens
sorted by expert, a histogram for the offsets, two grouped GEMMs, all on the device with no host sync, so the
step captures as one graph (`use_capturable_experts`; float32 weights take the batched experts instead). Each
expert's weights are read once per step however many rows it serves.

Status (issue 32): on the CPU the engine's tokens equal `generate`'s (greedy and sampled, tests/evals). On the H200
the captured step agrees with one full forward over the same tokens (bench/decode_hybrid_check.py on the tiny
hybrid: relative error of the centred logits 3e-7 in float32 eager, 5.7e-3 in bfloat16 replayed, against 8.8e-2
for a wrong context). An earlier failure of that check (1.2) was the check's own: it kept views of the graph's one
output buffer (`_Decoder.feed` now copies). Eval jobs on CUDA take this loop (tools/evaluate.py sets
`static_cache`); its speed on the 30B-A3B shape is not measured yet (bench/decode_hybrid.py).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import MethodType, ModuleType

import torch
import torch.nn.functional as F

HYBRID_MODEL_TYPES = {"nemotron_h"}
SSD_MODULE = "mamba_ssm.ops.triton.ssd_combined"
NORM_MODULE = "mamba_ssm.ops.triton.layernorm_gated"
STATE_UPDATE_MODULE = "mamba_ssm.ops.triton.selective_state_update"

log = logging.getLogger(__name__)

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: transformers' PyTorch functions serve
    triton = None


def import_without_init(*names: str) -> list[ModuleType]:
    """mamba-ssm's submodules `names`, imported without running the package's `__init__` (which imports its CUDA
    extension: a pure-python build is enough for its Triton kernels); the names are taken out of `sys.modules`
    again afterwards, so transformers' own lookup still finds mamba-ssm unimportable. Raises ImportError naming
    what is missing (mamba-ssm, triton, einops)."""
    spec = importlib.util.find_spec("mamba_ssm")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("mamba_ssm is not installed")
    if "mamba_ssm" in sys.modules:  # the whole package imported (its CUDA extension works): use it as it is
        return [importlib.import_module(n) for n in names]
    sys.modules["mamba_ssm"] = importlib.util.module_from_spec(spec)
    try:
        return [importlib.import_module(n) for n in names]
    finally:
        for name in [n for n in sys.modules if n == "mamba_ssm" or n.startswith("mamba_ssm.")]:
            del sys.modules[name]


@dataclass(frozen=True)
class MambaKernels:
    """The functions a cached Mamba-2 mixer runs (transformers' signatures); `scan` and `gated_norm` None: the
    class's own prefill and its norm module."""

    name: str
    conv_update: Callable
    state_update: Callable
    scan: Callable | None = None
    gated_norm: Callable | None = None


def _modeling() -> ModuleType:
    from transformers.models.nemotron_h import modeling_nemotron_h

    return modeling_nemotron_h


def torch_kernels() -> MambaKernels:
    """transformers' own decode functions (what `generate` runs without mamba-ssm and causal-conv1d)."""
    m = _modeling()
    return MambaKernels("torch", m.causal_conv1d_update, m.mamba2_selective_state_update)


@functools.cache
def _triton_kernels() -> MambaKernels | None:
    if triton is None:
        log.warning("hybrid decode: triton is not installed; the Mamba layers decode with transformers' PyTorch "
                    "functions (correct, slower)")
        return None
    try:
        ssd, norm, ssu = import_without_init(SSD_MODULE, NORM_MODULE, STATE_UPDATE_MODULE)
    except ImportError as err:
        log.warning("hybrid decode: mamba-ssm's Triton kernels are missing (%s); the Mamba layers decode with "
                    "transformers' PyTorch functions (correct, slower)", err)
        return None
    return MambaKernels("triton", conv_update_triton, ssu.selective_state_update, ssd.mamba_chunk_scan_combined,
                        norm.rmsnorm_fn)


def kernels_for(device: torch.device) -> MambaKernels:
    """Triton kernels on CUDA where they load (a missing one is logged once per process), else PyTorch's."""
    if device.type == "cuda":
        found = _triton_kernels()
        if found is not None:
            return found
    return torch_kernels()


def is_hybrid(model: torch.nn.Module) -> bool:
    return model.config.model_type in HYBRID_MODEL_TYPES


def supported(model: torch.nn.Module) -> bool:
    """The installed transformers gives this hybrid a static cache (5.24's `StaticCache` maps Mamba layers to
    in-place state buffers; older releases have no such layer type)."""
    from transformers import cache_utils

    return is_hybrid(model) and "linear_attention" in getattr(cache_utils, "STATIC_LAYER_TYPE_MAPPING", {})


def decode_masks(bias: torch.Tensor) -> dict[str, torch.Tensor | None]:
    """The one-token step's masks, precomputed as the model takes them (a dict skips its mask building)."""
    return {"full_attention": bias, "linear_attention": None}


def _mixers(model: torch.nn.Module) -> list[torch.nn.Module]:
    cls = _modeling().NemotronHMamba2Mixer
    return [m for m in model.modules() if isinstance(m, cls)]


@contextmanager
def bind(model: torch.nn.Module, kernels: MambaKernels) -> Iterator[None]:
    """Inside, each Mamba-2 mixer's forward is `cached_forward` on `kernels` (an instance attribute, removed on
    exit; a CUDA graph captured inside keeps the kernels it launched). A mixer that already has an instance
    forward (the trainers' Triton binding) keeps it as the no-cache path."""
    mixers = _mixers(model)
    saved = [vars(m).get("forward") for m in mixers]
    for mixer, own in zip(mixers, saved, strict=True):
        own = own.__func__ if own is not None else type(mixer).forward
        mixer.forward = MethodType(functools.partial(cached_forward, own=own, kernels=kernels), mixer)
    try:
        yield
    finally:
        for mixer, own in zip(mixers, saved, strict=True):
            if own is None:
                del mixer.forward
            else:
                mixer.forward = own


def capturable_experts(dtype: torch.dtype) -> str:
    """The experts implementation a captured step can run: grouped matmuls for 16-bit weights; for float32 the
    batched one (torch's float32 `grouped_mm` copies the offsets to the host, which a capture refuses: seen on the
    H200, bench/README.md, issue 32)."""
    return "grouped_mm" if dtype in (torch.bfloat16, torch.float16) else "batched_mm"


@contextmanager
def use_capturable_experts(model: torch.nn.Module) -> Iterator[None]:
    """Inside, the MoE experts run an implementation with device-only routing (`capturable_experts`); the configured
    one is put back on exit."""
    before = model.config._experts_implementation
    wanted = capturable_experts(model.dtype)
    if before == wanted:
        yield
        return
    model.set_experts_implementation(wanted)
    try:
        yield
    finally:
        model.set_experts_implementation(before)


def cached_forward(mixer, hidden_states: torch.Tensor, cache=None, attention_mask: torch.Tensor | None = None, *,
                   own: Callable, kernels: MambaKernels, **kwargs) -> torch.Tensor:
    """NemotronHMamba2Mixer.forward with a cache on `kernels`: a one-token step after a prefill, or a fresh
    prefill (with `kernels.scan`); anything else is the class's own forward."""
    if cache is not None and hidden_states.shape[1] == 1 and cache.get_conv_state(mixer.layer_idx) is not None:
        return _step(mixer, hidden_states, cache, kernels)
    fresh = cache is not None and cache.get_conv_state(mixer.layer_idx) is None
    if fresh and kernels.scan is not None:
        return _prefill(mixer, hidden_states, cache, attention_mask, kernels)
    return own(mixer, hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)


def _gated_norm(mixer, y: torch.Tensor, gate: torch.Tensor, kernels: MambaKernels) -> torch.Tensor:
    if kernels.gated_norm is None:
        return mixer.norm(y, gate)
    return kernels.gated_norm(y, mixer.norm.weight, None, z=gate.contiguous(), eps=mixer.norm.variance_epsilon,
                              group_size=mixer.intermediate_size // mixer.n_groups, norm_before_gate=False)


def _step(mixer, hidden_states: torch.Tensor, cache, kernels: MambaKernels) -> torch.Tensor:
    """One token per row: the mixer's recurrent form, as transformers writes it, on the state buffers."""
    b = hidden_states.shape[0]
    heads, p, n, g = mixer.num_heads, mixer.head_dim, mixer.ssm_state_size, mixer.n_groups
    projected = mixer.in_proj(hidden_states)
    gate, xbc, dt = projected.split([mixer.intermediate_size, mixer.conv_dim, heads], dim=-1)
    xbc = kernels.conv_update(xbc.transpose(1, 2), cache.get_conv_state(mixer.layer_idx),
                              mixer.conv1d.weight.squeeze(1), mixer.conv1d.bias, activation=mixer.activation)
    x, B, C = xbc.transpose(1, 2).split([mixer.intermediate_size, g * n, g * n], dim=-1)
    A = -torch.exp(mixer.A_log.float())
    y = kernels.state_update(
        cache.get_recurrent_state(mixer.layer_idx), x.reshape(b, heads, p), dt.transpose(1, 2).expand(-1, -1, p),
        A[:, None, None].expand(-1, p, n), B.reshape(b, g, n), C.reshape(b, g, n), mixer.D[:, None].expand(-1, p),
        z=None, dt_bias=mixer.dt_bias[:, None].expand(-1, p), dt_softplus=True)
    y = _gated_norm(mixer, y.reshape(b, 1, -1), gate, kernels)
    return mixer.out_proj(y.to(hidden_states.dtype))


def _prefill(mixer, hidden_states: torch.Tensor, cache, attention_mask: torch.Tensor | None,
             kernels: MambaKernels) -> torch.Tensor:
    """A fresh prompt (left padding zeroed before and after the convolution, as the class does): the convolution
    window and the chunked scan's final state go into the cache."""
    b, t, _ = hidden_states.shape
    heads, p, n, g = mixer.num_heads, mixer.head_dim, mixer.ssm_state_size, mixer.n_groups
    projected = mixer.in_proj(_masked(hidden_states, attention_mask))
    gate, xbc, dt = projected.split([mixer.intermediate_size, mixer.conv_dim, heads], dim=-1)
    window = cache.update_conv_state(xbc.transpose(1, 2), mixer.layer_idx, conv_kernel_size=mixer.conv_kernel_size)
    k = mixer.conv_kernel_size
    conv = F.conv1d(window.to(mixer.conv1d.weight.dtype), mixer.conv1d.weight, mixer.conv1d.bias, padding=k - 1,
                    groups=mixer.conv_dim)[..., : window.shape[-1]][..., -t:]
    # Channels last and contiguous, the layout the trainers' Triton path feeds the same scan (checked on the GPU).
    xbc = _masked(mixer.act(conv).transpose(1, 2).to(hidden_states.dtype).contiguous(), attention_mask)
    x, B, C = xbc.split([mixer.intermediate_size, g * n, g * n], dim=-1)
    y, final = kernels.scan(x.reshape(b, t, heads, p), dt, -torch.exp(mixer.A_log.float()), B.reshape(b, t, g, n),
                            C.reshape(b, t, g, n), chunk_size=mixer.chunk_size, D=mixer.D, z=None,
                            dt_bias=mixer.dt_bias, dt_softplus=True, dt_limit=mixer.time_step_limit,
                            return_final_states=True)
    cache.update_recurrent_state(final, mixer.layer_idx)
    y = _gated_norm(mixer, y.reshape(b, t, -1), gate, kernels)
    return mixer.out_proj(y.to(hidden_states.dtype))


def _masked(h: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    return h if attention_mask is None else (h * attention_mask[:, :, None]).to(h.dtype)


if triton is not None:

    @triton.jit
    def _conv_update_kernel(x_ptr, state_ptr, w_ptr, bias_ptr, out_ptr, channels, stride_xb, stride_xc,
                            stride_sb, stride_sc, stride_sk, stride_ob, stride_oc, K: tl.constexpr,
                            BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
        row = tl.program_id(0)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = c < channels
        state = state_ptr + row * stride_sb + c * stride_sc
        x = tl.load(x_ptr + row * stride_xb + c * stride_xc, mask=ok, other=0.0)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + c, mask=ok, other=0.0).to(tl.float32)
        for k in tl.static_range(K - 1):  # the window slides by one: state[k] <- state[k + 1]
            s = tl.load(state + (k + 1) * stride_sk, mask=ok, other=0.0)
            acc += s.to(tl.float32) * tl.load(w_ptr + c * K + k, mask=ok, other=0.0).to(tl.float32)
            tl.store(state + k * stride_sk, s, mask=ok)
        acc += x.to(tl.float32) * tl.load(w_ptr + c * K + K - 1, mask=ok, other=0.0).to(tl.float32)
        tl.store(state + (K - 1) * stride_sk, x.to(state_ptr.dtype.element_ty), mask=ok)
        if SILU:
            acc = acc * tl.sigmoid(acc)
        tl.store(out_ptr + row * stride_ob + c * stride_oc, acc.to(out_ptr.dtype.element_ty), mask=ok)


def conv_update_triton(hidden_states: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None = None, activation: str | None = None) -> torch.Tensor:
    """transformers' `causal_conv1d_update` for one token in one kernel: hidden_states [B, C, 1], conv_state
    [B, C, K] (the last K inputs, updated in place), weight [C, K] -> [B, C, 1] (float32 accumulation)."""
    if hidden_states.shape[-1] != 1 or activation not in (None, "silu"):
        return _modeling().causal_conv1d_update(hidden_states, conv_state, weight, bias, activation=activation)
    batch, channels, _ = hidden_states.shape
    k = conv_state.shape[-1]
    weight = weight.contiguous()
    out = torch.empty_like(hidden_states)
    block = 256
    _conv_update_kernel[(batch, triton.cdiv(channels, block))](
        hidden_states, conv_state, weight, bias if bias is not None else weight, out, channels,
        hidden_states.stride(0), hidden_states.stride(1), conv_state.stride(0), conv_state.stride(1),
        conv_state.stride(2), out.stride(0), out.stride(1), K=k, BLOCK=block, HAS_BIAS=bias is not None,
        SILU=activation == "silu")
    return out
