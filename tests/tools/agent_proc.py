"""A stand-in agent process for the kill-and-resume tests: it submits probe jobs, or re-attaches to
recorded ones by key alone, and waits on them.

    python tests/tools/agent_proc.py NOTEBOOK JOBS_ROOT local|slurm submit OUTPUT_DIR STEPS [OUTPUT_DIR STEPS ...]
    python tests/tools/agent_proc.py NOTEBOOK JOBS_ROOT local|slurm attach KEY [KEY ...]

Prints `submitted KEY EXTERNAL_ID` (or `attached KEY EXTERNAL_ID`) per job as soon as it has a handle,
then `result KEY JSON` per job in order. Run `submit` again after being killed, it must re-attach
to the same jobs instead of submitting others; `attach` knows nothing but the keys.
"""

from __future__ import annotations

import sys
from pathlib import Path

from memory.notebook import Notebook
from tools.jobs.executor import ExecutorSection, SlurmSection
from tools.jobs.launcher import Job, Launcher, Resources
from tools.jobs.probe import CountConfig, count


def main() -> None:
    db, root, kind, mode, *rest = sys.argv[1:]
    nb = Notebook.open(db)
    if "s1" not in {s.name for s in nb.sessions()}:
        nb.open_session("s1", lab=str(Path(db).parent), budget_gpuh=10.0, reserve_gpuh=0.5, planner="playbook",
                        executor=kind, config={})
    slurm = SlurmSection(partition="debug", gpus_per_node=1, cpus_per_task=1, mem_gb=1)
    executor = ExecutorSection(kind=kind, slurm=slurm if kind == "slurm" else None)
    launcher = Launcher.from_section(nb, "s1", executor, Path(root), poll_s=0.2)
    jobs: list[Job] = []
    if mode == "submit":
        for out, steps in zip(rest[::2], rest[1::2], strict=True):
            config = CountConfig(steps=int(steps), step_seconds=0.5, output_dir=Path(out))
            jobs.append(launcher.submit("probe", count, config, Resources(time_limit_min=2, signal_delay_s=10)))
            print("submitted", jobs[-1].key, jobs[-1].record.external_id, flush=True)
    else:
        for key in rest:
            jobs.append(launcher.attach(key))
            print("attached", key, jobs[-1].record.external_id, flush=True)
    for job in jobs:
        print("result", job.key, job.result().model_dump_json(), flush=True)


if __name__ == "__main__":
    main()
