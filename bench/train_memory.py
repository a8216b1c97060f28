"""Peak GPU memory of the project's training step on a Nemotron-H-shaped model, next to the memory estimate.

Builds the model from a config with random initialisation (memory depends on shapes, not weights; nothing is
read from disk or a hub), then for each configuration runs the trainers' own path under FSDP2 on this rank's
GPU: sharded loading (`trainers.distributed.load_sharded`), bf16 compute with float32 master weights and AdamW
state (full fine-tuning) or a bf16 frozen base with float32 adapters (LoRA), activation checkpointing per
decoder block, the chunked head + loss at supervised positions (`trainers.losses`, through `SFTObjective`) and the
loop's own step (`trainers.loop._one_step`, clipping, AdamW). It records per configuration the peak allocated and
reserved GPU memory over `--steps` optimizer steps, tokens/s, the loss, and `trainers.memory.estimate` for the
same configuration; a configuration that runs out of memory is recorded as such and the next one runs. It also
writes the estimate extrapolated to the 30B-A3B shape on 1, 4 and 8 GPUs. `--profile FILE`: after the last
configuration's timed steps, one more step under torch.profiler, its time by category (bench/profile_categories.py:
expert grouped GEMMs and their adapters, head + loss, Mamba scan, attention, recomputation, optimizer, FSDP copies).

The shape `bench-3b`: the first 26 blocks of the Nemotron-3-Nano-30B-A3B layer pattern (13 Mamba-2, 10 MoE,
3 attention), hidden 2048, 64 routed experts (top-6, intermediate 768) + a shared expert, vocabulary 131072:
about 3.0B parameters. `30b-a3b`: hidden 2688, 52 blocks (23 Mamba-2, 23 MoE, 6 attention), 128 experts top-6
(intermediate 1856, shared 3712), vocabulary 131072, as in the public config.

One H200, one process (torchrun starts the process group the trainers expect; NVLink multicast off):

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 python3 -m torch.distributed.run --standalone \\
        --nproc-per-node 1 bench/train_memory.py --out bench/results/train_memory-h200.json

CPU smoke of the same code path on a tiny shape (gloo, float32; about a minute):

    .venv/bin/torchrun --standalone --nproc-per-node 1 bench/train_memory.py --shape tiny --seq-len 256 --steps 1 \\
        --out /tmp/train_memory-cpu.json
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from any directory
sys.path.insert(0, str(Path(__file__).resolve().parent))

import transformers  # noqa: E402
from transformers import AutoModelForCausalLM, NemotronHConfig  # noqa: E402

from trainers import distributed, loop  # noqa: E402
from trainers.batch import Encoded  # noqa: E402
from trainers.common import LoRASettings, make_trainable  # noqa: E402
from trainers.memory import GIB, estimate, shape_of  # noqa: E402
from trainers.sft import SFTObjective  # noqa: E402

# M = Mamba-2, E = MoE, * = attention: the 30B-A3B block pattern. Passed as `hybrid_override_pattern`, which
# transformers 5.24 converts to `layers_block_type` and older 5.x releases (the GPU machine's 5.17) read as is.
PATTERN_30B = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"


def nemotron_h(shape: str, pattern: str | None = None) -> NemotronHConfig:
    """The shape's config; `pattern` replaces its block pattern (bench/decode_hybrid.py's reduced-depth check)."""
    if shape == "30b-a3b":
        dims = dict(hidden_size=2688, pattern=PATTERN_30B, n_routed_experts=128, moe_intermediate_size=1856,
                    moe_shared_expert_intermediate_size=3712, mamba_num_heads=64)
    elif shape == "bench-3b":
        dims = dict(hidden_size=2048, pattern=PATTERN_30B[:26], n_routed_experts=64, moe_intermediate_size=768,
                    moe_shared_expert_intermediate_size=1536, mamba_num_heads=64)
    else:  # tiny: the CPU smoke
        dims = dict(hidden_size=64, pattern="MEM*E", n_routed_experts=4, moe_intermediate_size=32,
                    moe_shared_expert_intermediate_size=32, mamba_num_heads=4)
    pattern = pattern or dims.pop("pattern")
    dims.pop("pattern", None)
    big = shape != "tiny"
    return NemotronHConfig(
        vocab_size=131072 if big else 1024, hybrid_override_pattern=pattern, num_hidden_layers=len(pattern),
        num_attention_heads=32 if big else 4, num_key_value_heads=2, head_dim=128 if big else 16,
        mamba_head_dim=64 if big else 16, ssm_state_size=128 if big else 16, n_groups=8 if big else 2,
        chunk_size=128 if big else 16, num_experts_per_tok=6 if big else 2, intermediate_size=4 * dims["hidden_size"],
        max_position_embeddings=8192, tie_word_embeddings=False, use_cache=False, **dims)


@torch.no_grad()
def random_init_(model: torch.nn.Module, std: float = 0.02, seed: int = 0) -> None:
    """Random weights in place (materialised meta models, FSDP shards included): matrices ~ N(0, std), norms 1,
    biases 0, LoRA B 0 (peft's start), Mamba A_log = log(1..heads), D and dt_bias 1 (transformers' init)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for i, (name, param) in enumerate(model.named_parameters()):
        leaf = name.rsplit(".", 1)[-1]
        # The whole tensor from one generator per parameter, then this rank's shard of it: the model is the same
        # whatever the number of ranks (a per-rank seed on the local shards made 2 ranks train another model than 1).
        full = torch.empty(param.shape, dtype=param.dtype, device=param.device)
        if leaf == "A_log":
            full.copy_(torch.log(torch.arange(1, full.numel() + 1, device=full.device, dtype=torch.float32)).view(full.shape))
        elif leaf in ("D", "dt_bias") or (full.ndim == 1 and "norm" in name):
            full.fill_(1.0)
        elif full.ndim == 1 or "lora_B" in name:
            full.zero_()
        else:
            full.normal_(0.0, std, generator=torch.Generator(device=full.device).manual_seed(seed * 1_000_003 + i))
        if isinstance(param, DTensor):
            param.to_local().copy_(distribute_tensor(full, param.device_mesh, param.placements,
                                                     src_data_rank=None).to_local())
        else:
            param.copy_(full)
        del full
    for buf in model.buffers():
        if buf.is_floating_point():
            buf.zero_()  # the router's score-correction bias


def rows(n: int, seq_len: int, vocab: int, seed: int) -> list[Encoded]:
    """Random token rows: the first quarter unsupervised (a prompt), the rest supervised (an answer)."""
    g = torch.Generator().manual_seed(seed)
    prompt = seq_len // 4
    return [Encoded(torch.randint(4, vocab, (seq_len,), generator=g).tolist(), [0] * prompt + [1] * (seq_len - prompt),
                    False) for _ in range(n)]


def build(config: NemotronHConfig, lora: LoRASettings | None, dtype: torch.dtype, env) -> torch.nn.Module:
    """The sharded trainable model as load_policy builds it (the same skeleton, sharding and dtypes), its shards
    filled in place with random weights instead of a checkpoint: no full copy beside the shards (on one GPU that
    copy doubled the 30B-A3B's 63 GB of weights during the load)."""
    storage = torch.float32 if lora is None else dtype
    compute = dtype if dtype != torch.float32 else None
    with torch.device("meta"):
        model = make_trainable(AutoModelForCausalLM.from_config(config, dtype=storage), None, lora, 0, True)
    distributed.shard(model, compute)
    model.to_empty(device=distributed.device(env))
    random_init_(model, seed=0)
    return model.train()


def measure(config, name: str, lora, micro: int, seq_len: int, steps: int, dtype, env, chunk: int) -> dict:
    torch.manual_seed(0)
    shape = shape_of(config, lora)
    est = estimate(shape, world_size=env.world_size, micro_batch_size=micro, seq_len=seq_len,
                   compute_bytes=2 if dtype == torch.bfloat16 else 4, activation_checkpointing=True,
                   loss_chunk_tokens=chunk)
    out = {"config": name, "lora": lora.model_dump() if lora else None, "micro_batch_size": micro, "seq_len": seq_len,
           "total_params": shape.total_params, "trainable_params": shape.trainable_params,
           "estimate_gib": {k: v / GIB for k, v in est.model_dump().items() if k != "world_size"} | {
               "total": est.total / GIB, "allocated": (est.total - est.reserve) / GIB}}
    phases: dict = {}
    try:
        out |= _steps(config, lora, micro, seq_len, steps, dtype, env, chunk, phases)
    except torch.OutOfMemoryError as e:
        out |= {"status": "oom", "error": str(e).splitlines()[0], "oom_message": str(e)[:600]}
    out["phases_gib"] = phases
    gc.collect()  # the model and optimizer of this configuration, before the next one is built
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def _mark(phases: dict, name: str | None) -> float:
    """Records allocated GiB now and the peak since the last mark under `name` (None: records nothing), restarts
    the peak and returns it."""
    if not torch.cuda.is_available():
        return 0.0
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / GIB
    if name is not None:
        phases[name], phases[name + "_peak"] = torch.cuda.memory_allocated() / GIB, peak
    torch.cuda.reset_peak_memory_stats()
    return peak


def _steps(config, lora, micro: int, seq_len: int, steps: int, dtype, env, chunk: int, phases: dict) -> dict:
    """`steps` optimizer steps of the loop's own step; the last one's phases (forward + backward, the optimizer)
    are marked apart, and the peak over all steps is the run's peak."""
    t0 = time.perf_counter()
    model = build(config, lora, dtype, env)
    build_s = time.perf_counter() - t0
    objective = SFTObjective(rows(micro, seq_len, config.vocab_size, 0), 0, None, chunk)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    _mark(phases, "built")
    peak, times, losses = 0.0, [], []
    for step in range(steps):
        last = step == steps - 1
        t0 = time.perf_counter()
        loss, _counts = loop._one_step(model, objective, list(range(micro)), micro)
        if last:
            peak = max(peak, _mark(phases, "forward_backward"))
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        peak = max(peak, _mark(phases, "optimizer" if last else None))
        times.append(time.perf_counter() - t0)
        losses.append(loss)
    steady = sorted(times[1:] or times)
    out = {"status": "ok", "losses": losses, "step_s": times, "build_s": build_s,
           "tokens_per_s": micro * seq_len / steady[len(steady) // 2]}
    if torch.cuda.is_available():
        out |= {"peak_allocated_gib": peak, "peak_reserved_gib": torch.cuda.max_memory_reserved() / GIB}
    if PROFILE["path"] is not None:  # after the peak is read: the profiled step's own cost is not in it
        PROFILE["table"] = profiled_step(model, objective, optimizer, micro, config.vocab_size,
                                         steady[len(steady) // 2])
    return out


PROFILE: dict = {"path": None, "table": None}  # --profile: where the last run's profiled step goes


def profiled_step(model, objective, optimizer, micro: int, vocab: int, wall_s: float) -> dict:
    """One more step of the loop under torch.profiler, its kernels by category (bench/profile_categories.py:
    expert grouped GEMMs and their adapters, head + loss, Mamba scan, attention, recomputation, optimizer),
    against `wall_s`, the unprofiled step's median time."""
    from profile_categories import categorize, labelled, phase
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with labelled(model), profile(activities=activities, record_shapes=True) as prof:
        t0 = time.perf_counter()
        with phase("forward_backward"):
            loop._one_step(model, objective, list(range(micro)), micro)
        with phase("optimizer"):
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        profiled_s = time.perf_counter() - t0
    return categorize(prof, 1, wall_s, mode="train", vocab=vocab) | {"profiled_wall_ms": profiled_s * 1e3,
                                                                      "micro_batch_size": micro}


def extrapolate(seq_len: int, micro: int, chunk: int) -> list[dict]:
    """The estimate for the 30B-A3B shape (full fine-tuning and LoRA r64 + FP32 head) on 1, 4 and 8 GPUs."""
    config = nemotron_h("30b-a3b")
    out = []
    for name, lora in (("full", None), ("lora-r64-head", LoRASettings(r=64, alpha=128, train_lm_head=True))):
        shape = shape_of(config, lora)
        for world in (1, 4, 8):
            est = estimate(shape, world_size=world, micro_batch_size=micro, seq_len=seq_len, compute_bytes=2,
                           activation_checkpointing=True, loss_chunk_tokens=chunk)
            out.append({"config": name, "gpus": world, "total_params": shape.total_params,
                        "trainable_params": shape.trainable_params, "estimate_total_gib": est.total / GIB,
                        "parts_gib": {k: v / GIB for k, v in est.model_dump().items() if k != "world_size"}})
    return out


def write_extrapolation(args) -> None:
    rows_30b = extrapolate(args.seq_len, 1, args.chunk)
    report = {"command": " ".join(sys.argv), "date": datetime.now(UTC).isoformat(), "shape": "30b-a3b",
              "model_config": nemotron_h("30b-a3b").to_dict(), "micro_batch_size": 1, "seq_len": args.seq_len,
              "loss_chunk_tokens": args.chunk, "activation_checkpointing": True, "compute_dtype": "bfloat16",
              "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
              "extrapolation_30b_a3b": rows_30b}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    for r in rows_30b:
        print(f"{r['config']:>14} on {r['gpus']} GPU(s): {r['estimate_total_gib']:6.1f} GiB per GPU  "
              + "  ".join(f"{k} {v:.1f}" for k, v in r["parts_gib"].items()))


def summarize(out: Path, inputs: list[Path]) -> None:
    """Issue 32's summary of measured runs (`{"runs": [{"micro_batch_size", "status", "tokens_per_s",
    "peak_allocated_gib", "estimate_gib": {"total"}}]}`), each with today's `trainers.memory.estimate` for its shape
    and configuration (the run files keep the estimate of the code that ran)."""
    runs = []
    for path in inputs:
        report = json.loads(path.read_text())
        config = nemotron_h(report["shape"])
        for r in report["runs"]:
            lora = LoRASettings(**r["lora"]) if r["lora"] else None
            est = estimate(shape_of(config, lora), world_size=report["world_size"], micro_batch_size=r["micro_batch_size"],
                           seq_len=r["seq_len"], compute_bytes=2, activation_checkpointing=True, loss_chunk_tokens=1024)
            runs.append({"micro_batch_size": r["micro_batch_size"], "status": r["status"],
                         "tokens_per_s": r.get("tokens_per_s"), "peak_allocated_gib": r.get("peak_allocated_gib"),
                         "peak_reserved_gib": r.get("peak_reserved_gib"), "config": r["config"], "seq_len": r["seq_len"],
                         "step_s": r.get("step_s"), "losses": r.get("losses"),
                         "estimate_gib": {"total": est.total / GIB, "allocated": (est.total - est.reserve) / GIB},
                         "source": {"file": path.name, "command": report["command"], "date": report["date"],
                                    "hardware": report["hardware"]}})
    out.write_text(json.dumps({"command": " ".join(sys.argv), "shape": "30b-a3b", "runs": runs}, indent=2) + "\n")
    for r in runs:
        print(f"micro {r['micro_batch_size']}: {r['status']} {r['tokens_per_s']:.0f} tok/s, peak {r['peak_allocated_gib']:.1f} "
              f"GiB allocated / {r['peak_reserved_gib']:.1f} reserved, estimate {r['estimate_gib']['allocated']:.1f} / "
              f"{r['estimate_gib']['total']:.1f} GiB")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="bench-3b", choices=["bench-3b", "30b-a3b", "tiny"])
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--chunk", type=int, default=1024, help="loss_chunk_tokens")
    p.add_argument("--runs", nargs="+", default=["full:1", "full:2", "lora:1", "lora:2"],
                   help="KIND:MICRO_BATCH, KIND full or lora (r64, alpha 128, FP32 head)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--profile", type=Path, default=None,
                   help="after the last run's timed steps, profile one more step and write its time by category here")
    p.add_argument("--extrapolate-only", action="store_true",
                   help="write only the 30B-A3B estimate on 1, 4 and 8 GPUs (CPU, no process group, no training)")
    p.add_argument("--summarize", type=Path, nargs="+", default=None,
                   help="write issue 32's summary of these run files to --out (no GPU, no training)")
    args = p.parse_args()
    if args.summarize:
        summarize(args.out, args.summarize)
        return
    if args.extrapolate_only:
        write_extrapolation(args)
        return
    PROFILE["path"] = args.profile
    env = distributed.setup()
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    config = nemotron_h(args.shape)
    lora = LoRASettings(r=64, alpha=128, train_lm_head=True)
    runs = [("full", None, int(m)) if k == "full" else ("lora-r64-head", lora, int(m))
            for k, m in (r.split(":") for r in args.runs)]
    results = []
    for name, lora, micro in runs:
        results.append(measure(config, name, lora, micro, args.seq_len, args.steps, dtype, env, args.chunk))
        if env.is_main:
            print(json.dumps(results[-1]), flush=True)
    report = {
        "command": " ".join(sys.argv), "date": datetime.now(UTC).isoformat(), "shape": args.shape,
        "model_config": config.to_dict(),
        "hardware": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor(),
        "world_size": env.world_size,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version()},
        "runs": results, "extrapolation_30b_a3b": extrapolate(args.seq_len, 1, args.chunk),
    }
    if env.is_main:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2, default=str) + "\n")
        for r in results:
            print(f"{r['config']:>14} micro {r['micro_batch_size']} x {r['seq_len']}: {r['status']:>4}  peak "
                  f"{r.get('peak_allocated_gib', float('nan')):6.1f} GiB  estimate {r['estimate_gib']['total']:6.1f} GiB  "
                  f"{r.get('tokens_per_s', float('nan')):8.0f} tok/s")
        if args.profile and PROFILE["table"] is not None:
            from profile_categories import render

            args.profile.write_text(json.dumps(PROFILE["table"] | {
                "command": " ".join(sys.argv), "shape": args.shape, "seq_len": args.seq_len,
                "hardware": report["hardware"], "lora": "r64 alpha 128, FP32 head"}, indent=2) + "\n")
            print(f"profiled step, micro {PROFILE['table']['micro_batch_size']}:\n{render(PROFILE['table'])}")
    distributed.teardown()


if __name__ == "__main__":
    main()
