"""One decode step of the eval engine's static-cache loop, timed apart from the loop around it, per attention kernel.

bench/gen_throughput.py times the engine end to end; this splits one step: the CUDA-graph replay of the model's
forward alone (CUDA events over `--replays` replays after a prefill of real prompts, so the cache holds real data)
and the engine's whole step (`evals.generate._decode_static` over one batch, divided by its steps), for the
attention kernels SDPA can pick with the engine's additive mask (default choice, memory-efficient, cuDNN, math) and
for transformers' eager attention, and `triton`: the engine's own split-KV kernel (evals/decode_attention.py, what
the engine runs on CUDA) and `triton-fused`: that kernel with the RMSNorms and MLPs compiled (the engine's
CUDA default, `evals.generate.fused_pieces`), the kernel checked first against its PyTorch reference and SDPA on a batch whose wholly masked
blocks hold NaN (a block read that should not be would show). Each is set as the graph is captured, which fixes the
kernels its replays run.
Per variant: ms per step, and the bytes a step must read (all weights, plus every row's whole static cache, which
the masked step reads in full) over that time against the copy bandwidth measured here. `--profile` adds the top
CUDA kernels of one plain (not replayed) step.

    python3 bench/decode_step.py --out bench/results/decode_step-llama-1b.json --profile
    .venv/bin/python bench/decode_step.py --device cpu --model tiny --batch 4 --new-tokens 8 --replays 4 \\
        --variants default eager --out /tmp/decode_step.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from collections import OrderedDict
from contextlib import nullcontext
from datetime import UTC, datetime
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from any directory
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gen_throughput import build, copy_bandwidth, make_items  # noqa: E402

from core.chat import render_prompt  # noqa: E402
from evals.decoding import Decoding  # noqa: E402
from evals.generate import (  # noqa: E402
    WIDTH_BUCKET,
    _decode_static,
    _Decoder,
    _left_pad,
    _Sampler,
    fused_pieces,
    generation_config,
)

VARIANTS = ["default", "efficient", "cudnn", "math", "eager", "triton", "triton-fused"]


def backend(variant: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = {"efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
              "math": SDPBackend.MATH}.get(variant)
    return sdpa_kernel([chosen]) if chosen is not None else nullcontext()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(variant: str, loaded, ids, mask, args) -> dict:
    model = loaded.model
    model.set_attn_implementation("eager" if variant == "eager" else "sdpa")
    batch, width = ids.shape
    replays = min(args.replays, args.new_tokens - 1)
    with torch.inference_mode(), backend(variant):
        decoder = _Decoder(model, batch, width, args.new_tokens, own_attention=variant.startswith("triton"),
                           fuse=variant == "triton-fused")
        token = decoder.prefill(ids, mask).argmax(-1)
        sync(args.device)
        t0 = time.perf_counter()
        for _ in range(replays):
            decoder.feed(token)
        sync(args.device)
        replay_s = (time.perf_counter() - t0) / replays
        pad = loaded.tokenizer.pad_token_id
        config = generation_config(Decoding(max_new_tokens=args.new_tokens, stop_token_ids=(-1,)), [-1], pad)
        sampler = _Sampler(config, [-1])  # the engine's decoder: the same variant, with the choice captured too
        decoder = _Decoder(model, batch, width, args.new_tokens, sampler, own_attention=variant.startswith("triton"),
                           fuse=variant == "triton-fused")
        decoders = OrderedDict({(batch, width, args.new_tokens, sampler.key): decoder})
        _decode_static(model, ids, mask, config, [-1], decoders)  # warm: the same shapes, the captured graph
        sync(args.device)
        t0 = time.perf_counter()
        _decode_static(model, ids, mask, config, [-1], decoders, check_every=args.check_every)
        sync(args.device)
        engine_s = (time.perf_counter() - t0) / args.new_tokens
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    cache = sum(t.numel() * t.element_size() for layer in decoder.cache.layers for t in (layer.keys, layer.values))
    return {"variant": variant, "graph_replayed": decoder.graph is not None, "replay_ms": replay_s * 1e3,
            "engine_step_ms": engine_s * 1e3, "bytes_per_step": weights + cache, "weight_bytes": weights,
            "cache_bytes": cache}


def profile_step(loaded, ids, mask, args) -> str:
    from torch.profiler import ProfilerActivity, profile

    loaded.model.set_attn_implementation("sdpa")
    batch, width = ids.shape
    with torch.inference_mode():
        decoder = _Decoder(loaded.model, batch, width, args.new_tokens)
        token = decoder.prefill(ids, mask).argmax(-1)
        decoder.graph = None  # plain calls: the profiler sees each kernel the graph would replay
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
        with fused_pieces(decoder.fused):  # as captured: the compiled norms and MLPs in place
            decoder.feed(token)
            with profile(activities=activities) as prof:
                for _ in range(3):
                    decoder.feed(token)
                sync(args.device)
    key = "cuda_time_total" if args.device == "cuda" else "cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=20, max_name_column_width=70)


def check_kernel(batch: int, length: int, seed: int = 0) -> dict:
    """The Triton kernel against its PyTorch reference and SDPA (bf16, GQA 32/8, head dim 64), each row with its
    own left padding and last position; the blocks no row may read hold NaN in the kernel's input."""
    from evals.decode_attention import BLOCK, decode_attention, decode_attention_reference

    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, 32, 1, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(batch, 8, length, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    bias = torch.full((batch, 1, 1, length), torch.finfo(torch.bfloat16).min, device="cuda", dtype=torch.bfloat16)
    starts = torch.randint(0, length // 2, (batch,), generator=g, device="cuda").tolist()
    ends = torch.randint(length // 2, length, (batch,), generator=g, device="cuda").tolist()
    for row, (lo, hi) in enumerate(zip(starts, ends, strict=True)):
        bias[row, 0, 0, lo : hi + 1] = 0
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), attn_mask=bias).transpose(1, 2).float()
    reference = decode_attention_reference(q, k, v, bias, 64 ** -0.5).float()
    poisoned_k, poisoned_v = k.clone(), v.clone()
    for row, (lo, hi) in enumerate(zip(starts, ends, strict=True)):
        for blk in range(-(-length // BLOCK)):
            if blk * BLOCK > hi or (blk + 1) * BLOCK <= lo:
                poisoned_k[row, :, blk * BLOCK : (blk + 1) * BLOCK] = float("nan")
                poisoned_v[row, :, blk * BLOCK : (blk + 1) * BLOCK] = float("nan")
    got = decode_attention(q, poisoned_k, poisoned_v, bias, 64 ** -0.5).float()
    torch.cuda.synchronize()
    rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    return {"batch": batch, "length": length, "finite": bool(torch.isfinite(got).all()),
            "vs_reference": rel(got, reference), "vs_sdpa": rel(got, sdpa), "reference_vs_sdpa": rel(reference, sdpa)}


def profile_engine(loaded, ids, mask, args) -> dict:
    """The engine's whole loop (`_decode_static`, its captured decoder, 32 steps) under the profiler: its top kernels
    and CPU ops, and the host's time against the GPU's (a loop the host cannot feed shows more CPU than CUDA)."""
    from torch.profiler import ProfilerActivity, profile

    batch, width = ids.shape
    pad = loaded.tokenizer.pad_token_id
    config = generation_config(Decoding(max_new_tokens=32, stop_token_ids=(-1,)), [-1], pad)
    decoders = OrderedDict()
    with torch.inference_mode():
        _decode_static(loaded.model, ids, mask, config, [-1], decoders)
        sync(args.device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            _decode_static(loaded.model, ids, mask, config, [-1], decoders)
            sync(args.device)
            wall = time.perf_counter() - t0
    averages = prof.key_averages()
    return {"steps": 32, "wall_s": wall,
            "self_cpu_s": sum(e.self_cpu_time_total for e in averages) / 1e6,
            "self_cuda_s": sum(e.self_device_time_total for e in averages) / 1e6,
            "by_cuda": averages.table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=60),
            "by_cpu": averages.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    p.add_argument("--model", default="llama-1b", choices=["llama-1b", "tiny"])
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--replays", type=int, default=200)
    p.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--profile-engine", action="store_true", help="profile the engine's whole loop")
    p.add_argument("--check-every", type=int, default=None, help="the engine's stop check interval (None: its own)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    with tempfile.TemporaryDirectory() as tmp:
        loaded = build(args.model, args.device, dtype, Path(tmp))
    prompts = [render_prompt(loaded.tokenizer, i.messages) for i in make_items(args.batch)]
    ids, mask = _left_pad(prompts, loaded.tokenizer.pad_token_id, loaded.device, WIDTH_BUCKET)
    bandwidth = copy_bandwidth(args.device, 1024 if args.device == "cuda" else 64)
    results, checks = [], []
    if any(v.startswith("triton") for v in args.variants):
        checks = [check_kernel(batch, length, seed) for seed, (batch, length) in enumerate([(128, 448), (8, 448), (3, 1000)])]
        print(f"kernel checks: {checks}", flush=True)
        if not all(c["finite"] and c["vs_reference"] < 1e-2 and c["vs_sdpa"] < 2e-2 for c in checks):
            raise SystemExit(f"the decode attention kernel disagrees with its reference or SDPA: {checks}")
    for variant in args.variants:
        try:
            r = measure(variant, loaded, ids, mask, args)
        except RuntimeError as err:  # a kernel SDPA cannot run with this mask and shape: recorded, the rest go on
            results.append({"variant": variant, "error": str(err)[:1000]})
            print(f"{variant:10} failed: {str(err)[:300]}", flush=True)
            continue
        r["replay_fraction_of_bandwidth"] = r["bytes_per_step"] / (r["replay_ms"] / 1e3) / bandwidth
        results.append(r)
        print(f"{variant:10} replay {r['replay_ms']:7.3f} ms  engine step {r['engine_step_ms']:7.3f} ms  "
              f"bytes/step {r['bytes_per_step'] / 1e9:.2f} GB  {r['replay_fraction_of_bandwidth']:.1%} of copy bandwidth",
              flush=True)
    table = profile_step(loaded, ids, mask, args) if args.profile else None
    engine = profile_engine(loaded, ids, mask, args) if args.profile_engine else None
    if engine:
        print(f"engine loop: wall {engine['wall_s']:.3f} s, CPU {engine['self_cpu_s']:.3f} s, "
              f"CUDA {engine['self_cuda_s']:.3f} s\n{engine['by_cpu']}\n{engine['by_cuda']}", flush=True)
    report = {"bench": "decode_step", "command": " ".join(["python", *sys.argv]),
              "at": datetime.now(UTC).isoformat(timespec="seconds"),
              "hardware": {"device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor(),
                           "copy_bandwidth_bytes_per_s": bandwidth},
              "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
              "shape": {"batch": args.batch, "width": ids.shape[1], "new_tokens": args.new_tokens,
                        "cache_length": ids.shape[1] + args.new_tokens},
              "kernel_checks": checks, "variants": results, "profile_top_kernels": table, "engine_profile": engine}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    if table:
        print(table)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
