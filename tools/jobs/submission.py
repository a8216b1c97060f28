"""Submission: the backend of a lab's `[executor]` section, and one attempt of a keyed job handed to it.

    backend = make_backend(ExecutorSection(kind="local"))
    job = submit_attempt(backend, spec, folder, args)    # a submitit job; its id goes on the attempt's row

Every job runs inside `Resumable` (tools/jobs/jobrun.py), which ends a run on the preemption or time-limit signal
instead of letting submitit requeue it behind the ledger's back.
"""

from __future__ import annotations

import os
import typing
from pathlib import Path
from typing import Any

import submitit
from pydantic import BaseModel

from tools.jobs.executor import ExecutorSection, local_gpus
from tools.jobs.jobrun import Resumable
from tools.jobs.keys import JobSpec
from tools.jobs.local import LocalBackend
from tools.jobs.resources import Backend
from tools.jobs.slurm import SlurmBackend
from tools.jobs.zygote import Zygote
from tools.jobs.zygote import default_dir as zygote_dir


def make_backend(section: ExecutorSection) -> Backend:
    """The backend of a lab's `[executor]` section."""
    if section.kind == "slurm":
        assert section.slurm is not None, "ExecutorSection validates that kind = 'slurm' has a slurm section"
        on = section.slurm.zygote and env_allows_zygote(os.environ)
        return SlurmBackend.from_section(section.slurm, zygote=Zygote(zygote_dir(os.environ)) if on else None)
    return LocalBackend(section.simulated_gpuh_per_device_s, zygote=local_zygote(section, os.environ),
                        host_gpus=local_gpus(os.environ))


def local_zygote(section: ExecutorSection, env: typing.Mapping[str, str]) -> Zygote | None:
    """The local jobs' fork server: on unless lab.toml's `executor.zygote = false` or POSTLAB_ZYGOTE=0;
    its zygotes live in POSTLAB_ZYGOTE_DIR (default /tmp/postlab-zygote-UID)."""
    if not section.zygote or not env_allows_zygote(env):
        return None
    return Zygote(zygote_dir(env))


def env_allows_zygote(env: typing.Mapping[str, str]) -> bool:
    return env.get("POSTLAB_ZYGOTE", "1") != "0"


def submit_attempt(backend: Backend, spec: JobSpec, folder: Path, args: BaseModel) -> submitit.Job[Any]:
    """One attempt of `spec` with the config `args`, submitted to `backend` from `folder`."""
    r = spec.resources
    wrapped = Resumable(spec.fn, r.time_limit_min * 60, r.signal_delay_s, env=backend.worker_env(), device=r.device,
                        every_rank=not r.single_process, memory_gb=r.mem_gb)
    return backend.submit(folder, spec.kind, r, wrapped, args)
