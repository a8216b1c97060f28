"""One finished playbook session shared by the agent and report tests (session-scoped: a session runs real
jobs, so the whole suite runs it once).

It is also the resume test's session: the agent is SIGKILLed while the incumbent's calibration job
runs, resumed from its graph checkpoint, SIGKILLed again while the SFT arm trains, its checkpoint
file deleted, and resumed from the notebook alone to its nomination.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from memory.notebook import Notebook, NotebookError
from tools.jobs import zygote

sys.path.insert(0, str(Path(__file__).parent / "agent"))
from labkit import make_lab  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SESSION = "s1"
BUDGET = "5gpuh"
DEADLINE_S = 1800


# `make test` runs four pytest-xdist workers (`-n 4 --dist loadgroup`). A work unit's tests run on one
# worker, so a session fixture too costly to build twice must keep its tests in one unit, and so must
# every Slurm test: the loopback cluster is one node, and one of them stops and restarts it. Any other
# test stays with its file, so module fixtures (a whole session, in places) are built once as well.
# xdist 3.8's own `xdist_group` marks do nothing on pytest 9.2 (pytest-xdist issue 1386), hence this
# scheduler; the units come from the test ids (any id naming Slurm joins its unit: a few unmarked ones do,
# at no cost), and collection checks that every test sits in the unit it needs.
FINISHED_FILES = {"tests/agent/test_session.py", "tests/agent/test_replay.py", "tests/memory/test_report.py",
                  "tests/hostile/test_chain_coverage.py", "tests/hostile/test_planner_view.py",
                  "tests/test_bench_gpu_session.py"}
WORLD_FILES = {"tests/test_decision_quality.py"}  # besides tests/world/: modules that call session_world()
# Files of whole sessions on the test world that form units of their own rather than make the toy_world unit longer
# than the rest of the suite: the world itself is built once per run, by whichever worker asks first
# (tools/world/testing.session_world).
OWN_WORLD_FILES = {"tests/world/test_variants.py": "variants", "tests/world/test_reserve_session.py": "reserve_session",
                   "tests/hostile/test_crash_resume.py": "crash_resume",
                   "tests/hostile/test_checkpoint_trust.py": "checkpoint_trust",
                   "tests/world/test_gpu_world.py": "gpu_world"}
# Longest units first (longest processing time first): the workers then end on short units and finish
# together. The three shared units lead; the files after them took 40-130 s each in a clean-clone run at
# load 4-8 (tests ran in collection order before, and test_distributed.py's ~110 s came last). A unit not
# named here keeps its collection order after these.
HEAVY_FIRST = ("finished", "slurm", "toy_world", "variants", "crash_resume", "checkpoint_trust", "reserve_session",
               "tests/ownlab/test_own_lab.py",
               *(f"tests/ownlab/test_own_recipes.py::test_each_recipe_runs_to_a_checked_nomination_on_the_own_lab[{r}]"
                 for r in ("aspen", "islet", "delta", "brook", "ember")),
               "tests/hostile/test_lab_sessions.py", "tests/trainers/test_distributed.py", "tests/test_bench_scaling.py",
               "tests/tools/test_bundle.py", "tests/tools/test_launcher.py", "tests/test_entry_points.py",
               "tests/agent/test_failures_session.py", "tests/tools/test_launcher_attach.py", "tests/test_pipeline.py",
               "tests/tools/test_builders.py", "tests/agent/test_llm_planner.py")


# Parametrized whole sessions that share nothing but a lab built in seconds: each case is a unit of its own, so the
# cases spread over the workers instead of queueing on one (the own lab's five recipes took 330-410 s in one unit).
SPREAD_FILES = {"tests/ownlab/test_own_recipes.py"}


def work_unit(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    if "slurm" in nodeid:
        return "slurm"
    if path in SPREAD_FILES:
        return nodeid
    if path in FINISHED_FILES:
        return "finished"
    if path in OWN_WORLD_FILES:
        return OWN_WORLD_FILES[path]
    if path.startswith("tests/world/") or path in WORLD_FILES:
        return "toy_world"
    return path


def _needed_unit(item: pytest.Item) -> str | None:
    if item.get_closest_marker("slurm"):
        return "slurm"
    if "finished" in item.fixturenames:
        return "finished"
    module = getattr(item, "module", None)  # a test function's module; doctests have none
    path = item.nodeid.split("::", 1)[0]
    if path in OWN_WORLD_FILES:
        return OWN_WORLD_FILES[path]
    if "toy_world" in item.fixturenames or (module is not None and "session_world" in vars(module)):
        return "toy_world"
    return None


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Units(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return Units(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    wrong = [f"  {item.nodeid} needs unit {need!r}, work_unit() gives {work_unit(item.nodeid)!r}"
             for item in items if (need := _needed_unit(item)) and work_unit(item.nodeid) != need]
    if wrong:
        raise pytest.UsageError("tests/conftest.py: work_unit() must put these tests in the unit they need "
                                "(add the file to FINISHED_FILES, or name it after what it needs):\n" + "\n".join(wrong))
    if getattr(config.option, "loadgroup", False):  # an xdist worker: the costliest units first (a stable sort)
        items.sort(key=lambda item: HEAVY_FIRST.index(u) if (u := work_unit(item.nodeid)) in HEAVY_FIRST
                   else len(HEAVY_FIRST))


@pytest.fixture(scope="session", autouse=True)
def _one_thread_per_process():
    """One intra-op thread in this process and in every process the tests start (agents, their jobs,
    on Slurm too: sbatch passes the environment on). The models are tiny, and on the shared 2-core
    machine two OpenMP threads per process mostly spin: the labkit parent's 40 SFT steps took 52 s of
    CPU with two threads and 4.8 s with one, at load 15."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        yield
        torch.set_num_threads(before)


@pytest.fixture(scope="session", autouse=True)
def _own_zygotes(tmp_path_factory: pytest.TempPathFactory, _one_thread_per_process):
    """Local jobs (agents' too: they inherit the variable) fork from zygotes of this test process's own
    directory (tools/jobs/zygote.py), stopped when the tests end: none outlives the suite, and none is
    shared with a developer's session.

    On an xdist worker (`make test`: every worker runs jobs) the zygote for this process's environment
    starts here, importing in the background while the first tests run, so that the worker's first job
    does not wait 10-17 s for it; agents and the tests' own launchers pass the same environment, so the
    same zygote serves them. A plain `pytest tests/x.py` starts none until a job needs one."""
    folder = tmp_path_factory.mktemp("zygote")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("POSTLAB_ZYGOTE_DIR", str(folder))
        if os.environ.get("PYTEST_XDIST_WORKER"):
            zygote.Zygote(folder).prepare(os.environ)
        yield folder
    zygote.stop(folder)


@dataclass
class Finished:
    lab: Path
    session: str
    kills: dict[str, str]  # job kind -> the key of the job in flight when the agent alone was killed
    logs: list[str]


def agent(log: Path, *args: str) -> subprocess.Popen:
    # A log file, not a pipe: the jobs the agent started inherit its stdout and outlive a SIGKILL.
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, str(REPO / "run_agent.py"), *args], cwd=REPO, stdout=out,
                                stderr=subprocess.STDOUT)


def _job_in_flight(lab: Path, kind: str) -> str | None:
    """The key of a job of `kind` pending or running now."""
    try:
        with Notebook.open(lab / "notebook.db", readonly=True) as nb:
            live = [j.key for j in nb.jobs(session=SESSION) if j.kind == kind and j.state in ("pending", "running")]
    except NotebookError:  # not there yet, or still being created by the agent
        return None
    return live[0] if live else None


def kill_when(proc: subprocess.Popen, log: Path, lab: Path, kind: str) -> tuple[str, str]:
    """SIGKILL the agent (only the agent: its jobs live on) once a job of `kind` is in flight; its log and the key
    of the job it left running."""
    deadline = time.monotonic() + DEADLINE_S
    while (key := _job_in_flight(lab, kind)) is None:
        if proc.poll() is not None:
            raise AssertionError(f"agent ended before a {kind} job started:\n{log.read_text()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"no {kind} job after {DEADLINE_S} s")
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    return log.read_text(), key


# Where `finished` kills the agent alone, in the order its session reaches them: calibration's eval job, the first
# training arm, the nomination's bundle job (this lab's calibration has no reference job: the alone-kill there is
# tests/hostile/test_checkpoint_trust.py's; tests/hostile/test_crash_resume.py kills the whole group at all four).
AGENT_KILLS = ("eval", "sft", "bundle")


@pytest.fixture(scope="session")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Finished:
    """One session on the tiny lab, its agent SIGKILLed alone at each of AGENT_KILLS and resumed each time (the jobs it
    left run on and are attached again); before the resume after the training kill graph.sqlite is removed, so that
    resume rebuilds the step from the notebook alone."""
    root = tmp_path_factory.mktemp("agent")
    lab, logs, killed = make_lab(root / "lab"), [], {}
    argv = ["--budget", BUDGET, "--lab", str(lab), "--session", SESSION, "--protocol", "test", "--quiet"]
    for n, kind in enumerate(AGENT_KILLS):
        log = root / f"run{n}.log"
        logs_n, killed[kind] = kill_when(agent(log, *argv), log, lab, kind)
        logs.append(logs_n)
        argv = ["resume", SESSION, "--lab", str(lab), "--quiet"]
        if kind == "sft":
            (lab / "graph.sqlite").unlink()
    last_log = root / "last.log"
    last = agent(last_log, *argv)
    last.wait(timeout=DEADLINE_S)
    logs.append(last_log.read_text())
    assert last.returncode == 0, logs[-1]
    return Finished(lab=lab, session=SESSION, kills=killed, logs=logs)
