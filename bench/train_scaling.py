"""Multi-GPU scaling of the project's training step: FSDP2 on 1, 2, 4 and 8 GPUs against one.

For each world size N it starts one job of N processes the way the local executor starts a multi-task job
(`python -m torch.distributed.run --standalone --nproc-per-node N`: rank and rendezvous from the environment,
which `trainers.distributed.setup` reads), with NVLink multicast off in that job's environment. Each job runs
full fine-tuning and then LoRA (rank 64 + FP32 head on the GPU) of the Nemotron-H-shaped model of
`bench/train_memory.py`, built and sharded the same way (random weights, `trainers.distributed.load_sharded`, FSDP2
per decoder block, activation checkpointing, chunked head + loss through `SFTObjective`, the loop's own step).

Every job trains on the same global batch (per-GPU micro-batch x the largest world size that runs), each rank
taking its share in micro-batches of the same per-GPU size; so a step costs every world size the same forward
passes of the same shape, and the N-rank loss and gradient-norm trajectories must equal the 1-GPU run's:
- float32 (CPU, gloo): both are sums of the same per-micro-batch terms, associated differently; rtol 1e-5, as in
  tests/trainers/test_distributed.py, whose docstring derives it;
- bfloat16 (GPU, NCCL): one GPU accumulates its micro-batches' gradients in bfloat16 before the float32 reduction,
  N GPUs sum them in float32, so gradients differ by up to bfloat16's unit roundoff (2^-8) and AdamW carries that
  into later losses; rtol 1e-2.
Recorded per mode and world size: tokens/s (global tokens per step over the median step time, the first step left
out as warm-up), speed-up and scaling efficiency against one GPU, peak memory per rank (allocated and reserved GPU
memory; peak host RSS on the CPU), the memory estimate, and both trajectories. World sizes above the visible GPU
count are recorded as not run. Goal (issue 19): >= 1.7x on 2 GPUs, >= 3.2x on 4.

GPU machine (bench-3b shape, seq 4096, bf16, micro-batch 1 per GPU; results to bench/results/train_scaling.json;
the GPU image lacks pydantic, so the wheels in bench/.wheels travel with the call and are installed first):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        bench/.wheels/*.whl && export PYTHONPATH=/tmp/site
    python3 bench/train_scaling.py --preset h200

CPU smoke (tiny shape, gloo, 1 and 2 processes, float32; 3 minutes on the shared 2-core host at load average ~20,
mostly interpreter start-up; not a performance figure):

    .venv/bin/python bench/train_scaling.py --preset cpu-smoke --out /tmp/scaling
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from datetime import UTC, datetime
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from any directory

from bench.train_memory import build, nemotron_h, rows  # noqa: E402
from core.util import write_json_atomic  # noqa: E402
from trainers import distributed, loop  # noqa: E402
from trainers.common import LoRASettings  # noqa: E402
from trainers.memory import GIB, estimate, shape_of  # noqa: E402
from trainers.sft import SFTObjective  # noqa: E402

# The values of tools/jobrun.NO_MULTICAST_ENV (a test checks they agree): tools imports submitit, which the GPU
# machine lacks. NVLink multicast can take a shared host's GPUs out of service, so every job here runs without it.
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
GOALS = {2: 1.7, 4: 3.2}  # issue 19: speed-up over one GPU wanted at these world sizes
CHUNK = 1024  # loss_chunk_tokens, as the trainers default


class Preset(BaseModel):
    """One benchmark configuration."""

    model_config = ConfigDict(frozen=True)
    shape: str = Field(description="bench/train_memory.py shape: bench-3b (~3B Nemotron-H) or tiny.")
    device: str = Field(description="cuda (NCCL, bf16) or cpu (gloo, float32; GPUs hidden from the job).")
    world_sizes: tuple[int, ...] = Field(description="Processes per job to try, one per GPU on cuda.")
    seq_len: int = Field(gt=8, description="Tokens per row (one quarter unsupervised prompt).")
    micro_batch_size: int = Field(gt=0, description="Rows per forward pass on each rank, the same at every N.")
    steps: int = Field(gt=1, description="Optimizer steps per mode; the first is warm-up, left out of tokens/s.")
    lr: float = Field(gt=0, description="AdamW learning rate (both modes).")
    lora_r: int = Field(gt=0, description="LoRA rank (alpha = 2 r, lm_head trained in FP32).")
    loss_rtol: float = Field(gt=0, description="Relative tolerance of N-rank losses and gradient norms vs 1 GPU.")


PRESETS = {
    "h200": Preset(shape="bench-3b", device="cuda", world_sizes=(1, 2, 4, 8), seq_len=4096, micro_batch_size=1,
                   steps=4, lr=1e-4, lora_r=64, loss_rtol=1e-2),
    "cpu-smoke": Preset(shape="tiny", device="cpu", world_sizes=(1, 2), seq_len=64, micro_batch_size=1, steps=3,
                        lr=1e-3, lora_r=8, loss_rtol=1e-5),
}
MODES = ("full", "lora")


class BadInput(ValueError):
    """An invocation that cannot run; reported in one line, exit 2."""


# ---------------------------------------------------------------- worker: one rank of one job


def lora_for(mode: str, preset: Preset) -> LoRASettings | None:
    return None if mode == "full" else LoRASettings(r=preset.lora_r, alpha=2 * preset.lora_r, train_lm_head=True)


def run_mode(config, mode: str, preset: Preset, global_batch: int, env) -> dict:
    """Builds the sharded model for `mode` and trains it for preset.steps steps; the same numbers on every rank."""
    torch.manual_seed(0)  # same random weights and LoRA init at every world size
    dtype = torch.bfloat16 if preset.device == "cuda" else torch.float32
    lora = lora_for(mode, preset)
    t0 = time.perf_counter()
    model = build(config, lora, dtype, env)
    build_s = time.perf_counter() - t0
    data = rows(global_batch * preset.steps, preset.seq_len, config.vocab_size, 1)
    objective = SFTObjective(data, 0, None, CHUNK)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=preset.lr)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # rank 0's full copy from the build, so the reserved peak is the training step's
        torch.cuda.reset_peak_memory_stats()
    losses, grad_norms, step_s = [], [], []
    for step in range(preset.steps):
        t0 = time.perf_counter()
        batch = loop.rows_for_step(step, global_batch, objective.n_rows, 0)
        loss, _ = loop._one_step(model, objective, batch, preset.micro_batch_size)
        grad_norms.append(loop._grad_norm(model, 1.0))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        step_s.append(time.perf_counter() - t0)
        losses.append(loss)
        if env.is_main:
            print(f"[N={env.world_size} {mode}] step {step + 1}/{preset.steps}: loss {loss:.6f} "
                  f"{step_s[-1]:.2f} s", flush=True)
    shape = shape_of(config, lora)
    est = estimate(shape, world_size=env.world_size, micro_batch_size=preset.micro_batch_size,
                   seq_len=preset.seq_len, compute_bytes=2 if dtype == torch.bfloat16 else 4,
                   activation_checkpointing=True, loss_chunk_tokens=CHUNK)
    timed = step_s[1:]
    out = {"status": "ok", "build_s": build_s, "losses": losses, "grad_norms": grad_norms, "step_s": step_s,
           "tokens_per_step": global_batch * preset.seq_len,
           "tokens_per_s": global_batch * preset.seq_len / statistics.median(timed),
           "total_params": shape.total_params, "trainable_params": shape.trainable_params,
           "estimate_gib_per_rank": est.total / GIB, "peak_per_rank": gather_peaks(),
           "multicast_env_seen": {k: os.environ.get(k) for k in NO_MULTICAST_ENV}}
    del model, optimizer
    return out


def gather_peaks() -> list[dict]:
    """Each rank's peak memory, in rank order (GPU allocator peaks on cuda; host RSS always)."""
    mine = {"peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB}
    if torch.cuda.is_available():
        mine |= {"peak_allocated_gib": torch.cuda.max_memory_allocated() / GIB,
                 "peak_reserved_gib": torch.cuda.max_memory_reserved() / GIB}
    if not torch.distributed.is_initialized():
        return [mine]
    everyone: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, mine)
    return everyone


def worker(args) -> None:
    """One rank: every mode in turn; rank 0 rewrites the result file after each, so a crash keeps what finished."""
    os.environ.update(NO_MULTICAST_ENV)  # also when torchrun was started by hand; NCCL reads them at init
    preset = PRESETS[args.preset].model_copy(update={"steps": args.steps or PRESETS[args.preset].steps})
    env = distributed.setup()
    config = nemotron_h(preset.shape)
    done: dict = {}
    for mode in args.modes:
        try:
            done[mode] = run_mode(config, mode, preset, args.global_batch, env)
        except torch.OutOfMemoryError as e:
            done[mode] = {"status": "oom", "error": str(e).splitlines()[0]}
        gc.collect()  # this mode's model and optimizer, before the next is built
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if env.is_main:
            write_json_atomic(args.result, done)
    distributed.teardown()


# ---------------------------------------------------------------- parent: one job per world size, then the report


def job_env(preset: Preset) -> dict[str, str]:
    """The environment of every job: multicast off; on the CPU preset GPUs hidden (gloo) and one thread per rank
    (the ranks share the cores)."""
    env = os.environ | NO_MULTICAST_ENV | {"PYTHONUNBUFFERED": "1"}
    if preset.device == "cpu":
        env |= {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    return env


def launch(n: int, args, global_batch: int, result: Path) -> tuple[int, list[str]]:
    """Runs one N-process job, echoing its output; returns its exit status and last output lines."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
           str(Path(__file__).resolve()), "--worker", "--preset", args.preset, "--global-batch", str(global_batch),
           "--result", str(result), "--modes", *args.modes] + (["--steps", str(args.steps)] if args.steps else [])
    tail: deque[str] = deque(maxlen=30)
    with subprocess.Popen(cmd, cwd=REPO, env=job_env(PRESETS[args.preset]), text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT) as proc:
        for line in proc.stdout:
            print(line, end="", flush=True)
            tail.append(line.rstrip("\n"))
    return proc.returncode, list(tail)


def visible_workers(preset: Preset) -> int:
    """How many ranks a job of this preset may have: the visible GPUs (cuda), or unbounded on the CPU."""
    return torch.cuda.device_count() if preset.device == "cuda" else max(preset.world_sizes)


def compare(run: dict, ref: dict, n: int, rtol: float) -> dict:
    """Speed-up, efficiency and trajectory agreement of an N-rank run against the 1-GPU run of the same mode."""
    out: dict = {}
    if run.get("status") != "ok" or ref.get("status") != "ok":
        return out
    speedup = run["tokens_per_s"] / ref["tokens_per_s"]
    out |= {"speedup": speedup, "efficiency": speedup / n}
    if n in GOALS:
        out |= {"goal_speedup": GOALS[n], "goal_met": speedup >= GOALS[n]}
    rel = [abs(a - b) / abs(b) for key in ("losses", "grad_norms") for a, b in zip(run[key], ref[key], strict=True)]
    out |= {"max_rel_diff_vs_1gpu": max(rel), "rtol": rtol, "matches_1gpu": max(rel) <= rtol}
    return out


def hardware(preset: Preset) -> dict:
    out = {"cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(), "device": preset.device}
    if preset.device == "cuda":
        out |= {"gpu": torch.cuda.get_device_name(0), "visible_gpus": torch.cuda.device_count()}
    return out


def versions() -> dict:
    import peft
    import transformers

    out = {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
           "python": platform.python_version()}
    if torch.cuda.is_available():
        out |= {"cuda": torch.version.cuda, "nccl": ".".join(map(str, torch.cuda.nccl.version()))}
    return out


def run_all(args) -> dict:
    """One job per runnable world size; the report with every field, not-run world sizes included."""
    preset = PRESETS[args.preset].model_copy(update={"steps": args.steps or PRESETS[args.preset].steps})
    visible = visible_workers(preset)
    worlds = [n for n in args.gpus if n <= visible]
    global_batch = preset.micro_batch_size * max(worlds)
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in worlds:
            result = Path(tmp) / f"n{n}.json"
            rc, tail = launch(n, args, global_batch, result)
            done = json.loads(result.read_text()) if result.is_file() else {}
            runs[str(n)] = {m: done.get(m) or {"status": "failed", "exit_code": rc, "output_tail": tail}
                            for m in args.modes}
    for n in args.gpus:
        if n not in worlds:
            runs[str(n)] = {m: {"status": "not_run", "reason": f"{n} GPUs asked, {visible} visible"}
                            for m in args.modes}
    for mode in args.modes:
        ref = runs[str(worlds[0])][mode] if worlds[0] == 1 else {}
        for n in args.gpus:
            runs[str(n)][mode] |= compare(runs[str(n)][mode], ref, n, preset.loss_rtol) if n > 1 else {}
    return {"command": " ".join([Path(sys.executable).name, *sys.argv]), "date": datetime.now(UTC).isoformat(),
            "preset": args.preset, "settings": preset.model_dump() | {"global_batch": global_batch,
                                                                       "modes": list(args.modes)},
            "environment": NO_MULTICAST_ENV, "hardware": hardware(preset), "versions": versions(),
            "model_config": nemotron_h(preset.shape).to_dict(), "runs": runs}


def table(report: dict) -> str:
    lines = [f"{'mode':>5} {'GPUs':>4} {'status':>8} {'tok/s':>9} {'speedup':>7} {'eff':>5} {'peak GiB/rank':>13} "
             f"{'loss vs 1':>10}"]
    for mode in report["settings"]["modes"]:
        for n, per_mode in report["runs"].items():
            r = per_mode[mode]
            peak = max((p.get("peak_allocated_gib", p["peak_rss_gib"]) for p in r.get("peak_per_rank", [])),
                       default=float("nan"))
            match = {True: "equal", False: "DIFFERS", None: "-"}[r.get("matches_1gpu")]
            lines.append(f"{mode:>5} {n:>4} {r['status']:>8} {r.get('tokens_per_s', float('nan')):9.0f} "
                         f"{r.get('speedup', float('nan')):7.2f} {r.get('efficiency', float('nan')):5.2f} "
                         f"{peak:13.2f} {match:>10}")
    return "\n".join(lines)


def check_args(args) -> None:
    preset = PRESETS[args.preset]
    if preset.device == "cuda" and not torch.cuda.is_available():
        raise BadInput(f"--preset {args.preset}: needs CUDA GPUs and none is visible (use --preset cpu-smoke)")
    bad = [n for n in args.gpus if n & (n - 1)]
    if bad:
        # The loop's gradient scaling is exact for power-of-two world sizes only (trainers/loop.py _one_step).
        raise BadInput(f"--gpus: {bad} not a power of two (expected values among 1, 2, 4, 8)")
    if 1 not in args.gpus:
        raise BadInput("--gpus: must include 1 (the run every other world size is measured against)")
    if args.steps is not None and args.steps < 2:
        raise BadInput(f"--steps: {args.steps}; expected at least 2 (the first step is warm-up)")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="h200")
    p.add_argument("--gpus", type=int, nargs="+", help="world sizes to try (default: the preset's)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--steps", type=int, help="optimizer steps per mode (default: the preset's)")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results", help="directory of the results JSON")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--global-batch", type=int, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.gpus = sorted(set(args.gpus or PRESETS[args.preset].world_sizes))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.worker:
        worker(args)
        return 0
    try:
        check_args(args)
    except BadInput as e:
        print(f"train_scaling: {e}", file=sys.stderr)
        return 2
    report = run_all(args)
    name = "train_scaling.json" if args.preset == "h200" else f"train_scaling-{args.preset}.json"
    path = write_json_atomic(args.out / name, report)
    print(f"\nresults: {path}\n{table(report)}")
    ran = [r for per_mode in report["runs"].values() for r in per_mode.values() if r["status"] != "not_run"]
    return 0 if all(r["status"] == "ok" and r.get("matches_1gpu", True) for r in ran) else 1


if __name__ == "__main__":
    sys.exit(main())
