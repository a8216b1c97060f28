"""A stand-in agent process for the kill-and-resume test; it submits one probe job and waits.

    python tests/tools/agent_proc.py NOTEBOOK JOBS_ROOT OUTPUT_DIR local|slurm

Run again after being killed, it must re-attach to the same job instead of submitting another.
"""

from __future__ import annotations

import sys
from pathlib import Path

from memory.notebook import Notebook
from tools.executor import ExecutorSection, SlurmSection
from tools.launcher import Launcher, Resources
from tools.probe import CountConfig, count


def main() -> None:
    db, root, out, kind = sys.argv[1:5]
    nb = Notebook.open(db)
    if "s1" not in {s.name for s in nb.sessions()}:
        nb.open_session("s1", lab=str(Path(db).parent), budget_gpuh=10.0, reserve_gpuh=0.5, planner="playbook",
                        executor=kind, config={})
    slurm = SlurmSection(partition="debug", gpus_per_node=1, cpus_per_task=1, mem_gb=1)
    executor = ExecutorSection(kind=kind, slurm=slurm if kind == "slurm" else None)
    launcher = Launcher.from_section(nb, "s1", executor, Path(root), poll_s=0.2)
    job = launcher.submit("probe", count, CountConfig(steps=16, step_seconds=0.5, output_dir=Path(out)),
                          Resources(time_limit_min=2, signal_delay_s=10))
    print("submitted", job.record.external_id, flush=True)
    print("result", job.result().model_dump_json(), flush=True)


if __name__ == "__main__":
    main()
