"""Where the project's training step spends its time, and what candidate changes to it buy, in one run.

The step is the trainers' own: `trainers.common.make_trainable` (full fine-tuning, or peft LoRA r 64 on the
dense targets), `trainers.sft.SFTObjective` (chunked head + loss at supervised positions) and
`trainers.loop._one_step`, then clipping and AdamW, on random token rows (the last three quarters of each row
supervised). Variants change one thing each:

- `full`: what the trainer does on one GPU today (bf16 weights, `torch.optim.AdamW` with its default foreach step);
- `full-fused`: the same with `AdamW(fused=True)`;
- `lora`: peft's default, which keeps the adapters in float32 and casts each adapted layer's input to float32;
- `lora-autocast`: the same step under `torch.autocast(bfloat16)` (adapters float32, their products bf16);
- `lora-bf16`: adapters stored in bf16 like the base (products bf16, no casts);
- `full-compile`, `lora-compile`: `full` and `lora-bf16` with each decoder block compiled
  (`trainers.common.compile_decoder_blocks`); `...-compile-fused`: and `AdamW(fused=True)`, what the trainer does
  on one CUDA process. Their first loss must
  match the eager variant's (same weights, same rows) within 2%, and `compile_s` is the first step's extra time;
- for the `nemotron-h` shape (LoRA on its routed experts too): `...-peft-experts` runs the experts through peft's
  own `ParamWrapper` (a parametrization registered and removed on every call: what the trainer did before
  `trainers.lora_experts`); `lora-compile-fused-mamba` also compiles each Mamba mixer's adapted `in_proj` (base
  matmul, LoRA factors, scale and add) as a region of its own; `...-nogc`: Python's garbage collector frozen and
  off during the steps (is a collection pause part of a host-bound step?). The `-compile` variants also replay the
  Mamba mixers from CUDA graphs, as the trainer does (`trainers.common.graph_mamba_mixers`), except
  `...-nographs` (the trainer before) and `-mamba`; a graphed variant's every loss must equal its `-nographs`
  twin's within 0.2% (`max_loss_gap_to_twin`), and `compiler.mamba_graphs` counts the mixers' eager calls,
  captures and replays.

Per variant: median step seconds over `--steps` after two warm-up steps, tokens/s, MFU (as
bench/train_throughput.py counts it, over the bf16 matmul rate measured here), peak GPU memory, the first loss
(a random model's is ln(vocab)), and the compiler's graph breaks and distinct graphs over all steps;
`--profile` adds the top CUDA kernels of one step of `full`, `lora` and `full-compile` (`--profile VARIANT...`:
of those), with the step's wall time beside the table's summed kernel time.

    python3 bench/train_step_variants.py --device cuda --out bench/results/train_step_variants-llama-1b.json --profile
    python3 bench/train_step_variants.py --device cuda --shape nemotron-h --batch 2 --variants full-compile-fused \\
        lora-bf16 lora-compile-fused --profile full-compile-fused lora-compile-fused --out /tmp/variants-h.json
    .venv/bin/python bench/train_step_variants.py --device cpu --shape tiny --seq-len 64 --batch 2 --steps 1 \\
        --variants full lora-bf16 --out /tmp/variants.json
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import statistics
import sys
import tempfile
import time
from collections import Counter
from contextlib import nullcontext
from datetime import UTC, datetime
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from any directory
sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_throughput import build_model, flops_per_token, matmul_peak  # noqa: E402

from core import tiny  # noqa: E402
from trainers import loop, mamba_kernels  # noqa: E402
from trainers.batch import Encoded  # noqa: E402
from trainers.common import LoRASettings, compile_decoder_blocks, graph_mamba_mixers, make_trainable  # noqa: E402
from trainers.sft import SFTObjective  # noqa: E402

VARIANTS = ["full", "full-fused", "lora", "lora-autocast", "lora-bf16", "full-compile", "lora-compile",
            "full-compile-fused", "lora-compile-fused", "lora-bf16-peft-experts", "lora-compile-fused-peft-experts",
            "lora-compile-fused-mamba", "lora-compile-fused-nogc", "full-compile-fused-nogc",
            "full-compile-fused-nographs", "lora-compile-fused-nographs"]
EAGER_OF = {"full-compile": "full", "lora-compile": "lora-bf16", "full-compile-fused": "full",
            "lora-compile-fused": "lora-bf16", "lora-bf16-peft-experts": "lora-bf16",
            "lora-compile-fused-peft-experts": "lora-bf16", "lora-compile-fused-mamba": "lora-bf16",
            "lora-compile-fused-nogc": "lora-bf16", "full-compile-fused-nogc": "full",
            "full-compile-fused-nographs": "full", "lora-compile-fused-nographs": "lora-bf16"}
# Variants whose every step's loss must equal their twin's (same weights, rows and updates; only the CUDA graphs
# over the Mamba mixers differ), within bf16 noise.
GRAPHS_TWIN = {"full-compile-fused": "full-compile-fused-nographs", "lora-compile-fused": "lora-compile-fused-nographs"}
PROFILED = ["full", "lora", "full-compile"]


def rows(n: int, seq_len: int, vocab: int) -> list[Encoded]:
    g = torch.Generator().manual_seed(0)
    prompt = seq_len // 4
    return [Encoded(torch.randint(4, vocab, (seq_len,), generator=g).tolist(), [0] * prompt + [1] * (seq_len - prompt),
                    False) for _ in range(n)]


def build(variant: str, model_dir: Path, device: str, dtype: torch.dtype):
    """The model and optimizer as the trainer builds them, changed by `variant`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, trust_remote_code=False).to(device)
    lora = LoRASettings(r=64, alpha=128) if variant.startswith("lora") else None
    model = make_trainable(model, model_dir, lora, 0, None)
    if variant.startswith(("lora-bf16", "lora-compile")):
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.to(dtype)
    if variant.endswith("-peft-experts"):
        from peft.tuners.lora.layer import ParamWrapper

        for m in model.modules():  # back to peft's own ParamWrapper.forward (the class's)
            if isinstance(m, ParamWrapper):
                vars(m).pop("forward", None)
    if "-compile" in variant:
        compile_decoder_blocks(model)
        if not variant.endswith(("-nographs", "-mamba")):  # as make_trainable does with compile_blocks
            graph_mamba_mixers(model)
    if variant.endswith("-mamba"):
        for m in model.modules():
            if type(m).__name__ == "NemotronHMamba2Mixer":
                m.in_proj.compile()
    trainable = [p for p in model.parameters() if p.requires_grad]
    fused = {"fused": True} if "-fused" in variant else {}
    return model, torch.optim.AdamW(trainable, lr=1e-5, **fused)


def step(model, optimizer, objective, batch: int, autocast: bool, device: str) -> float:
    ctx = torch.autocast(device, dtype=torch.bfloat16) if autocast else nullcontext()
    with ctx:
        loss, _ = loop._one_step(model, objective, list(range(batch)), batch)
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(variant: str, model_dir: Path, args, objective, fpt: float, peak: float | None) -> dict:
    from torch._dynamo.utils import counters

    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    torch._dynamo.reset()
    counters.clear()
    model, optimizer = build(variant, model_dir, args.device, dtype)
    autocast = variant == "lora-autocast" and args.device == "cuda"
    losses, times, first = [], [], []
    if variant.endswith("-nogc"):
        gc.collect()
        gc.freeze()
        gc.disable()
    for i in range(2 + args.steps):
        sync(args.device)
        t0 = time.perf_counter()
        losses.append(step(model, optimizer, objective, args.batch, autocast, args.device))
        sync(args.device)
        (times if i >= 2 else first).append(time.perf_counter() - t0)
    compiler = {"graph_breaks": sum(counters["graph_break"].values()),
                "unique_graphs": counters["stats"]["unique_graphs"],
                "mamba_graphs": dict(sum((r.counts for r in mamba_kernels.graph_regions(model)), Counter()))}
    table = profile(model, optimizer, objective, args, autocast) if variant in args.profile else None
    gc.enable()
    gc.unfreeze()
    step_s = statistics.median(times)
    tps = args.batch * args.seq_len / step_s
    return {"variant": variant, "step_s": times, "median_step_s": step_s, "tokens_per_s": tps,
            "compile_s": first[0] - step_s,
            "mfu": tps * fpt / peak if peak else None, "losses": losses,
            "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "peak_gb": torch.cuda.max_memory_allocated() / 1e9 if args.device == "cuda" else None,
            "attn_implementation": model.config._attn_implementation, "compiler": compiler,
            "profile_top_kernels": table}


def profile(model, optimizer, objective, args, autocast: bool) -> str:
    """The top CUDA kernels (or CPU ops on the CPU) of one step, as torch.profiler tabulates them."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    sync(args.device)
    with torch_profile(activities=activities) as prof:
        t0 = time.perf_counter()
        step(model, optimizer, objective, args.batch, autocast, args.device)
        sync(args.device)
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    key = "cuda_time_total" if args.device == "cuda" else "cpu_time_total"
    # The table's last line, "Self CUDA time total", is the step's kernel time; the second table, by host time,
    # says where a host-bound step's CPU goes.
    return (f"step wall {wall * 1e3:.1f} ms (profiled)\n" + events.table(sort_by=key, row_limit=30, max_name_column_width=60)
            + "\n" + events.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))


def check_twin(r: dict, results: list[dict]) -> None:
    """Stops the bench when a graphed variant's losses, step by step, leave its ungraphed twin's (either order)."""
    pairs = {**GRAPHS_TWIN, **{v: k for k, v in GRAPHS_TWIN.items()}}
    twin = next((e for e in results if e["variant"] == pairs.get(r["variant"])), None)
    if twin is None:
        return
    worst = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], twin["losses"], strict=True))
    r["max_loss_gap_to_twin"] = worst
    if worst > 2e-3:
        raise SystemExit(f"{r['variant']}: losses {r['losses']} leave {twin['variant']}'s {twin['losses']} "
                         f"(relative gap {worst:.2e}; same weights, rows and updates)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    p.add_argument("--shape", default="llama-1b", choices=["llama-1b", "nemotron-h", "tiny", "tiny-nemotron-h"])
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=4, help="timed steps after two warm-up steps")
    p.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS)
    p.add_argument("--profile", nargs="*", choices=VARIANTS, default=[],
                   help="profile one step of these variants (flag alone: full, lora, full-compile)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    if args.profile == [] and "--profile" in sys.argv:
        args.profile = PROFILED
    if args.device == "cpu":
        torch.set_num_threads(2)
    peak = matmul_peak(args.device)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(args.shape, tiny.build_tokenizer(Path(tmp) / "tok"), Path(tmp) / "model")
        fpt, total, active = flops_per_token(model_dir, args.seq_len)
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        objective = SFTObjective(rows(args.batch, args.seq_len, vocab), 0, None)
        for variant in args.variants:
            r = measure(variant, model_dir, args, objective, fpt, peak)
            if not math.isfinite(r["losses"][0]) or abs(r["losses"][0] - math.log(vocab)) > 0.25 * math.log(vocab):
                raise SystemExit(f"{variant}: first loss {r['losses'][0]} is not near ln(vocab) {math.log(vocab):.3f}")
            eager = next((e for e in results if e["variant"] == EAGER_OF.get(variant)), None)
            if eager is not None and abs(r["losses"][0] - eager["losses"][0]) > 0.02 * abs(eager["losses"][0]):
                raise SystemExit(f"{variant}: first loss {r['losses'][0]} differs from {eager['variant']}'s "
                                 f"{eager['losses'][0]} (same weights and rows)")
            check_twin(r, results)
            results.append(r)
            print(f"{variant:14} {r['median_step_s'] * 1e3:8.1f} ms  {r['tokens_per_s']:9.0f} tok/s  "
                  f"MFU {r['mfu'] or 0:.1%}  peak {r['peak_gb'] or 0:.1f} GB  first step +{r['compile_s']:.1f} s",
                  flush=True)
    import peft
    import transformers

    report = {"bench": "train_step_variants", "command": " ".join(["python", *sys.argv]),
              "at": datetime.now(UTC).isoformat(timespec="seconds"),
              "hardware": {"device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor(),
                           "bf16_matmul_flops": peak},
              "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                           "peft": peft.__version__, "python": platform.python_version()},
              "model": {"shape": args.shape, "parameters": total, "active_parameters": active,
                        "flops_per_token": fpt},
              "config": vars(args) | {"out": str(args.out)}, "variants": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for r in results:
        if r["profile_top_kernels"]:
            print(f"--- {r['variant']}: one step\n{r['profile_top_kernels']}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
