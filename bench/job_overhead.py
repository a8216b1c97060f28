"""Job engine overhead: submit -> job start and job end -> result in the agent, median of N empty jobs;
the cost of resuming: a fresh launcher's `attach(key)` reading back a finished job; and what the local
zygote (tools/jobs/zygote.py) saves: the same jobs with it and without it, side by side.

    .venv/bin/python bench/job_overhead.py [--jobs 20] [--executors local slurm] [--zygote-jobs 5]
        [--session-test] [--out bench/results/job_overhead.json]

Each job goes through the whole launcher path an agent uses (key, admission, notebook rows, launch
decision, submitit pickling, executor, result read back and cost settled). "submit -> start" is
from the call to `Launcher.submit` to the first line of the job function; "end -> result" is from
the job function's return to `Job.result()` returning in the agent (on Slurm this includes waiting
for `sacct` to report the final state the cost is settled from). "attach -> result" is what a
resumed agent pays per job it holds a key of: a new `Launcher` rebuilds the handle from the notebook
(function and result model re-imported by name) and reads the settled result back. Slurm runs on the loopback cluster
of scripts/slurm-up (one node, slurmdbd accounting). The launcher polls every 0.25 s here (its
Slurm default is 2 s, which adds up to 2 s to end -> result).

The zygote comparison runs two local jobs, alternately with and without a warm zygote (so a change of
the shared machine's load falls on both): `empty` (the executor's floor) and `sft`, two SFT steps of a
tiny Nemotron-H (the toy world's model) as `trainers.sft.train`. Per job it reports the wall time from
submit to result and the CPU seconds of every process the job took: the submitit controller, its task
(the client, or the plain python), and on the zygote the forked job (read from the zygote's reaped-children
times in /proc); the zygote's own start (its imports, once per session) is reported apart.
`--session-test` also times `pytest tests/agent/test_session.py` (one whole session, killed twice and
resumed) with the zygote and with POSTLAB_ZYGOTE=0.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from core import tiny
from memory.notebook import Notebook
from tools.jobs import zygote
from tools.jobs.executor import ExecutorSection, SlurmSection
from tools.jobs.launcher import Launcher, LocalBackend, Resources
from tools.jobs.probe import EmptyConfig, empty
from trainers import sft

REPO = Path(__file__).resolve().parents[1]


def measure(kind: str, jobs: int) -> dict[str, float]:
    slurm = SlurmSection(partition="debug", gpus_per_node=0, cpus_per_task=1, mem_gb=1)
    executor = ExecutorSection(kind=kind, slurm=slurm if kind == "slurm" else None, zygote=False)
    to_start, to_result, attach = [], [], []
    with tempfile.TemporaryDirectory() as tmp, Notebook.open(Path(tmp) / "notebook.db") as nb:
        nb.open_session("bench", lab=tmp, budget_gpuh=100, reserve_gpuh=0, planner="playbook", executor=kind,
                        config={})
        launcher = Launcher.from_section(nb, "bench", executor, Path(tmp) / "jobs", poll_s=0.25)
        for i in range(jobs):
            t_submit = time.time()
            job = launcher.submit("empty", empty, EmptyConfig(tag=f"{kind}-{i}"),
                                  Resources(time_limit_min=2, signal_delay_s=10))
            result = job.result(timeout_s=120)
            t_result = time.time()
            to_start.append(result.started_at - t_submit)
            to_result.append(t_result - result.ended_at)
            t_attach = time.time()
            resumed = Launcher.from_section(nb, "bench", executor, Path(tmp) / "jobs").attach(job.key)
            assert resumed.result(timeout_s=10) == result
            attach.append(time.time() - t_attach)
    return {
        "submit_to_start_median_s": round(statistics.median(to_start), 3),
        "end_to_result_median_s": round(statistics.median(to_result), 3),
        "submit_to_start_max_s": round(max(to_start), 3),
        "end_to_result_max_s": round(max(to_result), 3),
        "attach_to_result_median_s": round(statistics.median(attach), 4),
    }


# ---- with and without the zygote -------------------------------------------------------------------

def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _process_cpu_s(pid: int) -> float:
    """CPU seconds of `pid` and of the children it reaped (utime, stime, cutime, cstime in /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def _sft_job(work: Path, i: int) -> tuple:
    """Two SFT steps of the tiny Nemotron-H on eight rows (built once under `work`)."""
    model = work / "nemotron_h"
    if not model.exists():
        tiny.build_model("nemotron_h", tiny.build_tokenizer(work / "tokenizer"), model, seed=0)
        rows = [{"messages": [{"role": "user", "content": f"what is {n} + {n}?"},
                              {"role": "assistant", "content": f"{2 * n}"}]} for n in range(8)]
        (work / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = sft.SFTConfig(model_path=model, data_path=work / "sft.jsonl", output_dir=work / f"run-{i}", steps=2,
                           batch_size=4, micro_batch_size=4, max_len=64)
    return sft.train, config


def _one(launcher: Launcher, kind: str, work: Path, i: int, server: int | None) -> dict[str, float]:
    fn, config = (empty, EmptyConfig(tag=f"{i}")) if kind == "empty" else _sft_job(work, i)
    cpu0, zcpu0, t0 = _children_cpu_s(), _process_cpu_s(server) if server else 0.0, time.time()
    job = launcher.submit(kind, fn, config, Resources(time_limit_min=10, signal_delay_s=30))
    job.result(timeout_s=600)
    wall = time.time() - t0
    cpu = _children_cpu_s() - cpu0 + (_process_cpu_s(server) - zcpu0 if server else 0.0)
    return {"wall_s": wall, "cpu_s": cpu}


def compare_zygote(jobs: int) -> dict[str, object]:
    """`jobs` runs of each job kind, alternately through a warm zygote and plain."""
    folder = Path(tempfile.mkdtemp(prefix="zy-bench-", dir="/tmp"))
    handle = zygote.Zygote(folder)
    cpu0, t0 = _children_cpu_s(), time.time()
    server = handle.wait(os.environ, timeout_s=600)
    start = {"wall_s": round(time.time() - t0, 2), "cpu_s": round(_children_cpu_s() - cpu0 + _process_cpu_s(server), 2)}
    out: dict[str, object] = {"zygote_start": start}
    try:
        with tempfile.TemporaryDirectory() as tmp, Notebook.open(Path(tmp) / "notebook.db") as nb:
            nb.open_session("bench", lab=tmp, budget_gpuh=1000, reserve_gpuh=0, planner="playbook", executor="local",
                            config={})
            launchers = {"zygote": Launcher(nb, "bench", LocalBackend(zygote=handle), Path(tmp) / "jobs", poll_s=0.25),
                         "plain": Launcher(nb, "bench", LocalBackend(), Path(tmp) / "jobs", poll_s=0.25)}
            _sft_job(Path(tmp), -1)  # the tiny model and data, built before any timing
            for kind in ("empty", "sft"):
                runs: dict[str, list[dict[str, float]]] = {"zygote": [], "plain": []}
                for i in range(jobs):
                    for name in ("plain", "zygote") if i % 2 else ("zygote", "plain"):
                        runs[name].append(_one(launchers[name], kind, Path(tmp), 2 * i + (name == "zygote"),
                                               server if name == "zygote" else None))
                log = handle.socket(os.environ).with_suffix(".log").read_text()
                assert log.count("ended with status 0") >= jobs, "the zygote runs were not served by the zygote"
                out[kind] = {name: {f"{m}_median": round(statistics.median(r[m] for r in rs), 2)
                                    for m in ("wall_s", "cpu_s")} for name, rs in runs.items()}
    finally:
        zygote.stop(folder)
        shutil.rmtree(folder)
    return out


def session_test() -> dict[str, dict[str, float]]:
    """Wall and CPU time of one whole-session test, with the zygote and without (POSTLAB_ZYGOTE=0).

    CPU: pytest and every process it waited for (agents, their job controllers and tasks), plus the
    zygote's own and its jobs' (from its exit line). Jobs whose agent the test SIGKILLs are reparented
    and not counted, with either setting."""
    out = {}
    for name, switch in (("zygote", "1"), ("plain", "0")):
        with tempfile.TemporaryDirectory(prefix="zy-session-", dir="/tmp") as tmp:
            cpu0, t0 = _children_cpu_s(), time.time()
            proc = subprocess.run([sys.executable, "-m", "pytest", "tests/agent/test_session.py", "-q", "-p", "no:randomly",
                                   "--basetemp", f"{tmp}/t"], cwd=REPO, env={**os.environ, "POSTLAB_ZYGOTE": switch},
                                  capture_output=True, text=True)
            wall, cpu = time.time() - t0, _children_cpu_s() - cpu0
            assert proc.returncode == 0, proc.stdout[-3000:]
            logs = "".join(p.read_text() for p in Path(tmp, "t").glob("zygote*/*.log"))
            zcpu = sum(float(a) + float(b) for a, b in re.findall(r"exiting: ([\d.]+) CPU-s own, ([\d.]+) CPU-s", logs))
            out[name] = {"wall_s": round(wall, 1), "cpu_s": round(cpu + zcpu, 1), "zygote_cpu_s": round(zcpu, 1),
                         "jobs_forked": logs.count("ended with status")}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=20)
    parser.add_argument("--executors", nargs="*", choices=["local", "slurm"], default=["local", "slurm"])
    parser.add_argument("--zygote-jobs", type=int, default=5, help="runs of each job kind with and without the zygote")
    parser.add_argument("--session-test", action="store_true", help="also time tests/agent/test_session.py both ways")
    parser.add_argument("--out", type=Path, default=Path("bench/results/job_overhead.json"))
    args = parser.parse_args()
    command = (f"python bench/job_overhead.py --jobs {args.jobs} --executors {' '.join(args.executors)} "
               f"--zygote-jobs {args.zygote_jobs}{' --session-test' if args.session_test else ''}")
    result: dict[str, object] = {
        "command": command,
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs python {platform.python_version()}",
        "load_average_1min_at_start": round(os.getloadavg()[0], 2),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS", ""),
        "jobs": args.jobs,
        **{kind: measure(kind, args.jobs) for kind in args.executors},
    }
    if args.zygote_jobs:
        result["zygote"] = compare_zygote(args.zygote_jobs)
    if args.session_test:
        result["session_test"] = session_test()
    result["load_average_1min_at_end"] = round(os.getloadavg()[0], 2)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
