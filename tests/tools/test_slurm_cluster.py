"""The loopback cluster of scripts/slurm-up: idempotent start, real accounting, stop/start by PID files."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]
STATE = Path(os.environ.get("POSTLAB_SLURM_DIR", "/tmp/postlab-slurm"))
PID_FILES = {
    "slurmd": STATE / "slurmd.pid", "slurmctld": STATE / "slurmctld.pid", "slurmdbd": STATE / "slurmdbd.pid",
    "mariadbd": STATE / "mysql/run/mariadb.pid", "munged": Path("/run/munge/munged.pid"),
}


def _pids() -> dict[str, str]:
    return {name: path.read_text().strip() for name, path in PID_FILES.items() if path.exists()}


def _script(name: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(REPO / "scripts" / name)], capture_output=True, text=True, timeout=120)


def test_slurm_up_again_is_a_no_op(slurm_cluster: None) -> None:
    # Nothing is started again: every daemon keeps its pid. (No wall-clock bound: slurm-up waits for the node to be
    # idle, which a job an earlier test left completing can delay; a 10 s bound failed once at 10.2 s under load.)
    before = _pids()
    if set(before) != set(PID_FILES):
        pytest.skip(f"cluster not started by scripts/slurm-up (PID files in {STATE}: {sorted(before)})")
    up = _script("slurm-up")
    assert up.returncode == 0, up.stderr
    assert _pids() == before
    assert "idle" in up.stderr


def test_accounting_reports_elapsed_and_gpus(slurm_cluster: None, tmp_path: Path) -> None:
    job_id = subprocess.run(["sbatch", "--parsable", "--gpus-per-node=1", "-t", "1", f"--output={tmp_path}/o",
                             "--wrap", "sleep 2"], check=True, capture_output=True, text=True).stdout.strip()
    deadline = time.monotonic() + 30
    while True:
        rows = subprocess.run(["sacct", "-j", job_id, "-X", "-P", "-n", "-o", "State,ElapsedRaw,AllocTRES"],
                              check=True, capture_output=True, text=True).stdout.split("|")
        if rows[0] == "COMPLETED" or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    state, elapsed, tres = rows
    assert state == "COMPLETED" and int(elapsed) >= 2 and "gres/gpu=1" in tres


def test_down_stops_by_pid_files_and_up_restarts(slurm_cluster: None) -> None:
    if set(_pids()) != set(PID_FILES):
        pytest.skip(f"cluster not started by scripts/slurm-up (no PID files in {STATE})")
    down = _script("slurm-down")
    assert down.returncode == 0, down.stderr
    assert subprocess.run(["sinfo"], capture_output=True, timeout=30).returncode != 0
    t0 = time.monotonic()
    up = _script("slurm-up")
    assert up.returncode == 0, up.stderr
    assert time.monotonic() - t0 < 60
    node = subprocess.run(["sinfo", "-h", "-o", "%T"], check=True, capture_output=True, text=True).stdout.split()
    assert node == ["idle"]
