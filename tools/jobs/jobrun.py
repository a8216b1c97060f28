"""What runs on the worker around every job function: the `Resumable` wrapper and its events file.

Kept apart from tools/jobs/launcher.py so that a worker unpickling a job imports only submitit and this
module (the launcher's notebook imports cost about a second per job start).

Each run of a job appends to `<job folder>/<job id>_events.jsonl`: `start` (time, pid), then
`end` (time, ok). The launcher turns these into attempt rows and local wall-time costs.

A job is never requeued in place from the worker: on the preemption/timeout signal the wrapper
ends the run with a 'preempted:' or 'timeout:' error, and the launcher, which holds the ledger,
decides whether a new run is admitted against what is left of the budget (tools/jobs/launcher.py). A run's start is its worker process's
start, not the moment the job function is reached: the executor's time limit counts from there,
and imports take seconds on a loaded machine (Linux: read from /proc). In a job of several tasks
(one process per GPU) rank 0 writes the events: all ranks start and stop together.

Before the job function runs, the wrapper exports the torch.distributed rendezvous (RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT; read from submitit's job
environment, torchrun-style) and turns off NVLink multicast/NVLS (NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1) and Hub kernels (USE_HUB_KERNELS=0: no kernel code is
fetched from the Hub and run inside a job; core/loading.py), so a trainer only calls
`torch.distributed.init_process_group()`.

A local job runs beside its warden (tools/jobs/warden.py, one per task): its resident memory is bounded by
`[executor.resources.<kind>] mem_gb`, else LOCAL_MEMORY_SHARE of the host's memory (split between its tasks); a
SIGTERM ends it within TERM_GRACE_S (submitit's own handler ignores SIGTERM: a job once outlived its agent's end
at 17 GB); and once its controller or the agent above it is gone, it ends at its time limit. Each end is recorded
in the events file with its class and reason. Slurm's jobs are bounded by Slurm (--mem's cgroup, --time).

A model job placed on the CPU runs with CUDA_VISIBLE_DEVICES empty (on the CPU, wherever it lands); one placed
on CUDA that finds no usable GPU fails at once with a `no_gpu:` error (tools/jobs/failures.py: class no_gpu). A single-process function (`every_rank=False`: merges,
data, bundle jobs) runs on rank 0 only, the other ranks return at once.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import submitit
from pydantic import BaseModel
from submitit.core.utils import JobPaths

from core.placement import require_device
from core.versions import installed
from core.wall import completed
from tools.jobs.executor import host_memory_gb
from tools.jobs.failures import PREEMPTED_PREFIX, exception_type, raised_failure, safe_message

HEARTBEAT_S = 1.0  # seconds between touches of a local run's heartbeat file
# NVLink multicast (NCCL's NVLS, PyTorch's symmetric-memory multicast, NVSHMEM's NVLS) is off in every
# job: on GPU hosts shared with others, a program that uses it can put the host's GPUs out of service
# (the project's GPU machines require these settings). Exported on the worker itself, whatever
# environment the executor passed on.
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# No kernel code from the Hub in any job: transformers (5.25 on) reads this at every load and at every lazy kernel
# lookup, which the loader's `use_kernels=False` alone does not reach (core/loading.py).
NO_HUB_CODE_ENV = {"USE_HUB_KERNELS": "0"}
# A local job without `mem_gb` may hold this share of the host's memory (its tasks together): the agent, the
# zygote and the system keep the rest.
LOCAL_MEMORY_SHARE = 0.8
# Seconds a local job has, after a SIGTERM, to end before its warden kills it.
TERM_GRACE_S = 30.0
WARDEN = Path(__file__).with_name("warden.py")


class RunPaths(JobPaths):
    """submitit's paths of one job (`JobPaths`), plus the files the wrapper and the launcher add."""

    @property
    def events(self) -> Path:
        return self.folder / f"{self.job_id}_events.jsonl"

    @property
    def heartbeat(self) -> Path:
        return self.folder / f"{self.job_id}_heartbeat"

    @property
    def cancelled(self) -> Path:
        """Marker the launcher writes before cancelling, so that any later observer reads a cancel."""
        return self.folder / f"{self.job_id}_cancelled"


class RunInterrupted(Exception):
    """Raised inside a job when the preemption/timeout signal arrives: the run ends here."""


class Resumable(submitit.helpers.Checkpointable):
    """Runs `fn(config)` and logs each run to `<job folder>/<job id>_events.jsonl`.

    On the checkpoint signal it decides whether this is a timeout (the run is near its time
    limit) or a preemption and ends the run with that reason. It never requeues itself: a requeue
    costs a new run, which only the launcher can admit against the budget (a job function that
    keeps its state in its output directory resumes from it when the launcher submits it again).
    """

    memory_gb: int | None = None  # a wrapper pickled before the bound existed: the host's share
    term_grace_s: float = TERM_GRACE_S

    def __init__(self, fn: Callable[[Any], Any], time_limit_s: float, signal_delay_s: float,
                 env: dict[str, str] | None = None, device: str | None = None, every_rank: bool = True,
                 memory_gb: int | None = None, term_grace_s: float = TERM_GRACE_S):
        self.fn, self.time_limit_s, self.signal_delay_s = fn, time_limit_s, signal_delay_s
        self.memory_gb = memory_gb  # local: the job's resident memory bound (all its tasks); None: a host share
        self.term_grace_s = term_grace_s  # local: seconds from a SIGTERM to the warden's SIGKILL
        self.env = dict(env or {})  # set on the worker before the rendezvous is read (local: MASTER_ADDR/PORT)
        self.device = device  # where the job's model runs: cuda requires a usable GPU, cpu hides them; None: no model
        self.every_rank = every_rank  # False: a single-process function, which rank 0 alone runs
        self._started = 0.0

    def __call__(self, config: Any) -> Any:
        self._started = process_started_at()
        for name in ("MASTER_ADDR", "MASTER_PORT"):  # never a rendezvous inherited from the agent's environment
            os.environ.pop(name, None)
        os.environ.update({**self.env, **NO_MULTICAST_ENV, **NO_HUB_CODE_ENV})
        os.environ.update(distributed_env())
        if self.device == "cpu":
            # A CPU job stays on the CPU even on a GPU node whose devices Slurm does not fence off: CUDA reads
            # this when first initialised, which no job module does at import.
            os.environ["CUDA_VISIBLE_DEVICES"] = ""
        rank = submitit.JobEnvironment().global_rank
        if submitit.JobEnvironment().cluster == "local":
            start_warden(self.time_limit_s, self._started, self.memory_gb, self.term_grace_s)
        if rank != 0 and not self.every_rank:
            return None  # rank 0 runs the function once; the job's result is rank 0's
        if self.device == "cuda":
            require_device("cuda")  # before any model loads: never a quiet CPU run of a GPU job
        if rank != 0:
            return self.fn(config)
        _append_event({"event": "start", "t": self._started, "pid": os.getpid()})
        stop = threading.Event()
        if submitit.JobEnvironment().cluster == "local":
            threading.Thread(target=_heartbeat, args=(stop,), daemon=True).start()
        entered = time.time()
        try:
            result = self.fn(config)
        except BaseException as err:
            # The type and the class decided here, from the exception itself (tools/jobs/failures.py); its message,
            # which may carry input text, is kept for a person only: redacted, escaped and bounded (safe_message),
            # never read to decide anything (the job's stderr holds the whole trace).
            failure = raised_failure(err)
            _append_event({"event": "end", "t": time.time(), "ok": False, "error": exception_type(err),
                           "failure": None if failure is None else failure.model_dump(),
                           "message": safe_message(str(err))})
            raise
        finally:
            stop.set()
        returned = time.time()
        _append_event({"event": "end", "t": returned, "ok": True})
        return stamped(result, self._started, entered, returned)

    def checkpoint(self, config: Any) -> NoReturn:
        # Raised from submitit's signal handler into the job function: the run ends as a failure
        # whose message starts with the reason, which tools/jobs/failures.py classifies.
        elapsed = time.time() - self._started
        reason = "timeout" if near_time_limit(elapsed, self.time_limit_s, self.signal_delay_s) else "preempted"
        raise RunInterrupted(f"{reason}: after {elapsed:.0f} s of a {self.time_limit_s:.0f} s limit; "
                             "a new run needs the launcher's admission")


def start_warden(time_limit_s: float, started: float, memory_gb: int | None,
                 grace_s: float = TERM_GRACE_S) -> subprocess.Popen[bytes]:
    """Starts this local task's warden (tools/jobs/warden.py) and makes a SIGTERM end the task: the handler ends the
    run with a 'preempted:' error where Python gets to it, and the signal's number reaches the warden at once through
    the wakeup pipe, so a task busy in C code is killed after `grace_s` all the same."""
    env = submitit.JobEnvironment()
    share = memory_gb * 1024**3 if memory_gb else LOCAL_MEMORY_SHARE * host_memory_gb() * 1024**3
    bound = int(share / max(1, env.num_tasks))
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write)
    signal.signal(signal.SIGTERM, _terminated)
    watched = [f"{pid}:{start}" for pid, start in _ancestors(_task_pid(), 2)]
    warden = subprocess.Popen(
        [sys.executable, str(WARDEN), str(os.getpid()), str(bound), repr(started), repr(time_limit_s), repr(grace_s),
         str(_events_path()), str(read), *watched], pass_fds=(read,), stdin=subprocess.DEVNULL)
    os.close(read)
    return warden


def _terminated(signum: int, frame: Any) -> NoReturn:
    raise RunInterrupted(f"{PREEMPTED_PREFIX} SIGTERM from outside; the run ends here")


def _task_pid() -> int:
    """The process the executor started for this task: the zygote's client when the job was forked by the zygote."""
    job, _, client = os.environ.get("POSTLAB_ZYGOTE_CLIENT", "").partition(":")
    return int(client) if job == str(os.getpid()) else os.getpid()


def _ancestors(pid: int, levels: int) -> list[tuple[int, str]]:
    """(pid, /proc start time) of `pid`'s parent, its parent, ...: the local controller and the agent above it."""
    out = []
    for _ in range(levels):
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            start = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            break
        if pid <= 1:
            break
        out.append((pid, start))
    return out


# The rendezvous port of a job whose wrapper set none: derived from the job id, the same on every rank, below
# Linux's ephemeral range (32768-60999 by default), where the node's outgoing connections take their ports.
# submitit's own choice (20000-60000) mostly falls inside it: on the loopback cluster rank 0 of a 2-task eval
# found its port taken (EADDRINUSE) and rank 1 waited for it until the job's time limit.
RENDEZVOUS_PORTS = (20000, 32767)


def rendezvous_port(job_id: str) -> int:
    low, high = RENDEZVOUS_PORTS
    return low + int(hashlib.sha256(job_id.encode()).hexdigest(), 16) % (high - low + 1)


def distributed_env() -> dict[str, str]:
    """torchrun's variables for this task, from submitit's job environment (Slurm or local).

    The rendezvous host is the job's first node (`TorchDistributedEnvironment`) and its port is
    derived from the job id (`rendezvous_port`), the same on every rank; MASTER_ADDR and MASTER_PORT set by the
    wrapper win (the local backend's 127.0.0.1 and a port that was free at submission)."""
    dist = submitit.helpers.TorchDistributedEnvironment()
    port = os.environ.get("MASTER_PORT") or str(rendezvous_port(str(submitit.JobEnvironment().job_id)))
    return {
        "RANK": str(dist.rank), "WORLD_SIZE": str(dist.world_size), "LOCAL_RANK": str(dist.local_rank),
        "LOCAL_WORLD_SIZE": str(dist.local_world_size),
        "MASTER_ADDR": os.environ.get("MASTER_ADDR", dist.master_addr), "MASTER_PORT": port,
    }


def process_started_at() -> float:
    """Epoch seconds when this process started (10 ms resolution), from /proc's clock ticks since boot.

    A job forked by the zygote (tools/jobs/zygote.py) counts from its client's start, the task process the
    executor started and times: POSTLAB_ZYGOTE_CLIENT is "<job pid>:<client pid>" (for this process only)."""
    job, _, client = os.environ.get("POSTLAB_ZYGOTE_CLIENT", "").partition(":")
    stat = Path(f"/proc/{client}/stat" if job == str(os.getpid()) else "/proc/self/stat")
    ticks = int(stat.read_text().rsplit(")", 1)[1].split()[19])  # field 22, starttime
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")


def near_time_limit(elapsed_s: float, time_limit_s: float, signal_delay_s: float) -> bool:
    """Whether a signal after `elapsed_s` is the time-limit warning rather than a preemption.

    Slurm may send the warning up to a minute before `signal_delay_s` (its event resolution)."""
    slack = min(65.0, 0.1 * time_limit_s) + 1.0
    return elapsed_s >= time_limit_s - signal_delay_s - slack


def _heartbeat(stop: threading.Event) -> None:
    """Touch `<job id>_heartbeat` every HEARTBEAT_S while the job function runs (local runs only).

    A local run killed from outside (the controller's SIGKILL at the time limit, the OOM killer)
    writes no end event; the last heartbeat dates its end to within HEARTBEAT_S, so the launcher
    can tell a run killed at its limit from one that died early, and charge its real wall time.
    Slurm's accounting knows both already."""
    path = _run_paths().heartbeat
    while not stop.wait(HEARTBEAT_S):
        path.touch()


def _run_paths() -> RunPaths:
    env = submitit.JobEnvironment()
    return RunPaths(env.paths.folder, env.job_id)


def stamped(result: Any, process_started: float | None = None, entered: float | None = None,
            returned: float | None = None) -> Any:
    """The result with the versions this worker ran with (core/versions.py), where its model has a `versions` field
    that the job function left empty: every job's result says what made it, whoever wrote the job. Where it has a
    `wall` field, the job's own split of its time completed with what the wrapper saw (core/wall.py `completed`):
    the process's start before the function, the function's time after its last lap (epoch seconds)."""
    if not isinstance(result, BaseModel):
        return result
    fields = type(result).model_fields
    update: dict[str, Any] = {}
    if "versions" in fields and result.versions is None:
        update["versions"] = installed()
    if "wall" in fields and process_started is not None and entered is not None and returned is not None:
        update["wall"] = completed(result.wall, process_started, entered, returned)
    return result.model_copy(update=update) if update else result


def _events_path() -> Path:
    return _run_paths().events


def _append_event(event: dict[str, Any]) -> None:
    with open(_events_path(), "a") as f:
        f.write(json.dumps(event) + "\n")


def read_events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
