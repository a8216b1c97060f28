"""Hybrid decode: the eval engine's static loop (evals/decode_hybrid.py) vs batched `model.generate`, same run.

The model is a Nemotron-H shape with random bf16 weights, built on the meta device and materialised in place on
the GPU (no CPU copy, no disk): `30b-a3b` (bench/train_memory.py's shape: 52 blocks, 23 Mamba-2, 23 MoE of 128
experts top-6, 6 attention, vocabulary 131,072; 31.6B parameters) or `nemotron-h` (bench/gen_throughput.py's
0.89B bench hybrid). Prompts are the offline ones of gen_throughput (10-120 words; the tokenizer's 1,024 ids),
greedy, stop on the end-of-turn id. Per batch size:

- `engine`: `evals.generate.generate` over `batch` prompts (one batch), `--new-tokens` new tokens each; the first
  call captures the step's CUDA graph (and compiles the norms), the second is timed;
- `generate`: the same prompts left-padded in one batch through `model.generate` (DynamicCache; transformers'
  PyTorch Mamba functions since mamba-ssm's package does not import without its CUDA extension; grouped-matmul
  experts), `--generate-tokens` new tokens (fewer: it is slow); the engine is also timed at that length
  (`engine_same_length`) and its completions compared with `generate`'s (`equal_rows`: bf16, other kernels, so
  near-ties may flip a token);
- the bound: tokens/s if each step only read every weight once and each row's KV cache at the mean context
  (`gen_throughput.decode_bound`, bandwidth measured here by a device copy): at these batches every expert is hit
  each step. The Mamba state a step also reads and writes (float32, 12.3 GB at batch 256 on 30b-a3b) is not in it.

Before timing, the engine's step logits are checked against the same decoder stepped eagerly (`check_replay`: a
capture fault shows there) and against one full forward over the same tokens (`gen_throughput.check_static_decoder`;
in bf16 a random MoE's routing can flip on rounding, so run `--dtype float32` on the bench hybrid to tell). `--profile` adds the top kernels of three plain (not replayed) steps at
the largest batch. Writes `{"runs": [{"batch", "engine": {"tokens_per_s", "fraction_of_bound"}, "generate":
{"tokens_per_s"}}]}` plus the details.

    python3 bench/decode_hybrid.py --shape 30b-a3b --batches 64 256 --out bench/results/decode-30b-a3b.json
    python3 bench/decode_hybrid.py --shape nemotron-h --dtype float32 --batches 64 --new-tokens 64 --out /tmp/d.json
    .venv/bin/python bench/decode_hybrid.py --device cpu --shape tiny --batches 4 --new-tokens 8 \\
        --generate-tokens 4 --dtype float32 --out /tmp/decode-tiny.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from any directory
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gen_throughput import (  # noqa: E402
    DECODER_TOLERANCE,
    check_static_decoder,
    copy_bandwidth,
    decode_bound,
    make_items,
    sync,
)
from gen_throughput import HYBRID_PATTERN as BENCH_PATTERN  # noqa: E402
from train_memory import nemotron_h, random_init_  # noqa: E402

from core import tiny  # noqa: E402
from core.chat import eot_id, render_prompt  # noqa: E402
from evals import decode_hybrid  # noqa: E402
from evals.decoding import Decoding  # noqa: E402
from evals.generate import WIDTH_BUCKET, Loaded, _left_pad, generate, generation_config  # noqa: E402


def config_for(shape: str, tokenizer):
    from transformers import NemotronHConfig

    ids = {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": eot_id(tokenizer), "bos_token_id": None}
    if shape == "nemotron-h":
        return NemotronHConfig(vocab_size=len(tokenizer), hidden_size=2048, hybrid_override_pattern=BENCH_PATTERN,
                               num_attention_heads=16, num_key_value_heads=4, head_dim=128, intermediate_size=4096,
                               mamba_num_heads=64, mamba_head_dim=64, ssm_state_size=128, n_groups=8, chunk_size=128,
                               n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=1024,
                               moe_shared_expert_intermediate_size=2048, max_position_embeddings=4096,
                               tie_word_embeddings=False, **ids)
    config = nemotron_h(shape)
    config.use_cache = True
    for key, value in ids.items():
        setattr(config, key, value)
    return config


def build(shape: str, device: str, dtype: torch.dtype, workdir: Path) -> Loaded:
    """Meta-device skeleton, materialised on `device` and filled in place with random weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny.build_tokenizer(workdir / "tokenizer"), trust_remote_code=False)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config_for(shape, tokenizer), dtype=dtype)
    model.to_empty(device=device)
    random_init_(model)
    model.eval()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return Loaded(model=model, tokenizer=tokenizer, device=torch.device(device))


def generate_batched(loaded: Loaded, items, decoding: Decoding) -> tuple[list[list[int]], int, float]:
    """All `items` in one left-padded batch through `model.generate`: (new ids per row, new tokens, seconds)."""
    tok = loaded.tokenizer
    stops = list(decoding.stop_token_ids)
    ids, mask = _left_pad([render_prompt(tok, i.messages) for i in items], tok.pad_token_id, loaded.device,
                          WIDTH_BUCKET)
    sync(str(loaded.device))
    start = time.perf_counter()
    with torch.inference_mode():
        out = loaded.model.generate(input_ids=ids, attention_mask=mask,
                                    generation_config=generation_config(decoding, stops, tok.pad_token_id))
    sync(str(loaded.device))
    seconds = time.perf_counter() - start
    rows = [r[ids.shape[1]:].tolist() for r in out]
    n = sum(next((i + 1 for i, t in enumerate(r) if t in stops), len(r)) for r in rows)
    return rows, n, seconds


def timed_engine(loaded: Loaded, items, decoding: Decoding) -> tuple[list, float]:
    sync(str(loaded.device))
    start = time.perf_counter()
    comps = generate(loaded, items, decoding, seed=0, batch_size=len(items), static_cache=True)
    sync(str(loaded.device))
    return comps, time.perf_counter() - start


def run_batch(loaded: Loaded, batch: int, args, bandwidth: float) -> dict:
    items = make_items(batch, seed=batch)
    stop = (eot_id(loaded.tokenizer),)
    short = Decoding(max_new_tokens=args.generate_tokens, stop_token_ids=stop)
    full = Decoding(max_new_tokens=args.new_tokens, stop_token_ids=stop)
    generate_batched(loaded, items[:2], short.model_copy(update={"max_new_tokens": 2}))  # warm-up
    ref_rows, gen_tokens, gen_s = generate_batched(loaded, items, short)
    timed_engine(loaded, items, short)  # capture this shape
    same, same_s = timed_engine(loaded, items, short)
    timed_engine(loaded, items, full)
    comps, engine_s = timed_engine(loaded, items, full)
    loaded.decoders.clear()  # their state buffers (GBs at batch 256) before the next batch size
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    prompt_len = sum(len(render_prompt(loaded.tokenizer, i.messages)) for i in items) / batch
    kv_layers = loaded.model.config.layers_block_type.count("full_attention")
    bound = decode_bound(loaded, batch, prompt_len + args.new_tokens / 2, bandwidth, kv_layers)
    engine_tokens = sum(c.n_tokens for c in comps)
    cuts = [next((i for i, t in enumerate(r) if t in stop), len(r)) for r in ref_rows]
    ref_text = [loaded.tokenizer.decode(r[:cut], skip_special_tokens=False) for r, cut in zip(ref_rows, cuts, strict=True)]
    equal = sum(c.text == t for c, t in zip(same, ref_text, strict=True))
    engine_tps = engine_tokens / engine_s
    return {"batch": batch, "mean_prompt_tokens": prompt_len,
            "engine": {"tokens_per_s": engine_tps, "fraction_of_bound": engine_tps / bound, "tokens": engine_tokens,
                       "seconds": engine_s, "new_tokens": args.new_tokens, "bound_tokens_per_s": bound},
            "engine_same_length": {"tokens_per_s": sum(c.n_tokens for c in same) / same_s, "seconds": same_s,
                                   "new_tokens": args.generate_tokens},
            "generate": {"tokens_per_s": gen_tokens / gen_s, "tokens": gen_tokens, "seconds": gen_s,
                         "new_tokens": args.generate_tokens, "fraction_of_bound": gen_tokens / gen_s / bound},
            "speedup": engine_tps / (gen_tokens / gen_s),
            "speedup_same_length": sum(c.n_tokens for c in same) / same_s / (gen_tokens / gen_s),
            "equal_rows": equal, "rows": batch}


def check_replay(loaded: Loaded, items, steps: int = 8) -> dict:
    """The captured step against the same decoder stepped eagerly (same kernels, same shapes): tells a capture
    fault (stale buffers, state baked in at capture) from arithmetic differences such as bf16 routing flips."""
    from evals.generate import _Decoder

    tok = loaded.tokenizer
    ids, mask = _left_pad([render_prompt(tok, i.messages) for i in items], tok.pad_token_id, loaded.device,
                          WIDTH_BUCKET)
    fed = torch.randint(4, len(tok), (len(items), steps), generator=torch.Generator().manual_seed(0)).to(ids.device)
    with torch.inference_mode():
        decoder = _Decoder(loaded.model, len(items), ids.shape[1], steps + 1)
        runs = []
        for graph in (decoder.graph, None):
            decoder.graph = graph
            decoder.prefill(ids, mask)
            runs.append(torch.stack([decoder.feed(fed[:, t]).clone() for t in range(steps)], 1))
    replayed, eager = runs
    return {"steps": steps,
            "relative_error": float((replayed - eager).norm() / eager.norm())}


def profile_step(loaded: Loaded, batch: int, width: int) -> list[dict]:
    """Top CUDA kernels of three plain decode steps (the captured step's kernels, launched one by one)."""
    from torch.profiler import ProfilerActivity, profile

    from evals.generate import _Decoder

    items = make_items(batch, seed=batch)
    ids, mask = _left_pad([render_prompt(loaded.tokenizer, i.messages) for i in items], loaded.tokenizer.pad_token_id,
                          loaded.device, WIDTH_BUCKET)
    with torch.inference_mode():
        decoder = _Decoder(loaded.model, batch, ids.shape[1], 8)
        token = decoder.prefill(ids, mask).argmax(-1)
        decoder.graph = None
        with decoder._kernels(fused=True):
            decoder.feed(token)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    decoder.feed(token)
                sync("cuda")
    rows = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:20]
    return [{"name": e.key[:120], "calls": e.count, "cuda_ms_per_step": e.device_time_total / 3e3} for e in rows]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=["30b-a3b", "nemotron-h", "tiny"], default="30b-a3b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--generate-tokens", type=int, default=32)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        loaded = build(args.shape, args.device, dtype, Path(tmp))
    build_s = time.perf_counter() - t0
    kernels = decode_hybrid.kernels_for(loaded.device).name
    print(f"built {args.shape} in {build_s:.1f} s; Mamba decode kernels: {kernels}", flush=True)
    bandwidth = copy_bandwidth(args.device, 1024 if args.device == "cuda" else 64)
    replay = check_replay(loaded, make_items(8))
    check = check_static_decoder(loaded, make_items(8))
    print(f"replay vs eager: {replay}; static decoder vs a full forward: {check}", flush=True)
    if replay["relative_error"] > 1e-2 or not (check["relative_error"] <= DECODER_TOLERANCE[args.dtype]
                                               and check["relative_error"] < 0.25 * check["wrong_context_relative_error"]):
        raise SystemExit(f"static decoder check failed: replay {replay}, full forward {check}")
    loaded.decoders.clear()
    runs = []
    for batch in args.batches:
        runs.append(run_batch(loaded, batch, args, bandwidth))
        print(json.dumps(runs[-1]), flush=True)
    profile = profile_step(loaded, max(args.batches), 256) if args.profile else None
    weights = sum(t.numel() * t.element_size() for t in loaded.model.parameters())
    report = {"bench": "decode_hybrid", "command": " ".join(["python3", *sys.argv]),
              "at": datetime.now(UTC).isoformat(timespec="seconds"),
              "hardware": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
              "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
              "shape": args.shape, "dtype": args.dtype, "parameters": sum(t.numel() for t in loaded.model.parameters()),
              "weight_bytes": weights, "build_seconds": build_s, "mamba_kernels": kernels,
              "copy_bandwidth_gbs": bandwidth / 1e9, "static_decoder_check": check, "replay_check": replay, "runs": runs,
              "profile": profile}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for r in runs:
        print(f"batch {r['batch']:4d}: engine {r['engine']['tokens_per_s']:8.0f} tok/s "
              f"({100 * r['engine']['fraction_of_bound']:.1f}% of bound)  generate {r['generate']['tokens_per_s']:7.0f}"
              f" tok/s  x{r['speedup']:.1f} (same length x{r['speedup_same_length']:.1f})  equal rows "
              f"{r['equal_rows']}/{r['rows']}")
    if profile:
        for row in profile[:12]:
            print(f"{row['cuda_ms_per_step']:8.3f} ms  {row['calls'] // 3:4d}x  {row['name']}")


if __name__ == "__main__":
    main()
