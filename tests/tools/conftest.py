"""Fixtures for the launcher tests: the same tests run on the local executor and on the loopback
Slurm cluster (scripts/slurm-up). Slurm cases are skipped, with the reason, when `sinfo` cannot
reach a cluster with an idle node. The data tests (feedback, splits, builders) share the battle and
JSONL helpers and the tiny tokenizer at the end."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from core import tiny
from memory.notebook import Notebook
from tools.jobs.executor import ExecutorSection, SlurmSection
from tools.jobs.launcher import Launcher

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
def launcher(notebook: Notebook, executor: ExecutorSection, tmp_path: Path) -> Iterator[Launcher]:
    # A fresh submitit folder per test: Slurm job ids restart at 1 when its state is wiped.
    launcher = Launcher.from_section(notebook, SESSION, executor, tmp_path / "jobs", poll_s=0.2)
    yield launcher
    # A failed test must not leave its jobs holding the node's CPUs (or this machine's) for the next.
    for record in notebook.jobs(session=SESSION):
        if record.external_id and record.state in {"pending", "running"}:
            if executor.kind == "slurm":  # scancel of a job that ended meanwhile fails: nothing to do then
                subprocess.run(["scancel", record.external_id], capture_output=True, timeout=60)
            else:
                launcher.backend.cancel(record.external_id, Path(record.folder))


# ---- data tests (feedback, splits, builders, leak audit) ------------------------------------------


def make_battle(bid: str, prompt: str = "q", vote: str = "own", own: str = "own answer",
                other: str = "other answer", meta: dict | None = None, messages: list | None = None) -> dict:
    row = {"id": bid, "messages": messages or [{"role": "user", "content": prompt}],
           "own": own, "other": other, "vote": vote}
    if meta is not None:
        row["meta"] = meta
    return row


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture
def battle():
    """Factory of one feedback battle row (a dict in the documented format)."""
    return make_battle


@pytest.fixture
def jsonl():
    """Writes rows (dicts, or raw strings for broken lines) as a JSONL file and returns its path."""
    return write_jsonl


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    """The offline tiny tokenizer (trainers/tiny.py), built once per test session."""
    return tiny.build_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer")
