"""A warm fork server ("zygote") for local jobs: each job forks from a process that has already
imported torch, transformers and the project's job modules, instead of importing them again.

A local job's task process is `{python} -u -m submitit.core._submit FOLDER`, started by submitit's
controller; unpickling the job function imports torch and transformers, about 12 CPU-seconds on the
project's 2-core machine, for jobs that then work a second or two. The launcher's LocalBackend
(tools/jobs/launcher.py) passes submitit a `python` prefix that runs this file as a tiny client instead:

    .venv/bin/python tools/jobs/zygote.py SOCKET -u -m submitit.core._submit FOLDER

On a single-host Slurm cluster (lab.toml's `executor.slurm.zygote`, off by default) the SlurmBackend gives
sbatch the same prefix: srun starts the client, which sits in the step (sacct times it) while the job
runs forked from the zygote on this host. A task landing on another node finds no zygote and runs plain.

The client imports only the standard library. It connects to the zygote's Unix socket, sends its
argv, environment, cwd, umask, CPU affinity and ignored signals with its stdin/stdout/stderr (SCM_RIGHTS),
and the zygote forks a child that adopts them and runs `submitit.core._submit` as __main__, as
`python -u -m` would. The client stays the task process the controller watches: it forwards TERM,
INT, HUP, QUIT, USR1 and USR2 (submitit's timeout and preemption signal) to the child and exits with
the child's status, which the zygote reaps and reports. A client that dies (SIGKILL at the time
limit, a cancel) closes its connection, and the zygote kills the child's process group; a zygote
that dies makes the client kill the child and fail.

Correctness never depends on the zygote: whenever it cannot serve (none listening yet, a stale
socket, a refusal, a zygote still importing when the client's wait ends) the client execs the plain
python command. The zygote refuses a request whose
import-time environment (HF_*, TORCH*, OMP_*, PYTHON*, locale, ...) differs from its own, and once
any file of a module it preloaded changed (or a site-packages directory: a package was installed),
it refuses and retires: edited code is never served stale, and the launcher starts a fresh zygote
on its next submission. Zygotes are keyed (the socket's name) on the venv's python, the project
root, the preload list and that environment, so different trees, venvs and thread settings never
share one.

The zygote is a daemon in its own session (jobs outlive the agent that started it, as before),
single-threaded around its fork (it never runs a torch op, so no OpenMP pool exists to be copied),
one per key under POSTLAB_ZYGOTE_DIR (default /tmp/postlab-zygote-UID); it holds `KEY.lock` while
it listens, logs to `KEY.log`, and exits after IDLE_S seconds without a job or a request, or on
SIGTERM once its running jobs have ended. By hand:

    .venv/bin/python -m tools.jobs.zygote serve --socket /tmp/postlab-zygote-0/KEY.sock   # normally the launcher
    .venv/bin/python -m tools.jobs.zygote stop [--dir DIR]                               # stop a directory's zygotes

Only the standard library is imported at the top: this file is also the client, which must start
in milliseconds.
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import fcntl
import hashlib
import importlib
import io
import json
import os
import resource
import runpy
import selectors
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

ROOT = Path(__file__).resolve().parents[2]
# What a job needs before its function runs: the modules of every job function the tools submit and
# the model classes they load. Importing them is what the zygote saves each job.
PRELOAD = (
    "torch", "transformers", "transformers.models.nemotron_h.modeling_nemotron_h", "safetensors.torch", "peft",
    "submitit.core._submit", "tools.jobs.jobrun", "tools.train", "tools.evaluate", "tools.merge", "tools.nominate",
    "tools.nomination.publish", "tools.build_dataset", "tools.ingest", "tools.data.datasets", "tools.nomination.bundle", "tools.nomination.check_bundle",
    "evals.job", "evals.generate",
)
IDLE_S = 300.0  # seconds without a running job or a request before a zygote exits
RESTART_S = 60.0  # seconds between two starts of the same zygote by one launcher
# A client finding its zygote still importing waits this share of the job's time limit, at most WAIT_MAX_S.
WAIT_SHARE = 0.1
WAIT_MAX_S = 60.0
# The job's time limit in seconds, for an executor that does not tell its tasks (Slurm; submitit's local
# controller sets SUBMITIT_LOCAL_TIMEOUT_S): the launcher exports it in the sbatch script.
TIME_LIMIT_VAR = "POSTLAB_JOB_TIME_LIMIT_S"
MAX_SOCKET_PATH = 100  # bytes; Linux's limit for a Unix socket's path is 107
PROTOCOL = 2
# The client's resource limits a job adopts (a bounded child's CPU and address space: core/bounded.py); a forked
# process starts with no CPU time used, as an exec'd one does.
RLIMITS = ("RLIMIT_CPU", "RLIMIT_AS", "RLIMIT_DATA", "RLIMIT_FSIZE", "RLIMIT_CORE")
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
# Environment read while modules are imported (so baked into the zygote): hub and cache locations, torch
# and thread-pool settings (OpenMP, MKL and OpenBLAS size their pools when loaded), Python's own, locale.
IMPORT_ENV_PREFIXES = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TOKENIZERS_", "TORCH", "PYTORCH_", "OMP_", "GOMP_",
                       "KMP_", "MKL_", "OPENBLAS_", "PYTHON", "LC_", "XDG_")
IMPORT_ENV_NAMES = ("HOME", "LANG", "LANGUAGE", "TZ")
# Set by torch itself (to its default, the first time inductor asks for its cache: the zygote's imports do)
# and read only when used: whether a launcher had it set yet must not split its jobs over two zygotes.
IMPORT_ENV_SKIP = ("TORCHINDUCTOR_CACHE_DIR",)
MAX_MESSAGE = 1 << 20  # bytes: one request (argv and environment) or one reply


# ---- identity --------------------------------------------------------------------------------------

def import_env(env: Mapping[str, str]) -> dict[str, str]:
    """The part of an environment that importing the preloaded modules reads."""
    return {k: v for k, v in sorted(env.items())
            if (k.startswith(IMPORT_ENV_PREFIXES) or k in IMPORT_ENV_NAMES) and k not in IMPORT_ENV_SKIP}


def key(python: str, preload: Sequence[str], env: Mapping[str, str]) -> str:
    """The zygote serving jobs of this python, project tree, preload list and import-time environment."""
    spec = {"protocol": PROTOCOL, "python": os.path.realpath(python), "root": str(ROOT), "preload": list(preload),
            "env": import_env(env)}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def default_dir(env: Mapping[str, str]) -> Path:
    """Where the zygotes of this user live: POSTLAB_ZYGOTE_DIR, else /tmp/postlab-zygote-UID (a socket path
    must stay under about 100 bytes, so never inside a lab directory)."""
    return Path(env.get("POSTLAB_ZYGOTE_DIR") or f"/tmp/postlab-zygote-{os.getuid()}")


@dataclass
class Zygote:
    """The launcher's handle on the zygotes of one directory: starts them and names the client command."""

    folder: Path
    preload: tuple[str, ...] = PRELOAD
    python: str = sys.executable
    idle_s: float = IDLE_S
    started: dict[str, float] = field(default_factory=dict)  # socket -> when this handle last started its zygote
    refused: set[str] = field(default_factory=set)  # problems with the folder already said (said once each)

    def socket(self, env: Mapping[str, str]) -> Path:
        return self.folder / f"{key(self.python, self.preload, env)}.sock"

    def prepare(self, env: Mapping[str, str]) -> str | None:
        """The `python` prefix for submitit.LocalExecutor (None: the plain one, the socket path would be too
        long); starts a zygote for `env` unless one holds its lock.

        The first jobs after a start wait for the zygote's imports, within a share of their time limit
        (the client's `_connect`), else run the plain command. A zygote is started at most once per RESTART_S: one that
        keeps failing (a module that no longer imports) costs one import a minute, not one per job."""
        sock = self.socket(env)
        if len(os.fsencode(sock)) > MAX_SOCKET_PATH:
            return None
        problem = private_dir(self.folder)
        if problem is not None:
            # Jobs send their whole environment (API keys) and stdio through this directory: never through
            # one another user could have made or can write. The plain python still runs every job.
            if problem not in self.refused:
                self.refused.add(problem)
                print(f"zygote: not used: {problem}", file=sys.stderr, flush=True)
            return None
        if not _locked(sock.with_suffix(".lock")) and time.monotonic() - self.started.get(str(sock), -RESTART_S) >= RESTART_S:
            self.started[str(sock)] = time.monotonic()
            self.start(env)
        # -P: the client's sys.path must not start with tools/ (its modules would shadow others).
        return f"{_quote(self.python)} -P {_quote(str(Path(__file__).resolve()))} {_quote(str(sock))}"

    def start(self, env: Mapping[str, str]) -> None:
        """Start a zygote daemon for `env`; returns once it has detached (it imports in the background)."""
        problem = private_dir(self.folder)
        if problem is not None:
            raise PermissionError(f"zygote: {problem}")
        sock = self.socket(env)
        with open(sock.with_suffix(".log"), "ab") as log:
            subprocess.run([self.python, "-m", "tools.jobs.zygote", "serve", "--socket", str(sock),
                            "--preload", ",".join(self.preload), "--idle-s", str(self.idle_s)],
                           cwd=ROOT, env=dict(env), stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                           check=True, timeout=60)

    def listening(self, env: Mapping[str, str]) -> list[str] | None:
        """The command that runs `-u -m MODULE ARGS` forked from the zygote of `env` when one listens now (None:
        run python plainly). For short bounded children (check-bundle's, core/bounded.py): it never starts a
        zygote, and the child adopts the limits its client was given before exec (RLIMITS)."""
        sock = self.socket(env)
        if (len(os.fsencode(sock)) > MAX_SOCKET_PATH or private_dir(self.folder) is not None or not sock.exists()
                or not _locked(sock.with_suffix(".lock"))):
            return None
        return [self.python, "-P", str(Path(__file__).resolve()), str(sock), "-u"]

    def wait(self, env: Mapping[str, str], timeout_s: float = 120.0) -> int:
        """Start the zygote for `env` if needed and wait until it listens; its pid (benchmarks and tests)."""
        self.prepare(env)
        sock, deadline = self.socket(env), time.monotonic() + timeout_s
        while not sock.exists() or not _locked(sock.with_suffix(".lock")):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no zygote listening on {sock} after {timeout_s:.0f} s; see {sock.with_suffix('.log')}")
            time.sleep(0.05)
        return int(sock.with_suffix(".lock").read_text())


def listening_prefix(env: Mapping[str, str]) -> list[str] | None:
    """The command that runs `-u -m MODULE ARGS` forked from the zygote of `env` in its default directory when one
    listens now (Zygote.listening), else None: python plainly (also with POSTLAB_ZYGOTE=0, which turns it off)."""
    if env.get("POSTLAB_ZYGOTE", "1") == "0":
        return None
    return Zygote(default_dir(env)).listening(env)


def private_dir(folder: Path) -> str | None:
    """Create `folder` private (0700) if it is missing; None when it is a real directory of this user that
    no one else can enter, else what is wrong with it (naming it). Another local user who made it first
    (or made it writable) would receive every job's environment and file descriptors through a socket of
    their own here, so such a folder is never used."""
    try:
        folder.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass
    except OSError as err:
        return f"cannot create {folder}: {err.strerror}"
    try:
        st = os.lstat(folder)
    except OSError as err:
        return f"cannot read {folder}: {err.strerror}"
    if not stat.S_ISDIR(st.st_mode):
        return f"{folder} is not a directory (a symlink or a file); expected a directory of uid {os.getuid()}, mode 0700"
    if st.st_uid != os.getuid():
        return f"{folder} is owned by uid {st.st_uid}, not by this user (uid {os.getuid()}); remove it or set POSTLAB_ZYGOTE_DIR"
    if st.st_mode & 0o077:
        return (f"{folder} has mode {stat.S_IMODE(st.st_mode):04o}; expected 0700 (only its owner may enter it): "
                f"chmod 700 it or remove it")
    return None


def _quote(text: str) -> str:
    import shlex  # here: shlex imports re, which the client does not need

    return shlex.quote(text)


def _locked(lock: Path) -> bool:
    """Whether a live zygote holds `lock` (its listening role)."""
    try:
        fd = os.open(lock, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def running(folder: Path) -> list[int]:
    """Pids of the zygotes listening in `folder`."""
    pids = []
    for lock in sorted(folder.glob("*.lock")):
        text = lock.read_text().strip()
        if text and _locked(lock):
            pids.append(int(text))
    return pids


def stop(folder: Path, timeout_s: float = 30.0) -> list[int]:
    """SIGTERM every zygote listening in `folder` and wait until each has exited (after its running jobs);
    returns their pids. One still alive at the timeout is SIGKILLed, with its jobs."""
    pids = running(folder)
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for pid in pids:
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
    return pids


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


# ---- the client --------------------------------------------------------------------------------------

def client(argv: list[str]) -> NoReturn:
    """Run `python ARGV[1:]` through the zygote at ARGV[0]; exec it directly when the zygote cannot."""
    sock_path, args = argv[0], argv[1:]
    # Checked again here: the folder may have been removed (a /tmp cleaner) and made again by someone else
    # since the launcher checked it; the environment sent below holds the job's secrets.
    conn = _connect(sock_path, args) if private_dir(Path(sock_path).parent) is None else None
    if conn is None:
        _fallback(args)
    ignored = [int(s) for s in FORWARDED if signal.getsignal(s) == signal.SIG_IGN]
    umask = os.umask(0)
    os.umask(umask)
    request = {"protocol": PROTOCOL, "pid": os.getpid(), "argv": args, "cwd": os.getcwd(), "env": dict(os.environ), "umask": umask,
               "ignored": ignored, "affinity": sorted(os.sched_getaffinity(0)),
               "rlimits": {name: list(resource.getrlimit(getattr(resource, name))) for name in RLIMITS}}
    try:
        socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
        reply = json.loads(conn.recv(MAX_MESSAGE) or b"{}")
    except (OSError, ValueError):  # the zygote went away (or timed out) before forking: nothing runs yet
        reply = {"refused": "no reply"}
    if "pid" not in reply:
        conn.close()
        print(f"zygote: {reply.get('refused', 'no reply')}; running python directly", file=sys.stderr, flush=True)
        _fallback(args)
    _follow(conn, int(reply["pid"]), ignored)


def _connect(sock_path: str, args: list[str]) -> socket.socket | None:
    """A connection to the zygote, waiting for one that is still importing (it holds its lock, its socket
    is not there yet) for up to WAIT_SHARE of the job's time limit (the wait counts against it), at most
    WAIT_MAX_S: importing alongside it would cost the same seconds of CPU twice. None: run plain."""
    if args[:2] != ["-u", "-m"] or len(args) < 3:  # the only form submitit's LocalExecutor runs
        return None
    limit_s = float(os.environ.get("SUBMITIT_LOCAL_TIMEOUT_S") or os.environ.get(TIME_LIMIT_VAR) or 0)
    deadline = time.monotonic() + min(WAIT_MAX_S, WAIT_SHARE * limit_s)
    lock = Path(sock_path).with_suffix(".lock")
    while True:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        conn.settimeout(30.0)  # a listening zygote answers in milliseconds; one that hangs is not waited for
        try:
            conn.connect(sock_path)
            return conn
        except OSError:  # none listening: importing, or gone (a stale socket, no lock held)
            conn.close()
        if time.monotonic() > deadline or not _locked(lock):
            return None
        time.sleep(0.1)


def _fallback(args: list[str]) -> NoReturn:
    os.execv(sys.executable, [sys.executable, *args])


def _follow(conn: socket.socket, pid: int, ignored: list[int]) -> NoReturn:
    """Forward signals to the child until the zygote reports its end; then end the same way."""
    conn.settimeout(None)

    def forward(signum: int, _frame: Any) -> None:
        try:
            conn.send(json.dumps({"signal": signum}).encode())
        except OSError:  # the zygote is gone; the recv below sees it
            pass

    for s in FORWARDED:
        if s not in ignored:
            signal.signal(s, forward)
    try:
        reply = json.loads(conn.recv(MAX_MESSAGE) or b"{}")
    except OSError:
        reply = {}
    if "exit" in reply:
        sys.exit(reply["exit"])
    if "killed" in reply:  # end by the same signal, so the controller reads the same status
        signal.signal(reply["killed"], signal.SIG_DFL)
        os.kill(os.getpid(), reply["killed"])
    _killpg(pid)
    print(f"zygote: lost the zygote serving job process {pid}; killed it", file=sys.stderr, flush=True)
    sys.exit(1)


def _killpg(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # gone already (PermissionError: a reused id)
        pass


# ---- the zygote ------------------------------------------------------------------------------------

@dataclass
class Request:
    """One job to fork, as the client sent it."""

    protocol: int  # the client's PROTOCOL: a zygote serves its own only
    pid: int  # the client's: the job's run starts when it did (tools/jobs/jobrun.py reads POSTLAB_ZYGOTE_CLIENT)
    argv: list[str]  # python's arguments: -u -m MODULE ARGS...
    cwd: str
    env: dict[str, str]
    umask: int
    ignored: list[int]  # forwarded signals the client inherited as ignored: the job ignores them too
    affinity: list[int]
    fds: list[int]  # the client's stdin, stdout, stderr, received as new descriptors
    rlimits: dict[str, list[int]] = field(default_factory=dict)  # RLIMITS: the client's (soft, hard)

    def _replace_env(self, set_by_imports: dict[str, str]) -> Request:
        """With what the preloaded modules set in the environment when imported and the client has not set
        (in a new process they would set it again, importing): TORCHINDUCTOR_CACHE_DIR, for one."""
        return dataclasses.replace(self, env={**set_by_imports, **self.env})


@dataclass
class Server:
    """The zygote's state: its listening socket, its lock, one connection per running job."""

    sock_path: Path
    lock_fd: int
    preload: tuple[str, ...]
    idle_s: float
    listener: socket.socket | None = None
    selector: selectors.DefaultSelector = field(default_factory=selectors.DefaultSelector)
    jobs: dict[int, socket.socket | None] = field(default_factory=dict)  # child pid -> its client (None: gone)
    env: dict[str, str] = field(default_factory=dict)  # the import-time environment the zygote started with
    set_by_imports: dict[str, str] = field(default_factory=dict)  # variables the preloaded modules set
    watched: dict[str, tuple[int, int]] = field(default_factory=dict)
    stop_asked: str = ""
    wake_r: int = -1
    wake_w: int = -1
    retiring: str = ""
    last_active: float = field(default_factory=time.monotonic)

    def listen(self) -> None:
        self.watched = _snapshot()
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the selector through the wakeup fd
        # Only noted here: the loop retires (a handler runs between any two bytecodes, even mid-fork).
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stop_asked", "SIGTERM"))
        signal.signal(signal.SIGINT, lambda *_: setattr(self, "stop_asked", "SIGINT"))
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(str(self.sock_path))
        self.listener.listen(64)
        self.selector.register(self.listener, selectors.EVENT_READ)
        self.selector.register(self.wake_r, selectors.EVENT_READ)

    def loop(self) -> Request | None:
        """Serve until retired and idle. Returns in a forked child with its request; None in the zygote."""
        while True:
            if self.stop_asked:
                self.retire(self.stop_asked)
            if self.listener is None and not self.jobs:
                return None
            if self.listener is not None and not self.jobs and time.monotonic() - self.last_active > self.idle_s:
                self.retire(f"idle for {self.idle_s:.0f} s")
                continue
            for sel_key, _ in self.selector.select(timeout=min(self.idle_s, 5.0)):
                if sel_key.fileobj is self.listener:
                    request = self.accept()
                    if request is not None:
                        return request
                elif sel_key.fileobj == self.wake_r:
                    os.read(self.wake_r, 4096)
                    self.reap()
                else:
                    self.from_client(sel_key.fileobj, sel_key.data)

    def accept(self) -> Request | None:
        assert self.listener is not None, "accept() runs only while listening"
        conn, _ = self.listener.accept()
        self.last_active = time.monotonic()
        conn.settimeout(10.0)  # a client sends its request at once; one that does not must not stall the others
        try:
            msg, fds, _, _ = socket.recv_fds(conn, MAX_MESSAGE, 3)
            conn.settimeout(None)
            request = Request(**json.loads(msg), fds=fds)
        except (OSError, ValueError, TypeError) as err:
            log(f"bad request: {err}")
            conn.close()
            return None
        why = self.refusal(request)
        if why:
            log(f"refused: {why}")
            _send(conn, {"refused": why})
            conn.close()
            for fd in request.fds:
                os.close(fd)
            if why.startswith("stale"):
                self.retire(why)
            return None
        return self.fork(conn, request._replace_env(self.set_by_imports))

    def refusal(self, request: Request) -> str:
        """Why this zygote must not serve `request` ('' when it may)."""
        if request.protocol != PROTOCOL:
            return f"protocol {request.protocol}, the zygote speaks {PROTOCOL}"
        if len(request.fds) != 3 or request.argv[:2] != ["-u", "-m"]:
            return f"unexpected request (argv {request.argv[:3]}, {len(request.fds)} descriptors)"
        theirs = import_env(request.env)
        if theirs != self.env:
            names = sorted(k for k in set(theirs) | set(self.env) if theirs.get(k) != self.env.get(k))
            return f"environment differs from the zygote's in {', '.join(names)}"
        changed = _changed(self.watched)
        return f"stale: {changed} changed since the zygote imported it" if changed else ""

    def fork(self, conn: socket.socket, request: Request) -> Request | None:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()  # else the child would write the zygote's buffered log lines to the job's files
        pid = os.fork()
        if pid == 0:
            self.in_child(conn)
            return request
        try:
            os.setpgid(pid, pid)  # also here: the zygote may kill the group before the child set it itself
        except (ProcessLookupError, PermissionError):  # it has already set it (and exec'd nothing: EACCES)
            pass
        for fd in request.fds:
            os.close(fd)
        self.jobs[pid] = conn
        self.selector.register(conn, selectors.EVENT_READ, pid)
        _send(conn, {"pid": pid})
        log(f"job {pid}: {' '.join(request.argv)}")
        return None

    def in_child(self, conn: socket.socket) -> None:
        """Shed the zygote's descriptors and handlers: the child keeps none of its connections or its lock."""
        os.setpgid(0, 0)
        signal.set_wakeup_fd(-1)
        for s in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(s, signal.SIG_DFL)
        self.selector.close()
        for other in [c for c in self.jobs.values() if c is not None] + [conn]:
            other.close()
        if self.listener is not None:
            self.listener.close()
        for fd in (self.lock_fd, self.wake_r, self.wake_w):
            if fd >= 0:
                os.close(fd)

    def from_client(self, conn: Any, pid: int) -> None:
        """A signal to forward, or the client's end (EOF): then the job's whole group is killed."""
        try:
            msg = conn.recv(MAX_MESSAGE)
        except OSError:
            msg = b""
        if msg:
            signum = int(json.loads(msg)["signal"])
            if signum in FORWARDED:
                os.kill(pid, signum)
            return
        log(f"job {pid}: its client ended; killing the job")
        _killpg(pid)
        self.selector.unregister(conn)
        conn.close()
        self.jobs[pid] = None

    def reap(self) -> None:
        while self.jobs:
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.jobs.pop(pid, None)
            self.last_active = time.monotonic()
            log(f"job {pid}: ended with status {status} after {usage.ru_utime + usage.ru_stime:.1f} CPU-s")
            if conn is not None:
                reply = {"killed": os.WTERMSIG(status)} if os.WIFSIGNALED(status) else {"exit": os.waitstatus_to_exitcode(status)}
                _send(conn, reply)
                self.selector.unregister(conn)
                conn.close()

    def retire(self, why: str) -> None:
        """Stop listening (a fresh zygote may take the lock at once); exit once the running jobs ended."""
        if self.listener is None:
            return
        log(f"retiring: {why}; {len(self.jobs)} job(s) still running")
        self.selector.unregister(self.listener)
        self.sock_path.unlink(missing_ok=True)
        self.listener.close()
        self.listener = None
        os.close(self.lock_fd)  # after the unlink: a new zygote binds only once it holds the lock
        self.lock_fd = -1


def _send(conn: socket.socket, message: dict[str, Any]) -> None:
    try:
        conn.send(json.dumps(message).encode())
    except OSError:  # the client is gone; its EOF (or the reap) settles the rest
        pass


def _snapshot() -> dict[str, tuple[int, int]]:
    """(mtime, size) of every preloaded module outside the interpreter's own installation (the project and
    anything on PYTHONPATH), and of the site-packages directories (an install or removal changes them)."""
    installed = tuple({os.path.join(p, "") for p in (sys.prefix, sys.base_prefix, os.path.realpath(sys.prefix),
                                                     os.path.realpath(sys.base_prefix))})
    paths = {p for p in sys.path if p.endswith("site-packages") and os.path.isdir(p)}
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if isinstance(path, str) and os.path.isabs(path) and not path.startswith(installed):
            paths.add(path)
    return {p: _stamp(p) for p in sorted(paths) if os.path.exists(p)}


def _stamp(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_mtime_ns, st.st_size


def _changed(watched: dict[str, tuple[int, int]]) -> str:
    """The first watched file that changed or vanished ('' when none did)."""
    for path, stamp in watched.items():
        try:
            if _stamp(path) != stamp:
                return path
        except FileNotFoundError:
            return path
    return ""


def log(text: str) -> None:
    print(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} zygote {os.getpid()}: {text}", flush=True)


def run_job(request: Request) -> NoReturn:
    """In the forked child: become the process `python -u -m MODULE ARGS` would have been, and run it."""
    for target, fd in enumerate(request.fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request.cwd)
    os.umask(request.umask)
    os.sched_setaffinity(0, request.affinity)
    _adopt_limits(request.rlimits)
    os.environ.clear()
    os.environ.update(request.env)
    os.environ["POSTLAB_ZYGOTE_CLIENT"] = f"{os.getpid()}:{request.pid}"
    time.tzset()
    for s in FORWARDED:
        default = signal.default_int_handler if s == signal.SIGINT else signal.SIG_DFL
        signal.signal(s, signal.SIG_IGN if s in request.ignored else default)
    _reseed()
    _unbuffered_stdio()
    module, args = request.argv[2], request.argv[3:]
    sys.argv = ["-m", *args]
    sys.orig_argv = [sys.executable, *request.argv]
    sys.path[0] = request.cwd  # what `python -m` puts first
    _exit(_run_main(module))


def _adopt_limits(rlimits: dict[str, list[int]]) -> None:
    """The client's resource limits, each within the zygote's own hard limit (a process cannot raise that)."""
    for name in RLIMITS:
        if name not in rlimits:
            continue
        which = getattr(resource, name)
        ceiling = resource.getrlimit(which)[1]
        soft, hard = (_lower(int(v), ceiling) for v in rlimits[name])
        if hard != resource.RLIM_INFINITY and (soft == resource.RLIM_INFINITY or soft > hard):
            soft = hard
        resource.setrlimit(which, (soft, hard))


def _lower(value: int, ceiling: int) -> int:
    if value == resource.RLIM_INFINITY:
        return ceiling
    return value if ceiling == resource.RLIM_INFINITY else min(value, ceiling)


def _run_main(module: str) -> int:
    """Run `module` as __main__; its exit status as the interpreter would make it."""
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as done:
        if done.code is None or isinstance(done.code, int):
            return done.code or 0
        print(done.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        traceback.print_exc()
        return -signal.SIGINT  # python ends an uncaught KeyboardInterrupt by SIGINT, so the parent sees it
    except BaseException:  # noqa: BLE001 (the job's uncaught error: reported as python reports it)
        sys.excepthook(*sys.exc_info())
        return 1
    return 0


def _exit(status: int) -> NoReturn:
    """End as the interpreter would (non-daemon threads joined, atexit handlers run, stdio flushed), but
    without tearing down thousands of modules one by one: that took seconds of CPU in every job and
    delayed the end the controller waits for; the process's memory goes back at once anyway."""
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # what Py_Finalize runs first; the zygote registered none of its own
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: python's exit ignores it too
            pass
    if status < 0:
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    os._exit(status)


def _reseed() -> None:
    """numpy's global generator was seeded once, in the zygote: each job gets fresh entropy, as a new
    process would (Python's `random` reseeds itself after a fork)."""
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def _unbuffered_stdio() -> None:
    """New sys.stdin/stdout/stderr on descriptors 0-2, unbuffered as under `python -u`. The zygote's own
    objects (which a logging handler may hold) now write to the same descriptors, a line at a time."""
    sys.stdout.reconfigure(line_buffering=True)
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)),
                                                 encoding=sys.stdin.encoding, errors=sys.stdin.errors)
    for fd, name in ((1, "stdout"), (2, "stderr")):
        old = getattr(sys, name)
        new = io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding=old.encoding, errors=old.errors,
                               write_through=True)
        setattr(sys, name, new)
        setattr(sys, f"__{name}__", new)


def _take(lock_fd: int) -> bool:
    """Take the zygote's lock unless another zygote holds it. `_locked` probes it with a shared lock for
    microseconds: a few retries tell such a probe from a holder."""
    for _ in range(50):
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            time.sleep(0.01)
    return False


def serve(sock_path: Path, preload: tuple[str, ...], idle_s: float) -> None:
    """Detach, take the lock, import, listen, serve; in a forked child, run its job instead."""
    if os.fork():
        os._exit(0)  # the caller waits for this detach only; the daemon is reparented, not a zombie
    os.setsid()
    lock_fd = os.open(sock_path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    if not _take(lock_fd):
        os._exit(0)  # another zygote of this key is starting or listening
    os.ftruncate(lock_fd, 0)
    os.write(lock_fd, str(os.getpid()).encode())
    sock_path.unlink(missing_ok=True)  # a dead zygote's socket: from now on, a socket here means listening
    start, cpu, env = time.monotonic(), time.process_time(), dict(os.environ)
    log(f"importing {len(preload)} modules")
    for name in preload:
        importlib.import_module(name)
    threads = len(os.listdir("/proc/self/task"))
    log(f"imported in {time.monotonic() - start:.1f} s ({time.process_time() - cpu:.1f} CPU-s, {threads} threads)")
    server = Server(sock_path, lock_fd, preload, idle_s, env=import_env(env),
                    set_by_imports={k: v for k, v in os.environ.items() if env.get(k) != v})
    server.listen()
    log(f"listening on {sock_path}")
    request = server.loop()
    if request is not None:
        run_job(request)
    own, reaped = os.times()[:2], os.times()[2:4]
    log(f"exiting: {sum(own):.1f} CPU-s own, {sum(reaped):.1f} CPU-s of its jobs")


def main(argv: list[str]) -> None:
    if argv[:1] not in (["serve"], ["stop"]):
        client(argv)
    parser = argparse.ArgumentParser(prog="python -m tools.jobs.zygote", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_serve = sub.add_parser("serve", help="run a zygote (the launcher starts one on demand)")
    p_serve.add_argument("--socket", type=Path, required=True, help="socket path: DIR/KEY.sock")
    p_serve.add_argument("--preload", default=",".join(PRELOAD), help="comma-separated modules to import")
    p_serve.add_argument("--idle-s", type=float, default=IDLE_S, help="exit after this long without a job")
    p_stop = sub.add_parser("stop", help="stop the zygotes of a directory (after their running jobs)")
    p_stop.add_argument("--dir", type=Path, default=default_dir(os.environ), help="the zygotes' directory")
    args = parser.parse_args(argv)
    if args.command == "serve":
        problem = private_dir(args.socket.absolute().parent)  # not resolved: a symlink there is refused
        if problem is not None:
            print(f"zygote: refused: {problem}", file=sys.stderr)
            sys.exit(2)
        serve(args.socket.resolve(), tuple(filter(None, args.preload.split(","))), args.idle_s)
    else:
        print(f"stopped {len(stop(args.dir))} zygote(s) in {args.dir}")


if __name__ == "__main__":
    main(sys.argv[1:])
