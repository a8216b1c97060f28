"""The local backend: submitit's LocalExecutor, real subprocesses on this machine that outlive the agent, observed
through the job wrapper's events (tools/jobs/jobrun.py) and /proc."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path
from typing import Any, Literal

import submitit
from pydantic import BaseModel

from tools.jobs.jobrun import Resumable, RunPaths, read_events
from tools.jobs.resources import NO_SUBMITIT_LIMIT, Charge, Resources, Run, measured
from tools.jobs.zygote import Zygote

_SLACK_S = 5.0  # seconds: a killed local run this close to its limit was stopped by the limit


class LocalBackend:
    """submitit's LocalExecutor: real subprocesses on this machine, which outlive the agent.

    `simulated_gpuh_per_device_s` (the toy world's cost model): each run is charged its measured
    device-seconds times this factor, and marked simulated; None charges measured GPU-hours.
    `zygote`: each task forks from a warm server that has torch, transformers and the job modules
    imported already (tools/jobs/zygote.py), falling back to a plain python whenever it cannot; None: plain."""

    name: Literal["local"] = "local"

    def __init__(self, simulated_gpuh_per_device_s: float | None = None, zygote: Zygote | None = None,
                 host_gpus: int = 0) -> None:
        self.simulated_gpuh_per_device_s = simulated_gpuh_per_device_s
        self.zygote = zygote
        self.host_gpus = host_gpus
        # Jobs this process submitted: their controllers are our children, polled (and reaped) through
        # submitit's LocalJob; a resumed agent reads the others' liveness from /proc.
        self._submitted: dict[str, submitit.local.local.LocalJob[Any]] = {}

    def executor(self, folder: Path, kind: str, resources: Resources) -> submitit.LocalExecutor:
        # The controller copies this environment to the tasks: the zygote is chosen for it.
        python = self.zygote.prepare(os.environ) if self.zygote is not None else None
        ex = submitit.LocalExecutor(folder=folder, max_num_timeout=NO_SUBMITIT_LIMIT, python=python)
        ex.update_parameters(timeout_min=resources.time_limit_min, gpus_per_node=resources.gpus or 0,
                             tasks_per_node=self.tasks(resources), signal_delay_s=resources.signal_delay_s)
        return ex

    def submit(self, folder: Path, kind: str, resources: Resources, wrapped: Resumable,
               args: BaseModel) -> submitit.Job[Any]:
        job = self.executor(folder, kind, resources).submit(wrapped, args)
        self._submitted[job.job_id] = job
        return job

    def worker_env(self) -> dict[str, str]:
        # torchrun's single-node rendezvous: loopback and a port free now (the workers bind it seconds later).
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}

    def _alive(self, job_id: str, folder: Path) -> bool:
        job = self._submitted.get(job_id)
        if job is None:
            return _controller_alive(int(job_id), folder)
        if job.get_info()["jobState"] == "RUNNING":  # polls the controller's process (and reaps it once exited)
            return True
        del self._submitted[job_id]
        return False

    def gpus(self, resources: Resources) -> int:
        return resources.gpus or 0

    def tasks(self, resources: Resources) -> int:
        return resources.tasks or max(1, resources.gpus or 0)

    def ranks(self, resources: Resources) -> int:
        return self.tasks(resources)  # one node: a lab config with nodes > 1 is Slurm's only

    def devices(self, resources: Resources) -> int:
        # The local machine's CPU processes are its devices when it has no GPU (the toy world's cost model); on a
        # host with GPUs a CPU job (a merge, a dataset build) holds none and is charged none, as on Slurm.
        if resources.gpus:
            return resources.gpus
        return 0 if self.host_gpus else self.tasks(resources)

    def charge(self, device_seconds: float) -> Charge:
        if self.simulated_gpuh_per_device_s is None:
            return measured(device_seconds)
        return Charge(device_seconds=device_seconds, gpu_hours=device_seconds * self.simulated_gpuh_per_device_s,
                      charge="simulated")

    def job(self, folder: Path, job_id: str, task: int) -> submitit.Job[Any]:
        return submitit.local.local.LocalJob(folder=folder, job_id=job_id, tasks=(task,))

    def runs(self, job_id: str, folder: Path, resources: Resources) -> list[Run]:
        devices, paths = self.devices(resources), RunPaths(folder, job_id)
        # Liveness before the events: a worker that ends between the two reads then still counts as
        # alive for this poll, instead of as killed mid-run with its end event unread.
        alive = self._alive(job_id, folder)
        runs, start = _runs_from_events(read_events(paths.events), devices)
        if alive:
            if start is not None:
                runs.append(Run(state="RUNNING", started=start, ended=None, elapsed_s=time.time() - start,
                                devices=devices, exit_code=None))
            elif runs:
                # The function returned but the worker is still writing its result: not over yet.
                runs[-1] = runs[-1].model_copy(update={"state": "RUNNING"})
            else:
                runs.append(Run(state="PENDING", started=None, ended=None, elapsed_s=0.0, devices=devices,
                                exit_code=None))
        elif start is not None:  # killed from outside mid-run (cancel, time limit, OOM killer)
            end = _last_write(folder, job_id)
            runs.append(Run(state=self._death_state(paths, end - start, resources), started=start,
                            ended=end, elapsed_s=end - start, devices=devices, exit_code=None))
        elif not runs:  # died before the function started
            runs.append(Run(state=self._death_state(paths, 0.0, resources), started=None, ended=None,
                            elapsed_s=0.0, devices=devices, exit_code=None))
        elif runs[-1].state == "FAILED" and not paths.result_pickle.exists():
            # Interrupted from outside (a cancel, or the controller's kill at the time limit): the
            # function logged its end as a failure but the worker never got to pickle an outcome.
            state = self._death_state(paths, runs[-1].elapsed_s, resources)
            runs[-1] = runs[-1].model_copy(update={"state": state})
        return runs

    def _death_state(self, paths: RunPaths, elapsed_s: float, resources: Resources) -> str:
        if paths.cancelled.exists():
            return "CANCELLED"
        if elapsed_s >= resources.time_limit_min * 60 - _SLACK_S:
            return "TIMEOUT"
        return "FAILED"

    def unfit(self, resources: Resources) -> str | None:
        return None  # this host runs what it is given (a job on GPUs it lacks fails as no_gpu)

    def pending_reason(self, job_id: str) -> str:
        return ""

    def cancel(self, job_id: str, folder: Path) -> None:
        # The marker tells any later observer (also a resumed agent) that the end was a cancel.
        RunPaths(folder, job_id).cancelled.touch()
        if not self._alive(job_id, folder):
            return
        if not _ignores_sigint(int(job_id)):
            # submitit's local controller stops its tasks on SIGINT (SIGINT, then SIGKILL after 1 s).
            os.kill(int(job_id), signal.SIGINT)
            return
        # An agent started in the background of a script ignores SIGINT, and so do the controllers
        # it spawns: stop the workers instead; the controller then sees them gone and exits.
        for pid in _children(int(job_id)):
            os.kill(pid, signal.SIGKILL)

    def stop_strays(self, folder: Path) -> list[int]:
        """Kill (SIGKILL) every process still using `folder`: a controller started there, its tasks, or a task
        the zygote forked for it (each holds its log files open). Called before an attempt recorded but never
        submitted is submitted: an agent killed between the controller's start and submitit's writing of the
        job's pickle leaves that controller running, its task waiting 60 s for a pickle that never comes and then
        writing a traceback into the folder, after the attempt ran again there. Returns the pids killed; waits
        until none is left (RuntimeError past _STRAY_WAIT_S)."""
        deadline, killed = time.monotonic() + _STRAY_WAIT_S, set()
        while strays := _using(folder) - {os.getpid()}:
            if time.monotonic() > deadline:
                raise RuntimeError(f"processes {sorted(strays)} still use {folder} {_STRAY_WAIT_S:.0f} s after SIGKILL")
            for pid in strays - killed:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):  # gone meanwhile, or not ours to stop
                    pass
            killed |= strays
            time.sleep(0.05)
        return sorted(killed)


_STRAY_WAIT_S = 10.0
# What a job's processes run: submitit's local controller, its task, or a task forked by the zygote (whose command
# line stays the zygote server's). A bystander (a `tail -f` on a job's log) runs none of them and is left alone.
_JOB_PROCESSES = ("submitit.local._local", "submitit.core._submit", "tools.jobs.zygote")


def _stat_fields(stat: str) -> list[str]:
    """/proc/PID/stat's fields after the command name (state first): the name may hold spaces and parentheses."""
    return stat.rsplit(")", 1)[1].split()


def _using(folder: Path) -> set[int]:
    """Live job processes (not zombies; see _JOB_PROCESSES) that name `folder` or a path under it on their command
    line, or hold a file under it open."""
    roots, found = {str(folder.absolute()), str(folder.resolve())}, set()

    def inside(path: str) -> bool:
        return any(path == root or path.startswith(root + "/") for root in roots)

    for proc in Path("/proc").glob("[0-9]*"):
        try:
            args = [a.decode(errors="replace") for a in (proc / "cmdline").read_bytes().split(b"\0")]
            if not any(m in args for m in _JOB_PROCESSES) or _stat_fields((proc / "stat").read_text())[0] == "Z":
                continue
            if any(inside(a) for a in args) or any(inside(os.readlink(fd)) for fd in (proc / "fd").iterdir()):
                found.add(int(proc.name))
        except (FileNotFoundError, ProcessLookupError, PermissionError, NotADirectoryError):  # ended, or not ours
            continue
    return found


def _runs_from_events(events: list[dict[str, Any]], devices: int) -> tuple[list[Run], float | None]:
    """Closed runs from the wrapper's events, and the start time of a run left open (or None)."""
    runs, start = [], None
    for e in events:
        if e["event"] == "start":
            start = e["t"]
        elif start is not None:
            state = "COMPLETED" if e.get("ok") else "FAILED"
            runs.append(Run(state=state, started=start, ended=e["t"], elapsed_s=e["t"] - start,
                            devices=devices, exit_code=None))
            start = None
    return runs, start


_CMDLINE_WAIT_S = 2.0  # how long an empty /proc cmdline (a process mid-exec) is read again


def _controller_alive(pid: int, folder: Path) -> bool:
    """Whether `pid` is a live submitit local controller of `folder` (not a reused pid, not a zombie).

    Read from /proc, for controllers another (killed) agent started. The launcher's own children are
    polled through their LocalJob instead: right after the fork a child's cmdline is still its parent's."""
    deadline = time.monotonic() + _CMDLINE_WAIT_S
    while True:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (FileNotFoundError, ProcessLookupError):
            return False
        if _stat_fields(stat)[0] == "Z":
            return False
        # A process in the middle of its exec reads an empty cmdline for a moment (seen under load right after
        # the Popen that started it returned): read again rather than call a starting controller dead.
        if cmdline or time.monotonic() >= deadline:
            return "submitit.local._local" in cmdline and str(folder) in cmdline
        time.sleep(0.01)


def _ignores_sigint(pid: int) -> bool:
    """Whether process `pid` ignores SIGINT (bit 1 of SigIgn in /proc/<pid>/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return bool(int(line.split()[1], 16) >> (signal.SIGINT - 1) & 1)
    raise RuntimeError(f"/proc/{pid}/status has no SigIgn line")


def _children(pid: int) -> list[int]:
    """Live child processes of `pid` (the local controller's workers)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = _stat_fields(stat.read_text())
        except (FileNotFoundError, ProcessLookupError):  # exited while we looked
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            children.append(int(stat.parent.name))
    return children


def _last_write(folder: Path, job_id: str) -> float:
    """When a killed local run last wrote anything (its heartbeat included): its end, to within
    tools.jobs.jobrun.HEARTBEAT_S."""
    return max((p.stat().st_mtime for p in folder.glob(f"{job_id}_*")), default=time.time())
