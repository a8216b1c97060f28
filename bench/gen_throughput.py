"""Generation throughput: the eval engine (batched, left-padded) vs one prompt at a time.

Same model, same prompts, same served decoding (greedy, same max new tokens and stop id): generated
tokens per second of `evals.generate.generate` at batch >= 64, and of a loop calling
`model.generate` on one prompt at a time (what the seeds did), plus each as a fraction of the
memory-bandwidth bound for decode: every decode step must read all weights once and the KV cache
of every sequence, so tokens/s <= batch * bandwidth / (weight bytes + batch * KV bytes per sequence).
The bandwidth is measured in the same run with a device-to-device copy (bytes read + written).

Nothing is downloaded: the tokenizer is built offline (core.tiny) and the model is randomly
initialised from a config: `tiny` (the tiny Llama of core.tiny), `llama-1b` (Llama-3.2-1B
shaped: hidden 2048, 16 layers, 32 heads, 8 KV heads, MLP 8192; ~0.97B parameters without the
small offline vocabulary's embeddings) or `nemotron-h` (a scaled-down Nemotron-H hybrid: 18 layers
of Mamba2, MoE and attention, hidden 2048; ~0.9B parameters; served through `generate`, since the
engine's own static loop covers attention-only models). The one-at-a-time loop runs on the first
`--baseline-prompts` prompts only (it is slow); rates, not totals, are compared. `--sampled` uses
the served sampling settings (temperature 0.7, top-p 0.9, repetition penalty 1.1) on both sides;
the model is saved once and `evals.generate.load` timed on it (an eval job pays that once for
all its suites).

CPU smoke (about a minute on 2 cores):

    .venv/bin/python bench/gen_throughput.py --device cpu --model tiny --prompts 64 --batch-size 64 --max-new-tokens 32 --baseline-prompts 8

GPU (one H200; writes bench/results/gen_throughput-cuda-llama-1b.json; add --static-cache for the
compiled static-cache engine):

    python3 bench/gen_throughput.py --device cuda --model llama-1b --dtype bfloat16 --prompts 256 --batch-size 128 --max-new-tokens 256 --baseline-prompts 8
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from any directory

from core import tiny  # noqa: E402
from core.chat import Message, eot_id, render_prompt  # noqa: E402
from evals.decoding import Decoding  # noqa: E402
from evals.generate import STATIC_LOOP_MODEL_TYPES, Loaded, generate, generation_config  # noqa: E402
from evals.types import Item  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def build(model_name: str, device: str, dtype: torch.dtype, workdir: Path) -> Loaded:
    """Offline tokenizer plus a randomly initialised model on `device`."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok_dir = tiny.build_tokenizer(workdir / "tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(tok_dir, trust_remote_code=False)
    if model_name == "tiny":
        path = tiny.build_model("llama", tok_dir, workdir / "model")
        model = LlamaForCausalLM.from_pretrained(path, dtype=dtype)
    elif model_name == "nemotron-h":
        model = _nemotron_h(tokenizer, device, dtype)
    else:
        config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=2048, intermediate_size=8192,
                             num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                             max_position_embeddings=4096, tie_word_embeddings=False,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=eot_id(tokenizer))
        torch.manual_seed(0)
        with torch.device(device):
            model = LlamaForCausalLM(config).to(dtype)
    return Loaded(model=model.to(device).eval(), tokenizer=tokenizer, device=torch.device(device))


# M = Mamba-2, E = MoE, * = attention. Passed as `hybrid_override_pattern`, which transformers 5.24 converts to
# `layers_block_type` and the GPU machine's 5.17 reads as is.
HYBRID_PATTERN = "MEME*E" * 3


def _nemotron_h(tokenizer, device: str, dtype: torch.dtype):
    from transformers import NemotronHConfig, NemotronHForCausalLM

    config = NemotronHConfig(vocab_size=len(tokenizer), hidden_size=2048, hybrid_override_pattern=HYBRID_PATTERN,
                             num_attention_heads=16, num_key_value_heads=4, head_dim=128, intermediate_size=4096,
                             mamba_num_heads=64, mamba_head_dim=64, ssm_state_size=128, n_groups=8, chunk_size=128,
                             n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=1024,
                             moe_shared_expert_intermediate_size=2048, max_position_embeddings=4096,
                             tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=eot_id(tokenizer))
    torch.manual_seed(0)
    with torch.device(device):
        return NemotronHForCausalLM(config).to(dtype)


def load_seconds(loaded: Loaded, device: str, dtype: str, workdir: Path) -> float:
    """Seconds `evals.generate.load` takes on this model saved to local disk (weights and tokenizer)."""
    from evals.generate import load

    loaded.model.save_pretrained(workdir / "saved")
    loaded.tokenizer.save_pretrained(workdir / "saved")
    sync(device)
    start = time.perf_counter()
    again = load(workdir / "saved", device=device, dtype=dtype)
    sync(device)
    seconds = time.perf_counter() - start
    del again
    return seconds


def make_items(n: int, seed: int = 0) -> list[Item]:
    """Prompts of 10..120 words from the offline vocabulary (varied lengths exercise padding)."""
    rng = random.Random(seed)
    return [Item(id=f"p{i}", messages=(Message(role="user", content=" ".join(
        rng.choice(tiny._WORDS) for _ in range(rng.randint(10, 120)))),)) for i in range(n)]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def copy_bandwidth(device: str, mib: int) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read and written."""
    src = torch.empty(mib * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    start, reps = time.perf_counter(), 10
    for _ in range(reps):
        dst.copy_(src)
    sync(device)
    return 2 * src.numel() * reps / (time.perf_counter() - start)


def check_static_decoder(loaded: Loaded, items: list[Item], steps: int = 8) -> dict:
    """The engine's static-cache decode (one CUDA graph replay per step on a GPU, plain calls on the CPU) against
    one full forward over the same tokens: prompts left-padded and bucketed as the engine pads them, then `steps`
    fixed random tokens fed one step at a time. Returns the relative error of the step logits (each row centred,
    so the part that depends on the current token alone does not dominate) and, to show the check can tell, the
    error of a reference given the wrong context (each row's prompt taken from the next row)."""
    from evals.generate import WIDTH_BUCKET, _Decoder, _left_pad

    tok, device = loaded.tokenizer, loaded.device
    prompts = [render_prompt(tok, i.messages) for i in items]
    ids, mask = _left_pad(prompts, tok.pad_token_id, device, WIDTH_BUCKET)
    fed = torch.randint(4, len(tok), (len(prompts), steps - 1), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.inference_mode():
        decoder = _Decoder(loaded.model, len(prompts), ids.shape[1], steps)
        logits = decoder.prefill(ids, mask)
        got = [logits] + [decoder.feed(fed[:, t]) for t in range(steps - 1)]
        got_t = torch.stack(got, 1)
        refs = [_full_logits(loaded.model, c_ids, c_mask, fed) for c_ids, c_mask in
                ((ids, mask), (ids.roll(1, 0), mask.roll(1, 0)))]

    def rel(ref: torch.Tensor) -> float:
        centred = ref - ref.mean(-1, keepdim=True)
        return float((got_t - got_t.mean(-1, keepdim=True) - centred).norm() / centred.norm())

    return {"rows": len(prompts), "steps": steps, "relative_error": rel(refs[0]),
            "wrong_context_relative_error": rel(refs[1]), "graph_replayed": decoder.graph is not None}


def _full_logits(model, ids: torch.Tensor, mask: torch.Tensor, fed: torch.Tensor) -> torch.Tensor:
    """Float32 logits at the last prompt position and every fed position, from one plain forward."""
    full_ids, full_mask = torch.cat([ids, fed], 1), torch.cat([mask, torch.ones_like(fed)], 1)
    positions = (full_mask.cumsum(-1) - 1).masked_fill(full_mask == 0, 1)
    out = model(input_ids=full_ids, attention_mask=full_mask, position_ids=positions, use_cache=False).logits
    return out[:, ids.shape[1] - 1:].float()


# Tolerances of the static decoder check: float32 agrees to rounding; bf16 decode-shaped products round
# differently from the prefill-shaped ones of the reference (Hopper bf16 products: 1e-3..1e-2 relative).
DECODER_TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2}


def one_at_a_time(loaded: Loaded, items: list[Item], decoding: Decoding) -> tuple[int, float]:
    """The seeds' loop: model.generate on each prompt alone; returns (new tokens, seconds)."""
    tok = loaded.tokenizer
    stops = list(decoding.stop_token_ids)
    config = generation_config(decoding, stops, tok.pad_token_id)
    total, start = 0, time.perf_counter()
    for item in items:
        ids = torch.tensor([render_prompt(tok, item.messages)], device=loaded.device)
        with torch.inference_mode():
            out = loaded.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
        new = out[0, ids.shape[1]:].tolist()
        total += next((i + 1 for i, t in enumerate(new) if t in stops), len(new))
    sync(str(loaded.device))
    return total, time.perf_counter() - start


def decode_bound(loaded: Loaded, batch: int, context: float, bandwidth: float, kv_layers: int) -> float:
    """Upper bound on tokens/s of decode: per step, read all weights plus each sequence's KV cache
    (`kv_layers` attention layers; a hybrid's Mamba state is per sequence, not per token)."""
    cfg = loaded.model.config
    elem = next(loaded.model.parameters()).element_size()
    weight_bytes = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_per_token = 2 * kv_layers * cfg.num_key_value_heads * head_dim * elem
    return batch * bandwidth / (weight_bytes + batch * context * kv_per_token)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--model", choices=["tiny", "llama-1b", "nemotron-h"], default="tiny")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--prompts", type=int, default=64, help="prompts generated by the engine")
    parser.add_argument("--batch-size", type=int, default=64, help="engine batch size (>= 64 for the goal)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--static-cache", action="store_true", help="engine with static KV cache + CUDA graphs")
    parser.add_argument("--sampled", action="store_true", help="served sampling (T 0.7, top-p 0.9, rep. penalty 1.1)")
    parser.add_argument("--baseline-prompts", type=int, default=8, help="prompts for the one-at-a-time loop")
    parser.add_argument("--copy-mib", type=int, default=0, help="copy size for bandwidth (0: 1024 on cuda, 256 on cpu)")
    parser.add_argument("--out", type=Path, default=None, help="result JSON (default bench/results/...)")
    args = parser.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        loaded = build(args.model, args.device, getattr(torch, args.dtype), Path(tmp))
        load_s = load_seconds(loaded, args.device, args.dtype, Path(tmp))
    items = make_items(args.prompts)
    sampling = {"temperature": 0.7, "top_p": 0.9, "repetition_penalty": 1.1} if args.sampled else {}
    decoding = Decoding(max_new_tokens=args.max_new_tokens, stop_token_ids=(eot_id(loaded.tokenizer),), **sampling)
    bandwidth = copy_bandwidth(args.device, args.copy_mib or (1024 if args.device.startswith("cuda") else 256))
    check = None
    if args.static_cache and loaded.model.config.model_type in STATIC_LOOP_MODEL_TYPES:
        check = check_static_decoder(loaded, items[:8])
        print(f"static decoder check: {check}", flush=True)
        if not (check["relative_error"] <= DECODER_TOLERANCE[args.dtype]
                and check["relative_error"] < 0.25 * check["wrong_context_relative_error"]):
            raise SystemExit(f"static decoder disagrees with a full forward: {check}")
    generate(loaded, items[:4], decoding.model_copy(update={"max_new_tokens": 4}), seed=0, batch_size=4)  # warm-up

    # Two engine passes: the first pays one-time costs (compilation with --static-cache), the second
    # is the steady state an eval job sees after its first suite.
    passes, outputs = [], []
    for _ in range(2):
        sync(args.device)
        start = time.perf_counter()
        comps = generate(loaded, items, decoding, seed=0, batch_size=args.batch_size, static_cache=args.static_cache)
        sync(args.device)
        passes.append(time.perf_counter() - start)
        outputs.append(comps)
    # Same items, decoding, seed and batch size: a replicate must be reproducible (sampled too: the graph's draws
    # come from the seeded generator).
    if outputs[0] != outputs[1]:
        raise SystemExit("two passes with the same seed gave different completions")
    engine_s = passes[1]
    engine_tokens = sum(c.n_tokens for c in comps)
    # The loop gets a first pass too, so both sides are timed on shapes they have seen once.
    base_first_s = one_at_a_time(loaded, items[: args.baseline_prompts], decoding)[1]
    base_tokens, base_s = one_at_a_time(loaded, items[: args.baseline_prompts], decoding)

    prompt_len = sum(len(render_prompt(loaded.tokenizer, i.messages)) for i in items) / len(items)
    context = prompt_len + args.max_new_tokens / 2
    engine_tps, base_tps = engine_tokens / engine_s, base_tokens / base_s
    kv_layers = HYBRID_PATTERN.count("*") if args.model == "nemotron-h" else loaded.model.config.num_hidden_layers
    engine_bound = decode_bound(loaded, min(args.batch_size, args.prompts), context, bandwidth, kv_layers)
    base_bound = decode_bound(loaded, 1, context, bandwidth, kv_layers)
    result = {
        "bench": "gen_throughput",
        "command": " ".join(["python", *sys.argv]),
        "at": datetime.now(UTC).isoformat(timespec="seconds"),
        "hardware": {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu",
                     "torch": torch.__version__, "threads": torch.get_num_threads()},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version()},
        "static_decoder_check": check,
        "model": {"name": args.model, "dtype": args.dtype,
                  "parameters": sum(p.numel() for p in loaded.model.parameters())},
        "config": vars(args) | {"out": str(args.out), "mean_prompt_tokens": prompt_len},
        "copy_bandwidth_gbs": bandwidth / 1e9,
        "load_seconds": load_s,
        "decoding": decoding.model_dump(mode="json"),
        "engine": {"tokens": engine_tokens, "seconds": engine_s, "first_pass_seconds": passes[0],
                   "one_time_seconds": passes[0] - passes[1],
                   "tokens_per_s": engine_tps,
                   "stopped": sum(c.stopped for c in comps), "reproducible": True,
                   "bound_tokens_per_s": engine_bound,
                   "fraction_of_bound": engine_tps / engine_bound},
        "one_at_a_time": {"prompts": args.baseline_prompts, "tokens": base_tokens, "seconds": base_s,
                          "first_pass_seconds": base_first_s,
                          "tokens_per_s": base_tps, "bound_tokens_per_s": base_bound,
                          "fraction_of_bound": base_tps / base_bound},
        "speedup": engine_tps / base_tps,
    }
    out = args.out or RESULTS / f"gen_throughput-{args.device.split(':')[0]}-{args.model}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("engine", "one_at_a_time", "speedup", "copy_bandwidth_gbs", "load_seconds")},
                     indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
