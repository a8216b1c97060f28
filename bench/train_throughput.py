"""Training throughput: the project's SFT (full and LoRA) and DPO against TRL's default SFTTrainer / DPOTrainer.

Same model (random initialisation from a config: throughput depends on shapes, not weights), same rows, same
sequence length, batch and steps on both sides, in one run. For each trainer: tokens/s (median over the steps
after the first, which pays allocation and autotuning; `tokens_per_s_steady` also leaves out the second, where the
project's trainer captures its CUDA graphs on hybrids) and MFU = model FLOPs per token x tokens/s over the bf16
matmul rate measured in the same run (8192^3 products on this GPU). Model FLOPs per token: 6 x active
parameters (MoE: shared weights plus top-k of the routed experts) + 6 x attention layers x seq x attention width
(the causal half of QK^T and AV, forward and backward); LoRA and DPO are counted the same way (conventional MFU:
the frozen base's skipped weight gradients and DPO's reference forward are not credited).

Correctness before timing: every trainer's losses must be finite, and its first SFT/DPO loss near what a random
model gives (SFT: ln(vocab) within 25%; DPO: at least 75% of the sigmoid loss ln 2, the project adding its NLL
term), else the bench stops before reporting any figure.

Shapes: `llama-1b` (hidden 2048, 16 layers, 32 heads, 8 KV heads, MLP 8192), `nemotron-h` (bench/gen_throughput's
18-layer Mamba-2 / MoE / attention hybrid, hidden 2048), `tiny` and `tiny-nemotron-h` (core.tiny's Llama and
hybrid, for a CPU smoke).

GPU (one H200; TRL travels as wheels; writes bench/results/train_throughput-<shape>.json):

    python3 bench/train_throughput.py --device cuda --shape llama-1b --seq-len 4096 --batch 4 --steps 6
    python3 bench/train_throughput.py --device cuda --shape nemotron-h --seq-len 4096 --batch 2 --steps 4

CPU smoke (a few minutes on 2 cores):

    .venv/bin/python bench/train_throughput.py --device cpu --shape tiny --seq-len 128 --batch 2 --steps 3 \\
        --out /tmp/train_throughput-cpu.json
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import random
import statistics
import sys
import tempfile
import time
import traceback
from collections import Counter
from contextlib import contextmanager
from datetime import UTC, datetime
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from any directory

from core import tiny  # noqa: E402
from core.chat import eot_id  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
LORA_RANK = 64


def build_model(shape: str, tok_dir: Path, out: Path) -> Path:
    """Saves a randomly initialised model of `shape` with the offline tokenizer; returns its directory."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if shape in ("tiny", "tiny-nemotron-h"):
        return tiny.build_model("llama" if shape == "tiny" else "nemotron_h", tok_dir, out)
    tokenizer = AutoTokenizer.from_pretrained(tok_dir, trust_remote_code=False)
    special = {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": eot_id(tokenizer)}
    torch.manual_seed(0)
    if shape == "llama-1b":
        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
            num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, tie_word_embeddings=False,
            **special))
    else:
        from gen_throughput import _nemotron_h

        model = _nemotron_h(tokenizer, "cpu", torch.float32)
        model.config.pad_token_id, model.config.eos_token_id = special["pad_token_id"], special["eos_token_id"]
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def write_rows(workdir: Path, n: int, seq_len: int, seed: int = 0) -> tuple[Path, Path]:
    """SFT rows whose answer alone exceeds seq_len tokens (every row is cut to exactly seq_len on both sides) and
    DPO pairs whose prompt + answer fit in seq_len."""
    rng = random.Random(seed)

    def words(k: int) -> str:
        return " ".join(rng.choice(tiny._WORDS) for _ in range(k))

    sft, dpo = workdir / "sft.jsonl", workdir / "dpo.jsonl"
    with sft.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"s{i}", "messages": [{"role": "user", "content": words(16)},
                                                             {"role": "assistant", "content": words(seq_len)}]}) + "\n")
    with dpo.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"d{i}", "prompt": [{"role": "user", "content": words(16)}],
                                "chosen": words(seq_len // 3), "rejected": words(seq_len // 3)}) + "\n")
    return sft, dpo


def tokens_per_step(data: Path, kind: str, model_dir: Path, seq_len: int, batch: int) -> float:
    """Mean tokens a step trains on (each sequence rendered by the one chat renderer, cut at seq_len; a DPO
    pair is two sequences): TRL's per-step count, where its callbacks see no token counts."""
    from transformers import AutoTokenizer

    from core.chat import render

    tok = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    if kind == "dpo":
        convs = [[*r["prompt"], {"role": "assistant", "content": r[side]}] for r in rows for side in ("chosen", "rejected")]
    else:
        convs = [r["messages"] for r in rows]
    per_row = [min(seq_len, len(render(tok, conv, None).input_ids)) for conv in convs]
    return batch * sum(per_row) / len(rows)


def flops_per_token(model_dir: Path, seq_len: int) -> tuple[float, int, int]:
    """(model FLOPs per trained token, total parameters, active parameters)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=False)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    experts = getattr(config, "n_routed_experts", None)
    active = total - routed + (routed * config.num_experts_per_tok // experts if experts else 0)
    pattern = getattr(config, "layers_block_type", None)
    attn_layers = pattern.count("full_attention") if pattern else config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 6 * active + 6 * attn_layers * seq_len * config.num_attention_heads * head_dim, total, active


def matmul_peak(device: str) -> float | None:
    """bf16 FLOP/s of 8192^3 products on random data (mean of 10 after 3 warm-ups); None on CPU."""
    if device != "cuda":
        return None
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return 10 * 2 * 8192**3 / (start.elapsed_time(end) / 1e3)


def project_run(kind: str, model_dir: Path, data: Path, out: Path, args, dtype: str) -> dict:
    """One of the project's trainers; per-step tokens/s and losses from its metrics.jsonl."""
    from trainers.common import LoRASettings

    compiled = {"auto": None, "on": True, "off": False}[args.compile_blocks]
    common = dict(model_path=model_dir, data_path=data, output_dir=out, steps=args.steps, batch_size=args.batch,
                  micro_batch_size=args.batch, max_len=args.seq_len, lr=1e-5, dtype=dtype, allow_slow_mamba=True,
                  compile_blocks=compiled)
    if kind == "dpo":
        from trainers.dpo import DPOConfig, train

        config = DPOConfig(**common, heldout_fraction=0.0)
    else:
        from trainers.sft import SFTConfig, train

        config = SFTConfig(**common, lora=LoRASettings(r=LORA_RANK, alpha=2 * LORA_RANK) if kind == "sft-lora" else None)
    _fresh_gpu()
    start = time.perf_counter()
    with timed_reference_pass() as reference, graphed_mixers() as graphed:
        train(config)
    wall = time.perf_counter() - start
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    step_s = [(r["tokens"] - (lines[i - 1]["tokens"] if i else 0)) / r["tokens_per_s"] for i, r in enumerate(lines)]
    result = {"losses": [r["loss"] for r in lines], "step_tokens_per_s": [r["tokens_per_s"] for r in lines],
              "peak_gb": torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else None,
              "wall_s": wall, "steps_s": sum(step_s), "mamba_graphs": dict(sum(graphed, Counter())),
              "wall_includes": "model load, data encoding, DPO reference pass, steps, final save"}
    if kind == "dpo":
        # TRL's DPOTrainer runs the reference forward inside every step; the project runs it once before training
        # (cached by reference weights and data): over one epoch, the fair rate counts that pass too.
        result |= {"reference_s": reference["seconds"], "reference_cached": reference["cached"],
                   "tokens_per_s_with_reference": lines[-1]["tokens"] / (sum(step_s) + reference["seconds"])}
    return result


@contextmanager
def timed_reference_pass():
    """Times `trainers.dpo.reference_logprobs` (the DPO reference pass) while a run uses it; the function itself
    runs unchanged."""
    from trainers import dpo

    own, record = dpo.reference_logprobs, {"seconds": 0.0, "cached": None}

    def timed(*a, **k):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = own(*a, **k)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        record["seconds"] += time.perf_counter() - t0
        record["cached"] = out[1]
        return out

    dpo.reference_logprobs = timed
    try:
        yield record
    finally:
        dpo.reference_logprobs = own


@contextmanager
def graphed_mixers():
    """Yields the trainer's CUDA-graphed Mamba mixers' call counts (eager / capture / replay; empty where nothing
    is graphed) by watching `trainers.common.graph_mamba_mixers` while a run uses it; the function runs unchanged."""
    from trainers import common, mamba_kernels

    own, counts = common.graph_mamba_mixers, []

    def watched(model):
        n = own(model)
        counts.extend(r.counts for r in mamba_kernels.graph_regions(model))
        return n

    common.graph_mamba_mixers = watched
    try:
        yield counts
    finally:
        common.graph_mamba_mixers = own


def trl_run(kind: str, model_dir: Path, data: Path, out: Path, args, step_tokens: float,
            checkpointing: bool | None = None) -> dict:
    """TRL's SFTTrainer (full or LoRA) or DPOTrainer with its defaults, the same rows, length, batch and steps;
    `checkpointing` False overrides TRL's default gradient checkpointing (on since TRL 0.2x)."""
    import datasets
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    cuda = args.device == "cuda"
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    common = dict(output_dir=str(out), max_length=args.seq_len, per_device_train_batch_size=args.batch,
                  max_steps=args.steps, learning_rate=1e-5, logging_steps=1, save_strategy="no", report_to=[],
                  bf16=cuda, use_cpu=not cuda)
    if checkpointing is not None:
        common["gradient_checkpointing"] = checkpointing
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16 if cuda else torch.float32, trust_remote_code=False)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)
    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *_, **__):
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter())

        def on_step_end(self, *_, **__):
            if cuda:
                torch.cuda.synchronize()
            times[-1] = time.perf_counter() - times[-1]

    if kind == "dpo":
        dataset = datasets.Dataset.from_list([{"prompt": r["prompt"],
                                               "chosen": [{"role": "assistant", "content": r["chosen"]}],
                                               "rejected": [{"role": "assistant", "content": r["rejected"]}]}
                                              for r in rows])
        trainer = trl.DPOTrainer(model=model, args=trl.DPOConfig(**common), train_dataset=dataset,
                                 processing_class=tokenizer, callbacks=[Clock()])
    else:
        peft = trl_lora(model.config.model_type) if kind == "sft-lora" else None
        dataset = datasets.Dataset.from_list([{"messages": r["messages"]} for r in rows])
        trainer = trl.SFTTrainer(model=model, args=trl.SFTConfig(**common), train_dataset=dataset,
                                 processing_class=tokenizer, peft_config=peft, callbacks=[Clock()])
    _fresh_gpu()
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {"losses": losses, "step_tokens_per_s": [step_tokens / t for t in times],
            "peak_gb": torch.cuda.max_memory_allocated() / 1e9 if cuda else None,
            "gradient_checkpointing": trainer.args.gradient_checkpointing, "wall_s": wall, "steps_s": sum(times),
            "wall_includes": "trainer.train() only (model load and dataset tokenization happen before)"}


def trl_lora(model_type: str):
    """TRL's LoRA: peft's "all-linear" targets, r 64; on Nemotron-H, where peft refuses those (its Mamba mixers'
    out_proj and conv1d are no allowed targets), the project's own default targets (`trainers.common.lora_targets`:
    in_proj, attention, shared and routed experts), so both sides train the same adapters."""
    from peft import LoraConfig

    if model_type != "nemotron_h":
        return LoraConfig(r=LORA_RANK, lora_alpha=2 * LORA_RANK, target_modules="all-linear")
    from trainers.common import LoRASettings, lora_targets

    modules, params = lora_targets(model_type, LoRASettings(r=LORA_RANK, alpha=2 * LORA_RANK))
    return LoraConfig(r=LORA_RANK, lora_alpha=2 * LORA_RANK, target_modules=modules, target_parameters=params)


def _fresh_gpu() -> None:
    """Frees what earlier runs left and restarts the peak counter, so each run's peak is its own."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _versions() -> dict:
    import peft
    import transformers
    import trl

    return {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
            "trl": trl.__version__, "python": platform.python_version()}


def check(name: str, kind: str, losses: list[float], vocab: int) -> None:
    """Stops the bench before any timing is reported when a trainer's losses are not what random weights give."""
    expected = math.log(vocab) if kind.startswith("sft") else math.log(2)
    if not losses or not all(math.isfinite(x) for x in losses):
        raise SystemExit(f"{name}: non-finite or missing losses {losses}")
    # DPO losses carry an NLL term in the project's trainer, so only the lower side is checked there.
    low, high = 0.75 * expected, (1.25 * expected if kind.startswith("sft") else math.inf)
    if not low <= losses[0] <= high:
        raise SystemExit(f"{name}: first loss {losses[0]:.3f} is not near {expected:.3f} (random weights)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--shape", choices=["tiny", "tiny-nemotron-h", "llama-1b", "nemotron-h"],
                        default="tiny")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4, help="rows per optimizer step (one micro-batch)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--kinds", nargs="+", default=["sft-full", "sft-lora", "dpo"])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--compile-blocks", choices=["auto", "on", "off"], default="auto",
                        help="the project's compile_blocks (auto: the trainer's default, on for one-GPU dense models)")
    parser.add_argument("--trl-no-checkpointing", action="store_true",
                        help="also run TRL with gradient checkpointing off (its default is on), as run '<kind>-noac'")
    args = parser.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(2)
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    peak = matmul_peak(args.device)
    table = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tok_dir = tiny.build_tokenizer(work / "tokenizer")
        model_dir = build_model(args.shape, tok_dir, work / "model")
        sft, dpo = write_rows(work, args.batch * args.steps, args.seq_len)
        fpt, total, active = flops_per_token(model_dir, args.seq_len)
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        out = args.out or RESULTS / f"train_throughput-{args.shape}.json"
        for kind in args.kinds:
            data = dpo if kind == "dpo" else sft
            step_tokens = tokens_per_step(data, kind, model_dir, args.seq_len, args.batch)
            sides = [("project", partial(project_run, kind, model_dir, data, work / f"ours-{kind}", args, dtype)),
                     ("trl", partial(trl_run, kind, model_dir, data, work / f"trl-{kind}", args, step_tokens))]
            if args.trl_no_checkpointing:
                sides.append(("trl-noac", partial(trl_run, kind, model_dir, data, work / f"trl-noac-{kind}", args,
                                                  step_tokens, checkpointing=False)))
            for side, run in sides:
                table[f"{side}-{kind}"] = measured(f"{side} {kind}", kind, run, vocab, fpt, peak)
                write_result(out, args, peak, (fpt, total, active), table)
    print(f"{'run':20} {'tokens/s':>10} {'MFU':>6} {'peak GB':>8} {'first loss':>10}")
    for name, r in table.items():
        if r["status"] != "ok":
            print(f"{name:20} {r['status']}: {r['error'][:200]}")
            continue
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        peak_gb = f"{r['peak_gb']:.1f}" if r["peak_gb"] is not None else "-"
        print(f"{name:20} {r['tokens_per_s']:10.0f} {mfu:>6} {peak_gb:>8} {r['losses'][0]:10.3f}")
    print(f"wrote {out}")
    if any(r["status"] != "ok" for r in table.values()):
        sys.exit(1)


def measured(name: str, kind: str, run, vocab: int, fpt: float, peak: float | None) -> dict:
    """One trainer run with its checks; a run that raises or fails its check is recorded with its error and no
    figures, and the bench goes on with the next run (one GPU call measures them all)."""
    try:
        r = run()
        check(name, kind, r["losses"], vocab)
    # Any failure of one run (an OOM, a library version's API, a failed check) is this run's result: recorded with
    # its traceback, the other runs still measured, and the bench exits 1 at the end.
    except (Exception, SystemExit) as err:  # noqa: BLE001
        print(f"{name}: FAILED:\n{traceback.format_exc()}", flush=True)
        return {"status": "failed", "error": f"{type(err).__name__}: {err}"[:2000]}
    tps = statistics.median(r["step_tokens_per_s"][1:] or r["step_tokens_per_s"])
    # The trainer captures its CUDA graphs (trainers/step_graphs.py) in the second step: the steady rate leaves it out.
    steady = statistics.median(r["step_tokens_per_s"][2:] or r["step_tokens_per_s"])
    print(f"{name}: {tps:.0f} tokens/s ({steady:.0f} after the second step)", flush=True)
    return r | {"status": "ok", "tokens_per_s": tps, "mfu": tps * fpt / peak if peak else None,
                "tokens_per_s_steady": steady, "mfu_steady": steady * fpt / peak if peak else None}


def write_result(out: Path, args, peak: float | None, counts: tuple[float, int, int], table: dict) -> None:
    """Rewrites the result file after every run, so a call cut short keeps what ran."""
    fpt, total, active = counts
    result = {
        "bench": "train_throughput", "command": " ".join(["python", *sys.argv]),
        "at": datetime.now(UTC).isoformat(timespec="seconds"),
        "hardware": {"device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
                     "torch": torch.__version__, "bf16_matmul_flops": peak},
        "versions": _versions(),
        "model": {"shape": args.shape, "parameters": total, "active_parameters": active, "flops_per_token": fpt},
        "config": vars(args) | {"out": str(args.out)},
        "runs": table,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
