"""The local jobs' fork server (tools/jobs/zygote.py), with real processes: a zygote daemon, its clients as
submitit starts them, and the jobs they fork. The zygotes here preload only the probe's modules (a
second to start, not the ~13 CPU-s of the real list); the launcher's own tests run with the full one.

The job of the client-level tests is a small module on PYTHONPATH (so the zygote and every client
share it, and the zygote's key): it prints its pid and parent's pid, then sleeps, exits or waits
for a signal as told."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from core.bounded import Phase, run_phases
from memory.notebook import Notebook
from tools.jobs import zygote as zy
from tools.jobs.executor import ExecutorSection, SlurmSection
from tools.jobs.jobrun import RunPaths, read_events
from tools.jobs.launcher import Launcher, LocalBackend, Resources, SlurmBackend, local_zygote, make_backend
from tools.jobs.probe import CountConfig, count

PRELOAD = ("submitit.core._submit", "tools.jobs.jobrun", "tools.jobs.probe", "zyjob_dep")
JOB = """
import os, signal, sys, time
import zyjob_dep
print(os.getpid(), os.getppid(), flush=True)
if sys.argv[1] == "started":
    from tools.jobs.jobrun import process_started_at
    print(process_started_at(), flush=True)
    sys.exit(len(sys.stdin.readline()))
if sys.argv[1] == "exit":
    sys.exit(int(sys.argv[2]))
if sys.argv[1] == "limits":
    import json, resource
    print(json.dumps({"cpu": resource.getrlimit(resource.RLIMIT_CPU), "ppid": os.getppid()}), flush=True)
    sys.exit(0)
if sys.argv[1] == "spin":
    while True:
        pass
if sys.argv[1] == "usr2":
    signal.signal(signal.SIGUSR2, lambda *_: (print("got USR2", flush=True), sys.exit(3)))
time.sleep(60)
"""


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "zyjob.py").write_text(JOB)
    (mods / "zyjob_dep.py").write_text("VERSION = 1\n")
    (mods / "zyslow.py").write_text("import time\ntime.sleep(3)  # a slow import: the zygote is still starting\n")
    path = [str(mods), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


@pytest.fixture
def zygote(tmp_path_factory: pytest.TempPathFactory, env: dict[str, str]):
    handle = zy.Zygote(tmp_path_factory.mktemp("zy"), preload=PRELOAD, idle_s=60)
    yield handle
    zy.stop(handle.folder)
    assert zy.running(handle.folder) == []


def client(zygote: zy.Zygote, env: dict[str, str], *args: str) -> subprocess.Popen:
    """A task process as submitit's controller starts it: the launcher's prefix, then python's arguments."""
    prefix = zygote.prepare(env)
    assert prefix is not None
    return subprocess.Popen([*prefix.split(), "-u", "-m", *args], env=env, stdout=subprocess.PIPE, text=True)


def pids(proc: subprocess.Popen) -> tuple[int, int]:
    """The job's pid and its parent's, as it printed them."""
    pid, ppid = proc.stdout.readline().split()
    return int(pid), int(ppid)


def gone(pid: int, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not zy.alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_a_job_forks_from_the_zygote_and_ends_with_its_status(zygote: zy.Zygote, env: dict[str, str]) -> None:
    server = zygote.wait(env)
    proc = client(zygote, env, "zyjob", "exit", "7")
    pid, ppid = pids(proc)
    assert proc.wait(timeout=30) == 7
    assert ppid == server and pid not in (server, proc.pid)  # forked by the zygote, not the zygote itself


def test_a_job_starts_when_its_client_did(zygote: zy.Zygote, env: dict[str, str]) -> None:
    # The executor's time limit and the ledger's wall time count from the task process it started.
    zygote.wait(env)
    prefix = zygote.prepare(env)
    proc = subprocess.Popen([*prefix.split(), "-u", "-m", "zyjob", "started"], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    pids(proc)
    started = float(proc.stdout.readline())
    ticks = int(Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    client_started = time.time() - float(Path("/proc/uptime").read_text().split()[0]) + ticks / os.sysconf("SC_CLK_TCK")
    proc.communicate("\n", timeout=30)
    assert proc.returncode == 1  # the job read the line from the client's stdin
    assert started == pytest.approx(client_started, abs=0.03)


def test_signals_reach_the_job_and_its_end_is_the_clients(zygote: zy.Zygote, env: dict[str, str]) -> None:
    server = zygote.wait(env)
    proc = client(zygote, env, "zyjob", "usr2")
    assert pids(proc)[1] == server
    time.sleep(0.5)  # the job sets its handler right after printing
    proc.send_signal(signal.SIGUSR2)  # what submitit's controller sends before the time limit
    assert proc.stdout.readline().strip() == "got USR2"
    assert proc.wait(timeout=30) == 3
    proc = client(zygote, env, "zyjob", "sleep")
    pid, _ = pids(proc)
    proc.send_signal(signal.SIGTERM)  # no handler: the job dies of it, and so does the client
    assert proc.wait(timeout=30) == -signal.SIGTERM
    assert gone(pid)


def test_a_killed_client_takes_its_job_with_it(zygote: zy.Zygote, env: dict[str, str]) -> None:
    zygote.wait(env)
    proc = client(zygote, env, "zyjob", "sleep")
    pid, _ = pids(proc)
    proc.kill()  # the controller's SIGKILL at the time limit, or a cancel
    proc.wait(timeout=30)
    assert gone(pid)


def test_a_dead_zygote_means_a_plain_python(zygote: zy.Zygote, env: dict[str, str]) -> None:
    server = zygote.wait(env)
    running = client(zygote, env, "zyjob", "sleep")
    job, _ = pids(running)
    os.kill(server, signal.SIGKILL)  # its socket file stays behind, with no one listening
    assert running.wait(timeout=30) == 1 and gone(job)  # the client kills the orphan and fails
    zygote.started[str(zygote.socket(env))] = time.monotonic()  # keep prepare() from starting a new one
    proc = client(zygote, env, "zyjob", "exit", "0")
    assert pids(proc) == (proc.pid, os.getpid())  # the client exec'd python itself
    assert proc.wait(timeout=60) == 0


def test_an_environment_the_zygote_did_not_import_with_is_refused(zygote: zy.Zygote, env: dict[str, str]) -> None:
    zygote.wait(env)
    prefix = zygote.prepare(env)
    other = {**env, "HF_HUB_OFFLINE": "0" if env.get("HF_HUB_OFFLINE") == "1" else "1"}
    proc = subprocess.Popen([*prefix.split(), "-u", "-m", "zyjob", "exit", "0"], env=other,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert pids(proc)[0] == proc.pid
    assert proc.wait(timeout=60) == 0
    assert "environment differs from the zygote's in HF_HUB_OFFLINE" in proc.stderr.read()


def test_edited_source_is_never_served_stale(zygote: zy.Zygote, env: dict[str, str], tmp_path: Path) -> None:
    first = zygote.wait(env)
    dep = tmp_path / "mods" / "zyjob_dep.py"
    dep.write_text("VERSION = 2  # edited after the zygote imported it\n")
    proc = client(zygote, env, "zyjob", "exit", "0")
    assert pids(proc)[0] == proc.pid  # refused: run by a fresh python, which imports the edited file
    assert proc.wait(timeout=60) == 0
    deadline = time.monotonic() + 30
    while zy.running(zygote.folder) == [first] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert first not in zy.running(zygote.folder)  # the stale zygote stopped listening
    zygote.started.clear()
    second = zygote.wait(env)  # the next submission's zygote imports the edited file
    assert second != first
    proc = client(zygote, env, "zyjob", "exit", "0")
    assert pids(proc)[1] == second
    assert proc.wait(timeout=30) == 0


def test_an_idle_zygote_exits(tmp_path_factory: pytest.TempPathFactory, env: dict[str, str]) -> None:
    handle = zy.Zygote(tmp_path_factory.mktemp("zy"), preload=PRELOAD, idle_s=1)
    server = handle.wait(env)
    assert gone(server, timeout_s=30)
    assert not handle.socket(env).exists()


def test_a_launcher_job_through_the_zygote_gives_the_result_of_a_plain_one(
        zygote: zy.Zygote, env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)  # the zygote's key is the launcher's environment
    server = zygote.wait(env)
    results = {}
    for name, backend in (("zygote", LocalBackend(zygote=zygote)), ("plain", LocalBackend())):
        nb = Notebook.open(tmp_path / f"{name}.db")
        nb.open_session("s", lab=str(tmp_path), budget_gpuh=10, reserve_gpuh=0, planner="playbook",
                        executor="local", config={})
        launcher = Launcher(nb, "s", backend, tmp_path / f"jobs-{name}", poll_s=0.1)
        config = CountConfig(steps=3, step_seconds=0.05, output_dir=tmp_path / f"out-{name}")
        job = launcher.submit("probe", count, config, Resources(time_limit_min=2, signal_delay_s=10))
        results[name] = job.result(timeout_s=120)
        record = job.record
        assert record.state == "completed"
        events = read_events(RunPaths(Path(record.folder), record.external_id).events)
        results[name + "_pid"] = events[0]["pid"]
        nb.close()
    assert results["zygote"] == results["plain"]
    log = handle_log(zygote, env)
    assert f"job {results['zygote_pid']}: -u -m submitit.core._submit" in log and results["zygote_pid"] != server
    assert f"job {results['plain_pid']}:" not in log


def handle_log(zygote: zy.Zygote, env: dict[str, str]) -> str:
    return zygote.socket(env).with_suffix(".log").read_text()


def test_the_client_imports_nothing_heavy() -> None:
    code = "import json, sys, runpy; runpy.run_path(sys.argv[1]); print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-P", "-c", code, zy.__file__], capture_output=True, text=True, check=True)
    loaded = json.loads(out.stdout)
    assert not [m for m in loaded if m.split(".")[0] in {"torch", "transformers", "pydantic", "submitit", "tools"}]


def test_lab_toml_and_the_environment_turn_it_off() -> None:
    local = ExecutorSection(kind="local")
    assert local_zygote(local, {"POSTLAB_ZYGOTE_DIR": "/tmp/zy"}).folder == Path("/tmp/zy")
    assert local_zygote(local, {}).folder == Path(f"/tmp/postlab-zygote-{os.getuid()}")
    assert local_zygote(local, {"POSTLAB_ZYGOTE": "0"}) is None
    assert local_zygote(ExecutorSection(kind="local", zygote=False), {}) is None


def test_slurm_tasks_fork_from_a_zygote_only_when_the_lab_says_so(tmp_path: Path, env: dict[str, str],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POSTLAB_ZYGOTE_DIR", str(tmp_path / "zy"))
    monkeypatch.delenv("POSTLAB_ZYGOTE", raising=False)
    slurm = SlurmSection(partition="debug")
    assert make_backend(ExecutorSection(kind="slurm", slurm=slurm)).zygote is None  # no torch on a login node
    on = ExecutorSection(kind="slurm", slurm=slurm.model_copy(update={"zygote": True}))
    assert make_backend(on).zygote.folder == tmp_path / "zy"
    monkeypatch.setenv("POSTLAB_ZYGOTE", "0")
    assert make_backend(on).zygote is None
    # sbatch's tasks run the client, told the job's time limit (Slurm does not tell them) for their wait.
    monkeypatch.setenv("PYTHONPATH", env["PYTHONPATH"])  # where the probe's preloaded modules lie
    backend = SlurmBackend("debug", zygote=zy.Zygote(tmp_path / "own", preload=PRELOAD, idle_s=60))
    try:
        ex = backend.executor(tmp_path / "jobs", "eval", Resources(time_limit_min=7))
        assert str(backend.zygote.socket(os.environ)) in ex.python and "tools/jobs/zygote.py" in ex.python
        assert ex.parameters["setup"] == [f"export {zy.TIME_LIMIT_VAR}=420"]
    finally:
        zy.stop(backend.zygote.folder)


@pytest.mark.parametrize(("limit_var", "limit_s", "served"), [("SUBMITIT_LOCAL_TIMEOUT_S", 600, True),
                                                              ("SUBMITIT_LOCAL_TIMEOUT_S", 5, False),
                                                              (zy.TIME_LIMIT_VAR, 600, True)])
def test_a_client_waits_for_a_starting_zygote_within_a_share_of_its_limit(
        tmp_path_factory: pytest.TempPathFactory, env: dict[str, str], limit_var: str, limit_s: int,
        served: bool) -> None:
    handle = zy.Zygote(tmp_path_factory.mktemp("zy"), preload=(*PRELOAD, "zyslow"), idle_s=60)
    try:
        job_env = {**env, limit_var: str(limit_s)}  # as submitit's local controller, or an sbatch script, sets it
        proc = client(handle, job_env, "zyjob", "exit", "0")  # at once: the zygote is importing for 3 s
        pid, ppid = pids(proc)
        assert proc.wait(timeout=60) == 0
        assert (ppid in zy.running(handle.folder)) is served and (pid == proc.pid) is not served
    finally:
        zy.stop(handle.folder)


def test_a_bounded_child_forks_from_a_listening_zygote_under_the_limits_set_before_exec(
        zygote: zy.Zygote, env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """check-bundle's bounded child (core/bounded.py) runs through the zygote that listens for its environment, and
    keeps the CPU bound its client was given before exec: a forked process starts with no CPU time used."""
    monkeypatch.setenv("PYTHONPATH", env["PYTHONPATH"])
    assert zygote.listening(os.environ) is None  # none listening: a plain python, none started
    assert zy.running(zygote.folder) == []
    server = zygote.wait(env)
    prefix = zygote.listening(os.environ)
    assert prefix is not None
    assert zy.listening_prefix({**os.environ, "POSTLAB_ZYGOTE_DIR": str(zygote.folder), "POSTLAB_ZYGOTE": "0"}) is None
    [out] = run_phases("zyjob", ["limits"], [Phase(3, 30)], marked=False, python=prefix)
    assert isinstance(out, dict), out
    assert out["ppid"] == server and out["cpu"] == [3, 3]
    started = time.monotonic()
    [spun] = run_phases("zyjob", ["spin"], [Phase(1, 30)], marked=False, python=prefix)
    assert spun == "stopped by its limits (1 s of CPU)" and time.monotonic() - started < 20
    assert "zyjob spin" in handle_log(zygote, env)
