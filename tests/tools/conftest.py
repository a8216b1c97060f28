"""Fixtures for the launcher tests: the same tests run on the local executor and on the loopback
Slurm cluster (scripts/slurm-up). Slurm cases are skipped, with the reason, when `sinfo` cannot
reach a cluster with an idle node."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from agent.config import ExecutorSection, SlurmSection
from memory.notebook import Notebook
from tools.launcher import Launcher

SESSION = "s1"


def slurm_unreachable() -> str | None:
    """Why the loopback cluster cannot run jobs, or None when it can."""
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=15)
    except (FileNotFoundError, subprocess.TimeoutExpired) as err:
        return f"sinfo failed ({err}); start the cluster with scripts/slurm-up (needs root and apt)"
    if out.returncode != 0:
        return f"sinfo failed: {out.stderr.strip()}; start the cluster with scripts/slurm-up"
    if not {"idle", "mixed", "allocated"} & set(out.stdout.split()):
        return f"no usable Slurm node (states: {out.stdout.split()})"
    return None


@pytest.fixture(scope="session")
def slurm_cluster() -> None:
    reason = slurm_unreachable()
    if reason:
        pytest.skip(reason)


SLURM = ExecutorSection(
    kind="slurm", time_limit_min=5,
    slurm=SlurmSection(partition="debug", gpus_per_node=1, cpus_per_task=1, mem_gb=1),
)


@pytest.fixture(params=["local", pytest.param("slurm", marks=pytest.mark.slurm)])
def executor(request: pytest.FixtureRequest) -> ExecutorSection:
    if request.param == "slurm":
        request.getfixturevalue("slurm_cluster")
        return SLURM
    return ExecutorSection(kind="local", time_limit_min=5)


@pytest.fixture
def notebook(tmp_path: Path) -> Notebook:
    nb = Notebook.open(tmp_path / "notebook.db")
    nb.open_session(SESSION, lab=str(tmp_path), budget_gpuh=10.0, reserve_gpuh=0.5, planner="playbook",
                    executor="local", config={})
    yield nb
    nb.close()


@pytest.fixture
def launcher(notebook: Notebook, executor: ExecutorSection, tmp_path: Path) -> Launcher:
    # A fresh submitit folder per test: Slurm job ids restart at 1 when its state is wiped.
    return Launcher(notebook, SESSION, executor, tmp_path / "jobs", poll_s=0.2)
