"""Jobs of several processes (one per GPU, torchrun-style rendezvous) and what they are billed, on
the local executor and the loopback Slurm cluster; the toy world's simulated cost model."""

from __future__ import annotations

import subprocess
import time
from datetime import datetime
from pathlib import Path

import pytest
from pydantic import ValidationError

from memory.notebook import Notebook
from tools.jobs.executor import ExecutorSection, SlurmSection
from tools.jobs.launcher import BudgetRefused, JobFailed, Launcher, Resources
from tools.jobs.probe import AllReduceConfig, CountConfig, all_reduce, count

SESSION = "s1"  # the session the conftest's notebook fixture opens
# What every job's wrapper switches off, whatever the executor passed on: NVLink multicast and Hub kernels.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
                "USE_HUB_KERNELS": "0"}


@pytest.mark.slow  # two workers importing torch: ~30 s at a load of 10 on 2 cores
def test_two_task_job_all_reduces_and_is_billed_for_its_tasks(launcher: Launcher, notebook: Notebook) -> None:
    slurm = launcher.backend.name == "slurm"
    # Slurm: two GPUs, hence two tasks (one per GPU); locally a CPU-only job of two processes.
    resources = Resources(time_limit_min=3, signal_delay_s=10, gpus=2) if slurm else \
        Resources(time_limit_min=3, signal_delay_s=10, tasks=2)
    job = launcher.submit("ranks", all_reduce, AllReduceConfig(tag="two", seconds=1.0), resources)
    result = job.result(timeout_s=180)
    assert (result.rank, result.world_size, result.rank_sum) == (0, 2, 1 + 2)
    assert len(set(result.pids)) == 2  # two processes met in one group
    assert result.no_multicast == NO_MULTICAST
    (attempt,) = job.attempts()
    assert attempt.charge == "measured"
    if slurm:
        out = subprocess.run(["sacct", "-j", attempt.external_id, "-X", "-P", "-n", "-o", "ElapsedRaw,AllocTRES"],
                             check=True, capture_output=True, text=True).stdout.split("|")
        assert "gres/gpu=2" in out[1]
        assert attempt.device_seconds == int(out[0]) * 2
    else:
        assert result.master.startswith("127.0.0.1:")
        held = _seconds(attempt.ended_at) - _seconds(attempt.started_at)
        assert attempt.device_seconds == pytest.approx(held * 2)  # both processes, for the time they held
        assert attempt.device_seconds >= 2 * 1.0
    assert attempt.gpu_hours == pytest.approx(attempt.device_seconds / 3600)


@pytest.mark.slow  # two workers importing torch, then the group's timeout
def test_a_rank_that_hangs_the_group_is_classified_nccl_timeout(notebook: Notebook, tmp_path: Path) -> None:
    # Rank 1 never joins the all_reduce: rank 0 times out in gloo after 3 s; recorded, not retried.
    launcher = Launcher.from_section(notebook, SESSION, ExecutorSection(kind="local"), tmp_path / "jobs", poll_s=0.2)
    config = AllReduceConfig(tag="hang", skip_rank=1, timeout_s=3)
    job = launcher.submit("ranks", all_reduce, config, Resources(time_limit_min=3, signal_delay_s=10, tasks=2))
    with pytest.raises(JobFailed) as failed:
        job.result(timeout_s=180)
    record = failed.value.record
    assert record.failure_class == "nccl_timeout", record.failure_detail
    assert record.failure_detail.startswith("a collective operation timed out")  # minted: no log text
    assert len(job.attempts()) == 1 and record.device_seconds >= 2 * 3
    (fail,) = notebook.decisions(SESSION, kind="fail")
    assert fail.payload.failure_class == "nccl_timeout"


def _seconds(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()


def test_slurm_asks_one_task_per_gpu(tmp_path: Path) -> None:
    nb = Notebook.open(tmp_path / "notebook.db")
    slurm = ExecutorSection(kind="slurm", slurm=SlurmSection(partition="debug", gpus_per_node=4, cpus_per_task=2))
    backend = Launcher.from_section(nb, "s1", slurm, tmp_path / "jobs").backend
    params = backend.executor(tmp_path / "f", "sft", Resources(time_limit_min=10)).parameters
    assert (params["gpus_per_node"], params["ntasks_per_node"], params["nodes"]) == (4, 4, 1)
    # A CPU job holds no GPU and is charged none; a 2-node training job is charged the GPUs of both nodes.
    assert backend.devices(Resources(time_limit_min=10, gpus=0, tasks=2)) == 0
    two_nodes = Resources(time_limit_min=10, nodes=2)
    assert (backend.devices(two_nodes), backend.ranks(two_nodes)) == (8, 8)
    params = backend.executor(tmp_path / "f", "sft", two_nodes).parameters
    assert (params["gpus_per_node"], params["ntasks_per_node"], params["nodes"]) == (4, 4, 2)


def test_simulated_cost_charges_device_seconds_times_the_factor(tmp_path: Path) -> None:
    nb = Notebook.open(tmp_path / "notebook.db")
    nb.open_session("s1", lab=str(tmp_path), budget_gpuh=10.0, reserve_gpuh=0.5, planner="playbook",
                    executor="local", config={})
    factor = 0.01  # GPU-hours per device-second: the toy world's lab.toml declares one such number
    toy = ExecutorSection(kind="local", simulated_gpuh_per_device_s=factor)
    launcher = Launcher.from_section(nb, "s1", toy, tmp_path / "jobs", poll_s=0.1)
    t0 = time.time()
    job = launcher.submit("probe", count, CountConfig(steps=3, step_seconds=0.4, output_dir=tmp_path / "o"),
                          Resources(time_limit_min=1, signal_delay_s=10))
    job.result(timeout_s=60)
    wall = time.time() - t0
    record = job.record
    assert record.charge == "simulated" and 1.2 <= record.device_seconds <= wall
    assert record.gpu_hours == pytest.approx(record.device_seconds * factor)
    assert nb.ledger("s1").spent_gpuh == pytest.approx(record.gpu_hours)

    # Admission forecasts in the charged units: a 20-minute bound is 1200 s x 0.01 = 12 GPU-h, over
    # the budget of 10 (measured, it would be 0.333 GPU-h and fit).
    big = Resources(time_limit_min=20, signal_delay_s=10)
    assert launcher.forecast("probe", big).gpuh == pytest.approx(1200 * factor)
    with pytest.raises(BudgetRefused, match="forecast 12.000 GPU-h does not fit"):
        launcher.submit("probe", count, CountConfig(steps=1, step_seconds=0, output_dir=tmp_path / "b"), big)
    real = Launcher.from_section(nb, "s1", ExecutorSection(kind="local"), tmp_path / "jobs")
    assert real.forecast("probe", big).gpuh == pytest.approx(1200 / 3600)


def test_simulated_cost_is_refused_on_slurm() -> None:
    with pytest.raises(ValidationError, match="simulated_gpuh_per_device_s is for the local executor only"):
        ExecutorSection(kind="slurm", slurm=SlurmSection(partition="debug"), simulated_gpuh_per_device_s=0.01)
    with pytest.raises(ValidationError, match="simulated_gpuh_per_device_s"):
        ExecutorSection(kind="local", simulated_gpuh_per_device_s=0)
