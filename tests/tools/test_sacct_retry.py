"""Slurm accounting that answers with an error for a while (slurmdbd restarting or busy) is asked again; one that
stays down is one clear error. `sacct` here is a shell script first on PATH that fails its first tries, as slurmdbd
does while it restarts ("Connection refused"), then answers with one accounting line."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tools.jobs import slurm
from tools.jobs.launcher import Resources, SlurmBackend


def _flaky_sacct(tmp_path: Path, failures: int) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "sacct"
    script.write_text(f"""#!/bin/sh
n=$(cat {tmp_path}/tries 2>/dev/null || echo 0); n=$((n + 1)); echo $n > {tmp_path}/tries
if [ $n -le {failures} ]; then echo "sacct: error: slurmdbd: Connection refused" >&2; exit 1; fi
echo "COMPLETED|26|billing=1,cpu=1,mem=1G,node=1|2026-12-01T10:00:00|2026-12-01T10:00:26|0:0"
""")
    script.chmod(0o755)
    return bin_dir


def _backend() -> SlurmBackend:
    return SlurmBackend.__new__(SlurmBackend)  # runs() reads no configuration: the task count is in Resources


@pytest.fixture
def quick_retries(monkeypatch):
    monkeypatch.setattr(slurm, "SACCT_RETRY_S", (0.01, 0.01, 0.01))


def test_a_transient_accounting_error_is_asked_again(tmp_path, monkeypatch, quick_retries):
    monkeypatch.setenv("PATH", f"{_flaky_sacct(tmp_path, failures=2)}{os.pathsep}{os.environ['PATH']}")
    runs = _backend().runs("470", tmp_path, Resources(time_limit_min=1, tasks=1))
    assert [(r.state, r.elapsed_s) for r in runs] == [("COMPLETED", 26.0)]
    assert (tmp_path / "tries").read_text().strip() == "3"


def test_accounting_that_stays_down_is_one_clear_error(tmp_path, monkeypatch, quick_retries):
    monkeypatch.setenv("PATH", f"{_flaky_sacct(tmp_path, failures=99)}{os.pathsep}{os.environ['PATH']}")
    with pytest.raises(RuntimeError, match=r"sacct -j 470: Slurm accounting did not answer after 4 tries: "
                                           r"sacct: error: slurmdbd: Connection refused"):
        _backend().runs("470", tmp_path, Resources(time_limit_min=1, tasks=1))
    assert (tmp_path / "tries").read_text().strip() == "4"
