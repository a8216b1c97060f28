"""Nemotron-H's Mamba-2 mixers on mamba-ssm's Triton SSD kernels, without mamba-ssm's CUDA extension.

Why: transformers uses mamba-ssm's kernels only when `import mamba_ssm` works, which needs its compiled
selective-scan extension (a CUDA build of many minutes), and its fused training path also calls causal-conv1d's
extension. Missing either, the mixer runs its pure-torch scan: ~15x slower, fp32 intermediates of
batch x chunks x chunk^2 x heads, and no per-sequence boundaries (so no packing). The chunked SSD scan itself,
`mamba_ssm/ops/triton/ssd_combined.py`, is Triton (it needs only triton and einops), so:

- `load_ssd()` loads mamba-ssm's Triton modules from the installed distribution without running the package's
  `__init__` (which imports the CUDA extension): a pure-python build is enough,
  `MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE pip install --no-build-isolation mamba-ssm`. The names are
  taken out of `sys.modules` again afterwards, so transformers' own lookup still finds mamba-ssm unimportable and
  never picks its fused path (which would call the missing causal-conv1d extension).
- `mixer_forward`: the mixer's forward without a cache (training, and no-cache scoring passes): in_proj; the
  causal depthwise convolution by torch's grouped `conv1d` (cuDNN), or, for packed rows, as a sum of shifted
  taps with the taps that reach into the previous row zeroed; the scan by `mamba_chunk_scan_combined` (with
  `seq_idx` for packed rows, so no state crosses a row boundary); the gated RMSNorm by mamba-ssm's Triton kernel;
  out_proj. With a cache (generation) the mixer's own forward runs.
- `use_triton_ssd(model)`: binds that forward on each Nemotron-H Mamba-2 mixer of a CUDA model (the instance
  attribute shadows the class's forward; modules, parameters and state-dict names stay as they were, so peft
  LoRA on in_proj/out_proj and checkpoints are unaffected). With `graphed=True` (the trainers' one-GPU path,
  `trainers.common.graph_mamba_mixers`) each mixer's no-cache forward and backward are replayed from CUDA graphs
  where its calls repeat (`trainers.step_graphs`): the Triton kernels' Python launches made the step host-bound.

Packed rows reach the mixers as the model keyword `seq_idx` (int32 [batch, seq], the row index of each token):
transformers passes extra keywords down to the Mamba mixers, and its torch fallback raises on `seq_idx` rather
than mixing rows.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
from collections.abc import Callable
from types import MethodType, ModuleType

import torch
import torch.nn.functional as F

from trainers.step_graphs import GraphedRegion

SSD_MODULE = "mamba_ssm.ops.triton.ssd_combined"
NORM_MODULE = "mamba_ssm.ops.triton.layernorm_gated"


@functools.cache
def load_ssd() -> tuple[ModuleType, ModuleType]:
    """(ssd_combined, layernorm_gated) from the installed mamba-ssm, its package `__init__` not run; raises
    ImportError naming what is missing (mamba-ssm, triton or einops)."""
    spec = importlib.util.find_spec("mamba_ssm")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("mamba_ssm is not installed")
    if "mamba_ssm" in sys.modules:  # the whole package imported (its CUDA extension works): use it as it is
        return importlib.import_module(SSD_MODULE), importlib.import_module(NORM_MODULE)
    # A package object for mamba_ssm whose __init__ is not executed: its submodules import against it.
    sys.modules["mamba_ssm"] = importlib.util.module_from_spec(spec)
    try:
        return importlib.import_module(SSD_MODULE), importlib.import_module(NORM_MODULE)
    finally:
        for name in [n for n in sys.modules if n == "mamba_ssm" or n.startswith("mamba_ssm.")]:
            del sys.modules[name]


def missing() -> list[str]:
    """What the Triton SSD path lacks here ([] = it loads)."""
    try:
        load_ssd()
    except ImportError as err:
        return [f"mamba_ssm's Triton SSD kernels ({err})"]
    return []


def _mixer_class() -> type:
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

    return NemotronHMamba2Mixer


def _bind(model: torch.nn.Module, scan: Callable, gated_norm: Callable, graphed: bool = False) -> int:
    mixers = [m for m in model.modules() if isinstance(m, _mixer_class())]
    for mixer in mixers:
        region = None
        if graphed:
            core = functools.partial(_mixer_core, mixer, scan=scan, gated_norm=gated_norm)
            region = GraphedRegion(core, mixer.parameters, functools.partial(_mixer_state, mixer))
        forward = functools.partial(mixer_forward, own=type(mixer).forward, scan=scan, gated_norm=gated_norm,
                                    region=region)
        mixer.forward = MethodType(forward, mixer)
    return len(mixers)


def use_triton_ssd(model: torch.nn.Module, graphed: bool = False) -> int:
    """Binds `mixer_forward` on mamba-ssm's Triton kernels to every Nemotron-H Mamba-2 mixer; returns how many.
    `graphed`: each mixer's training forward and backward replayed from CUDA graphs (`trainers.step_graphs`)."""
    ssd, norm = load_ssd()
    return _bind(model, ssd.mamba_chunk_scan_combined, norm.rmsnorm_fn, graphed)


def graph_regions(model: torch.nn.Module) -> list[GraphedRegion]:
    """The CUDA-graphed regions of the model's mixers (empty where `use_triton_ssd(graphed=True)` did not bind)."""
    regions = []
    for mixer in model.modules():
        forward = vars(mixer).get("forward") if isinstance(mixer, _mixer_class()) else None
        region = forward.__func__.keywords.get("region") if forward is not None else None
        if region is not None:
            regions.append(region)
    return regions


def _mixer_state(mixer) -> tuple:
    """What a captured mixer graph freezes besides shapes and weights: training mode (dropout) and each peft
    adapter layer's enabled/merged/active state (its forward branches on them)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    adapters = tuple((m.disable_adapters, m.merged, tuple(m.active_adapters)) for m in mixer.modules()
                     if isinstance(m, BaseTunerLayer))
    return mixer.training, adapters


def use_reference_ssd(model: torch.nn.Module) -> int:
    """Binds `mixer_forward` on `reference_scan` / `reference_gated_norm` (pure torch, step by step): the same
    wiring as the Triton path, for CPU tests and as the GPU bench's oracle for packed rows."""
    return _bind(model, reference_scan, reference_gated_norm)


def keeps_rows_apart(model: torch.nn.Module) -> bool:
    """True when every Mamba mixer of the model runs `mixer_forward` (so packed rows get per-row state)."""
    mixers = [m for m in model.modules() if isinstance(m, _mixer_class())]
    return all("forward" in vars(m) for m in mixers)


def on_triton(model: torch.nn.Module) -> bool:
    """True when the model has Mamba mixers and each runs `mixer_forward` on mamba-ssm's Triton kernels."""
    mixers = [m for m in model.modules() if isinstance(m, _mixer_class())]
    if not mixers or not all("forward" in vars(m) for m in mixers) or missing():
        return False
    scan = load_ssd()[0].mamba_chunk_scan_combined
    return all(vars(m)["forward"].__func__.keywords["scan"] is scan for m in mixers)


def causal_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                seq_idx: torch.Tensor | None) -> torch.Tensor:
    """Causal depthwise convolution over time: x [B, T, C], weight [C, 1, K] -> [B, T, C].

    Without `seq_idx`: one grouped conv1d. With it: out[t] = bias + sum_s w[K-1-s] * x[t-s] over the shifts s
    whose source x[t-s] lies in the same row as t (a packed row starts from zeros, as it would alone)."""
    k = weight.shape[-1]
    if seq_idx is None:
        out = F.conv1d(x.transpose(1, 2), weight, bias, padding=k - 1, groups=x.shape[-1])[..., : x.shape[1]]
        return out.transpose(1, 2).contiguous()
    taps = weight[:, 0, :].to(x.dtype)  # [C, K]
    out = x * taps[:, k - 1]
    for s in range(1, k):
        shifted = F.pad(x, (0, 0, s, 0))[:, : x.shape[1]]
        same = F.pad(seq_idx, (s, 0), value=-1)[:, : x.shape[1]] == seq_idx
        out = out + shifted * same[..., None].to(x.dtype) * taps[:, k - 1 - s]
    return out if bias is None else out + bias.to(x.dtype)


def mixer_forward(mixer, hidden_states: torch.Tensor, cache=None, attention_mask: torch.Tensor | None = None, *,
                  own: Callable, scan: Callable, gated_norm: Callable, region: GraphedRegion | None = None,
                  **kwargs) -> torch.Tensor:
    """NemotronHMamba2Mixer.forward with `scan` (mamba_chunk_scan_combined's signature) and `gated_norm`
    (rmsnorm_fn's); `own`, the class's forward, runs whenever there is a cache (generation). With `region`, the
    no-cache path runs through it (CUDA graphs where calls repeat)."""
    if cache is not None or kwargs.get("cache_params") is not None:  # transformers < 5.24 names it cache_params
        cached = {} if cache is None else {"cache": cache}
        return own(mixer, hidden_states, attention_mask=attention_mask, **cached, **kwargs)
    seq_idx = kwargs.get("seq_idx")
    if seq_idx is not None:
        seq_idx = seq_idx.to(device=hidden_states.device, dtype=torch.int32)
    if region is not None:
        return region(hidden_states, attention_mask, seq_idx)
    return _mixer_core(mixer, hidden_states, attention_mask, seq_idx, scan=scan, gated_norm=gated_norm)


def _mixer_core(mixer, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None,
                seq_idx: torch.Tensor | None, *, scan: Callable, gated_norm: Callable) -> torch.Tensor:
    """The mixer without a cache: in_proj, convolution, scan, gated norm, out_proj."""
    b, t, _ = hidden_states.shape
    heads, head_dim, groups, state = mixer.num_heads, mixer.head_dim, mixer.n_groups, mixer.ssm_state_size
    projected = mixer.in_proj(_masked(hidden_states, attention_mask))
    gate, xbc, dt = projected.split([mixer.intermediate_size, mixer.conv_dim, heads], dim=-1)
    xbc = mixer.act(causal_conv(xbc, mixer.conv1d.weight, mixer.conv1d.bias, seq_idx))
    x, B, C = _masked(xbc, attention_mask).split(
        [mixer.intermediate_size, groups * state, groups * state], dim=-1)
    y = scan(x.reshape(b, t, heads, head_dim), dt, -torch.exp(mixer.A_log.float()),
             B.reshape(b, t, groups, state), C.reshape(b, t, groups, state), chunk_size=mixer.chunk_size, D=mixer.D,
             dt_bias=mixer.dt_bias, dt_softplus=True, seq_idx=seq_idx, dt_limit=mixer.time_step_limit)
    y = gated_norm(y.reshape(b, t, -1), mixer.norm.weight, None, z=gate.contiguous(),
                   eps=mixer.norm.variance_epsilon, group_size=mixer.intermediate_size // groups,
                   norm_before_gate=False)
    return mixer.out_proj(y.to(hidden_states.dtype))


def _masked(h: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    # Padding positions are zeroed before and after the convolution, as in transformers' mixer: a padded
    # token must feed nothing into the state.
    return h if attention_mask is None else (h * attention_mask[:, :, None]).to(h.dtype)


def reference_scan(x, dt, A, B, C, chunk_size, D=None, dt_bias=None, dt_softplus=False, seq_idx=None,
                   dt_limit=(0.0, float("inf"))) -> torch.Tensor:
    """The Mamba-2 recurrence one step at a time, in float32 (Dao & Gu 2024, eq. 1 with scalar A per head):
    h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t^T, y_t = C_t h_t + D x_t; the state restarts at zero where
    `seq_idx` changes. x [b, t, heads, p], dt [b, t, heads], B and C [b, t, groups, n]; `chunk_size` is unused
    (no chunks), kept for the kernel's signature."""
    b, t, heads, p = x.shape
    dt = dt.float() + (0 if dt_bias is None else dt_bias.float())
    dt = (F.softplus(dt) if dt_softplus else dt).clamp(*dt_limit)
    rep = heads // B.shape[2]
    Bh, Ch = (m.float().repeat_interleave(rep, dim=2) for m in (B, C))  # [b, t, heads, n]
    h = x.new_zeros(b, heads, p, B.shape[-1], dtype=torch.float32)
    ys = []
    for i in range(t):
        if seq_idx is not None and i > 0:
            h = h * (seq_idx[:, i] == seq_idx[:, i - 1]).float()[:, None, None, None]
        decay = torch.exp(dt[:, i] * A.float())[..., None, None]
        h = decay * h + (dt[:, i, :, None] * x[:, i].float())[..., None] * Bh[:, i, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", h, Ch[:, i]))
    y = torch.stack(ys, 1)
    if D is not None:
        y = y + x.float() * D.float()[:, None]
    return y.to(x.dtype)


def reference_gated_norm(x, weight, bias, z=None, eps=1e-6, group_size=None, norm_before_gate=True) -> torch.Tensor:
    """rmsnorm_fn's gated group RMSNorm in torch (norm_before_gate False: norm(x * silu(z)) * weight)."""
    if bias is not None or norm_before_gate:
        raise ValueError("reference_gated_norm: only bias None, norm_before_gate False (Nemotron-H's form)")
    h = x.float() * F.silu(z.float())
    groups = h.view(*h.shape[:-1], -1, group_size)
    groups = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + eps)
    return (groups.view_as(h) * weight.float()).to(x.dtype)
