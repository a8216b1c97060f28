"""Job engine overhead: submit -> job start and job end -> result in the agent, median of N empty jobs;
and the cost of resuming: a fresh launcher's `attach(key)` reading back a finished job.

    .venv/bin/python bench/job_overhead.py [--jobs 20] [--executors local slurm] [--out bench/results/job_overhead.json]

Each job goes through the whole launcher path an agent uses (key, admission, notebook rows, launch
decision, submitit pickling, executor, result read back and cost settled). "submit -> start" is
from the call to `Launcher.submit` to the first line of the job function; "end -> result" is from
the job function's return to `Job.result()` returning in the agent (on Slurm this includes waiting
for `sacct` to report the final state the cost is settled from). "attach -> result" is what a
resumed agent pays per job it holds a key of: a new `Launcher` rebuilds the handle from the notebook
(function and result model re-imported by name) and reads the settled result back. Slurm runs on the loopback cluster
of scripts/slurm-up (one node, slurmdbd accounting). The launcher polls every 0.25 s here (its
Slurm default is 2 s, which adds up to 2 s to end -> result).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from memory.notebook import Notebook
from tools.executor import ExecutorSection, SlurmSection
from tools.launcher import Launcher, Resources
from tools.probe import EmptyConfig, empty


def measure(kind: str, jobs: int) -> dict[str, float]:
    slurm = SlurmSection(partition="debug", gpus_per_node=0, cpus_per_task=1, mem_gb=1)
    executor = ExecutorSection(kind=kind, slurm=slurm if kind == "slurm" else None)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=20)
    parser.add_argument("--executors", nargs="+", choices=["local", "slurm"], default=["local", "slurm"])
    parser.add_argument("--out", type=Path, default=Path("bench/results/job_overhead.json"))
    args = parser.parse_args()
    result = {
        "command": f"python bench/job_overhead.py --jobs {args.jobs} --executors {' '.join(args.executors)}",
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs python {platform.python_version()}",
        "load_average_1min_at_start": round(os.getloadavg()[0], 2),
        "jobs": args.jobs,
        **{kind: measure(kind, args.jobs) for kind in args.executors},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
