"""Hostile `[executor]` settings (issue 44, item 9): sbatch options that abbreviate what the launcher sets, and job
resources no machine has, are refused when lab.toml is loaded (static bounds) or before a session opens (what the
partition's nodes or this host have), naming the key; exit 2, nothing written."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from agent.config import SBATCH_ALLOWED, LabConfigError, load_lab_config
from agent.inputs import runtime_problems
from tools.jobs.executor import MAX_TIME_LIMIT_MIN, host_memory_gb, local_gpus
from tools.jobs.launcher import NodeNeed, partition_problem, sinfo_minutes, sinfo_nodes

sys.path.insert(0, str(Path(__file__).parent))
from hostile_kit import LAB_TOML, assert_refused, files, make_lab, run_cli  # noqa: E402

SBATCH = '"--exclusive"'


@pytest.fixture
def lab(tmp_path: Path) -> Path:
    return make_lab(tmp_path / "lab")


def _refused(lab: Path, toml: str) -> str:
    (lab / "lab.toml").write_text(toml)
    with pytest.raises(LabConfigError) as err:
        load_lab_config(lab)
    return str(err.value)


@pytest.mark.parametrize(("option", "expected"), [
    ("--arr=1-100", "--arr abbreviates --array, which the launcher sets"),
    ("--ch=/tmp", "--ch abbreviates --chdir, which the launcher sets"),
    ("--ti=99999", "--ti abbreviates --time, which the launcher sets"),
    ("--out=/tmp/x", "--out abbreviates --output, which the launcher sets"),
    ("--part=other", "--part abbreviates --partition"),
    ("--no-r", "--no-r abbreviates --no-requeue"),
    ("--gres=gpu:8", "--gres is not among the sbatch options extra_sbatch may pass"),
    ("--export=NONE", "--export is not among the sbatch options"),
    ("--hold", "--hold is not among the sbatch options"),
    ("--constr=h100", "--constr is not among the sbatch options extra_sbatch may pass; expected one of"),
])
def test_an_sbatch_option_outside_the_allow_list_is_refused_abbreviated_or_not(lab: Path, option: str, expected: str):
    message = _refused(lab, LAB_TOML.replace(SBATCH, f'"{option}"', 1))
    assert f"executor.slurm.extra_sbatch[0]: '{option}': {expected}" in message, message


def test_the_allowed_sbatch_options_load_by_their_full_names(lab: Path):
    options = ["--exclusive", "--begin=now+60", "--requeue", "--reservation=maint", "--mail-type=END", "#SBATCH --hint=nomultithread"]
    (lab / "lab.toml").write_text(LAB_TOML.replace('extra_sbatch = ["--exclusive", "#SBATCH --constraint=h100"]',
                                                   f"extra_sbatch = {options!r}".replace("'", '"'), 1))
    assert load_lab_config(lab).executor.slurm.extra_sbatch == options
    assert {"constraint", "exclusive", "requeue", "begin"} <= SBATCH_ALLOWED


def _resource(kind: str, key: str, value: int) -> str:
    return LAB_TOML.replace("[planner]", f"[executor.resources.{kind}]\n{key} = {value}\n\n[planner]", 1)


@pytest.mark.parametrize(("kind", "key", "value", "bound"), [
    ("train", "time_limit_min", 2**63 - 1, MAX_TIME_LIMIT_MIN),
    ("eval", "gpus", 1000, 64),
    ("train", "nodes", 2**40, 4096),
    ("merge", "cpus", 2**31, 4096),
    ("data", "mem_gb", 2**50, 65536),
])
def test_a_resource_past_any_machine_is_refused_at_load(lab: Path, kind: str, key: str, value: int, bound: int):
    message = _refused(lab, _resource(kind, key, value))
    assert f"executor.resources.{kind}.{key}: Input should be less than or equal to {bound}" in message, message


def test_a_time_limit_of_centuries_is_refused_for_every_job_too(lab: Path):
    message = _refused(lab, LAB_TOML.replace("time_limit_min = 120", f"time_limit_min = {2**63 - 1}", 1))
    assert f"executor.time_limit_min: Input should be less than or equal to {MAX_TIME_LIMIT_MIN}" in message


def _local(toml: str) -> str:
    return toml.replace('kind = "slurm"', 'kind = "local"', 1)


def test_gpus_or_memory_this_host_lacks_are_refused_before_a_session_opens(lab: Path):
    """`gpus = 1000` on a host without GPUs was accepted, then every eval refused by the budget: the local executor
    runs every job on this host, so what it lacks is refused (the run exits 2 and writes nothing)."""
    gpus, memory = local_gpus(os.environ) + 1, int(host_memory_gb()) + 1
    toml = _local(_resource("eval", "gpus", gpus).replace("[planner]", f"[executor.resources.train]\nmem_gb = {memory}"
                                                          "\n\n[planner]", 1))
    (lab / "lab.toml").write_text(toml)
    problems = runtime_problems(load_lab_config(lab), os.environ, "playbook", "local")
    want_gpus = f"[executor.resources.eval] gpus = {gpus}: this host has {gpus - 1} GPU(s)"
    want_memory = f"[executor.resources.train] mem_gb = {memory}: this host has"
    assert any(want_gpus in p for p in problems) and any(want_memory in p for p in problems), problems
    fitting = _local(_resource("eval", "gpus", gpus - 1))
    (lab / "lab.toml").write_text(fitting)
    assert not [p for p in runtime_problems(load_lab_config(lab), os.environ, "playbook", "local") if "[executor" in p]
    (lab / "lab.toml").write_text(toml)
    before = files(lab)
    [done] = run_cli([["--budget", "1gpuh", "--lab", str(lab), "--planner", "playbook"]])
    assert_refused(done.returncode, done.stderr, str(lab / "lab.toml"), want_gpus, want_memory)
    assert files(lab) == before


def test_a_time_limit_past_the_partitions_is_refused_as_a_job_that_would_pend_forever():
    """sinfo's %l (the partition's time limit) read as Slurm prints it; a job asking more pends forever."""
    assert [sinfo_minutes(t) for t in ("infinite", "1-00:00:00", "02:00:00", "30:00", "45", "00:00:01")] == \
        [None, 1440, 120, 30, 45, 1]
    nodes = sinfo_nodes("2-00:00:00 16 64000 gpu:h100:8\n2-00:00:00 2 21694 (null)\n")
    assert [(n.cpus, n.mem_mb, n.gpus, n.time_limit_min) for n in nodes] == [(16, 64000, 8, 2880), (2, 21694, 0, 2880)]
    assert partition_problem("gpu", nodes, NodeNeed(cpus=8, mem_gb=32, gpus=1, time_limit_min=2880)) is None
    problem = partition_problem("gpu", nodes, NodeNeed(cpus=8, mem_gb=32, gpus=1, time_limit_min=2881))
    assert problem is not None and "allows jobs of at most 2880 minutes" in problem and "asks 2881" in problem
    unlimited = sinfo_nodes("infinite 16 64000 gpu:8\n")
    assert partition_problem("gpu", unlimited, NodeNeed(cpus=8, mem_gb=32, gpus=1, time_limit_min=40_000)) is None
