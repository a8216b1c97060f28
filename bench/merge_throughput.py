"""Merge throughput: the streamed soup of two multi-shard checkpoints against a plain copy of the same bytes.

    .venv/bin/python bench/merge_throughput.py --size-gb 4 --shard-gb 1 [--dir /scratch] [--repeats 2]

Builds two checkpoints of random bf16 tensors (`--size-gb` each, `--shard-gb` shards, safetensors with an index),
checks that the soup equals the FP32 formula cast back on sampled tensors, then times, alternating and each in a
fresh process (so peak RSS is the operation's own): `trainers.merge.soup` (reads 2 x size, writes size, fsynced)
and a plain file copy of one checkpoint's shards (reads size, writes size, fsynced) on the same disk. Reports
output GB/s of each, the soup's share of copy bandwidth, and peak RSS against the shard size. Goal (issue 18):
>= 70% of copy bandwidth, peak RSS under two shard sizes. Writes bench/results/merge_throughput.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from any directory, without the package installed
RESULTS = REPO / "bench" / "results" / "merge_throughput.json"

CHILD = r"""
import json, os, shutil, sys, time
from pathlib import Path
sys.path.insert(0, {repo!r})
op, src_a, src_b, out = sys.argv[1:5]
def fsync_dir(d):
    for f in Path(d).iterdir():
        fd = os.open(f, os.O_RDONLY); os.fsync(fd); os.close(fd)
start = time.perf_counter()
if op == "soup":
    from trainers.merge import SoupConfig, soup
    t0 = time.perf_counter()
    soup(SoupConfig(models=[Path(src_a), Path(src_b)], weights=[0.5, 0.5], output_dir=Path(out)))
else:
    t0 = time.perf_counter()
    Path(out).mkdir()
    for f in sorted(Path(src_a).iterdir()):
        shutil.copyfile(f, Path(out) / f.name)
written = time.perf_counter() - t0
fsync_dir(out)
elapsed = time.perf_counter() - t0
# VmHWM is this process image's own peak; ru_maxrss would carry the parent's peak across fork + exec.
hwm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(json.dumps({{"seconds": elapsed, "fsync_seconds": elapsed - written, "peak_rss_bytes": hwm}}))
"""


def build_checkpoint(path: Path, size_gb: float, shard_gb: float, seed: int) -> int:
    """Random bf16 tensors of 64 MiB each, grouped into shards; a minimal Llama-like config.json."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    tensor_elems = 32 * 1024 * 1024  # 64 MiB in bf16
    n_tensors = max(2, round(size_gb * 2**30 / (tensor_elems * 2)))
    per_shard = max(1, round(shard_gb * 2**30 / (tensor_elems * 2)))
    shards = [list(range(i, min(i + per_shard, n_tensors))) for i in range(0, n_tensors, per_shard)]
    weight_map, total = {}, 0
    for s, ids in enumerate(shards):
        name = f"model-{s + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {f"layers.{i}.weight": torch.randn(4096, tensor_elems // 4096, generator=gen).to(torch.bfloat16)
                   for i in ids}
        save_file(tensors, path / name, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, name)
        total += sum(t.numel() * 2 for t in tensors.values())
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return total


def check_soup(a: Path, b: Path, work: Path) -> float:
    """Soup on sampled tensors equals (0.5 a + 0.5 b) in FP32 cast back to bf16; returns the max abs error."""
    import torch
    from safetensors import safe_open

    from trainers.merge import SoupConfig, shard_map, soup

    out = work / "check"
    soup(SoupConfig(models=[a, b], weights=[0.5, 0.5], output_dir=out))
    worst = 0.0
    names = sorted(shard_map(a))
    for key in (names[0], names[len(names) // 2], names[-1]):
        tensors = []
        for d in (a, b, out):
            with safe_open(d / shard_map(d)[key], framework="pt") as f:
                tensors.append(f.get_tensor(key))
        ref = (0.5 * tensors[0].float() + 0.5 * tensors[1].float()).to(torch.bfloat16)
        worst = max(worst, (tensors[2].float() - ref.float()).abs().max().item())
    shutil.rmtree(out)
    return worst


def profile_soup(a: Path, b: Path, out: Path) -> dict:
    """One soup in this process with each pipeline stage's busy seconds summed over its shards (reads and
    combining in the worker threads; hash and write in the writers; the flushers' fdatasync calls, the disk's
    time): a stage's sum against wall time x shards in flight says how close it came to bounding the soup."""
    import threading
    from collections import Counter

    from trainers import merge

    busy, lock = Counter(), threading.Lock()

    def timed(name, fn):
        def wrapper(*args):
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                with lock:
                    busy[name] += time.perf_counter() - start
        return wrapper

    pipeline, sync = merge._ShardPipeline, os.fdatasync
    write, run = pipeline._write, pipeline.run

    def run_timed(self, plan, work):
        return run(self, plan, timed("read and combine", work))

    pipeline._write, pipeline.run, os.fdatasync = timed("hash and write", write), run_timed, timed("fdatasync", sync)
    try:
        start = time.perf_counter()
        merge.soup(merge.SoupConfig(models=[a, b], weights=[0.5, 0.5], output_dir=out))
        wall = time.perf_counter() - start
    finally:
        pipeline._write, pipeline.run, os.fdatasync = write, run, sync
    shutil.rmtree(out)
    return {"wall_seconds": wall, "busy_seconds": dict(busy)}


def filesystem(path: Path) -> str:
    """The mount holding `path` (device, mount point, type), from /proc/mounts: which disk was measured."""
    mounts = [line.split()[:3] for line in Path("/proc/mounts").read_text().splitlines()]
    best = max((m for m in mounts if str(path.resolve()).startswith(m[1])), key=lambda m: len(m[1]))
    return " ".join(best)


def run_child(op: str, a: Path, b: Path, out: Path) -> dict:
    code = CHILD.format(repo=str(REPO))
    proc = subprocess.run([sys.executable, "-c", code, op, str(a), str(b), str(out)], capture_output=True, text=True,
                          check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{op} child failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    shutil.rmtree(out)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=4.0, help="size of each checkpoint in GiB")
    parser.add_argument("--shard-gb", type=float, default=1.0, help="shard size in GiB")
    parser.add_argument("--dir", type=Path, default=None, help="scratch directory on the disk to measure")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--profile", action="store_true", help="also one in-process soup with per-stage busy times")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        work = Path(tmp)
        t0 = time.perf_counter()
        size = build_checkpoint(work / "a", args.size_gb, args.shard_gb, seed=1)
        build_checkpoint(work / "b", args.size_gb, args.shard_gb, seed=2)
        build_s = time.perf_counter() - t0
        disk = filesystem(work)
        max_err = check_soup(work / "a", work / "b", work)
        if max_err != 0.0:
            raise SystemExit(f"soup differs from the FP32 formula cast back: max abs error {max_err}")
        profile = profile_soup(work / "a", work / "b", work / "profiled") if args.profile else None
        runs: dict[str, list[dict]] = {"soup": [], "copy": []}
        for _ in range(args.repeats):
            for op in ("copy", "soup"):
                runs[op].append(run_child(op, work / "a", work / "b", work / f"out-{op}"))

    gb = size / 1e9
    table = {}
    for op, rs in runs.items():
        secs = statistics.median(r["seconds"] for r in rs)
        table[op] = {"seconds_median": secs, "seconds_all": [r["seconds"] for r in rs],
                     "fsync_seconds_all": [r["fsync_seconds"] for r in rs],
                     "output_gb_per_s": gb / secs, "peak_rss_gb": max(r["peak_rss_bytes"] for r in rs) / 1e9}
    share = table["soup"]["output_gb_per_s"] / table["copy"]["output_gb_per_s"]
    shard_bytes = args.shard_gb * 2**30
    result = {
        "command": "python bench/merge_throughput.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.node()} {platform.machine()} cores={os.cpu_count()}",
        "python": platform.python_version(), "filesystem": disk,
        "checkpoint_gb": gb, "shard_gb": shard_bytes / 1e9, "build_seconds": build_s,
        "soup_equals_fp32_formula": True,
        "soup": table["soup"], "copy": table["copy"],
        "soup_share_of_copy_bandwidth": share,
        "soup_peak_rss_in_shards": table["soup"]["peak_rss_gb"] * 1e9 / shard_bytes,
        "soup_stage_profile": profile,
        "goals": {"share>=0.70": share >= 0.70,
                  "peak_rss<2_shards": table["soup"]["peak_rss_gb"] * 1e9 < 2 * shard_bytes},
    }
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'op':6} {'GB/s out':>9} {'s (median)':>11} {'peak RSS GB':>12}")
    for op in ("copy", "soup"):
        r = table[op]
        print(f"{op:6} {r['output_gb_per_s']:9.2f} {r['seconds_median']:11.2f} {r['peak_rss_gb']:12.2f}")
    if profile:
        print(f"profiled soup: {profile}")
    print(f"soup / copy bandwidth: {share:.0%}; soup peak RSS = {result['soup_peak_rss_in_shards']:.2f} shards "
          f"(goal < 2); checkpoint {gb:.2f} GB in {shard_bytes / 1e9:.2f} GB shards")


if __name__ == "__main__":
    main()
