"""Slurm on a small partition (issue 43, item 7), on the loopback cluster of scripts/slurm-up (one node: 2 CPUs, about
21 GB, 2 GPU gres). A job no node can hold (the defaults: 8 CPUs, 64 GB) is refused before submission, by the rule
read from `sinfo`, as a recorded decision and before a session opens; a job pending past the lab's bound is
reported (a `wait` decision with Slurm's reason, a CLI line); `run_agent.py close SESSION --why` ends the stuck
session, its job cancelled and settled, the reason in its stop decision."""

from __future__ import annotations

import io
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent.config import load_lab_config
from agent.inputs import runtime_problems
from agent.live import PlainLog
from memory.notebook import Notebook
from tools.jobs.executor import SlurmSection
from tools.jobs.launcher import (
    Launcher,
    NodeNeed,
    PartitionNode,
    PartitionRefused,
    Resources,
    SlurmBackend,
    partition_nodes,
    partition_problem,
)
from tools.jobs.probe import EmptyConfig, empty

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "agent"))
from labkit import make_lab  # noqa: E402

SESSION = "s1"


def test_a_partition_problem_names_what_the_job_asks_and_what_the_largest_node_has() -> None:
    nodes = [PartitionNode(cpus=2, mem_mb=21694, gpus=2), PartitionNode(cpus=16, mem_mb=64000, gpus=0)]
    assert partition_problem("p", nodes, NodeNeed(cpus=2, mem_gb=21, gpus=2)) is None
    assert partition_problem("p", nodes, NodeNeed(cpus=16, mem_gb=62, gpus=0)) is None  # the other node fits
    problem = partition_problem("p", nodes, NodeNeed(cpus=8, mem_gb=64, gpus=1))
    assert problem is not None and "has 8 CPU(s), 64 GB and 1 GPU(s) (its largest: 2 CPUs, 21 GB, 2 GPU(s))" in problem
    assert "cpus_per_task and mem_gb (defaults 8 and 64)" in problem
    assert "has no nodes" in (partition_problem("nope", [], NodeNeed(cpus=1, mem_gb=1, gpus=0)) or "")


@pytest.mark.slurm
def test_resources_the_partition_lacks_are_refused_before_submission(slurm_cluster: None, tmp_path: Path) -> None:
    (node,) = partition_nodes("debug") or [None]
    assert node is not None and node.cpus >= 1 and node.gpus == 2 and node.mem_mb > 1024
    nb = Notebook.open(tmp_path / "notebook.db")
    nb.open_session(SESSION, lab=str(tmp_path), budget_gpuh=10, reserve_gpuh=0, planner="playbook", executor="slurm",
                    config={})
    defaults = Launcher(nb, SESSION, SlurmBackend.from_section(SlurmSection(partition="debug")), tmp_path / "jobs")  # 8 CPUs, 64 GB
    with pytest.raises(PartitionRefused, match=r"no node of Slurm partition 'debug' has 8 CPU\(s\), 64 GB"):
        defaults.submit("eval", empty, EmptyConfig(tag="a"), Resources(time_limit_min=2, gpus=1))
    (refusal,) = nb.decisions(SESSION, kind="refuse")
    assert refusal.payload.kind == "eval" and "would pend forever" in refusal.payload.reason
    assert nb.jobs(session=SESSION) == [] and not (tmp_path / "jobs").exists()  # nothing submitted, no row
    # The same rule before a session opens: `run` on such a lab exits 2 naming each kind.
    lab = make_lab(tmp_path / "lab", slurm=True)
    text = (lab / "lab.toml").read_text().replace("cpus_per_task = 1\nmem_gb = 1\n", "")
    (lab / "lab.toml").write_text(text)
    problems = runtime_problems(load_lab_config(lab), {}, "playbook", "slurm")
    assert any(p.startswith("[executor] jobs of kind train, eval") and "8 CPU(s), 64 GB" in p for p in problems)
    nb.close()


@pytest.mark.slurm
def test_a_job_pending_past_the_bound_is_reported_and_close_ends_the_stuck_session(slurm_cluster: None,
                                                                                  tmp_path: Path) -> None:
    lab = make_lab(tmp_path / "lab", slurm=True)
    # A job Slurm holds back for an hour (--begin): it pends, as one on a busy or too small partition would.
    text = (lab / "lab.toml").read_text().replace(
        "zygote = true\n", 'zygote = false\nextra_sbatch = ["--begin=now+3600"]\npending_report_min = 0.02\n')
    (lab / "lab.toml").write_text(text)
    config = load_lab_config(lab)
    nb = Notebook.open(lab / "notebook.db")
    nb.open_session(SESSION, lab=str(lab), budget_gpuh=10, reserve_gpuh=0, planner="playbook", executor="slurm",
                    config={"lab": config.model_dump(mode="json")})
    out = io.StringIO()
    log = PlainLog(stream=out, session=SESSION, notebook=lab / "notebook.db", poll_s=0.1)
    launcher = Launcher.from_section(nb, SESSION, config.executor, lab / "jobs", poll_s=0.2)
    job = launcher.submit("data", empty, EmptyConfig(tag="held"), Resources(time_limit_min=2, gpus=0))
    deadline = time.monotonic() + 60
    while not nb.decisions(SESSION, kind="wait") and time.monotonic() < deadline:
        job.done()
        time.sleep(0.2)
    job.done()  # reported once per attempt
    (wait,) = nb.decisions(SESSION, kind="wait")
    assert wait.payload.key == job.key and wait.payload.reason == "BeginTime" and wait.payload.pending_s >= 1
    assert "data still pending after" in wait.rationale and "run_agent.py close" in wait.rationale
    time.sleep(0.5)
    log.close()
    assert any("still pending after" in line and "BeginTime" in line for line in out.getvalue().splitlines())
    nb.close()
    # The person ends it: the job is cancelled at Slurm and settled, the session stopped with the reason.
    closed = subprocess.run([sys.executable, "run_agent.py", "close", SESSION, "--lab", str(lab), "--why",
                             "the partition is reserved all week"], cwd=REPO, capture_output=True, text=True,
                            timeout=300)
    assert closed.returncode == 0, closed.stderr
    assert "stopped (1 of 1 open job(s) cancelled and settled)" in closed.stdout
    with Notebook.open(lab / "notebook.db", readonly=True) as nb:
        (record,) = nb.jobs(session=SESSION)
        assert record.state == "failed" and record.failure_class == "cancelled" and record.gpu_hours == 0
        assert nb.session(SESSION).status == "stopped"
        stop = nb.decisions(SESSION, kind="stop")[-1]
        assert stop.rationale == "closed by a person: the partition is reserved all week"
        assert [d.kind for d in nb.decisions(SESSION)][-2:] == ["fail", "stop"]
        assert nb.verify().ok
    queued = subprocess.run(["squeue", "-h", "-j", record.external_id or "", "-o", "%T"], capture_output=True, text=True)
    assert queued.stdout.strip() in ("", "CANCELLED")
    again = subprocess.run([sys.executable, "run_agent.py", "close", SESSION, "--lab", str(lab), "--why", "x"],
                           cwd=REPO, capture_output=True, text=True, timeout=300)
    assert again.returncode == 2 and "already ended (stopped); nothing to close" in again.stderr
