"""The same playbook session on the loopback Slurm cluster (scripts/slurm-up): every job went through
sbatch, is in `sacct`, and its cost was settled from sacct's elapsed time and allocated GPUs (none: the lab runs
every job on the node's CPU).

The cluster's one node is this host, so the lab sets `executor.slurm.zygote`: srun starts each task as
the zygote's client (in the step, timed by sacct) and the job forks from this host's warm zygote. Without
it every one of the session's jobs imported torch and transformers afresh: back to back at load 4.4, this
test took 228.6 s with POSTLAB_ZYGOTE=0 and 82.5 s with the zygote."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from memory.notebook import Notebook

sys.path.insert(0, str(Path(__file__).parent))
from labkit import make_lab  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.slurm]
REPO = Path(__file__).resolve().parents[2]


def _slurm_unreachable() -> str | None:
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=15)
    except (FileNotFoundError, subprocess.TimeoutExpired) as err:
        return f"sinfo failed ({err}); start the cluster with scripts/slurm-up"
    usable = {"idle", "mixed", "allocated"} & set(out.stdout.split())
    return None if out.returncode == 0 and usable else f"no usable Slurm node: {out.stdout.strip() or out.stderr.strip()}"


def test_session_on_slurm_settles_every_job_from_sacct(tmp_path):
    reason = _slurm_unreachable()
    if reason:
        pytest.skip(reason)
    lab = make_lab(tmp_path / "lab", slurm=True)
    out = subprocess.run([sys.executable, str(REPO / "run_agent.py"), "--budget", "5gpuh", "--lab", str(lab),
                          "--session", "slurm1", "--protocol", "test", "--quiet"], cwd=REPO, capture_output=True,
                         text=True, timeout=3000)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    with Notebook.open(lab / "notebook.db", readonly=True) as nb:
        assert nb.session("slurm1").status == "done" and nb.verify().ok
        assert len(nb.decisions("slurm1", kind="nominate")) == 1
        jobs = nb.jobs(session="slurm1")
        assert jobs and all(j.executor == "slurm" and j.state == "completed" and j.external_id for j in jobs)
        ledger = nb.ledger("slurm1")
        assert ledger.spent_gpuh <= ledger.budget_gpuh
    ids = ",".join(j.external_id for j in jobs)
    sacct = subprocess.run(["sacct", "-j", ids, "-X", "-n", "-P", "-o", "JobID,State,ElapsedRaw"], capture_output=True,
                           text=True, timeout=60, check=True).stdout.split()
    rows = {line.split("|")[0]: line.split("|") for line in sacct}
    for j in jobs:
        job_id, state, elapsed = rows[j.external_id]
        assert state == "COMPLETED"
        # Every job ran on the node's CPU (the lab's resources say gpus = 0): charged no GPU-hours.
        assert j.gpu_hours == 0 and j.device_seconds == 0 and j.resources["gpus"] == 0
    # The tasks srun started forked from this host's zygote (tests/conftest.py gives the suite its own
    # zygote directory), unless POSTLAB_ZYGOTE=0 turned it off: its log names each job folder it served.
    # A job whose task found the zygote still importing past its wait ran a plain python, which is correct
    # too, so not every job need be there.
    logs = "".join(log.read_text() for log in Path(os.environ["POSTLAB_ZYGOTE_DIR"]).glob("*.log"))
    served = any(f"submitit.core._submit {j.folder}" in logs for j in jobs)
    assert served == (os.environ.get("POSTLAB_ZYGOTE", "1") != "0"), logs[-3000:]
