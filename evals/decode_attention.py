"""Attention for one decode step over a static KV cache: split-KV, grouped heads, masked blocks never read.

The engine's static loop (evals/generate.py) attends from one new token per row to a preallocated cache of
`width + max_new_tokens` positions under an additive mask. SDPA's kernels at one query per head read the whole
cache at about a third of the copy bandwidth (bench/decode_step.py on an H200: 79 us a layer at batch 128, 35% of
the step). This kernel (Triton, CUDA only):

- runs one program per (row, KV head, split of the cache length), the G query heads of a KV head together, so each
  key and value is read once per row (grouped-query attention without repeating K/V);
- skips every block of `BLOCK` positions that the row's mask wholly excludes (the left padding, the slots not yet
  written): a step reads the cache up to the current position only, not to its allocated end;
- keeps a running max and sum per split (online softmax in float32), then one small kernel combines the splits.

`decode_attention_reference` is the same algorithm in PyTorch, block by block (the specification the kernel is
checked against on the GPU, and what the CPU tests check against SDPA). `attention` is the function registered with
transformers as `postlab_decode`: it takes the kernel for one-token steps on CUDA with a 4-D additive mask and hands
every other call (prefill, CPU) to transformers' SDPA attention unchanged.
"""

from __future__ import annotations

import math

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

NAME = "postlab_decode"
BLOCK = 64
# A block whose largest mask value is below this is wholly masked (the engine masks with finfo(dtype).min).
MASKED = -1e30

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: the reference and SDPA serve
    triton = None


def split_plan(length: int, programs: int, target: int) -> tuple[int, int]:
    """(splits, blocks per split) for a cache of `length` positions over `programs` (row, KV head) pairs: enough
    splits that about `target` programs run (a small batch still fills the GPU), never more than the blocks."""
    blocks = -(-length // BLOCK)
    splits = max(1, min(blocks, -(-target // programs)))
    per_split = -(-blocks // splits)
    return -(-blocks // per_split), per_split


def decode_attention_reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor,
                               scale: float, splits: int = 2) -> torch.Tensor:
    """query [B, H, 1, D], key/value [B, KVH, L, D], bias [B, 1, 1, >= L] additive -> [B, 1, H, D] (query dtype).

    The kernel's algorithm: per split of whole blocks, an online softmax over the blocks some position of which the
    row's mask admits; the splits are then combined by their maxima and sums."""
    b, h, _, d = query.shape
    kvh, length = key.shape[1], key.shape[2]
    g = h // kvh
    q = query.float().reshape(b, kvh, g, d)
    mask = bias[:, 0, 0, :length].float()
    blocks = -(-length // BLOCK)
    per_split = -(-blocks // splits)
    parts = []
    for first in range(0, blocks, per_split):
        m = torch.full((b, kvh, g), -math.inf, device=q.device)
        s_sum = torch.zeros(b, kvh, g, device=q.device)
        acc = torch.zeros(b, kvh, g, d, device=q.device)
        for blk in range(first, min(first + per_split, blocks)):
            cols = slice(blk * BLOCK, min((blk + 1) * BLOCK, length))
            admitted = mask[:, cols].amax(-1) > MASKED  # [B]: rows that read this block
            scores = torch.einsum("bkgd,bkld->bkgl", q, key[:, :, cols].float()) * scale + mask[:, None, None, cols]
            m_new = torch.maximum(m, scores.amax(-1))
            p = torch.exp(scores - m_new[..., None])
            alpha = torch.exp(m - m_new)
            new_sum = s_sum * alpha + p.sum(-1)
            new_acc = acc * alpha[..., None] + torch.einsum("bkgl,bkld->bkgd", p, value[:, :, cols].float())
            keep = admitted[:, None, None]
            m, s_sum = torch.where(keep, m_new, m), torch.where(keep, new_sum, s_sum)
            acc = torch.where(keep[..., None], new_acc, acc)
        parts.append((m, s_sum, acc))
    m_max = torch.stack([p[0] for p in parts]).amax(0)
    weights = [torch.exp(p[0] - m_max) for p in parts]
    denom = sum(w * p[1] for w, p in zip(weights, parts, strict=True))
    out = sum(w[..., None] * p[2] for w, p in zip(weights, parts, strict=True)) / denom[..., None]
    return out.reshape(b, 1, h, d).to(query.dtype)


if triton is not None:

    @triton.jit
    def _split_kernel(Q, K, V, Bias, Acc, Max, Sum, scale, length, kv_heads, blocks_per_split,
                      sqb, sqh, skb, skh, skl, svb, svh, svl, sbb,
                      G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_L: tl.constexpr):
        pair, split = tl.program_id(0), tl.program_id(1)
        row, head = pair // kv_heads, pair % kv_heads
        offs_g, offs_d = tl.arange(0, GP), tl.arange(0, D)
        q = tl.load(Q + row * sqb + (head * G + offs_g)[:, None] * sqh + offs_d[None, :],
                    mask=(offs_g < G)[:, None], other=0.0)
        m_i = tl.full([GP], float("-inf"), tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        start = split * blocks_per_split * BLOCK_L
        for i in range(0, blocks_per_split):
            offs_l = start + i * BLOCK_L + tl.arange(0, BLOCK_L)
            inside = offs_l < length
            bias = tl.load(Bias + row * sbb + offs_l, mask=inside, other=float("-inf")).to(tl.float32)
            if tl.max(bias, 0) > -1e30:  # some position of the block is admitted: read its keys and values
                k = tl.load(K + row * skb + head * skh + offs_l[:, None] * skl + offs_d[None, :],
                            mask=inside[:, None], other=0.0)
                s = tl.dot(q, tl.trans(k)) * scale + bias[None, :]
                m_new = tl.maximum(m_i, tl.max(s, 1))
                alpha = tl.exp(m_i - m_new)
                p = tl.exp(s - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                v = tl.load(V + row * svb + head * svh + offs_l[:, None] * svl + offs_d[None, :],
                            mask=inside[:, None], other=0.0)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
                m_i = m_new
        slot = pair * tl.num_programs(1) + split
        tl.store(Acc + (slot * GP + offs_g)[:, None] * D + offs_d[None, :], acc)
        tl.store(Max + slot * GP + offs_g, m_i)
        tl.store(Sum + slot * GP + offs_g, l_i)

    @triton.jit
    def _combine_kernel(Acc, Max, Sum, Out, splits, kv_heads, sob, soh,
                        G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr):
        pair = tl.program_id(0)
        row, head = pair // kv_heads, pair % kv_heads
        offs_g, offs_d = tl.arange(0, GP), tl.arange(0, D)
        m_max = tl.full([GP], float("-inf"), tl.float32)
        for s in range(0, splits):
            m_max = tl.maximum(m_max, tl.load(Max + (pair * splits + s) * GP + offs_g))
        denom = tl.zeros([GP], tl.float32)
        out = tl.zeros([GP, D], tl.float32)
        for s in range(0, splits):
            slot = pair * splits + s
            w = tl.exp(tl.load(Max + slot * GP + offs_g) - m_max)
            denom += w * tl.load(Sum + slot * GP + offs_g)
            out += w[:, None] * tl.load(Acc + (slot * GP + offs_g)[:, None] * D + offs_d[None, :])
        out = out / denom[:, None]
        tl.store(Out + row * sob + (head * G + offs_g)[:, None] * soh + offs_d[None, :],
                 out.to(Out.dtype.element_ty), mask=(offs_g < G)[:, None])


_SMS: dict[int, int] = {}


@torch.compiler.disable  # launched as is where a caller is compiled (the engine compiles the parts around it)
def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """The Triton kernel (CUDA): the contract of `decode_attention_reference`."""
    b, h, _, d = query.shape
    kvh, length = key.shape[1], key.shape[2]
    g = h // kvh
    index = query.device.index or 0
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(query.device).multi_processor_count
    splits, per_split = split_plan(length, b * kvh, 4 * _SMS[index])
    gp = max(16, triton.next_power_of_2(g))
    acc = torch.empty(b * kvh * splits * gp * d, dtype=torch.float32, device=query.device)
    maxima = torch.empty(b * kvh * splits * gp, dtype=torch.float32, device=query.device)
    sums = torch.empty_like(maxima)
    out = torch.empty(b, 1, h, d, dtype=query.dtype, device=query.device)
    _split_kernel[(b * kvh, splits)](
        query, key, value, bias, acc, maxima, sums, scale, length, kvh, per_split,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2), bias.stride(0),
        G=g, GP=gp, D=d, BLOCK_L=BLOCK, num_warps=4, num_stages=2)
    _combine_kernel[(b * kvh,)](acc, maxima, sums, out, splits, kvh, out.stride(0), out.stride(2),
                                G=g, GP=gp, D=d, num_warps=4)
    return out


def kernel_applies(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """One query token on CUDA with Triton, a 4-D additive mask shared by the heads and covering the cache,
    contiguous head dimensions of a power-of-two size, whole groups of query heads per KV head, 16-bit inputs
    (Triton's dot would round float32 ones to tf32: a float32 model keeps SDPA's float32 arithmetic)."""
    d = query.shape[-1]
    return (triton is not None and query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)
            and query.shape[2] == 1 and query.stride(-1) == 1 and mask is not None
            and mask.dim() == 4 and mask.dtype.is_floating_point and mask.shape[1] == mask.shape[2] == 1
            and mask.shape[-1] >= key.shape[2] and mask.stride(-1) == 1 and key.stride(-1) == 1
            and 16 <= d <= 256 and d & (d - 1) == 0 and query.shape[1] % key.shape[1] == 0
            and query.shape[1] // key.shape[1] <= 16)


def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
              **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract ([B, H, q, D] in, [B, q, H, D] out): the kernel where it applies,
    else transformers' SDPA attention as is."""
    if kernel_applies(query, key, attention_mask) and value.stride(-1) == 1:
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return decode_attention(query, key, value, attention_mask, scale), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


def register() -> str:
    """Registers `attention` (and SDPA's mask builder) under NAME with transformers; returns NAME."""
    AttentionInterface.register(NAME, attention)
    if NAME not in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME
